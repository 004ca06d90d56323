"""Garbage-collector settings for the long-lived service processes.

The scheduler's engine loop, the gateway's streams and the worker's step inputs allocate many
short-lived objects that the collector tracks (plans, per-sequence records, token lists) and
that almost never form cycles. With Python's default first-generation threshold (700) the
collector runs several times per engine step and walks every live prompt and output list (in a
worker, every object of torch and the model) each time it reaches the older generations; the
threshold below cut the scheduler's step time by a quarter to a third (`python -m
strata.bench.scheduler_step`; figures in bench/RESULTS.md, "Figures moved from code comments"). What
start-up allocated (modules, the model and its graphs, the tokenizer) is frozen so that full
collections skip it.
"""

from __future__ import annotations

import gc

SERVING_GEN0_THRESHOLD = 50_000


def tune_for_serving() -> None:
    """Call once start-up is done."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(SERVING_GEN0_THRESHOLD, *gc.get_threshold()[1:])


def thaw() -> None:
    """Undo the freeze and collect: before a process replaces what start-up built (a worker's KV
    cache and graphs on a new InitCache), so that cycles among the old objects are freed too."""
    gc.unfreeze()
    gc.collect()
