"""How long one GPU takes to hand a step from one process to another when the receiving stream
waits on a word the sending stream writes (stream_memops.py), with nothing on either host:
a ping-pong of `--rounds` rounds, both processes' work queued up front behind a long sleep.

Each round, process A waits for word B >= i, runs `--work-us` of GPU work (a sleep kernel: a
pipeline stage's step), writes word A = i + 1; process B waits for word A >= i + 1, works,
writes word B = i + 1. The GPU time of the whole exchange, less the work's own time (measured
alone, the same way), is twice the hand-off. Both hosts queue the rounds while the first sleep
runs, so no host is in the chain, as in a pipeline whose hosts run ahead; a run where a host was
still queueing when the rounds began is flagged (its figure may hold host time).

`--ops` adds what a stage queues around the wait (_Ops): the ring copies, the step's staging.
Words in shared host memory (what the stage links use) or, for comparison, in device memory
(CUDA IPC). Run it with and without an MPS server (`--mps` starts one of its own).

A one-program kernel polling the word in place of the driver's wait was tried on an H200 under
MPS: 53-59 us a hand-off against 3 us (bench/RESULTS.md, issue 29, session 14).

    python -m strata.bench.stream_wait_latency --work-us 0,600 --ops none,memcpy,kernel,staged --mps
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.multiprocessing as mp

LEAD_MS = 300.0  # the sleep ahead of the rounds, while both hosts queue them


def _sleep_cycles(us: float) -> int:
    return int(us * torch.cuda.clock_rate() * 1e3 / 1e6) if us > 0 else 0  # clock_rate: MHz


def _work(cycles: int) -> None:
    if cycles:
        torch.cuda._sleep(cycles)


ACT_ELEMENTS = 16 * 2048  # a 16-stream decode step's hidden state (and again its residual), bf16


class _Ops:
    """What a stage queues around the wait, as `--ops` names it:
    none     the wait, the work and the write alone;
    memcpy   each side copies two activations into a ring before its write (cuMemcpyAsync, as
             ring.Ring.write) and two out of it after its wait (as IpcReceiver.take);
    kernel   the same four copies as elementwise kernels;
    staged   memcpy, plus a step's staging ahead of the wait: a pinned host-to-device copy and a
             device-to-device one (cuda_graphs.DecodeGraphs.run)."""

    def __init__(self, name: str, dev: torch.device):
        from strata.services.worker.transport import stream_memops

        self.name, self.memops = name, stream_memops
        self.ring = torch.zeros(2, ACT_ELEMENTS, dtype=torch.bfloat16, device=dev)
        self.acts = torch.ones(2, ACT_ELEMENTS, dtype=torch.bfloat16, device=dev)
        self.inputs = torch.zeros(2, ACT_ELEMENTS, dtype=torch.bfloat16, device=dev)
        self.host = torch.zeros(4096, dtype=torch.int32).pin_memory()
        self.staged = torch.zeros(4096, dtype=torch.int32, device=dev)
        self.tables = torch.zeros(4096, dtype=torch.int32, device=dev)

    def _copy(self, stream, dst, src) -> None:
        if self.name == "kernel":
            torch.mul(src, 1, out=dst)
        else:
            self.memops.copy(stream, dst, src)

    def before_wait(self, stream) -> None:
        if self.name == "staged":
            self.staged.copy_(self.host, non_blocking=True)
            self.tables.copy_(self.staged)

    def after_wait(self, stream) -> None:
        if self.name != "none":
            for part in range(2):
                self._copy(stream, self.inputs[part], self.ring[part])

    def before_write(self, stream) -> None:
        if self.name != "none":
            for part in range(2):
                self._copy(stream, self.ring[part], self.acts[part])


def _player(role: int, where: str, ops: str, path: str, words_dev, rounds: int, work_us: float, queues) -> None:
    from strata.services.worker.transport import stream_memops

    q_ready, q_go, q_out = queues
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    if where == "host":
        words = stream_memops.SharedWords(path, 2, False, dev)
        addr = [words.address(0), words.address(1)]
    else:
        addr = [words_dev.data_ptr(), words_dev.data_ptr() + 4]
    wait_geq = stream_memops.wait_geq
    stream = torch.cuda.current_stream()
    cycles, lead = _sleep_cycles(work_us), _sleep_cycles(LEAD_MS * 1e3)
    around = _Ops(ops, dev)
    wait_geq(stream, addr[0], 0)  # compiled and loaded before the clock runs
    _work(cycles)
    around.before_wait(stream), around.after_wait(stream), around.before_write(stream)
    torch.cuda.synchronize()
    q_ready.put(role)
    q_go.get()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    torch.cuda._sleep(lead)
    queued = torch.cuda.Event()
    for i in range(rounds):
        around.before_wait(stream)
        wait_geq(stream, addr[1], i) if role == 0 else wait_geq(stream, addr[0], i + 1)
        around.after_wait(stream)
        _work(cycles)
        around.before_write(stream)
        stream_memops.write(stream, addr[role], i + 1)
    end.record(stream)
    queued.record(stream)  # (queried right away: the rounds must not have started yet)
    ahead = not queued.query()
    end.synchronize()
    q_out.put((role, start.elapsed_time(end) - LEAD_MS, ahead))
    if where == "host":
        words.close()


def _work_alone(rounds: int, work_us: float) -> float:
    """The rounds' work back to back in one process (nothing around it)."""
    cycles = _sleep_cycles(work_us)
    _work(cycles)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(_sleep_cycles(LEAD_MS * 1e3))
    for _ in range(rounds):
        _work(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) - LEAD_MS


def run(where: str, ops: str, rounds: int, work_us: float) -> tuple[float, bool]:
    """(microseconds per hand-off, one direction; whether both hosts queued every round ahead)."""
    from strata.services.worker.transport import stream_memops

    ctx = mp.get_context("spawn")
    words = stream_memops.SharedWords.create(2, torch.device("cuda:0")) if where == "host" else None
    words_dev = torch.zeros(2, dtype=torch.int32, device="cuda:0") if where == "device" else None
    queues = (ctx.Queue(), ctx.Queue(), ctx.Queue())
    procs = [
        ctx.Process(
            target=_player,
            args=(r, where, ops, words.path if words else "", words_dev, rounds, work_us, queues),
        )
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            queues[0].get(timeout=120)
        time.sleep(0.2)
        for _ in procs:
            queues[1].put(True)
        outs = [queues[2].get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        if words is not None:
            words.close()
    ms = max(o[1] for o in outs)
    alone = _work_alone(2 * rounds, work_us)
    return (ms - alone) * 1e3 / (2 * rounds), all(o[2] for o in outs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=50, help="ping-pong rounds (each two hand-offs)")
    p.add_argument("--where", default="host", help="where the words live: host, device, or both (comma-separated)")
    p.add_argument("--work-us", default="0,100,600", help="GPU work between a wait and the write, comma-separated")
    p.add_argument(
        "--ops", default="none", help="what each side queues around the wait: none, memcpy, kernel, staged (_Ops)"
    )
    p.add_argument("--mps", action="store_true", help="run the players under an MPS server of this run's own")
    args = p.parse_args()
    daemon = None
    if args.mps:
        from strata.mps import MpsDaemon

        daemon = MpsDaemon()
        daemon.start()
        os.environ.update(daemon.env)  # the spawned players find it; this process has no context yet
    try:
        print(f"device {torch.cuda.get_device_name(0)}, {'under MPS' if args.mps else 'no MPS'}")
        for where in args.where.split(","):
            for ops in args.ops.split(","):
                for work in (float(w) for w in args.work_us.split(",")):
                    us, ahead = run(where, ops, args.rounds, work)
                    note = "" if ahead else "  (a host was still queueing when the rounds began: hosts may be in it)"
                    print(
                        f"  words in {where} memory, around the wait {ops:6s}, {work:5.0f} us of work: "
                        f"{us:7.1f} us per hand-off{note}"
                    )
    finally:
        if daemon is not None:
            daemon.stop()


if __name__ == "__main__":
    main()
