"""The prompt logprobs' row kernel (kernels/prompt_logprobs.py) gives its torch reference's
logsumexp, ranks and top k, on CPU under Triton's interpreter: a ragged last tile, every top
count variant, ties with the prompt token, -inf entries. On a GPU, in bfloat16:
tests/gpu/test_prompt_logprobs_gpu.py."""

from __future__ import annotations

import pytest

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter

if not can_run_interpreted_here("strata.kernels.prompt_logprobs"):

    @pytest.mark.triton_interpreter(seconds=3)  # its tests' time under the interpreter
    def test_prompt_logprobs_kernel_under_triton_interpreter():
        pytest.importorskip("triton")
        rerun_under_interpreter(__file__, timeout=300)

else:
    import torch

    from strata.kernels.prompt_logprobs import logprob_rows, logprob_rows_reference

    @pytest.mark.parametrize("k", [0, 1, 3, 20])
    def test_the_kernel_gives_the_references_rows(k):
        rows, vocab = 5, 5000  # three tiles of 2048, the last one ragged
        g = torch.Generator().manual_seed(k)
        logits = torch.randn(rows, vocab, generator=g) * 3
        targets = torch.randint(0, vocab, (rows,), generator=g)
        logits[1, targets[1]] = logits[1].max() + 1.0  # the top token: rank 1
        logits[2, :100] = logits[2, targets[2]]  # ties with the token count against it
        logits[3, 4000:] = float("-inf")  # a tile partly and one wholly -inf
        logits[3, 2048:4000] = float("-inf")
        targets[4] = 4999  # the ragged tile's last entry
        got, want = logprob_rows(logits, targets, k), logprob_rows_reference(logits, targets, k)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
        assert torch.equal(got[1], want[1]) and got[1][1] == 1
        assert torch.equal(got[2], want[2])  # the token's logit
        assert got[3].shape == want[3].shape == (rows, k) and torch.equal(got[3], want[3])
        assert torch.equal(got[4], want[4])  # (no ties among the top values here)

    def test_spans_of_a_long_row_and_a_top_k_within_one_lane():
        """A vocabulary of several spans (each lane of a span sees every BLOCK-th entry), where one
        lane holds all of a row's top entries and another row's top entries straddle two spans."""
        from strata.kernels.prompt_logprobs import BLOCK, MAX_TILES

        rows, vocab = 3, 2 * MAX_TILES * BLOCK + 777  # two whole spans and a ragged third
        g = torch.Generator().manual_seed(11)
        logits = torch.randn(rows, vocab, generator=g)
        targets = torch.randint(0, vocab, (rows,), generator=g)
        logits[0, 5 + BLOCK * torch.arange(6)] = 10.0 + torch.arange(6.0)  # one lane, six tiles
        edge = MAX_TILES * BLOCK
        logits[1, edge - 3 : edge + 3] = 20.0 + torch.arange(6.0)  # across the first spans' border
        logits[2, -4:] = 30.0 + torch.arange(4.0)  # the ragged span's last entries
        got, want = logprob_rows(logits, targets, 5), logprob_rows_reference(logits, targets, 5)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
        for g_, w_ in zip(got[1:], want[1:]):
            assert torch.equal(g_, w_)

    def test_rows_filled_chunk_by_chunk_merge_as_one():
        from strata.kernels.prompt_logprobs import LogprobRows

        g = torch.Generator().manual_seed(9)
        logits = torch.randn(7, 3000, generator=g)
        targets = torch.randint(0, 3000, (7,), generator=g)
        stats = LogprobRows(7, 3000, 2, logits.device)
        for start in (0, 3, 5):
            end = {0: 3, 3: 5, 5: 7}[start]
            stats.fill(logits[start:end], targets[start:end], start)
        for got, want in zip(stats.merge(), logprob_rows_reference(logits, targets, 2)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        with pytest.raises(ValueError, match="do not fit"):
            stats.fill(logits[:2], targets[:2], 6)

    def test_the_workers_chunks_through_the_kernel_equal_its_reference_path(monkeypatch):
        """The last stage's chunked rows (sampling/prompt_logprobs.py) through LogprobRows, as on
        CUDA, against its torch path, on logits of a random head."""
        import numpy as np

        from strata.services.worker.sampling import prompt_logprobs as worker_rows

        g = torch.Generator().manual_seed(4)
        hidden, residual = torch.randn(12, 16, generator=g), torch.randn(12, 16, generator=g)
        head = torch.randn(16, 2500, generator=g)

        def compute_logits(h, r):
            return (h + r) @ head

        rows = worker_rows.PromptRows(np.arange(1, 11), np.arange(100, 110) * 7, np.array([3] * 6 + [1] * 4))
        monkeypatch.setattr(worker_rows, "CHUNK_ELEMENTS", 4 * 2500)  # chunks of 4 rows
        plain = worker_rows.prompt_logprobs(compute_logits, hidden, residual, rows, 2500)
        monkeypatch.setattr(worker_rows, "fused", lambda device: True)
        kernel = worker_rows.prompt_logprobs(compute_logits, hidden, residual, rows, 2500)
        for got, want in zip(kernel, plain):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
