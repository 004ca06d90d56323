"""The sparse penalties kernel (kernels/penalties.py) against its torch reference and the dense
formula, under Triton's CPU interpreter: duplicates in the history, drafts before verify rows,
logit bias, rows left alone, bf16 logits."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter

if not can_run_interpreted_here("strata.kernels.penalties"):

    @pytest.mark.triton_interpreter(seconds=0.2)  # its tests' time under the interpreter
    def test_penalties_kernel_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=120)

else:

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_sparse_penalties_equal_dense_formula(dtype):
        from strata.kernels.penalties import apply_penalties, apply_penalties_reference, penalty_values

        g = torch.Generator().manual_seed(0)
        R, V, S, L = 5, 97, 4, 40
        src = (torch.randn(R, V, generator=g) * 3).to(dtype)
        history = torch.randint(0, 12, (S, L), generator=g, dtype=torch.int32)  # many repeats
        counts = torch.zeros(S, V, dtype=torch.int32)
        seen = torch.zeros(S, V, dtype=torch.bool)
        prompt_len = 10
        for s in range(S):
            seen[s, history[s, :prompt_len].long()] = True
            counts[s].index_put_(
                (history[s, prompt_len:30].long(),), torch.ones(20, dtype=torch.int32), accumulate=True
            )
        bias = torch.zeros(S, V)
        bias[1, 5], bias[1, 60], bias[3, 2] = 2.5, -1.0, 7.0
        rows = torch.tensor([0, 2, 3, 4])  # row 1 unpenalised
        slots = torch.tensor([1, 0, 3, 3])
        sample_pos = torch.tensor([30, 30, 30, 31])  # row 4 verifies after one draft
        bias_tok = torch.tensor([[5, 60], [-1, -1], [2, -1], [2, -1]])
        drafts = torch.tensor([[-1, -1], [-1, -1], [-1, -1], [7, -1]])
        n_drafts = torch.tensor([0, 0, 0, 1])
        history[3, 30] = 7  # the draft, written by position
        rep = torch.tensor([1.3, 1.0, 0.8, 0.8])
        freq = torch.tensor([0.5, 0.0, 0.2, 0.2])
        pres = torch.tensor([0.25, 0.0, 1.0, 1.0])
        args = (rows, slots, sample_pos, history, counts, seen, bias, bias_tok, drafts, n_drafts, rep, freq, pres)

        expected = src.float().clone()
        for i, (r, s) in enumerate(zip(rows.tolist(), slots.tolist())):
            c = counts[s].clone()
            if n_drafts[i]:
                c[drafts[i, 0]] += 1
            expected[r] = penalty_values(src[r].float(), bias[s], c, seen[s], rep[i], freq[i], pres[i])
        ref = src.float().clone()
        apply_penalties_reference(src, ref, *args)
        out = src.float().clone()
        apply_penalties(src, out, *args, 33, block=16)
        assert torch.equal(ref, expected)
        assert torch.equal(out, expected)
        assert torch.equal(out[1], src[1].float())
