"""Sort plus longest common prefix (BatchLLM's grouping step), written once for its two users:
`strata batch`, which finds prompts worth sending as prefix groups, and the scheduler's shared-KV
runs (services/scheduler/shared_kv_runs.py), which find a step's sequences that share leading KV
blocks. Sorted, sequences that share a prefix are neighbours, and two neighbours share exactly
their common leading run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def common_prefix_len(a: Sequence[int], b: Sequence[int], guess: int = 0) -> int:
    """Length of the common leading run of a and b. Checked first at `guess` (the previous
    neighbours' run: a group's members all share the same one), then by binary search, each
    probe one C-level slice compare: os.path.commonprefix walked the lists in Python, which cost
    milliseconds a step on the scheduler's critical path at offline batch sizes."""
    n = min(len(a), len(b))
    g = min(guess, n)
    if a[:g] == b[:g]:
        if g == n or a[g] != b[g]:
            return g
        lo, hi = g + 1, n
    else:
        lo, hi = 0, g - 1
    while lo < hi:  # invariant: a[:lo] == b[:lo], and a[:hi + 1] != b[:hi + 1] unless hi == n
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _first(pair: tuple) -> Sequence[int]:
    return pair[0]


def sort_by_prefix(items: list[T], key: Callable[[T], Sequence[int]]) -> tuple[list[T], list[int]]:
    """(items sorted by key, stably; common[i]: the common prefix length of the keys of sorted
    items i and i + 1). Each key is computed once."""
    keyed = sorted([(key(item), item) for item in items], key=_first)
    common: list[int] = []
    run = 0
    for (a, _), (b, _) in zip(keyed, keyed[1:]):
        run = common_prefix_len(a, b, run)
        common.append(run)
    return [item for _, item in keyed], common
