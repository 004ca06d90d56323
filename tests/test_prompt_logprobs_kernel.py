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
        assert got[2].shape == want[2].shape == (rows, k) and torch.equal(got[2], want[2])
        assert torch.equal(got[3], want[3])  # (no ties among the top values here but row 2's)
