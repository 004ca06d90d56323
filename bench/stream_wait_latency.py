"""How long one GPU takes to hand a step from one process to another when the receiving stream
waits on a word the sending stream writes (stream_memops.py), with nothing on either host:
a ping-pong of `--rounds` rounds, both processes' work queued up front.

Each round, process A waits for word B >= i, runs a small kernel, writes word A = i + 1; process B
waits for word A >= i + 1, runs a small kernel, writes word B = i + 1. The GPU time of the whole
exchange over the rounds, less the kernels' own time (measured alone), is twice the hand-off.
Words in shared host memory (what the token link uses) and, for comparison, in device memory
(shared by CUDA IPC). Run it with and without an MPS server.

    python -m strata.bench.stream_wait_latency --rounds 2000
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.multiprocessing as mp


def _kernel(x: torch.Tensor) -> None:
    x.mul_(1.0001)


def _player(role: int, where: str, path: str, words_dev, rounds: int, q_ready, q_go, q_out) -> None:
    from strata.services.worker import stream_memops

    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    if where == "host":
        words = stream_memops.SharedWords(path, 2, False, dev)
        addr = [words.address(0), words.address(1)]
    else:
        addr = [words_dev.data_ptr(), words_dev.data_ptr() + 4]
    x = torch.ones(1 << 16, device=dev)
    stream = torch.cuda.current_stream()
    _kernel(x)
    torch.cuda.synchronize()
    q_ready.put(role)
    q_go.get()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for i in range(rounds):
        if role == 0:
            stream_memops.wait_geq(stream, addr[1], i)
        else:
            stream_memops.wait_geq(stream, addr[0], i + 1)
        _kernel(x)
        stream_memops.write(stream, addr[role], i + 1)
    end.record(stream)
    end.synchronize()
    q_out.put((role, start.elapsed_time(end)))
    if where == "host":
        words.close()


def _kernel_alone(rounds: int) -> float:
    x = torch.ones(1 << 16, device="cuda:0")
    _kernel(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(rounds):
        _kernel(x)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def run(where: str, rounds: int) -> float:
    """Microseconds per hand-off (one direction)."""
    from strata.services.worker import stream_memops

    ctx = mp.get_context("spawn")
    words = stream_memops.SharedWords.create(2, torch.device("cuda:0")) if where == "host" else None
    words_dev = torch.zeros(2, dtype=torch.int32, device="cuda:0") if where == "device" else None
    q_ready, q_go, q_out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(
            target=_player, args=(r, where, words.path if words else "", words_dev, rounds, q_ready, q_go, q_out)
        )
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            q_ready.get(timeout=120)
        time.sleep(0.2)
        for _ in procs:
            q_go.put(True)
        ms = max(q_out.get(timeout=120)[1] for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        if words is not None:
            words.close()
    alone = _kernel_alone(2 * rounds)
    return max(ms - alone, 0.0) * 1e3 / (2 * rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2000, help="ping-pong rounds (each two hand-offs)")
    p.add_argument("--where", default="host,device", help="where the words live: host, device or both")
    args = p.parse_args()
    print(f"device {torch.cuda.get_device_name(0)}")
    for where in args.where.split(","):
        # 0: no more than the same kernels cost launched back to back from one process
        print(f"  words in {where} memory: {run(where, args.rounds):.1f} us per hand-off ({args.rounds} rounds)")


if __name__ == "__main__":
    main()
