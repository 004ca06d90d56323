"""The worker's reading of a plan's shared-KV runs (services/worker/step/cascade_inputs.py):
the arrays cascade attention gets, when it is skipped, and the malformed structures it refuses."""

import numpy as np
import pytest

from strata.services.worker.step.cascade_inputs import shared_kv_run_inputs
from strata.services.worker.step.sequence_table import PlanError
from strata.v1 import engine_pb2

BS = 4


def step(run_of, lens, q_lens, num_computed, tables):
    plan = engine_pb2.StepPlan(shared_kv_run=run_of, shared_kv_run_lens=lens)
    q_lens, num_computed = np.asarray(q_lens), np.asarray(num_computed)
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    width = max(len(t) for t in tables)
    block_tables = np.array([t + [0] * (width - len(t)) for t in tables])
    return plan, qsl, num_computed, num_computed + q_lens, block_tables


def inputs(*args):
    plan, qsl, num_computed, seq_lens, tables = step(*args)
    return shared_kv_run_inputs(plan, qsl, num_computed, seq_lens, tables, BS)


def test_two_runs_after_a_sequence_outside_any():
    # seq 0 alone; run 1 = seqs 1-3 (prefix 12: blocks 10-12); run 2 = seqs 4-6 (prefix 8: blocks 20, 21).
    got = inputs(
        [0, 1, 1, 1, 2, 2, 2],
        [12, 8],
        [3, 1, 2, 1, 1, 1, 1],
        [0, 13, 12, 12, 9, 8, 8],
        [[1], [10, 11, 12, 13], [10, 11, 12, 14], [10, 11, 12, 15], [20, 21, 22], [20, 21, 23], [20, 21, 24]],
    )
    assert got.token_start.tolist() == [3, 7, 10]  # seq 1's first token, seq 4's, the end
    assert got.prefix_lens.tolist() == [12, 8] and got.table_rows.tolist() == [1, 4]
    assert got.seq_prefix_lens.tolist() == [0, 12, 12, 12, 8, 8, 8]
    assert set(got.arrays()) == {
        "cascade.token_start",
        "cascade.prefix_lens",
        "cascade.table_rows",
        "cascade.seq_prefix_lens",
    }


def test_prompt_chunks_save_no_prefix_reads():
    # Three members over a 40-token prefix: as decodes they read it once for the run (a cascade);
    # as 20-token prompt chunks each reads it once per query tile either way (no cascade); beside
    # a decoding pair of the same run, the pair alone saves under half the reads; five decodes more.
    tables = [list(range(10)) + [97 + i, 200 + i] for i in range(3)]
    assert inputs([1, 1, 1], [40], [1, 1, 1], [40, 40, 40], tables) is not None
    assert inputs([1, 1, 1], [40], [20, 20, 20], [40, 40, 40], tables) is None
    assert inputs([1, 1, 1], [40], [20, 1, 1], [40, 40, 40], tables) is None
    six = [list(range(10)) + [97 + i, 200 + i] for i in range(6)]
    assert inputs([1] * 6, [40], [20, 1, 1, 1, 1, 1], [40] * 6, six) is not None  # five decodes save 60%


def test_no_runs_or_too_little_shared_means_no_cascade():
    assert inputs([], [], [1, 1], [4, 4], [[1, 2], [3, 4]]) is None
    # Two members sharing 4 of their 2 x 41 keys: not worth a second kernel and a merge.
    assert inputs([1, 1], [4], [1, 1], [40, 40], [list(range(11)), [0] + list(range(11, 21))]) is None
    # A pair saves under half its reads, however long the prefix: the plain kernel's L2 hits win.
    assert inputs([1, 1], [40], [1, 1], [40, 40], [list(range(11)), list(range(10)) + [99]]) is None
    # Three members over the same prefix save two thirds: a cascade.
    assert (
        inputs(
            [1, 1, 1], [40], [1, 1, 1], [40, 40, 40], [list(range(11)), list(range(10)) + [98], list(range(10)) + [99]]
        )
        is not None
    )


@pytest.mark.parametrize(
    "run_of,lens,num_computed,tables,why",
    [
        ([1, 0, 1], [4], [5, 5, 5], [[1, 2], [3, 4], [1, 5]], "consecutive"),
        ([2, 2], [4, 4], [5, 5], [[1, 2], [1, 3]], "numbered"),
        ([1, 1, 3], [4], [5, 5, 5], [[1, 2], [1, 3], [1, 4]], "one entry per sequence"),
        ([1, 1], [0], [5, 5], [[1, 2], [1, 3]], "one entry per sequence"),
        ([1], [4], [5, 5], [[1, 2], [1, 2]], "one entry per sequence"),
        ([1, 1], [8], [5, 9], [[1, 2, 3], [1, 2, 4]], "past its prefix"),
        ([1, 1], [8], [9, 9], [[1, 2, 3], [1, 5, 4]], "share the blocks"),
        ([1, 1], [6], [9, 9], [[1, 2, 3], [1, 5, 4]], "share the blocks"),  # mid-block: the partial block too
    ],
)
def test_malformed_runs_are_refused(run_of, lens, num_computed, tables, why):
    with pytest.raises(PlanError, match=why):
        inputs(run_of, lens, [1] * len(num_computed), num_computed, tables)
