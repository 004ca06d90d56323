"""The worker's step inputs (services/worker/step/step_inputs.py): an eager step's head runs on a
padded row count, whose padding repeats a real row, so cuBLAS meets few GEMM shapes and every
padded row is a valid index into the step's tokens."""

import numpy as np

from strata.services.worker.step.step_inputs import LOGITS_ROWS_MULTIPLE, padded_rows


def test_sampled_rows_are_padded_to_a_few_shapes_with_a_real_row():
    for n in (1, 5, LOGITS_ROWS_MULTIPLE, LOGITS_ROWS_MULTIPLE + 1, 300):
        index = np.arange(n, dtype=np.int64) * 3 + 7
        padded = padded_rows(index)
        assert len(padded) % LOGITS_ROWS_MULTIPLE == 0 and 0 <= len(padded) - n < LOGITS_ROWS_MULTIPLE
        assert padded.dtype == np.int64 and np.array_equal(padded[:n], index)
        assert (padded[n:] == index[-1]).all()
    shapes = {len(padded_rows(np.zeros(n, dtype=np.int64))) for n in range(1, 257)}
    assert len(shapes) == 256 // LOGITS_ROWS_MULTIPLE
