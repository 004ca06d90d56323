"""Prefill-sized all-reduces of two ranks, eagerly, us a call: NCCL's against the copy-engine
all-reduce (tensor_parallel/copy_all_reduce.py, `--tensor-parallel-copy-engine`), each alone and
with the residual add and RMSNorm after it (NCCL's then rmsnorm.py's fused add-norm; the copy
engine's fused); and the floor under the copy engine's: a plain cudaMemcpy of the message into the
peer's buffer (CUDA IPC), both ranks at once as the exchange runs them, and one way. Rows of the 8B's
hidden 4,096 in bf16: 1,024 to 8,192 rows, 8-64 MiB (a 4,096-token chunk is 32 MiB).

NCCL moved 240-270 GB/s there on two H200s, a copy engine 370-380 (bench/RESULTS.md, session 19).

    python -m strata.bench.peer_copy           # two GPUs
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing

import torch


def _eager_us(call, calls: int = 20) -> float:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        call()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def _rank(rank: int, port: int, sizes_mib: list[int], results) -> None:
    from strata.kernels.rmsnorm import fused_add_rms_norm
    from strata.services.worker.tensor_parallel.copy_all_reduce import CopyEngineAllReduce
    from strata.services.worker.tensor_parallel.group import TensorParallelGroup
    from strata.services.worker.tensor_parallel.ipc_all_reduce import exported_handle, peer_memory
    from strata.stage_links import set_nccl_environment

    set_nccl_environment()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, world_size=2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    group = TensorParallelGroup(rank, 2, device, timeout=120.0, all_reduce="nccl")
    group.form(store, 1)
    pg = group.pg
    largest = max(sizes_mib) << 19  # bf16 elements
    recv = torch.zeros(largest, dtype=torch.bfloat16, device=device)
    torch.cuda.synchronize()
    store.set(f"recv{rank}", exported_handle(recv))
    store.wait([f"recv{1 - rank}"])
    peer = peer_memory(store.get(f"recv{1 - rank}"), device, torch.bfloat16, largest)
    engine = CopyEngineAllReduce(store, rank, 1, device, torch.bfloat16)
    weight = torch.ones(4096, dtype=torch.bfloat16, device=device)

    def meet():
        pg.allreduce([torch.zeros(1, device=device)]).wait()
        torch.cuda.synchronize()

    rows = []
    for mib in sizes_mib:
        n = mib << 19
        x = torch.zeros(n // 4096, 4096, dtype=torch.bfloat16, device=device)
        residual = torch.zeros_like(x)
        row = {"mib": mib}
        for name, call in {
            "nccl": lambda: pg.allreduce([x]).wait(),
            "copy_engine": lambda: engine(x),
            "nccl_then_norm": lambda: (
                pg.allreduce([x]).wait() or fused_add_rms_norm(x, residual, weight, 1e-5, residual_out=residual)
            ),
            "copy_engine_fused": lambda: engine.add_rms_norm(x, residual, weight, 1e-5, residual_out=residual),
            "copy_both": lambda: peer[:n].copy_(x.view(-1)),
        }.items():
            call()  # (a first call compiles: not while the peer times its calls)
            meet()
            row[name] = _eager_us(call)
        meet()
        row["copy_one_way"] = _eager_us(lambda: peer[:n].copy_(x.view(-1))) if rank == 0 else None
        meet()
        rows.append(row)
    if rank == 0:
        results.put(rows)
    meet()
    engine.abort()
    group.abort("done")


def main(argv: list[str] | None = None) -> int:
    from strata.launcher import free_port

    p = argparse.ArgumentParser(prog="python -m strata.bench.peer_copy", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64])
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs; {torch.cuda.device_count()} visible")
        return 1
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, args.sizes_mib, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        rows = results.get(timeout=300)
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    ways = ("nccl", "copy_engine", "nccl_then_norm", "copy_engine_fused", "copy_both", "copy_one_way")
    name = torch.cuda.get_device_name(0)
    print(f"two ranks on 2 x {name}, bf16 rows of 4,096, eagerly, us a call (GB/s: the message over the time)")
    print(f"{'MiB':>5} " + " ".join(f"{w:>19}" for w in ways))
    for r in rows:
        cells = [f"{r[w]:.1f} ({r['mib'] * 2**20 / (r[w] * 1e3):.0f})" for w in ways]
        print(f"{r['mib']:>5} " + " ".join(f"{c:>19}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
