"""Triton kernels vs their torch references, on CPU under Triton's interpreter.

Why a subprocess: triton.jit reads TRITON_INTERPRET when a kernel is *defined* (at import of
strata.kernels.paged_attention), and the choice sticks for the life of the process. Setting the variable
from this module would either come too late (another test already imported the kernels for the
GPU) or leak into every module imported after it. So, unless this process was started with
TRITON_INTERPRET=1 and has not yet defined the kernels otherwise, this module only holds two
launcher tests: one re-runs this same file in a fresh `python -m pytest` with TRITON_INTERPRET=1
(where the real tests below are collected; one such process serves every kernel test file of the
session, tests/triton_interpreter.py), one compiles the kernels for sm_90 without a GPU.
To debug a single case directly:  TRITON_INTERPRET=1 python -m pytest tests/test_kernels.py -k window

The interpreter computes bfloat16 wrongly: float32 and float16 here, bf16 in tests/gpu/.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter

if not can_run_interpreted_here("strata.kernels.paged_attention"):

    @pytest.mark.triton_interpreter(seconds=23)  # its tests' time under the interpreter
    def test_kernels_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=540)

    def test_kernels_compile_for_sm90_without_spills(capsys):
        """Compile every kernel variant for an H100; fails on a spill or an unpipelined K/V loop.
        In this process (its kernels are compiled ones here): a process of its own spent 4-5 s of
        its 15 importing torch and Triton again."""
        from strata.kernels import compile_check

        returncode = compile_check.main(["--strict"])
        stdout = capsys.readouterr().out
        print(stdout)
        assert returncode == 0, stdout[-5000:]
        assert "attention bf16 D=128" in stdout

else:
    from strata.kernels.attention_launch import AttentionLaunchConfig, choose_launch_config
    from strata.kernels.kv_cache_write import write_kv_cache
    from strata.kernels.paged_attention import paged_attention
    from strata.kernels.reference import paged_attention_reference, write_kv_cache_reference
    from strata.kernels.testing import kv_by_slot, make_paged_batch

    TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}

    def run_both(batch, scale, **kwargs):
        """Kernel output and float32 reference output for one batch."""
        args = batch.attention_args()
        window = kwargs.pop("sliding_window", None)
        got = paged_attention(*args, scale, sliding_window=window, **kwargs)
        want = paged_attention_reference(*args, scale, sliding_window=window)
        return got, want

    def assert_matches(got, want, dtype):
        assert not torch.isnan(got).any(), "kernel read a poisoned (unowned) cache slot or divided by zero"
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])

    # --- the oracle itself -------------------------------------------------------------------

    @pytest.mark.parametrize("window", [None, 3])
    def test_reference_matches_dense_sdpa(window):
        """Contiguous prefill (no cache reuse): the paged reference equals dense causal attention."""
        batch = make_paged_batch([7, 12], [0, 0], num_q_heads=8, num_kv_heads=2, head_dim=16, block_size=4, seed=1)
        got = paged_attention_reference(*batch.attention_args(), 0.3, sliding_window=window)
        for b, (begin, end) in enumerate([(0, 7), (7, 19)]):
            n = end - begin
            positions = torch.arange(n)
            blocks = batch.block_tables[b, positions // 4].long()
            keys, values = (batch.kv_cache[i, blocks, :, positions % 4] for i in (0, 1))
            allowed = positions[None, :] <= positions[:, None]
            if window is not None:
                allowed &= positions[None, :] > positions[:, None] - window
            q = batch.query[begin:end].transpose(0, 1)  # [H, n, D]
            k = keys.repeat_interleave(4, dim=1).transpose(0, 1)
            v = values.repeat_interleave(4, dim=1).transpose(0, 1)
            dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=0.3)
            torch.testing.assert_close(got[begin:end], dense.transpose(0, 1), atol=1e-5, rtol=1e-5)

    # --- KV-cache write ----------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("num_kv_heads,head_dim", [(2, 64), (3, 128)])
    def test_write_kv_cache_matches_reference_and_skips_negative_slots(dtype, num_kv_heads, head_dim):
        gen = torch.Generator().manual_seed(3)
        num_blocks, block_size, tokens = 5, 4, 9
        # key/value as strided views of one fused projection, like a real qkv split.
        fused = torch.randn(tokens, 2 * num_kv_heads + 1, head_dim, generator=gen).to(dtype)
        key, value = fused[:, :num_kv_heads], fused[:, num_kv_heads : 2 * num_kv_heads]
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
        slots[[2, 7]] = -1
        cache = torch.randn(2, num_blocks, num_kv_heads, block_size, head_dim, generator=gen).to(dtype)
        expected = cache.clone()
        write_kv_cache(key, value, cache, slots)
        write_kv_cache_reference(key, value, expected, slots)
        assert torch.equal(cache, expected)
        # The written slots really changed, the skipped tokens left no trace.
        flat = kv_by_slot(cache)
        written = slots[slots >= 0]
        assert torch.equal(flat[0, written], key[slots >= 0])
        assert torch.equal(flat[1, written], value[slots >= 0])
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
        untouched[written] = False
        original = kv_by_slot(expected)
        assert torch.equal(flat[:, untouched], original[:, untouched])

    def test_write_then_attend_decode_uses_the_new_token():
        """End to end: the decode token's own key/value, written by the kernel, is attended to."""
        batch = make_paged_batch([1, 1], [5, 16], num_q_heads=4, num_kv_heads=4, head_dim=64, block_size=8, seed=4)
        new_kv = torch.randn(2, 2, 4, 64) * 3
        write_kv_cache(new_kv[0], new_kv[1], batch.kv_cache, batch.slot_mapping)
        got, want = run_both(batch, 0.125)
        assert_matches(got, want, torch.float32)
        # The last position's value now matters: attention over the same cache minus it differs.
        truncated = paged_attention_reference(
            batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens - 1, batch.block_tables, 1, 20, 0.125
        )
        assert not torch.allclose(got, truncated, atol=1e-3)

    # --- paged attention: single pass --------------------------------------------------------

    # Prefill from scratch, a prefill chunk over cached context crossing a block edge, decodes
    # at and around block edges, a chunk ending exactly on a block edge.
    MIXED_QUERY = [9, 6, 1, 1, 1, 8]
    MIXED_CONTEXT = [0, 13, 15, 16, 31, 8]

    # Every pair of (group, head size, dtype) values in one of the first six cases; the rest of the
    # cross product is behind the slow marker (STRATA_SLOW_TESTS=1).
    MIXED_CASES = [(1, 64, torch.float32), (1, 128, torch.float16), (4, 64, torch.float16)]
    MIXED_CASES += [(4, 128, torch.float32), (8, 64, torch.float32), (8, 128, torch.float16)]
    MIXED_SLOW = [(1, 64, torch.float16), (1, 128, torch.float32), (4, 64, torch.float32)]
    MIXED_SLOW += [(4, 128, torch.float16), (8, 64, torch.float16), (8, 128, torch.float32)]

    @pytest.mark.parametrize(
        "group,head_dim,dtype",
        MIXED_CASES + [pytest.param(*case, marks=pytest.mark.slow) for case in MIXED_SLOW],
        ids=[f"{g}-{d}-dtype{int(t == torch.float16)}" for g, d, t in MIXED_CASES + MIXED_SLOW],
    )
    def test_mixed_prefill_and_decode_batch(dtype, head_dim, group):
        batch = make_paged_batch(
            MIXED_QUERY,
            MIXED_CONTEXT,
            num_q_heads=2 * group,
            num_kv_heads=2,
            head_dim=head_dim,
            block_size=8,
            dtype=dtype,
            seed=group + head_dim,
        )
        got, want = run_both(batch, head_dim**-0.5, num_kv_splits=1)
        assert_matches(got, want, dtype)

    @pytest.mark.parametrize("block_size,tile_n,block_q", [(4, 16, 3), (16, 16, 2), (8, 32, 5), (32, 16, 4)])
    def test_tile_and_page_boundaries(block_size, tile_n, block_q):
        """Keys tiles spanning several pages or part of one; query blocks cutting chunks unevenly."""
        query_lens = [17, 1, 1, 5, 16]
        context_lens = [15, 31, 32, 27, 0]
        batch = make_paged_batch(
            query_lens,
            context_lens,
            num_q_heads=8,
            num_kv_heads=2,
            head_dim=64,
            block_size=block_size,
            seed=block_size * tile_n,
        )
        config = AttentionLaunchConfig(block_q=block_q, tile_n=tile_n, num_kv_splits=1)
        got, want = run_both(batch, 0.2, config=config)
        assert_matches(got, want, torch.float32)

    @pytest.mark.parametrize("window", [1, 5, 16])
    def test_sliding_window(window):
        batch = make_paged_batch(
            [12, 1, 1, 4], [20, 40, 3, 17], num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=4, seed=window
        )
        config = AttentionLaunchConfig(block_q=4, tile_n=16, num_kv_splits=1)
        got, want = run_both(batch, 0.125, sliding_window=window, config=config)
        assert_matches(got, want, torch.float32)
        # The window really cuts something off: without it the results differ.
        full = paged_attention_reference(*batch.attention_args(), 0.125)
        assert not torch.allclose(want, full, atol=1e-4)

    def test_empty_sequences_padding_tokens_and_out_argument():
        """q_len 0 sequences, query/out as strided views, padding tokens past the last sequence."""
        batch = make_paged_batch(
            [3, 0, 1, 0, 2], [4, 9, 9, 0, 6], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=4, seed=7
        )
        fused = torch.randn(batch.query.shape[0] + 2, 12, 64)  # 2 padding tokens, q is 8 of 12 heads
        fused[:6, :8] = batch.query
        query = fused[:, :8]
        qsl = batch.query_start_loc
        out_storage = torch.full((8, 9, 64), 7.0)
        out = out_storage[:, :8]
        result = paged_attention(
            query,
            batch.kv_cache,
            qsl,
            batch.seq_lens,
            batch.block_tables,
            batch.max_query_len,
            batch.max_seq_len,
            0.125,
            out=out,
            num_kv_splits=1,
        )
        assert result.data_ptr() == out.data_ptr()
        want = paged_attention_reference(*batch.attention_args(), 0.125)
        assert_matches(out[:6], want, torch.float32)
        assert torch.all(out_storage[:, 8] == 7.0), "wrote outside the out view"

    # --- paged attention: split-KV -----------------------------------------------------------

    @pytest.mark.parametrize(
        "head_dim,group,dtype",
        [
            (64, 4, torch.float16),
            (128, 8, torch.float32),
            (128, 1, torch.float16),
            # Behind the slow marker: each shape and each dtype keeps a case above.
            pytest.param(64, 4, torch.float32, marks=pytest.mark.slow),
            pytest.param(128, 8, torch.float16, marks=pytest.mark.slow),
            pytest.param(128, 1, torch.float32, marks=pytest.mark.slow),
        ],
        ids=["64-4-dtype1", "128-8-dtype0", "128-1-dtype1", "64-4-dtype0", "128-8-dtype1", "128-1-dtype0"],
    )
    def test_split_kv_decode_matches_single_pass_and_reference(dtype, head_dim, group):
        # Context lengths from 3 (most splits empty) to 300 (several tiles per split).
        batch = make_paged_batch(
            [1, 1, 1],
            [299, 2, 130],
            num_q_heads=2 * group,
            num_kv_heads=2,
            head_dim=head_dim,
            block_size=16,
            dtype=dtype,
            seed=head_dim * group,
        )
        split = AttentionLaunchConfig(block_q=1, tile_n=32, num_kv_splits=4)
        got_split, want = run_both(batch, head_dim**-0.5, config=split)
        got_single = paged_attention(*batch.attention_args(), head_dim**-0.5, num_kv_splits=1)
        assert_matches(got_split, want, dtype)
        assert_matches(got_single, want, dtype)

    def test_head_dim_256_with_its_own_tiles():
        """Gemma 3's head size, with the tiles chosen for it (half the keys per tile of D <= 128):
        a mixed batch in the prefill launch (windowed too), then decodes cut into split-KV parts."""
        batch = make_paged_batch(
            [9, 1, 4], [30, 40, 0], num_q_heads=4, num_kv_heads=2, head_dim=256, block_size=16, seed=256
        )
        for window in (None, 7):
            got, want = run_both(batch, 256**-0.5, sliding_window=window, num_kv_splits=1)
            assert_matches(got, want, torch.float32)
        decodes = make_paged_batch([1, 1], [70, 3], num_q_heads=4, num_kv_heads=2, head_dim=256, block_size=16, seed=2)
        config = choose_launch_config(
            num_seqs=2,
            num_q_heads=4,
            num_kv_heads=2,
            head_dim=256,
            max_query_len=1,
            max_seq_len=decodes.max_seq_len,
            sm_count=132,
        )
        assert config.tile_n == 32 and config.num_kv_splits == 2  # 71 keys: two 64-key splits
        got, want = run_both(decodes, 256**-0.5, config=config)
        assert_matches(got, want, torch.float32)

    def test_split_kv_with_prefill_chunks_and_window():
        """The split path is general: query blocks of prefill chunks and a window split too."""
        batch = make_paged_batch(
            [7, 1, 3], [60, 90, 0], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=8, seed=11
        )
        config = AttentionLaunchConfig(block_q=4, tile_n=16, num_kv_splits=3)
        for window in (None, 37):
            got, want = run_both(batch, 0.125, sliding_window=window, config=config)
            assert_matches(got, want, torch.float32)

    def test_automatic_split_choice_runs_split_path_for_small_decode_batch():
        batch = make_paged_batch([1, 1], [700, 520], num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=16, seed=5)
        chosen = choose_launch_config(
            num_seqs=2,
            num_q_heads=4,
            num_kv_heads=1,
            head_dim=64,
            max_query_len=1,
            max_seq_len=batch.max_seq_len,
            sm_count=132,
        )
        assert chosen.num_kv_splits == 16  # one 64-key tile per split: 11 tiles, a power of two of splits
        got, want = run_both(batch, 0.125)
        assert_matches(got, want, torch.float32)

    # --- launch heuristics (python only) -----------------------------------------------------

    def test_launch_config_heuristics():
        def choose(**overrides):
            args = dict(
                num_seqs=256,
                num_q_heads=32,
                num_kv_heads=8,
                head_dim=64,
                max_query_len=1,
                max_seq_len=640,
                sm_count=132,
            )
            return choose_launch_config(**{**args, **overrides})

        assert choose().num_kv_splits == 1  # 2048 programs fill an H100
        assert choose().block_q == 1
        few = choose(num_seqs=2, max_seq_len=32768)
        assert few.num_kv_splits > 1 and few.num_kv_splits & (few.num_kv_splits - 1) == 0
        assert choose(num_seqs=2, max_seq_len=64).num_kv_splits == 1  # one tile: nothing to split
        assert choose(num_seqs=1, max_seq_len=576).num_kv_splits == 16  # 9 tiles, one per split
        assert choose(num_seqs=16, max_seq_len=576).num_kv_splits == 4  # 128 programs: ~4 per SM
        assert choose(num_seqs=2, max_query_len=16, max_seq_len=32768).num_kv_splits == 1  # prefill
        assert choose(num_seqs=2, max_seq_len=32768, num_kv_splits=1).num_kv_splits == 1  # forced
        assert choose(num_kv_splits=8).num_kv_splits == 8
        prefill = choose(max_query_len=512)
        assert prefill.block_q * 4 == 64  # 16 tokens x GQA group of 4 fill the 64-row dot
        assert choose(num_q_heads=14, num_kv_heads=2, max_query_len=512).block_q == 9  # group 7: 63 rows
        # Every query at least 32 tokens long (D <= 128): 128 rows, 8 warps; not at D = 256.
        long = choose(max_query_len=512, min_query_len=32)
        assert long.block_q * 4 == 128 and long.num_warps == 8
        assert choose(max_query_len=512, min_query_len=31).block_q * 4 == 64
        assert choose(head_dim=128, max_query_len=512, min_query_len=512).block_q * 4 == 128
        assert choose(head_dim=256, max_query_len=512, min_query_len=512).block_q * 4 == 64
        assert choose(num_q_heads=14, num_kv_heads=2, max_query_len=512, min_query_len=18).block_q == 18

    def test_rejects_unsupported_shapes():
        batch = make_paged_batch([2], [3], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=4)
        with pytest.raises(AssertionError):
            paged_attention(
                batch.query[..., :48],
                batch.kv_cache[..., :48],
                batch.query_start_loc,
                batch.seq_lens,
                batch.block_tables,
                2,
                5,
                0.1,
            )  # head_dim 48 is not a power of two
        with pytest.raises(AssertionError):
            paged_attention(
                batch.query[:, :3], batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 2, 5, 0.1
            )  # 3 query heads over 2 kv heads
