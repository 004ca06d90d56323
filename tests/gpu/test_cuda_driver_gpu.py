"""The driver calls that keep the GIL (services/worker/device/cuda_driver.py): each does what torch's own
call does, on the stream it is given.

    python -m pytest tests/gpu/test_cuda_driver_gpu.py -q
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest
import torch

from strata.services.worker.device import cuda_driver

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = torch.device("cuda:0")


def test_a_copy_from_page_locked_memory_and_between_device_buffers_moves_the_bytes():
    src = torch.arange(1000, dtype=torch.int64).pin_memory()
    dst = torch.zeros(1000, dtype=torch.int64, device=DEV)
    stream = cuda_driver.current_stream(DEV)
    cuda_driver.copy(dst.data_ptr(), src.data_ptr(), 800 * 8, stream)
    other = torch.full((1000,), -1, dtype=torch.int64, device=DEV)
    cuda_driver.copy(other.data_ptr(), dst.data_ptr(), 800 * 8, stream)
    torch.cuda.synchronize()
    assert torch.equal(dst[:800].cpu(), src[:800]) and (dst[800:] == 0).all()
    assert torch.equal(other[:800], dst[:800]) and (other[800:] == -1).all()


def test_a_row_copy_spreads_a_packed_table_into_a_wider_one():
    packed = torch.arange(5 * 3, dtype=torch.int32, device=DEV)  # [5, 3], packed
    table = torch.full((8, 7), -1, dtype=torch.int32, device=DEV)
    spread = cuda_driver.RowCopy()
    stream = cuda_driver.current_stream(DEV)
    spread(table.data_ptr(), table.stride(0) * 4, packed.data_ptr(), 3 * 4, 3 * 4, 5, stream)
    torch.cuda.synchronize()
    assert torch.equal(table[:5, :3], packed.view(5, 3))
    assert (table[:5, 3:] == -1).all() and (table[5:] == -1).all()


def test_timing_events_order_and_time_the_work_between_them():
    a = torch.randn(4096, 4096, device=DEV)
    a = a @ a / 64  # (the first matmul sets up cuBLAS)
    torch.cuda.synchronize()
    stream = cuda_driver.current_stream(DEV)
    start = cuda_driver.timing_event(DEV)
    for _ in range(20):
        a = a @ a / 64
    end = cuda_driver.TimingEvent()
    end.record(stream)
    end.synchronize()
    assert end.query() and start.query()
    reference_start, reference_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reference_start.record()
    for _ in range(20):
        a = a @ a / 64
    reference_end.record()
    torch.cuda.synchronize()
    ms, reference = start.elapsed_time(end), reference_start.elapsed_time(reference_end)
    assert 0.3 * reference < ms < 3 * reference


def test_a_torch_event_recorded_by_the_driver_orders_the_work_before_it():
    event = torch.cuda.Event()
    event.record()  # torch makes the event's CUDA object at its first record
    torch.cuda.synchronize()
    stream = cuda_driver.current_stream(DEV)
    assert stream == torch.cuda.current_stream(DEV).cuda_stream
    torch.cuda._sleep(200_000_000)  # about 0.1 s of spinning on the GPU
    cuda_driver.record(event, stream)
    assert not event.query()
    event.synchronize()
    assert event.query()


def test_a_graph_launched_by_the_driver_gives_replays_outputs():
    x = torch.randn(64, 64, device=DEV)
    w = torch.randn(64, 64, device=DEV)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.relu(x @ w) + 1
    executable = cuda_driver.graph_exec(graph)
    assert executable, "this torch exposes no graph executable: steps fall back to replay()"
    for _ in range(3):
        x.copy_(torch.randn(64, 64, device=DEV))
        cuda_driver.launch(executable, cuda_driver.current_stream(DEV))
        torch.cuda.synchronize()
        assert torch.allclose(y, torch.relu(x @ w) + 1)


def test_the_calls_keep_the_gil():
    """A thread spinning in Python gets no turn while the main thread makes a burst of driver
    calls shorter than the switch interval; it takes turns with torch's copy_, which lets go."""
    src = torch.zeros(16, dtype=torch.int64).pin_memory()
    dst = torch.zeros(16, dtype=torch.int64, device=DEV)
    stream = cuda_driver.current_stream(DEV)
    ticks, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # longer than a burst of driver calls: the spinner runs when main lets go
    spinner = threading.Thread(target=spin)
    try:
        spinner.start()
        time.sleep(0.01)  # (a sleep lets go: the spinner starts)

        def burst(copy, times: int) -> int:
            before = ticks[0]
            for _ in range(times):
                copy()
            return ticks[0] - before

        held = burst(lambda: cuda_driver.copy(dst.data_ptr(), src.data_ptr(), 128, stream), 50)
        let_go = burst(lambda: dst.copy_(src, non_blocking=True), 10)
    finally:
        stop.set()
        sys.setswitchinterval(old)
        spinner.join()
    assert held == 0
    assert let_go > 0


def test_a_freed_timing_event_goes_back_to_its_devices_pool_and_times_again():
    first = cuda_driver.timing_event(DEV)
    handle = first.handle
    del first  # (its record may still be pending: a handle is recorded again all the same)
    start = cuda_driver.timing_event(DEV)
    assert start.handle == handle
    torch.cuda._sleep(20_000_000)
    end = cuda_driver.timing_event(DEV)
    end.synchronize()
    assert start.elapsed_time(end) > 0


def test_host_copies_land_behind_the_stream_and_their_buffers_serve_the_next_step():
    from strata.services.worker.device.device_to_host import HostCopies

    tokens = torch.zeros(300, dtype=torch.int64, device=DEV)
    torch.cuda._sleep(100_000_000)  # the copy must wait for the work queued before it
    tokens += torch.arange(300, device=DEV)
    copies = HostCopies()
    host = copies.take(tokens)
    logprobs = copies.take(torch.full((3, 4), -0.5, device=DEV))
    done = cuda_driver.timing_event(DEV)
    done.synchronize()
    assert isinstance(host, np.ndarray) and host.tolist() == list(range(300))
    assert logprobs.shape == (3, 4) and (logprobs == -0.5).all()
    address = host.ctypes.data
    copies.give_back()
    again = HostCopies().take(torch.ones(400, dtype=torch.int64, device=DEV))  # the same size class
    cuda_driver.timing_event(DEV).synchronize()
    assert again.ctypes.data == address and (again == 1).all()
    assert isinstance(HostCopies().take(torch.ones(2, dtype=torch.bfloat16, device=DEV)), torch.Tensor)
