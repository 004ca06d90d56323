"""The tensor-parallel all-reduce alone, per message size: NCCL's (a stage's default) against the
one-shot through torch's symmetric memory without multicast (--tensor-parallel-all-reduce
symm-mem), both through the TensorParallelGroup a stage uses, on T processes of a GPU each.

Each size is timed the way a decode step runs it: 64 all-reduces back to back captured in one CUDA
graph (a step of a 32-layer model has 64 plus the embedding's and the draw's), replayed, timed
with CUDA events; the figure is microseconds per all-reduce. Each method's result is checked on
every rank (integer inputs: exact) before it is timed. The sizes: bf16 8 KiB (an 8B model's
batch-1 decode: 4,096 x 2 bytes), 128 KiB (16 streams), 2 MiB (batch 256), 32 MiB (a prefill
chunk). The one-shot takes up to 512 KiB in serving (symm_mem.MAX_BYTES); here its buffer holds
every size, to show where it stops paying.

    python -m strata.bench.all_reduce                      # 2 GPUs
    python -m strata.bench.all_reduce --tensor-parallel-size 4 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os

import torch

from strata.bench.graph_timing import graph_time_us
from strata.launcher import free_port

SIZES_KIB = (8, 128, 2048, 32768)
CALLS = 64


def _rank(rank: int, size: int, port: int, args, results) -> None:
    from strata.stage_links import set_nccl_environment

    set_nccl_environment()
    from strata.services.worker.tensor_parallel.group import TensorParallelGroup
    from strata.services.worker.tensor_parallel.symm_mem import SymmetricMemoryAllReduce

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, world_size=size, is_master=rank == 0, timeout=datetime.timedelta(seconds=120)
    )
    group = TensorParallelGroup(rank, size, device, timeout=120.0, dtype=dtype)
    group.form(store, 1)
    largest = max(args.sizes_kib) * 1024
    one_shot = None
    try:
        one_shot = SymmetricMemoryAllReduce(group.pg, store, rank, size, 1, device, dtype, max_bytes=largest)
    except Exception as e:  # reported, and the NCCL column still comes
        if rank == 0:
            print(f"symmetric memory unavailable: {type(e).__name__}: {e}", flush=True)
    rows = []
    expected = size * (size + 1) / 2
    for kib in args.sizes_kib:
        n = kib * 1024 // torch.empty((), dtype=dtype).element_size()
        x = torch.empty(n, dtype=dtype, device=device)
        row = {"kib": kib}
        methods = {"nccl": lambda: group._run("all-reduce", lambda pg: pg.allreduce([x]))}
        if one_shot is not None:
            methods["one_shot"] = lambda: one_shot(x)
        for name, fn in methods.items():
            x.fill_(rank + 1)
            fn()
            torch.cuda.synchronize()
            ok = bool((x == expected).all())
            x.zero_()  # the timed calls sum zeros: no overflow over 64 calls
            row[name] = graph_time_us(lambda _: fn(), CALLS, replays=args.replays) if ok else float("nan")
            row[f"{name}_ok"] = ok
        rows.append(row)
    if rank == 0:
        results.put(rows)
    group.abort("done")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.bench.all_reduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--tensor-parallel-size", type=int, default=2, help="ranks, one GPU each (cuda:0 ..)")
    p.add_argument("--sizes-kib", type=lambda s: [int(x) for x in s.split(",")], default=list(SIZES_KIB))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--replays", type=int, default=50, help="graph replays timed per size")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    size = args.tensor_parallel_size
    if torch.cuda.device_count() < size:
        print(f"needs {size} GPUs; {torch.cuda.device_count()} visible")
        return 1
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, size, port, args, results)) for r in range(size)]
    for proc in procs:
        proc.start()
    rows = results.get(timeout=600)
    for proc in procs:
        proc.join(60)
    name = torch.cuda.get_device_name(0)
    print(f"all-reduce of {args.dtype} over {size} x {name}, {CALLS} calls per graph, us per call")
    print(f"{'size':>10} {'nccl':>10} {'one-shot':>10}  faster")
    for row in rows:
        one = row.get("one_shot", float("nan"))
        faster = "one-shot" if one < row["nccl"] else "nccl"
        bad = [k.removesuffix("_ok") for k, v in row.items() if k.endswith("_ok") and not v]
        note = f"  WRONG: {', '.join(bad)}" if bad else ""
        print(f"{row['kib']:>7} KiB {row['nccl']:>10.2f} {one:>10.2f}  {faster}{note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tensor_parallel_size": size, "device": name, "dtype": args.dtype, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
