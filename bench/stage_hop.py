"""The stage hop alone (issue 29's hop target: at most 100 us per decode step at batch 256, 2 MiB of
activations): two processes joined by two real stage-transport links, one each way, playing
ping-pong with a step's (hidden, residual) of --rows x --hidden, through the same calls a stage
makes (open_receiver / open_sender, send on the step thread, take into fixed inputs as a step
graph's). No model runs, so every microsecond is the hop's.

Two figures per transport, each per hop (a round is two hops):
- live: the rounds back to back, timed on process A's host clock up to its GPU's last read. Each
  hop here pays both hosts (the sender's launches and announcement, the receiver's wake-up) and the
  GPUs' copies in series: what a pipeline whose stages do nothing else would see.
- on the GPU (CUDA only): both GPUs first run a long sleep kernel, so the hosts queue every round
  ahead; A's CUDA events from the end of its sleep to its last read time the GPUs' side alone
  (copies into and out of the ring or NCCL's transfer, the cross-process waits). In a pipeline
  the hosts run ahead of their GPUs like this, and this is what a hop costs the GPU's timeline.

Two stages on one GPU without MPS take turns as two contexts, and each hand-off waits for the GPU to
switch between them (about 150 us, strata/mps.py): run that case with --mps, as `strata bench
pipeline --mps` runs its stages.

Also printed: the sender's host time per step, the receiver's host wait, and the floor: the same
bytes copied device to device twice in one process (a hop through a ring is a copy in and a copy
out).

    python -m strata.bench.stage_hop --mps                            # ipc on cuda:0, batch 256, 1B shape
    python -m strata.bench.stage_hop --devices cuda:0,cuda:1 --transports ipc,distributed
    python -m strata.bench.stage_hop --devices cpu,cpu --transports ipc,distributed --rows 16 --hidden 256
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time

import torch

SESSION = 7
_NAMES = {"ipc": "STAGE_TRANSPORT_IPC", "distributed": "STAGE_TRANSPORT_DISTRIBUTED"}


def _open_links(role: int, transport: str, device, dtype, rows: int, hidden: int, slots: int, links):
    """This process's receiver (from the peer) and sender (to the peer): the links cross through
    the two queues as the scheduler would carry them in InitCache."""
    from strata.services.worker.transport.stage_transport import open_receiver, open_sender
    from strata.v1 import engine_pb2

    kind = getattr(engine_pb2, _NAMES[transport])
    receiver = open_receiver(
        engine_pb2.InitCacheRequest(
            session=SESSION,
            previous_stage_transport=kind,
            previous_stage_address="127.0.0.1:1",
            transport_timeout_seconds=120,
        ),
        device=device,
        dtype=dtype,
        hidden_size=hidden,
        max_rows=rows,
        slots=slots,
    )
    links[role].put(receiver.link().SerializeToString())
    link = engine_pb2.StageLink.FromString(links[1 - role].get(timeout=120))
    sender = open_sender(
        engine_pb2.InitCacheRequest(session=SESSION, next_stage_link=link, transport_timeout_seconds=120),
        lambda msg: None,  # ipc and distributed announce on their own doorbells: no Forward message
        device=device,
    )
    return receiver, sender


def _player(role: int, transport: str, device: str, args, links, results) -> None:
    """Role 0 (A) serves and times; role 1 (B) returns every step as it came."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    out: dict = {}
    if role == 0:
        out["copy_floor_us"] = copy_floor_us(device, dtype, args.rows, args.hidden)
    receiver, sender = _open_links(role, transport, device, dtype, args.rows, args.hidden, args.slots, links)
    hidden = torch.zeros(args.rows, args.hidden, dtype=dtype, device=device)
    residual = torch.zeros_like(hidden)
    step = 0

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def rounds(n: int, check: bool = False) -> None:
        nonlocal step
        for _ in range(n):
            if role == 0:
                if check:  # each round's value (small: exact in bf16), which B returns plus one
                    hidden.fill_(step % 64)
                    residual.fill_(-(step % 64))
                sender.send(step, hidden, residual)
                receiver.take(step, (hidden, residual))
            else:
                receiver.take(step, (hidden, residual))
                if check:
                    hidden.add_(1)
                    residual.sub_(1)
                sender.send(step, hidden, residual)
            step += 1

    rounds(args.warmup, check=True)
    sync()
    if role == 0:
        last = (step - 1) % 64
        ok = bool((hidden == last + 1).all()) and bool((residual == -last - 1).all())
        out["intact"] = ok
    # live: hosts and GPUs in series
    sender.send_seconds, sender.steps_sent = 0.0, 0
    wait_before = receiver.wait_seconds
    started = time.perf_counter()
    rounds(args.rounds)
    sync()
    live = time.perf_counter() - started
    out["live_hop_us"] = live / (2 * args.rounds) * 1e6
    out["send_host_us"] = sender.send_seconds / max(sender.steps_sent, 1) * 1e6
    out["receive_wait_us"] = (receiver.wait_seconds - wait_before) / max(args.rounds, 1) * 1e6
    if cuda:
        # on the GPU: the sleep lets both hosts queue every round first. B's is shorter, so its
        # stream already waits on A's first step when A's sleep ends.
        links[2 + role].put(True)  # both are here: the sleeps start together
        links[3 - role].get(timeout=120)
        torch.cuda._sleep(int(args.sleep_cycles * (1.0 if role == 0 else 0.25)))
        start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_evt.record()
        queued = time.perf_counter()
        rounds(args.gpu_rounds)
        end_evt.record()
        out["host_queue_ms"] = (time.perf_counter() - queued) * 1e3
        # The sleep must outlast the hosts' queueing, or their pace shows in the GPU's figure.
        # (B's host finishes with A's: it can only take what A announced.)
        out["gpu_figure_host_free"] = not start_evt.query()
        sync()
        out["gpu_hop_us"] = start_evt.elapsed_time(end_evt) * 1e3 / (2 * args.gpu_rounds)
    if role == 0:
        results.put(out)
    links[4 + role].put(True)  # done: close only after the peer has taken its last step
    links[5 - role].get(timeout=120)
    sender.close()
    receiver.close()


def copy_floor_us(device: torch.device, dtype, rows: int, hidden: int, reps: int = 200) -> float | None:
    """Two device-to-device copies of a step's two tensors in one process: a ring hop's copies."""
    if device.type != "cuda":
        return None
    src = torch.randn(2, rows, hidden, device=device).to(dtype)
    mid, dst = torch.empty_like(src), torch.empty_like(src)
    for _ in range(10):
        mid.copy_(src)
        dst.copy_(mid)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        mid.copy_(src)
        dst.copy_(mid)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def measure(transport: str, devices: tuple[str, str], args) -> dict:
    ctx = multiprocessing.get_context("spawn")
    links = [ctx.Queue() for _ in range(6)]
    results = ctx.Queue()
    players = [ctx.Process(target=_player, args=(r, transport, devices[r], args, links, results)) for r in (0, 1)]
    for p in players:
        p.start()
    try:
        out = results.get(timeout=args.timeout)
    finally:
        for p in players:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if any(p.exitcode for p in players):
        raise SystemExit(f"{transport}: a player failed (exit codes {[p.exitcode for p in players]})")
    return out


def _print(transport: str, out: dict, args) -> None:
    floor = out.get("copy_floor_us")
    if floor is not None:
        print(f"{transport}: floor, two device copies of the step in one process: {floor:.1f} us")
    gpu = out.get("gpu_hop_us")
    gpu_text = "-" if gpu is None else f"{gpu:.1f} us"
    if gpu is not None and not out["gpu_figure_host_free"]:
        gpu_text += " (the hosts did not get ahead: not the GPU's alone; try fewer --gpu-rounds)"
    print(
        f"{transport}: data {'intact' if out['intact'] else 'WRONG'}; hop live {out['live_hop_us']:.1f} us, "
        f"on the GPU {gpu_text}   (target <= {args.target_us:g} us); sender's host {out['send_host_us']:.1f} us "
        f"a step, receiver's host waited {out['receive_wait_us']:.1f} us a round",
        flush=True,
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--devices", default="cuda:0,cuda:0", help="A's and B's devices (cpu,cpu: ipc through /dev/shm, or gloo)"
    )
    ap.add_argument("--transports", default="ipc", help="comma list of ipc, distributed (NCCL needs two GPUs)")
    ap.add_argument("--rows", type=int, default=256, help="rows a step carries: the decode batch")
    ap.add_argument("--hidden", type=int, default=2048, help="hidden size (2048: the 1B shape)")
    ap.add_argument("--dtype", default="bfloat16", help="activations' dtype")
    ap.add_argument("--slots", type=int, default=4, help="ipc ring slots (a stage's default is its micro-batches + 2)")
    ap.add_argument("--warmup", type=int, default=50, help="rounds before timing; they check the data too")
    ap.add_argument("--rounds", type=int, default=1000, help="live rounds (two hops each)")
    ap.add_argument(
        "--gpu-rounds",
        type=int,
        default=50,
        help="rounds queued behind the sleep (CUDA; at 200 an ipc host blocked on a full launch queue on an H200)",
    )
    ap.add_argument(
        "--sleep-cycles",
        type=float,
        default=1e9,
        help="A's sleep kernel in GPU cycles (1e9: ~0.5 s); must outlast the queueing",
    )
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for a transport's figures")
    ap.add_argument("--target-us", type=float, default=100.0, help="the hop target printed beside the figures")
    ap.add_argument("--mps", action="store_true", help="run both players under an MPS server of their own (one GPU)")
    ap.add_argument("--output", default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    devices = tuple(d.strip() for d in args.devices.split(","))
    if len(devices) != 2:
        raise SystemExit("--devices takes two devices")
    dtype = getattr(torch, args.dtype)
    nbytes = 2 * args.rows * args.hidden * dtype.itemsize
    print(
        f"stage hop: {args.rows} x {args.hidden} {args.dtype}, 2 tensors = {nbytes / 2**20:.2f} MiB a step, {devices[0]} <-> {devices[1]}"
    )
    report = {
        "rows": args.rows,
        "hidden": args.hidden,
        "dtype": args.dtype,
        "bytes": nbytes,
        "devices": devices,
        "mps": args.mps,
        "transports": {},
    }
    mps = None
    if args.mps:  # both players become clients of one MPS server, as `strata serve --mps` stages do
        from strata.mps import MpsDaemon

        mps = MpsDaemon()
        mps.start()
        os.environ.update(mps.env)  # spawned players inherit it
    failed = 0
    try:
        for transport in [t.strip() for t in args.transports.split(",") if t.strip()]:
            out = measure(transport, devices, args)
            report["transports"][transport] = out
            failed += not out["intact"]
            _print(transport, out, args)
    finally:
        if mps is not None:
            mps.stop()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
