"""The driver's stream memory operations on shared host words (services/worker/transport/stream_memops.py):
a stream that waits on a word runs nothing behind the wait until another process's stream writes
it, or this process's host stores it.

    python -m pytest tests/gpu/test_stream_memops_gpu.py -q
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.multiprocessing as mp

from strata.services.worker.transport import stream_memops
from strata.services.worker.transport.stream_memops import SharedWords
from tests import stage_transport_peers as peers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_this_gpu_can_wait_on_a_shared_word():
    assert stream_memops.usable(torch.device("cuda:0"))


def test_a_host_store_releases_a_waiting_stream():
    dev = torch.device("cuda:0")
    words = SharedWords.create(2, dev)
    try:
        src = torch.full((256,), 3.0, device=dev)
        dst = torch.zeros(256, device=dev)
        stream = torch.cuda.current_stream(dev)
        stream_memops.wait_geq(stream, words.address(1), 5)
        dst.copy_(src)
        done = torch.cuda.Event()
        done.record(stream)
        time.sleep(0.2)
        assert not done.query()
        words.host[1] = 4  # below the value waited for
        time.sleep(0.1)
        assert not done.query()
        words.host[1] = 5
        done.synchronize()
        assert dst.eq(3.0).all()
    finally:
        torch.cuda.synchronize()
        words.close()


def test_a_fresh_thread_queues_a_write_and_a_wait():
    """A thread that has made no CUDA call yet (an executor's, taking a step's activations) has
    no current context: the calls must still queue."""
    import threading

    dev = torch.device("cuda:0")
    words = SharedWords.create(1, dev)
    failures = []

    def fresh():
        try:
            stream = torch.cuda.current_stream(dev)
            stream_memops.write(stream, words.address(0), 9)
            stream_memops.wait_geq(stream, words.address(0), 9)
            stream.synchronize()
        except Exception as e:  # reported to the test's thread
            failures.append(e)

    try:
        t = threading.Thread(target=fresh)
        t.start()
        t.join(timeout=30)
        assert not failures and int(words.host[0]) == 9
    finally:
        torch.cuda.synchronize()
        words.close()


def test_a_process_waits_for_the_word_another_process_writes():
    dev = torch.device("cuda:0")
    ctx = mp.get_context("spawn")
    words = SharedWords.create(1, dev)
    src = torch.zeros(64, device=dev)
    dst = torch.full((64,), -1.0, device=dev)
    report_q, go_q = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=peers.word_waiter_main, args=(words.path, src, dst, report_q, go_q))
    child.start()
    try:
        what, ran_early = report_q.get(timeout=120)
        assert what == "queued" and not ran_early
        src.fill_(9.0)
        stream_memops.write(torch.cuda.current_stream(dev), words.address(0), 1)
        torch.cuda.synchronize()
        assert int(words.host[0]) == 1
        go_q.put(True)
        what, copied = report_q.get(timeout=120)
        assert what == "copied" and copied == [9.0] * 64
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
        words.close()
    assert child.exitcode == 0
