"""The controlled draw (kernels/controlled_sampling.py) and the penalty patches
(kernels/penalties.py) under Triton's CPU interpreter: drawing from the logits plus a sparse
patch and a grammar bitmask gives the tokens the sampler's kernel draws from the float32 logits
with the penalties and the mask applied (the general path), bit for bit; the sampler's kernel
leaves skipped rows alone."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter

if not can_run_interpreted_here(
    "strata.kernels.penalties", "strata.kernels.gumbel_sampling", "strata.kernels.controlled_sampling"
):

    @pytest.mark.triton_interpreter(seconds=8)  # its tests' time under the interpreter
    def test_controlled_sampling_kernels_under_triton_interpreter():
        pytest.importorskip("triton")
        rerun_under_interpreter(__file__, timeout=300)

else:
    V = 5000  # two splits of the large-batch shape, a partial last block
    S, L = 6, 48

    def _state(g, dtype):
        """Logits of 8 rows with ties, penalty state of S slots, per-row draw settings."""
        n = 8
        logits = (torch.randn(n, V, generator=g) * 3).to(dtype)
        logits[0, [17, 4100]] = 20.0  # a greedy tie across splits: the first wins
        history = torch.randint(20, 60, (S, L), generator=g, dtype=torch.int32)  # many repeats
        history[:, 5] = 4100  # a penalised token in the second split
        counts = torch.zeros(S, V, dtype=torch.int32)
        seen = torch.zeros(S, V, dtype=torch.bool)
        for s in range(S):
            seen[s, history[s, :8].long()] = True
            counts[s].index_put_((history[s, 8:40].long(),), torch.ones(32, dtype=torch.int32), accumulate=True)
        bias = torch.zeros(S, V)
        bias[1, 7], bias[1, 4500], bias[3, 2] = 4.0, 30.0, -2.0  # 4500 then wins row 3's draw
        draw = dict(
            seeds=torch.randint(-(2**62), 2**62, (n,), generator=g),
            positions=torch.randint(0, 2**30, (n,), generator=g),
            inv_temperature=torch.tensor([1.0, 1.0, 2.0, 1.0, 0.5, 1.0, 1.0, 1.0]),
            greedy=torch.tensor([1, 0, 0, 0, 0, 1, 0, 1], dtype=torch.uint8),
        )
        return logits, history, counts, seen, bias, draw

    def _penalty_args(history, counts, seen, bias):
        rows = torch.tensor([0, 3, 5, 6])  # logits rows penalised
        slots = torch.tensor([0, 1, 0, 3])
        sample_pos = torch.tensor([40, 41, 40, 40])  # row 3 verifies after one draft
        bias_tok = torch.tensor([[-1, -1], [7, 4500], [-1, -1], [2, -1]])
        drafts = torch.tensor([[-1], [4100], [-1], [-1]])
        n_drafts = torch.tensor([0, 1, 0, 0])
        rep = torch.tensor([1.3, 1.3, 0.8, 1.0])
        freq = torch.tensor([0.5, 0.5, 0.2, 0.0])
        pres = torch.tensor([0.25, 0.25, 1.0, 0.0])
        return (rows, slots, sample_pos, history, counts, seen, bias, bias_tok, drafts, n_drafts, rep, freq, pres)

    def _bitmask(g, rows: int, mask_vocab: int):
        words = (mask_vocab + 31) // 32
        mask = torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
        return mask

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_patches_equal_the_dense_penalties_and_clear_their_tokens(dtype):
        from strata.kernels.penalties import apply_penalties, penalty_patches, penalty_patches_reference

        g = torch.Generator().manual_seed(0)
        logits, history, counts, seen, bias, _ = _state(g, dtype)
        args = _penalty_args(history, counts, seen, bias)
        dense = logits.float().clone()
        apply_penalties(logits, dense, *args, 43, block=16)
        width = 48  # >= 41 + 2, not a multiple of the block
        src, ref_src = logits.clone(), logits.clone()
        tok, val = penalty_patches(src, *args, width, block=16)
        ref_tok, ref_val = penalty_patches_reference(ref_src, *args, width)
        assert torch.equal(tok, ref_tok)
        keep = tok >= 0
        assert torch.equal(val[keep], ref_val[keep])
        assert torch.equal(src, ref_src)
        rows = args[0]
        for i, r in enumerate(rows.tolist()):  # the patch holds apply_penalties' values at its tokens
            t = tok[i][keep[i]].long()
            assert torch.equal(val[i][keep[i]], dense[r, t])
            assert torch.isinf(src[r, t]).all()
            untouched = torch.ones(V, dtype=torch.bool)
            untouched[t] = False
            assert torch.equal(src[r, untouched], logits[r, untouched])
        assert torch.equal(src[1], logits[1])

    @pytest.mark.parametrize(
        "store,dtype",
        [
            (False, torch.float32),
            (True, torch.bfloat16),
            # Behind the slow marker: each dtype and each store choice keeps a case above.
            pytest.param(False, torch.bfloat16, marks=pytest.mark.slow),
            pytest.param(True, torch.float32, marks=pytest.mark.slow),
        ],
        ids=["False-dtype0", "True-dtype1", "False-dtype1", "True-dtype0"],
    )
    def test_controlled_draw_equals_the_sampler_on_the_controlled_float32_logits(dtype, store):
        from strata.kernels.controlled_sampling import apply_bitmask_, controlled_draw, controlled_draw_reference
        from strata.kernels.gumbel_sampling import gumbel_argmax
        from strata.kernels.penalties import apply_penalties, penalty_patches

        g = torch.Generator().manual_seed(1)
        logits, history, counts, seen, bias, draw = _state(g, dtype)
        args = _penalty_args(history, counts, seen, bias)
        mask_vocab = V - 400  # the tokenizer's vocab is smaller than the model's
        # Controlled rows (logits rows): 0, 3, 5, 6 penalised; 2, 3, 7 masked; rows 1 and 4 plain.
        rows = torch.tensor([0, 2, 3, 5, 6, 7], dtype=torch.int64)
        bitmask = _bitmask(g, 3, mask_vocab)
        bitmask[1, 4500 // 32] |= 1 << (4500 % 32)
        bitmask[2] = 0
        bitmask[2, 0] = 1 << 17  # row 7 may only emit token 17
        mask_index = torch.tensor([-1, 0, 1, -1, -1, 2], dtype=torch.int32)
        patch_index = torch.tensor([0, -1, 1, 2, 3, -1], dtype=torch.int32)

        # The general path: penalties into a float32 copy, the mask, the sampler's kernel.
        dense = logits.float().clone()
        apply_penalties(logits, dense, *args, 43, block=16)
        apply_bitmask_(dense, bitmask, rows[mask_index >= 0], mask_vocab)
        keys = (draw["seeds"], draw["positions"], draw["inv_temperature"], draw["greedy"])
        want = gumbel_argmax(dense, *keys, None, False)[0]

        src = logits.clone()
        patch = penalty_patches(src, *args, 48, block=16)
        tokens = torch.full((8,), -7, dtype=torch.int64)
        kept = torch.full((20,), -1, dtype=torch.int64)
        state_rows = torch.tensor([3, 9, 4, 11, 0, 5, 12, 19])
        controlled_draw(
            src,
            rows,
            *keys,
            tokens,
            mask=(bitmask, mask_index, mask_vocab),
            patch=(*patch, patch_index),
            store=(kept, state_rows) if store else None,
        )
        assert torch.equal(tokens[rows], want[rows]), (tokens, want)
        assert (tokens[[1, 4]] == -7).all()  # rows not listed are left alone
        assert tokens[7] == 17 and tokens[3] == 4500
        assert tokens[0] == 17  # the greedy tie: 4100 was penalised below 17's 20.0
        if store:
            assert torch.equal(kept[state_rows[rows]], want[rows])
            assert (kept[state_rows[[1, 4]]] == -1).all()
        # The torch reference agrees (its noise uses torch.log, not log2: no near-ties here).
        ref = torch.full((8,), -7, dtype=torch.int64)
        controlled_draw_reference(
            src, rows, *keys, ref, mask=(bitmask, mask_index, mask_vocab), patch=(*patch, patch_index)
        )
        assert torch.equal(ref, tokens)

    def test_skipped_rows_are_left_alone_by_the_sampler_kernel():
        from strata.kernels.gumbel_sampling import gumbel_argmax

        g = torch.Generator().manual_seed(2)
        logits, _, _, _, _, draw = _state(g, torch.bfloat16)
        keys = (draw["seeds"], draw["positions"], draw["inv_temperature"], draw["greedy"])
        full = gumbel_argmax(logits, *keys, None, False)[0]
        skip = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1], dtype=torch.uint8)
        out = torch.full((8,), -3, dtype=torch.int64)
        kept = torch.full((8,), -1, dtype=torch.int64)
        store_rows = torch.arange(8)
        gumbel_argmax(logits, *keys, None, False, store=(kept, store_rows), skip=skip, out=out)
        drawn = skip == 0
        assert torch.equal(out[drawn], full[drawn]) and (out[~drawn] == -3).all()
        assert torch.equal(kept[drawn], full[drawn]) and (kept[~drawn] == -1).all()
