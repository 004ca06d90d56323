"""The tensor-parallel all-reduce alone, per message size: NCCL's (a stage's default), the one-shot
through torch's symmetric memory without multicast (--tensor-parallel-all-reduce symm-mem), and
Strata's own one-shot over CUDA IPC (--tensor-parallel-all-reduce ipc), on T processes of a GPU
each.

Each size is timed the way a decode step runs it: 64 all-reduces back to back captured in one CUDA
graph (a step of a 32-layer model has 64 plus the embedding's and the draw's), replayed, timed
with CUDA events; the figure is microseconds per all-reduce. Each method's result is checked on
every rank (integer inputs: exact) before it is timed. The sizes: bf16 8 KiB (an 8B model's
batch-1 decode: 4,096 x 2 bytes), 128 KiB (16 streams), 2 MiB (batch 256), 8 MiB (batch 1,024),
32 MiB (a prefill chunk). Here torch's buffer holds every size, to show where it stops paying;
Strata's has its serving size (with two ranks 16 MiB, 32 MiB fused with the norm; 512 KiB with
more), past which NCCL serves.

Back to back is not how a batch-1 step meets them: there each sits between two GEMVs, and a
dependent launch lets the next GEMV stream its weights while the ranks meet. So each method is
also timed "in a chain": 64 x (the 8B rank's o_proj GEMV, then an all-reduce of its 8 KiB output)
minus 64 GEMVs alone, what each all-reduce adds to the step (issue 51's budget: 2.4 us).

Last, what follows a row-parallel linear in the unfused layers (batches past the decode chain):
the sum, the residual add and the RMSNorm, per --norm-rows of the 8B's hidden size, as the ipc
one-shot fused with them (what serves), the ipc sum then the add-norm kernel, NCCL's then that
kernel, and the add-norm kernel alone (the floor without communication).

    python -m strata.bench.all_reduce                      # 2 GPUs
    python -m strata.bench.all_reduce --tensor-parallel-size 4 --json out.json
    python -m strata.bench.all_reduce --tensor-parallel-size 1   # one GPU: each method with no peer, a floor
    python -m strata.bench.all_reduce --one-gpu                  # one GPU, two ranks: ipc's meeting in L2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch

from strata.bench.graph_timing import graph_time_us
from strata.bench.spawn_ranks import run_on_ranks
from strata.mps import MpsDaemon

SIZES_KIB = (8, 128, 2048, 8192, 32768)
CALLS = 64
# --one-gpu: each launch lets its successor start at once (a dependent launch), so the programs of a
# whole graph may sit on the GPU waiting; 64 launches of 64 programs from each rank filled the GPU
# the two ranks share, and a rank's running one-shot then waited for a peer that had no room to
# start (both hung at 128 KiB). Separate GPUs never meet this: a kernel's successors launch only
# once all of its programs run. So one GPU's graphs hold at most ONE_GPU_PROGRAMS programs a rank.
ONE_GPU_CALLS = 8
ONE_GPU_PROGRAMS = 512


def _rank(rank: int, size: int, port: int, args, results) -> None:
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(120, exit=True)  # a rank waiting on a lost peer says where
    from strata.stage_links import set_nccl_environment

    set_nccl_environment()
    from strata.services.worker.tensor_parallel.group import TensorParallelGroup
    from strata.services.worker.tensor_parallel.ipc_all_reduce import IpcAllReduce
    from strata.services.worker.tensor_parallel.symm_mem import SymmetricMemoryAllReduce

    device = torch.device("cuda", 0 if args.one_gpu else rank)
    torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, world_size=size, is_master=rank == 0, timeout=datetime.timedelta(seconds=120)
    )
    group, one_shot = None, None
    if not args.one_gpu:  # (NCCL and symmetric memory refuse two ranks on one GPU)
        group = TensorParallelGroup(rank, size, device, timeout=120.0, dtype=dtype)
        group.form(store, 1)
        # A stage of one forms no group; the floor still wants NCCL's kernel and torch's one-shot.
        pg = group.pg if size > 1 else _group_of_one(store, device)
        try:
            largest = max(args.sizes_kib) * 1024
            one_shot = SymmetricMemoryAllReduce(pg, store, rank, size, 1, device, dtype, max_bytes=largest)
        except Exception as e:  # reported, and the NCCL column still comes
            if rank == 0:
                print(f"symmetric memory unavailable: {type(e).__name__}: {e}", flush=True)
    # At its serving size: past it, more programs than fit on the GPU at once would each wait for
    # their peer's, which a GPU that schedules them in another order may never start.
    ipc = IpcAllReduce(store, rank, size, 2, device, dtype, max_bytes=_ipc_max_bytes(args))
    methods = {"ipc": ipc} if group is None else _methods(pg, one_shot, ipc)
    rows = []
    expected = size * (size + 1) / 2
    # The ranks meet before timing: else one rank's replays would count its wait for the other to
    # finish capturing (a skew that put ipc at 10-680 us a call past 256 KiB).
    meet = (
        None
        if group is None
        else (lambda: pg.allreduce([torch.zeros(1, device=device)]).wait() and torch.cuda.synchronize())
    )
    for kib in args.sizes_kib:
        calls = _calls(kib, args.one_gpu)
        n = kib * 1024 // torch.empty((), dtype=dtype).element_size()
        x = torch.empty(n, dtype=dtype, device=device)
        row = {"kib": kib, "calls": calls}
        for name, reduce in methods.items():
            x.fill_(rank + 1)
            if not reduce(x):  # not for it (past its buffer): no column
                continue
            torch.cuda.synchronize()
            ok = bool((x == expected).all())
            x.zero_()  # the timed calls sum zeros: no overflow over 64 calls
            row[f"{name}_ok"] = ok
            timed = (
                graph_time_us(lambda _, r=reduce: r(x), calls, replays=args.replays, before_timing=meet)
                if ok
                else float("nan")
            )
            row[name] = timed
            print(f"rank {rank}: {kib} KiB {name} {row[name]:.2f} us (exact: {ok})", file=sys.stderr, flush=True)
        rows.append(row)
    # (On one GPU the ranks' GEMVs would share it, and a chain's waiting programs could fill it.)
    chained = {} if args.one_gpu else _in_a_chain(methods, device, dtype, args.replays)
    normed = [] if group is None else _with_add_and_norm(store, rank, size, pg, ipc, device, dtype, args, meet)
    if rank == 0:
        results.put((rows, chained, normed))
    ipc.abort()
    if group is not None:
        group.abort("done")


def _ipc_max_bytes(args) -> int | None:
    """The one-shot's buffers: --ipc-max-mib, or the serving size (None)."""
    return args.ipc_max_mib << 20 if args.ipc_max_mib else None


def _calls(kib: int, one_gpu: bool) -> int:
    """Calls a graph holds: CALLS, or on one GPU as many as leave room for both ranks' programs."""
    if not one_gpu:
        return CALLS
    from strata.kernels.one_shot_all_reduce import BLOCK_BYTES, MAX_PROGRAMS

    programs = min(-(-kib * 1024 // BLOCK_BYTES), MAX_PROGRAMS)
    return max(1, min(ONE_GPU_CALLS, ONE_GPU_PROGRAMS // programs))


def _group_of_one(store, device) -> torch.distributed.ProcessGroupNCCL:
    pg = torch.distributed.ProcessGroupNCCL(torch.distributed.PrefixStore("strata/one/", store), 0, 1)
    pg.allreduce([torch.ones(1, device=device)]).wait()  # its communicator, outside the capture
    return pg


def _methods(pg, one_shot, ipc) -> dict:
    methods = {"nccl": lambda x: pg.allreduce([x]).wait() or True}
    if one_shot is not None:
        methods["one_shot"] = one_shot
    methods["ipc"] = ipc
    return methods


def _in_a_chain(methods: dict, device, dtype, replays: int) -> dict:
    """us each all-reduce adds between two GEMVs: 64 x (o_proj of an 8B rank at T = 2, [1, 2048] x
    [2048, 4096], then the all-reduce of its output) against the 64 GEMVs alone."""
    from strata.kernels.decode_linear import plain_linear

    gen = torch.Generator(device="cpu").manual_seed(0)
    weight = (torch.randn(4096, 2048, generator=gen) / 64).to(device=device, dtype=dtype)
    x = torch.randn(1, 2048, generator=gen).to(device=device, dtype=dtype)
    alone = graph_time_us(lambda _: plain_linear(x, weight), CALLS, replays=replays)
    out = {"gemv_us": alone}
    for name, reduce in methods.items():
        paired = graph_time_us(lambda _, reduce=reduce: reduce(plain_linear(x, weight)), CALLS, replays=replays)
        out[name] = paired - alone
    return out


def _with_add_and_norm(store, rank, size, pg, ipc, device, dtype, args, meet) -> list[dict]:
    """us per call of what follows a row-parallel linear in the unfused layers: the sum over the
    ranks, the residual add and the RMSNorm, for rows of the 8B's hidden 4,096 (16: the 16-stream
    decode step; 528: it with a 512-token prefill; 1,024). Three ways: the ipc one-shot fused with
    the add and norm (what serves), the ipc sum then the fused add-norm kernel, NCCL's then that
    kernel; and the add-norm kernel alone, the floor without communication."""
    from strata.kernels.rmsnorm import fused_add_rms_norm
    from strata.services.worker.tensor_parallel.ipc_all_reduce import IpcAllReduce

    fused = IpcAllReduce(store, rank, size, 3, device, dtype, kind="norm", max_bytes=_ipc_max_bytes(args))
    hidden = 4096
    weight = torch.ones(hidden, dtype=dtype, device=device)
    out = []
    for rows in args.norm_rows:
        x = torch.zeros(rows, hidden, dtype=dtype, device=device)
        residual = torch.zeros_like(x)
        ways = {
            "ipc_fused": lambda: fused.add_rms_norm(x, residual, weight, 1e-5, residual_out=residual),
            "ipc_then_norm": lambda: ipc(x) and fused_add_rms_norm(x, residual, weight, 1e-5, residual_out=residual),
            "nccl_then_norm": lambda: (
                pg.allreduce([x]).wait() or fused_add_rms_norm(x, residual, weight, 1e-5, residual_out=residual)
            ),
            "norm_alone": lambda: fused_add_rms_norm(x, residual, weight, 1e-5, residual_out=residual),
        }
        row = {"rows": rows}
        for name, way in ways.items():
            if rows * hidden > ipc.capacity and name.startswith("ipc"):
                continue
            row[name] = graph_time_us(lambda _, w=way: w(), CALLS, replays=args.replays, before_timing=meet)
        out.append(row)
    fused.abort()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.bench.all_reduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--tensor-parallel-size", type=int, default=2, help="ranks, one GPU each (cuda:0 ..)")
    p.add_argument("--sizes-kib", type=lambda s: [int(x) for x in s.split(",")], default=list(SIZES_KIB))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--replays", type=int, default=50, help="graph replays timed per size")
    p.add_argument(
        "--one-gpu",
        action="store_true",
        help="every rank on cuda:0 under an MPS server of its own, ipc only: what the one-shot's "
        "meeting costs without a link between GPUs (and each rank's GEMVs share the GPU)",
    )
    p.add_argument(
        "--norm-rows",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[16, 528, 1024],
        help="rows of hidden 4,096 for the all-reduce followed by the residual add and RMSNorm",
    )
    p.add_argument(
        "--ipc-max-mib",
        type=int,
        default=0,
        help="the ipc one-shot's buffers, MiB (0: its serving sizes, 16 and 32 MiB with two ranks): whether it beats NCCL "
        "on a prefill step's messages past that (its grid stays at most 256 programs, which loop over the rest)",
    )
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    size = args.tensor_parallel_size
    if torch.cuda.device_count() < (1 if args.one_gpu else size):
        print(f"needs {size} GPUs; {torch.cuda.device_count()} visible")
        return 1
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    mps = MpsDaemon() if args.one_gpu else None
    saved = dict(os.environ)
    if mps is not None:  # both ranks' kernels at once: a spinning kernel must not hold the GPU
        mps.start()
        os.environ.update(mps.env)
    try:
        rows, chained, normed = run_on_ranks(_rank, size, args)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        if mps is not None:
            mps.stop()
    name = torch.cuda.get_device_name(0)
    methods = ("nccl", "one_shot", "ipc")
    where = f"{size} ranks on one {name} (MPS)" if args.one_gpu else f"{size} x {name}"
    calls = f"up to {ONE_GPU_CALLS}" if args.one_gpu else CALLS
    print(f"all-reduce of {args.dtype} over {where}, {calls} calls per graph, us per call")
    print(f"{'size':>10} {'nccl':>10} {'symm-mem':>10} {'ipc':>10}  fastest")
    for row in rows:
        times = {m: row.get(m, float("nan")) for m in methods}
        fastest = min([(t, m) for m, t in times.items() if t == t], default=(0, "-"))[1]
        bad = [k.removesuffix("_ok") for k, v in row.items() if k.endswith("_ok") and not v]
        note = f"  WRONG: {', '.join(bad)}" if bad else ""
        print(f"{row['kib']:>7} KiB " + " ".join(f"{times[m]:>10.2f}" for m in methods) + f"  {fastest}{note}")
    if chained:
        print(
            f"in a chain (8 KiB between GEMVs of {chained['gemv_us']:.2f} us), us each all-reduce adds: "
            + ", ".join(f"{m} {chained.get(m, float('nan')):.2f}" for m in methods)
            + "   (issue 51's batch-1 budget: 2.4)"
        )
    if normed:
        print(f"the sum, the residual add and the RMSNorm of rows of 4,096 {args.dtype}, us per call")
        ways = ("ipc_fused", "ipc_then_norm", "nccl_then_norm", "norm_alone")
        print(f"{'rows':>6} " + " ".join(f"{w:>15}" for w in ways))
        for row in normed:
            print(f"{row['rows']:>6} " + " ".join(f"{row.get(w, float('nan')):>15.2f}" for w in ways))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "tensor_parallel_size": size,
                    "one_gpu": args.one_gpu,
                    "device": name,
                    "dtype": args.dtype,
                    "rows": rows,
                    "in_a_chain": chained,
                    "with_add_and_norm": normed,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
