"""Cascade attention vs the paged-attention reference, on CPU under Triton's interpreter.

Same arrangement as tests/test_kernels.py (this module re-runs itself with TRITON_INTERPRET=1);
bf16 and speed are proven in tests/gpu/test_cascade_attention_gpu.py and bench/cascade_attention.py.
Each case shares prefixes the way the server does (share_prefixes: whole blocks through the
block table, a prefix that ends mid-block through a copied block), so a kernel that read a
member's own block where the prefix lives, or the prefix past its end, disagrees.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter

if not can_run_interpreted_here("strata.kernels.paged_attention", "strata.kernels.cascade_attention"):

    @pytest.mark.triton_interpreter(seconds=8)  # its tests' time under the interpreter
    def test_cascade_attention_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=300)

    def test_prefix_launch_heuristics():
        from strata.kernels.cascade_attention import choose_prefix_config

        def choose(**overrides):
            args = dict(
                num_runs=32,
                max_run_tokens=512,
                max_prefix_len=2048,
                num_q_heads=32,
                num_kv_heads=8,
                head_dim=64,
                sm_count=132,
            )
            return choose_prefix_config(**{**args, **overrides})

        assert choose().block_t * 4 == 64  # 16 tokens x GQA group of 4: 64 rows per dot
        assert choose(num_q_heads=9, num_kv_heads=3).block_t == 21  # SmolLM2: 63 rows
        # 32 runs of 16 decodes (issue 12's workload): 256 programs, under 2 per SM: 2 parts.
        assert choose().prefix_splits == 2
        assert choose(num_runs=256).prefix_splits == 1  # 256 pairs: 2,048 programs already
        one_run = choose(num_runs=1, max_run_tokens=64, max_prefix_len=1024)
        assert one_run.prefix_splits == 4  # n = 64 siblings over 1024 tokens: 32 programs, 256 keys per part
        assert choose(num_runs=1, max_run_tokens=64, max_prefix_len=100).prefix_splits == 1
        assert choose(num_runs=1, max_run_tokens=2, max_prefix_len=1 << 20).prefix_splits == 8
        assert choose(prefix_splits=3).prefix_splits == 3
        assert (choose(head_dim=256).tile_n, choose(head_dim=256).num_warps) == (32, 8)  # Gemma 3: spill-free

else:
    from strata.kernels.attention_launch import AttentionLaunchConfig
    from strata.kernels.cascade_attention import PrefixLaunchConfig, SharedKVRuns, cascade_attention
    from strata.kernels.reference import cascade_attention_reference, paged_attention_reference
    from strata.kernels.testing import make_paged_batch, share_prefixes

    TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}

    def batch_with_runs(
        query_lens,
        context_lens,
        run_sizes,
        prefix_lens,
        *,
        first_seq=0,
        dtype=torch.float32,
        heads=(4, 2),
        head_dim=32,
        block_size=8,
        seed=0,
    ):
        batch = make_paged_batch(
            query_lens,
            context_lens,
            num_q_heads=heads[0],
            num_kv_heads=heads[1],
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            seed=seed,
        )
        return batch, share_prefixes(batch, run_sizes, prefix_lens, first_seq=first_seq)

    def check(batch, runs, dtype=torch.float32, **kwargs):
        scale = batch.query.shape[2] ** -0.5
        want = paged_attention_reference(*batch.attention_args(), scale)
        by_parts = cascade_attention_reference(
            *batch.attention_args()[:5], runs, batch.max_query_len, batch.max_seq_len, scale
        )
        torch.testing.assert_close(by_parts.float(), want.float(), **TOLERANCE[dtype])
        got = cascade_attention(
            *batch.attention_args()[:5], runs, batch.max_query_len, batch.max_seq_len, scale, **kwargs
        )
        assert not torch.isnan(got).any(), "read a poisoned (unowned) slot"
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])

    # Each head layout once, the dtypes in turn; the rest of the cross product is behind the slow
    # marker (STRATA_SLOW_TESTS=1).
    RAGGED_CASES = [((4, 2), 32, torch.float32), ((8, 1), 64, torch.float16)]
    RAGGED_CASES += [((6, 2), 16, torch.float32), ((2, 2), 32, torch.float16)]
    RAGGED_SLOW = [((4, 2), 32, torch.float16), ((8, 1), 64, torch.float32)]
    RAGGED_SLOW += [((6, 2), 16, torch.float16), ((2, 2), 32, torch.float32)]
    LAYOUTS = [(4, 2), (8, 1), (6, 2), (2, 2)]

    @pytest.mark.parametrize(
        "heads,head_dim,dtype",
        RAGGED_CASES + [pytest.param(*case, marks=pytest.mark.slow) for case in RAGGED_SLOW],
        ids=[f"heads{LAYOUTS.index(h)}-{d}-dtype{int(t == torch.float16)}" for h, d, t in RAGGED_CASES + RAGGED_SLOW],
    )
    def test_ragged_runs_of_decodes_and_prefill_chunks(dtype, heads, head_dim):
        """Two sequences outside any run, then runs of 1, 3 and 2 members: decodes and prefill chunks
        past the prefix; prefixes of 37 (mid-block), 16 (block end) and 5 keys."""
        query_lens = [1, 4, 1, 1, 1, 1, 3, 1]
        context_lens = [20, 9, 45, 40, 47, 52, 33, 30]
        batch, runs = batch_with_runs(
            query_lens,
            context_lens,
            [1, 3, 2],
            [37, 16, 5],
            first_seq=2,
            dtype=dtype,
            heads=heads,
            head_dim=head_dim,
            seed=head_dim + heads[0],
        )
        check(batch, runs, dtype)

    def test_large_run_spans_several_query_tiles():
        """20 decode members with GQA 4: two 16-token tiles of the run, each reading the prefix."""
        batch, runs = batch_with_runs([1] * 20, [70 + i for i in range(20)], [20], [67], heads=(8, 2))
        check(batch, runs)

    @pytest.mark.parametrize("prefix_splits,own_block_q", [(1, 4), (3, 4), (2, 1)])
    def test_split_prefix_with_either_query_block(prefix_splits, own_block_q):
        """The prefix in parallel parts (some empty for the short prefix), each folded into the
        own keys' result by prefill-shaped and decode-shaped programs alike."""
        batch, runs = batch_with_runs([1, 1, 1, 2, 1], [150, 160, 171, 40, 41], [3, 2], [149, 33], heads=(4, 1))
        check(
            batch,
            runs,
            config=AttentionLaunchConfig(block_q=own_block_q, tile_n=16, num_kv_splits=1),
            prefix_config=PrefixLaunchConfig(block_t=2, prefix_splits=prefix_splits, tile_n=16),
        )

    def test_padding_runs_and_loose_bounds_as_in_a_cuda_graph():
        """A captured graph launches for fixed bounds: more runs than the step has (empty ones at
        the end), a larger run-token bound, padding sequences with seq_len 0."""
        batch, runs = batch_with_runs([1] * 6, [30, 31, 45, 40, 41, 0], [2, 3], [24, 40])
        batch.seq_lens[5] = 0  # a padding row: reads nothing
        end = int(runs.token_start[-1])
        padded = SharedKVRuns(
            token_start=torch.cat([runs.token_start, torch.full((3,), end, dtype=torch.int32)]),
            prefix_lens=torch.cat([runs.prefix_lens, torch.zeros(3, dtype=torch.int32)]),
            table_rows=torch.cat([runs.table_rows, torch.zeros(3, dtype=torch.int32)]),
            seq_prefix_lens=runs.seq_prefix_lens,
            max_run_tokens=6,
            max_prefix_len=4096,
        )
        scale = 32**-0.5
        got = cascade_attention(*batch.attention_args()[:5], padded, 1, 4096, scale)
        want = paged_attention_reference(*batch.attention_args(), scale)
        torch.testing.assert_close(got[:5], want[:5], **TOLERANCE[torch.float32])

    def test_head_dim_256_with_its_own_tiles():
        """Gemma 3's head size with the tiles chosen for it (half the keys per tile; the own keys'
        prefill blocks of 32 rows): decodes and a prefill chunk past two shared prefixes."""
        batch, runs = batch_with_runs(
            [1, 5, 1, 1], [40, 38, 45, 50], [2, 2], [37, 20], heads=(4, 2), head_dim=256, block_size=16, seed=9
        )
        check(batch, runs)

    def test_no_runs_equals_paged_attention():
        batch = make_paged_batch([1, 3], [10, 4], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
        none = SharedKVRuns(
            token_start=torch.zeros(1, dtype=torch.int32),
            prefix_lens=torch.zeros(0, dtype=torch.int32),
            table_rows=torch.zeros(0, dtype=torch.int32),
            seq_prefix_lens=torch.zeros(2, dtype=torch.int32),
            max_run_tokens=0,
            max_prefix_len=0,
        )
        check(batch, none)
