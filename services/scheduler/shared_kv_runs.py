"""Shared-KV runs: the step's sequences that share leading KV blocks, for cascade attention.

Not to be confused with prefix groups (the client's PrefixGroup, prefix_sharing.py), which decide
who shares blocks: a run is found per step, from the block tables alone, whoever made them shared
(a prefix group, n > 1 siblings, or prefix-cache hits on the same blocks). Attention then reads a
run's shared prefix once for all of its members.

The plan carries them as StepPlan.shared_kv_run (per sequence, its run's index + 1; 0: none) and
shared_kv_run_lens (per run, its prefix in tokens), under the same names on the wire
(engine.proto's StepPlan).
"""

from __future__ import annotations

from strata.common_prefix import sort_by_prefix
from strata.services.scheduler.plan import ScheduledSeq, StepPlan


def find_shared_kv_runs(plan: StepPlan, block_size: int) -> None:
    """Finds the plan's shared-KV runs and makes each run's members consecutive (after every
    sequence outside a run).

    Sharing is read from the block tables themselves, over the full blocks before each
    sequence's first query token (a prefix must lie wholly in the cache). Sorted by those block
    ids, sequences that share blocks are adjacent, and two neighbours share exactly their common
    leading run (BatchLLM's sort plus longest common prefix, strata/common_prefix.py). A run is
    cut from its neighbour where their common blocks fall below half of those on either side:
    unrelated requests that only share a chat template's first block must not shorten a
    family's prefix to that block."""
    by_first_block: dict[int, list[ScheduledSeq]] = {}
    for s in plan.seqs:
        table = s.request.blocks.block_ids
        if table and s.num_computed >= block_size:
            by_first_block.setdefault(table[0], []).append(s)
    runs: list[tuple[int, list[ScheduledSeq]]] = []  # (prefix blocks, members)
    for candidates in by_first_block.values():
        if len(candidates) < 2:
            continue
        order, common = sort_by_prefix(
            candidates, key=lambda s: s.request.blocks.block_ids[: s.num_computed // block_size]
        )
        run = [order[0]]
        for i, shared in enumerate(common):
            neighbours = max(common[i - 1] if i else 0, common[i + 1] if i + 1 < len(common) else 0)
            if 2 * shared < neighbours:  # a cut: close the run
                runs.append((min(common[i - len(run) + 1 : i], default=0), run))
                run = []
            run.append(order[i + 1])
        runs.append((min(common[len(common) - len(run) + 1 :], default=0), run))
    runs = [(blocks, members) for blocks, members in runs if len(members) >= 2 and blocks > 0]
    if not runs:
        return
    run_of = {s.seq_id: r + 1 for r, (_, members) in enumerate(runs) for s in members}
    plan.seqs = [s for s in plan.seqs if s.seq_id not in run_of] + [s for _, members in runs for s in members]
    plan.shared_kv_run = [run_of.get(s.seq_id, 0) for s in plan.seqs]
    plan.shared_kv_run_lens = [blocks * block_size for blocks, _ in runs]
