"""A CPU stand-in for CUDA graph capture and replay that fails where a real capture would.

`ReplayByRerun` has CUDAGraphRunner's interface: `capture` runs the step once and keeps it, `replay` reruns it.
Both run under `NoDeviceReads`, which refuses what a stream being captured refuses: reading a device tensor's
values on the host (`.item()`, `bool()`, `.tolist()`, `.numpy()`, `.cpu()`) and ops whose output size depends
on device values (`nonzero`, boolean-mask indexing, `masked_select`, `unique`). On a CPU every tensor is a host
tensor, so device-ness is tracked as taint: the runner's persistent device buffers, the model's weights and cache
pools are device tensors, and so is every result computed from one (Triton launches in the interpreter taint all
their tensor arguments). A graph replays the host decisions of its capture, and the stand-in holds the runner to
that: replay reruns the same Python, whose host values are the capture's frozen copies.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

T = torch.Tensor
HOST_READS = {T.item, T.tolist, T.numpy, T.__array__, T.__bool__, T.__int__, T.__float__, T.__index__, T.cpu}
SIZE_FROM_VALUES = {T.nonzero, torch.nonzero, T.masked_select, torch.masked_select, torch.unique, T.unique,
                    torch.argwhere, T.argwhere}


class HostReadDuringCapture(RuntimeError):
    pass


_ACTIVE: list[NoDeviceReads] = []


@contextmanager
def kernel(args):
    """Marks a stand-in kernel (a stub of a library kernel) running on `args`: inside a guarded capture or replay
    it may read its tensors, as a real kernel does on the device."""
    if not _ACTIVE:
        yield
        return
    with _ACTIVE[-1].kernel_launch(args):
        yield


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class NoDeviceReads(TorchFunctionMode):
    """Raises on host reads of device tensors (tracked by storage) while entered."""

    def __init__(self, roots) -> None:
        super().__init__()
        self.roots = {_storage(t) for t in roots if t.numel()}
        self.device = set(self.roots)
        self.alive: list[torch.Tensor] = []  # tainted results, kept so no host tensor reuses their storage
        self.suspended = 0

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.pop()
        self.device, self.alive = set(self.roots), []  # one step's intermediates: forgotten after it
        return super().__exit__(*exc)

    def tainted(self, *values) -> bool:
        return any(isinstance(v, torch.Tensor) and v.numel() and _storage(v) in self.device
                   for v in tree_leaves(values))

    def taint(self, *values) -> None:
        for v in tree_leaves(values):
            if isinstance(v, torch.Tensor) and v.numel():
                self.device.add(_storage(v))
                self.alive.append(v)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.suspended:
            return func(*args, **kwargs)
        device_input = self.tainted(args, kwargs)
        if device_input:
            name = getattr(func, "__name__", str(func))
            # .to("cpu") asks for a host copy; .to(device) with the runner's device (a CPU here) is device to device.
            to_host = func is T.to and "cpu" in (*args[1:], kwargs.get("device"))
            mask_index = func in (T.__getitem__, T.__setitem__) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool and self.tainted(i)
                for i in tree_leaves(args[1]))
            if func in HOST_READS or to_host:
                raise HostReadDuringCapture(f"{name}() reads a device tensor on the host during CUDA graph "
                                            "capture/replay (a real capture fails: no host syncs in a graph)")
            if func in SIZE_FROM_VALUES or mask_index:
                raise HostReadDuringCapture(f"{name}() sizes its output from device values during CUDA graph "
                                            "capture/replay (a host sync; use a static size)")
        out = func(*args, **kwargs)
        if device_input:
            self.taint(out)
        return out

    @contextmanager
    def kernel_launch(self, args):
        """A Triton launch (interpreter): its host copies are the kernel's own; every tensor it touches is device."""
        if self.tainted(args):
            self.taint(args)
        self.suspended += 1
        try:
            yield
        finally:
            self.suspended -= 1


def _module_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Weights, buffers, and tensors held as plain attributes (cache pools, the draft's fused weight)."""
    roots = list(model.parameters()) + list(model.buffers())
    for module in model.modules():
        roots += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
    return roots


def _roots(owner) -> list[torch.Tensor]:
    """The device tensors of a capture's owner (the runner, its PiecewiseCUDAGraphs, or the DSpark proposer):
    persistent input buffers (and the pieces' buffers), weights, buffers and the layers' cache pools."""
    if hasattr(owner, "draft"):  # DSparkProposer: its input buffers, the draft's and the target's tensors
        return [v for v in vars(owner).values() if isinstance(v, torch.Tensor)] + _module_tensors(owner.draft) \
            + _module_tensors(owner.target)
    roots = [buf.gpu for buf in vars(owner.input_batch).values() if hasattr(buf, "gpu")] \
        if hasattr(owner, "input_batch") else [owner.input_ids]
    roots += tree_leaves(getattr(owner, "buffers", {}))
    return roots + _module_tensors(owner.model)


class ReplayByRerun:
    """CUDAGraphRunner's interface on a CPU: `replay` reruns what `capture` was given, both under NoDeviceReads."""

    def __init__(self, device) -> None:
        self.fns = {}
        self.guard: NoDeviceReads | None = None

    def capture(self, desc, fn, warmup: int = 1) -> None:
        roots = _roots(fn.func.__self__)  # a partial of runner._forward, pieces._piece or proposer._propose_padded
        if self.guard is None:
            self.guard = NoDeviceReads(roots)
        else:  # the pieces' buffers exist only once their first capture has made them
            self.guard.roots |= {_storage(t) for t in roots if t.numel()}
            self.guard.device |= self.guard.roots
        fn()  # the warm-up runs eagerly, as CUDAGraphRunner's does
        self._guarded(fn)
        self.fns[desc] = fn

    def replay(self, desc):
        return self._guarded(self.fns[desc])

    def _guarded(self, fn):
        from triton.runtime import interpreter

        from vllm.model_executor.models.kimi_k3 import moe
        launch = interpreter.GridExecutor.__call__
        guard = self.guard

        @functools.wraps(launch)
        def guarded_launch(executor, *args, **kwargs):
            with guard.kernel_launch((args, kwargs)):
                return launch(executor, *args, **kwargs)

        capturing = moe.capturing_graph
        interpreter.GridExecutor.__call__ = guarded_launch
        moe.capturing_graph = lambda x: True  # what a real capture's stream reports
        try:
            with guard:
                return fn()
        finally:
            interpreter.GridExecutor.__call__ = launch
            moe.capturing_graph = capturing
