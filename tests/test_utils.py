"""async_tensor_h2d / async_tensor_d2h: copies, never views of the caller's data, from lists and numpy alike."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.utils import async_tensor_d2h, async_tensor_h2d, async_tensors_h2d

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_h2d_copies_lists_and_numpy_arrays(device):
    data = np.random.default_rng(0).integers(0, 1000, size=(3, 5))
    t = async_tensor_h2d(data, torch.int64, device)
    data[0, 0] = -1  # the caller reuses its buffer at once
    assert t.device.type == device and t.dtype == torch.int64
    assert t.cpu()[0, 0] != -1 and torch.equal(t.cpu()[1:], torch.from_numpy(data[1:]))
    floats = async_tensor_h2d([[0.5, 1.0], [2.0, 3.5]], torch.float32, device)
    assert torch.equal(floats.cpu(), torch.tensor([[0.5, 1.0], [2.0, 3.5]]))


@pytest.mark.parametrize("device", DEVICES)
def test_h2d_of_several_arrays_keeps_each_shape_and_value(device):
    slots = np.array([[3, 4, 5], [6, 7, 8]], dtype=np.int32)
    flags = np.array([True, False])
    qsl, s, f, empty = async_tensors_h2d([[0, 2, 9], slots, flags, np.zeros(0)], device)
    slots[0, 0] = -1  # copies, not views of the caller's arrays
    assert all(t.device.type == device and t.dtype == torch.int64 for t in (qsl, s, f, empty))
    assert qsl.tolist() == [0, 2, 9] and s.tolist() == [[3, 4, 5], [6, 7, 8]] and f.tolist() == [1, 0]
    assert empty.shape == (0,)


@pytest.mark.parametrize("device", DEVICES)
def test_d2h_returns_the_values_once_the_stream_has_run(device):
    x = torch.randn(64, device=device)
    host = async_tensor_d2h(x * 2)
    if device == "cuda":
        assert host.is_pinned()
        torch.cuda.current_stream().synchronize()
    assert host.device.type == "cpu" and torch.equal(host, (x * 2).cpu())


@pytest.mark.gpu
def test_h2d_pinned_buffers_are_not_reused_before_their_copies_run():
    """Host buffers come back to torch's pinned cache once freed; a copy still queued behind GPU work must keep its
    buffer until it has run, or a later call's data would land in an earlier tensor."""
    torch.cuda._sleep(50_000_000)  # keeps the stream busy while the copies are queued behind it
    tensors = [async_tensor_h2d(np.full(257, i, dtype=np.int64), torch.int64, "cuda") for i in range(64)]
    torch.cuda.current_stream().synchronize()
    for i, t in enumerate(tensors):
        assert torch.equal(t.cpu(), torch.full((257,), i, dtype=torch.int64))


def test_add_reader_blocking_reads_whole_messages_under_uvloop():
    """uvloop makes a watched fd non-blocking; a message longer than the pipe's buffer then came back half read
    (BlockingIOError), which the server took for a dead engine core."""
    import asyncio
    import multiprocessing
    import threading

    uvloop = pytest.importorskip("uvloop")
    from vllm.utils import add_reader_blocking
    sizes = [3_000_000 + i for i in range(12)]

    async def read_all():
        r, w = multiprocessing.Pipe(duplex=False)
        loop, got = asyncio.get_running_loop(), []
        done = loop.create_future()

        def on_readable():
            try:
                while r.poll() and not done.done():
                    got.append(len(r.recv_bytes()))
                    if len(got) == len(sizes):
                        done.set_result(None)
            except OSError as e:
                done.set_exception(e)
        add_reader_blocking(loop, r.fileno(), on_readable)
        writer = threading.Thread(target=lambda: [w.send_bytes(b"x" * n) for n in sizes], daemon=True)
        writer.start()
        try:
            await asyncio.wait_for(done, 60)
        finally:
            loop.remove_reader(r.fileno())
            r.close()
        writer.join(5)
        return got

    assert uvloop.run(read_all()) == sizes
