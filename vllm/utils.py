"""Small helpers shared across layers (no imports from the rest of the package)."""
from __future__ import annotations

import functools
import gc
import os

import numpy as np
import torch

_DEFAULT_NUM_SMS = 132  # H100/H200, for tiles and grids sized where no GPU is visible (the interpreter)


def async_tensor_h2d(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`data` (a list or numpy array) as a tensor on `device` without waiting for the device. A plain
    torch.tensor(data, device=cuda) copies from pageable memory, which blocks the host until the GPU has run
    everything queued before the copy; from pinned memory the copy is queued like a kernel. The pinned buffer
    comes from torch's caching host allocator, which keeps it until the copy has run. It is allocated pinned and
    filled, not made by `pin_memory()`: that asks the driver whether the source is pinned first (about 0.1 ms a
    call on an H100 host, several calls per prompt step)."""
    device = torch.device(device)
    host = torch.as_tensor(data, dtype=dtype)  # may share a numpy array's memory: both branches copy
    if device.type != "cuda":
        return host.to(device, copy=True)
    pinned = torch.empty(host.shape, dtype=dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned.to(device, non_blocking=True)


def async_tensors_h2d(arrays: list, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """Host integer arrays (numpy or lists, any shapes) as int64 device tensors of the same shapes, in one queued
    upload (async_tensor_h2d) split into views: each separate upload costs a pinned buffer and a copy."""
    flat = [np.asarray(a).reshape(-1) for a in arrays]
    packed = async_tensor_h2d(np.concatenate(flat).astype(np.int64), torch.int64, device)
    return tuple(t.view(np.shape(a)) for t, a in zip(packed.split([len(f) for f in flat]), arrays, strict=True))


def async_tensor_d2h(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` queued on the current stream (pinned memory on CUDA): read it only after an event
    recorded behind it has completed."""
    if t.device.type != "cuda":
        return t
    return t.to("cpu", non_blocking=True)


def add_reader_blocking(loop, fd: int, callback) -> None:
    """loop.add_reader(fd, callback), with `fd` left blocking. uvloop (libuv) makes a watched fd non-blocking, and
    a multiprocessing Connection's recv() of a message longer than the pipe's buffer then stops half-read with
    BlockingIOError (a 1 MB output of whole-vocabulary logprobs read as a dead engine core). Readiness still
    comes from the loop; only the read may wait for the rest of a message already being written."""
    loop.add_reader(fd, callback)
    os.set_blocking(fd, True)


def freeze_gc_heap() -> None:
    """Moves every object alive now out of the cyclic garbage collector's reach (as upstream's engine core and
    API server do once started). A process that holds a model, its tokenizer and the server for its whole life
    has hundreds of thousands of objects, and each oldest-generation collection walks all of them in whichever
    step allocates at that moment: with 64 streams on the built-in model that step took 252 ms against a median
    of 2 ms (benchmarks/bench_gc_pauses.py, development CPU; frozen, the slowest of 200 steps took 2.9).
    Only for processes that own what they hold until exit: a frozen object that later becomes cyclic garbage is
    never collected."""
    gc.collect()
    gc.freeze()


@functools.lru_cache
def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors (an H100/H200's 132 off CUDA), for kernels that size grids by it."""
    if device.type != "cuda":
        return _DEFAULT_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def partial_marker_len(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of one of `markers`: a streaming parser holds
    them back until the next delta says whether a marker (a tool-call or thinking delimiter) begins there."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
