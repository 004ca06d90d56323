"""What a prefill-sized all-reduce of two ranks could cost through the copy engines: NCCL's
all-reduce against a plain cudaMemcpy of the message into the peer's buffer (mapped by CUDA IPC),
both ranks copying at once as a two-rank exchange would, and one way; and the local add that would
follow. Messages of 8-64 MiB (a 4,096-token chunk of an 8B model is 32 MiB), eagerly, us a call.

NCCL moves 240-270 GB/s there on two H200s; a copy engine 370-380 (bench/RESULTS.md, session 19).
An all-reduce built on the copies has to signal the peer and wait for it cheaply. Three tries, none
serving (RESULTS, session 19): kernels spinning on a flag (776fe94: 129 us at 32 MiB against NCCL's
136, once 4.8 ms at 8 MiB), the same in pieces on a second stream (0ad91e7: milliseconds, the
spinning kernels held the SMs the next signals needed), and cuStreamWaitValue32 on host words
(5d9b024: exact, about 390 us a call at 16-64 MiB, flat: host-bound at four pieces).

    python -m strata.bench.peer_copy           # two GPUs
"""

from __future__ import annotations

import argparse
import datetime

import torch

from strata.bench.graph_timing import eager_time_us
from strata.bench.spawn_ranks import run_on_ranks

# Calls timed between two events, and the repeats whose median is taken.
CALLS, REPEATS = 20, 3


def _rank(rank: int, size: int, port: int, sizes_mib: list[int], results) -> None:
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

    def meet():
        pg.allreduce([torch.zeros(1, device=device)]).wait()
        torch.cuda.synchronize()

    rows = []
    for mib in sizes_mib:
        n = mib << 19
        x = torch.ones(n, dtype=torch.bfloat16, device=device)
        row = {"mib": mib}
        for name, call in {
            "nccl": lambda _: pg.allreduce([x]).wait(),
            "copy_both": lambda _: peer[:n].copy_(x),
            "local_add": lambda _: x.add_(recv[:n]),
        }.items():
            meet()
            row[name] = eager_time_us(call, CALLS, REPEATS)
        meet()
        row["copy_one_way"] = eager_time_us(lambda _: peer[:n].copy_(x), CALLS, REPEATS) if rank == 0 else None
        meet()
        rows.append(row)
    if rank == 0:
        results.put(rows)
    meet()
    group.abort("done")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.bench.peer_copy", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32, 64])
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs; {torch.cuda.device_count()} visible")
        return 1
    rows = run_on_ranks(_rank, 2, args.sizes_mib, timeout=300)
    print(
        f"two ranks on 2 x {torch.cuda.get_device_name(0)}, bf16, eagerly, us a call (GB/s: the message over the time)"
    )
    print(f"{'MiB':>5} {'nccl':>14} {'copy both':>14} {'copy one way':>14} {'local add':>10}")
    for r in rows:
        gbs = {k: r["mib"] * 2**20 / (r[k] * 1e3) for k in ("nccl", "copy_both", "copy_one_way")}
        print(
            f"{r['mib']:>5} {r['nccl']:>7.1f} ({gbs['nccl']:>4.0f}) {r['copy_both']:>7.1f} ({gbs['copy_both']:>4.0f}) "
            f"{r['copy_one_way']:>7.1f} ({gbs['copy_one_way']:>4.0f}) {r['local_add']:>10.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
