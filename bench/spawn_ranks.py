"""The two-GPU microbenchmarks' ranks: a spawned process per rank, meeting through a TCPStore on a
free port, rank 0 putting the rows on a queue (all_reduce.py, peer_copy.py, prefill_overlap.py)."""

from __future__ import annotations

import multiprocessing

from strata.launcher import free_port


def run_on_ranks(target, size: int, *args, timeout: float = 600.0):
    """target(rank, size, port, *args, results) in a process per rank; what one of them puts on
    `results` first. Every rank is joined (killed past a minute) before it returns."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, size, port, *args, results)) for rank in range(size)]
    for proc in procs:
        proc.start()
    try:
        return results.get(timeout=timeout)
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
