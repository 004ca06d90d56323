"""Tensor-parallel ranks as threads of one process, for in-process tests: T TensorParallelGroups
formed through one in-memory store over gloo (which releases the GIL while it waits), each rank's
work on a thread of its own. Milliseconds, where a process per rank costs seconds."""

from __future__ import annotations

import itertools
import threading

import torch
import torch.distributed as dist

from strata.services.worker.tensor_parallel.group import TensorParallelGroup

_SESSIONS = itertools.count(1)


def form_groups(size: int, timeout: float = 30.0) -> list[TensorParallelGroup]:
    """`size` formed gloo groups, one per rank (each needs its own thread for collectives)."""
    store, session = dist.HashStore(), next(_SESSIONS)
    groups = [TensorParallelGroup(rank, size, torch.device("cpu"), timeout) for rank in range(size)]
    run_on_threads([lambda g=g: g.form(store, session) for g in groups])
    return groups


def run_on_threads(jobs) -> list:
    """Runs each job on a thread of its own; their results in order (the first error raised)."""
    results, errors = [None] * len(jobs), [None] * len(jobs)

    def run(i, job):
        try:
            results[i] = job()
        except BaseException as e:  # re-raised below, on the caller's thread
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i, job), daemon=True) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
        if t.is_alive():
            raise TimeoutError("a rank's thread did not finish in 120 s")
    for e in errors:
        if e is not None:
            raise e
    return results


def run_ranks(groups: list[TensorParallelGroup], fn) -> list:
    """fn(rank, group) on every rank's thread; their results in rank order."""
    return run_on_threads([lambda r=r, g=g: fn(r, g) for r, g in enumerate(groups)])
