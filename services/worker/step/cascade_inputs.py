"""A plan's shared-KV runs as cascade-attention inputs: checked, and used only where they pay.

The scheduler lists the sequences that share leading KV blocks (explicit prefix groups, n > 1
siblings, shared prefix-cache hits) as consecutive runs with a prefix length per run
(services/scheduler/shared_kv_runs.py; on the wire StepPlan.shared_kv_run / shared_kv_run_lens).
Attention trusts that structure to read a prefix through one member's block table for all of them, so a wrong plan would silently mix
sequences: it is checked here as strictly as any other plan field.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.kernels.shared_kv_runs import SharedKVRuns
from strata.services.worker.step.sequence_table import PlanError
from strata.v1 import engine_pb2

# A cascade costs a second kernel and a merge of partials, and the plain kernel already reads a
# prefix that neighbouring sequences share partly from L2: pairs (which save under half the
# reads) ran slower as cascades, 16-member runs much faster (bench/cascade_attention.py;
# figures: bench/RESULTS.md, "Figures moved from code comments").
MIN_SAVED_FRACTION = 0.5
# Only a member whose queries fit one tile of the prefix kernel (decodes, verify steps) reads its
# run's prefix once for the run: a prompt chunk reads the prefix once per query tile either way,
# and the paged kernel's tuned prefill launch beats the cascade's on it (prefill-only runs:
# figures in bench/RESULTS.md, "Prefix groups against the prefix cache").
SHORT_QUERY = 16


@dataclass
class SharedKVRunInputs:
    """Host twin of kernels' SharedKVRuns (numpy, in plan order)."""

    token_start: np.ndarray  # [R+1] first batch token of each run, then the end of the last
    prefix_lens: np.ndarray  # [R]
    table_rows: np.ndarray  # [R] a member's index in the step (its block-table row holds the prefix)
    seq_prefix_lens: np.ndarray  # [B] its run's prefix length, 0 outside any run

    def arrays(self) -> dict[str, np.ndarray]:
        return {
            f"cascade.{name}": getattr(self, name).astype(np.int32)
            for name in ("token_start", "prefix_lens", "table_rows", "seq_prefix_lens")
        }


def shared_kv_run_inputs(
    plan: engine_pb2.StepPlan,
    query_start_loc: np.ndarray,
    num_computed: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
) -> SharedKVRunInputs | None:
    """The step's shared-KV runs, or None when it has none or a cascade would not pay. Raises PlanError
    on a malformed structure: members not consecutive, queries inside the prefix, or members
    whose block tables differ where the prefix lives."""
    if not plan.shared_kv_run and not plan.shared_kv_run_lens:
        return None
    run_of = np.asarray(plan.shared_kv_run, dtype=np.int64)
    lens = np.asarray(plan.shared_kv_run_lens, dtype=np.int64)
    num_runs = len(lens)
    if len(run_of) != len(seq_lens) or num_runs == 0 or (lens <= 0).any() or (run_of > num_runs).any():
        raise PlanError("shared_kv_run needs one entry per sequence, each 0 or a run of shared_kv_run_lens")
    members = np.nonzero(run_of)[0]
    ids = run_of[members]
    # Consecutive members, runs in order 1..R, none empty: then the runs' tokens are one stretch.
    if (
        (np.diff(members) != 1).any()
        or ids[0] != 1
        or (np.diff(ids) < 0).any()
        or (np.diff(ids) > 1).any()
        or ids[-1] != num_runs
    ):
        raise PlanError("a plan's shared-KV runs must be consecutive sequences, numbered 1.. in order")
    member_prefix = lens[ids - 1]
    if (num_computed[members] < member_prefix).any():
        raise PlanError("a shared-KV run's member must compute only tokens past its prefix")
    first = np.searchsorted(ids, np.arange(1, num_runs + 1))  # each run's first member, in members
    leaders = members[first]
    prefix_blocks = -(-member_prefix // block_size)
    width = int(prefix_blocks.max())
    if width > block_tables.shape[1]:
        raise PlanError("a shared prefix is longer than its members' block tables")
    column = np.arange(width)[None, :] < prefix_blocks[:, None]
    leader_rows = block_tables[np.repeat(leaders, np.bincount(ids - 1, minlength=num_runs)), :width]
    if (column & (block_tables[members, :width] != leader_rows)).any():
        raise PlanError("a shared-KV run's members must share the blocks that hold their prefix")

    short = (query_start_loc[members + 1] - query_start_loc[members]) <= SHORT_QUERY
    readers = np.bincount(ids - 1, weights=short, minlength=num_runs)  # members that read the prefix once
    saved = int((np.maximum(readers - 1, 0) * lens).sum())
    if saved < MIN_SAVED_FRACTION * int(seq_lens.sum()):
        return None
    seq_prefix = np.zeros(len(seq_lens), dtype=np.int64)
    seq_prefix[members] = member_prefix
    ends = query_start_loc[members[np.r_[first[1:], len(members)] - 1] + 1]
    return SharedKVRunInputs(
        token_start=np.r_[query_start_loc[leaders[0]], ends],
        prefix_lens=lens,
        table_rows=leaders,
        seq_prefix_lens=seq_prefix,
    )


def shared_kv_runs(h, uploaded: dict[str, torch.Tensor]) -> SharedKVRuns | None:
    """The kernels' view of HostInputs h's runs, from its uploaded arrays (StepInputBuilder.upload)."""
    runs = h.shared_kv_runs
    if runs is None:
        return None
    return SharedKVRuns(
        token_start=uploaded["cascade.token_start"],
        prefix_lens=uploaded["cascade.prefix_lens"],
        table_rows=uploaded["cascade.table_rows"],
        seq_prefix_lens=uploaded["cascade.seq_prefix_lens"],
        max_run_tokens=int(runs.token_start[-1] - runs.token_start[0]),
        max_prefix_len=int(runs.prefix_lens.max()),
    )
