"""Two processes joined by one stage-transport link, without the services: the receiver opens its
end and hands its StageLink to the sender; the Forward messages and the credits travel through
multiprocessing queues instead of the Forward stream (ipc has its own doorbell). Each step's tensors hold values derived
from its step id, so a slot overwritten before it was read, or read before it was written, shows.

Run in spawned processes by tests/gpu/test_stage_transport_gpu.py (module-level functions)."""

from __future__ import annotations

import asyncio
import threading
import time

import torch

from strata.v1 import engine_pb2

HIDDEN = 64
SESSION = 3


def step_tensors(step: int, rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    base = torch.arange(rows * HIDDEN, dtype=torch.float32, device=device).reshape(rows, HIDDEN)
    return base + step * 1000.0, -(base + step * 1000.0)


def rows_of(step: int) -> int:
    return 1 + (step * 37) % 128


def receiver_main(
    transport: int, device: str, slots: int, steps: int, link_q, msg_q, ack_q, result_q, delay: float = 0.0
):
    from strata.services.worker.transport.stage_transport import open_receiver

    torch.cuda.set_device(torch.device(device))

    async def main():
        request = engine_pb2.InitCacheRequest(
            session=SESSION,
            previous_stage_transport=transport,
            previous_stage_address="127.0.0.1:1",
            transport_timeout_seconds=60,
        )
        receiver = open_receiver(
            request, device=device, dtype=torch.float32, hidden_size=HIDDEN, max_rows=128, slots=slots
        )
        link_q.put(receiver.link().SerializeToString())
        loop = asyncio.get_running_loop()
        bad = []
        if receiver.on_step_thread:  # ipc: announcements come on its doorbell, not the queues
            # Odd steps land in fixed inputs, as a graph's (take's `into`); even ones in new tensors.
            inputs = torch.full((2, 128, HIDDEN), -1.0, device=device)
            for step in range(steps):
                into = (inputs[0], inputs[1]) if step % 2 else None
                hidden, residual = await loop.run_in_executor(None, receiver.take, step, into)
                if delay:  # a slow reader: the sender must wait for credits, never overwrite
                    await asyncio.sleep(delay)
                want_h, want_r = step_tensors(step, rows_of(step), device)
                if not (torch.equal(hidden, want_h) and torch.equal(residual, want_r)):
                    bad.append(step)
            torch.cuda.synchronize()
            result_q.put(bad)
            receiver.close()
            return
        for _ in range(steps):
            msg = engine_pb2.Activations.FromString(await loop.run_in_executor(None, msg_q.get))
            assert receiver.deliver(msg)
            hidden, residual = await receiver.receive(msg.step_id)
            if delay:  # a slow reader: the sender must wait for credits, never overwrite
                await asyncio.sleep(delay)
            while not receiver.acks.empty():
                ack_q.put(receiver.acks.get_nowait().SerializeToString())
            want_h, want_r = step_tensors(msg.step_id, rows_of(msg.step_id), device)
            if not (torch.equal(hidden, want_h) and torch.equal(residual, want_r)):
                bad.append(msg.step_id)
        torch.cuda.synchronize()
        result_q.put(bad)
        receiver.close()

    asyncio.run(main())


def sender_main(device: str, steps: int, link_q, msg_q, ack_q, done_q):
    from strata.services.worker.transport.stage_transport import open_sender

    torch.cuda.set_device(torch.device(device))
    link = engine_pb2.StageLink.FromString(link_q.get(timeout=60))
    sender = open_sender(
        engine_pb2.InitCacheRequest(session=SESSION, next_stage_link=link, transport_timeout_seconds=60),
        lambda msg: msg_q.put(msg.SerializeToString()),
        device=device,
    )

    def credits():
        while True:
            data = ack_q.get()
            if data is None:
                return
            sender.on_ack(engine_pb2.ForwardAck.FromString(data))

    threading.Thread(target=credits, daemon=True).start()
    # One reused output buffer, as a captured graph's: the sender must copy it before the next
    # step overwrites it, without waiting for the GPU on this (the step) thread.
    hidden = torch.empty(128, HIDDEN, device=device)
    residual = torch.empty(128, HIDDEN, device=device)
    for step in range(steps):
        n = rows_of(step)
        h, r = step_tensors(step, n, device)
        torch.cuda._sleep(2_000_000)  # a long kernel before the copy: a missing wait shows
        hidden[:n].copy_(h)
        residual[:n].copy_(r)
        sender.send(step, hidden[:n], residual[:n])
    done_q.get(timeout=300)
    ack_q.put(None)
    sender.close()


def word_waiter_main(path, src, dst, report_q, go_q):
    """The waiting side of tests/gpu/test_stream_memops_gpu.py: opens the shared word at `path`,
    queues a wait on it and a copy behind it, says whether the copy ran before the other process
    wrote the word, and then what it copied."""
    from strata.services.worker.transport.stream_memops import SharedWords, wait_geq

    words = SharedWords(path, 1, False, src.device)
    stream = torch.cuda.current_stream(src.device)
    wait_geq(stream, words.address(0), 1)
    dst.copy_(src)
    done = torch.cuda.Event()
    done.record(stream)
    time.sleep(0.2)  # the copy would have run by now without the wait
    report_q.put(("queued", done.query()))
    go_q.get(timeout=120)  # the other process has written the data, then the word
    done.synchronize()
    report_q.put(("copied", dst.cpu().tolist()))
    words.close()


def clock_player_main(role: int, path: str, directory: str, rounds: int, report_q):
    """One side of tests/gpu/test_gpu_clock_gpu.py's ping-pong: `rounds` steps, each waiting for
    the other process's word, stamped start and handed on this stage's GPU clock around a ~0.3 ms
    kernel, then writing its own word; the dump's path goes back."""
    from strata.services.worker.diagnostics.gpu_clock import GpuClock
    from strata.services.worker.transport.stream_memops import SharedWords, wait_geq, write

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    words = SharedWords(path, 2, False, dev)
    clock = GpuClock(directory, role, dev)
    stream = torch.cuda.current_stream(dev)
    for i in range(rounds):
        wait_geq(stream, words.address(1 - role), i + role)  # stage 1 waits for stage 0's step i
        clock.stamp(i, "start")
        torch.cuda._sleep(600_000)
        clock.stamp(i, "handed")
        write(stream, words.address(role), i + 1)
    report_q.put(str(clock.dump()))
    words.close()
