"""The fused-MoE kernels (kernels/fused_moe.py) against their torch references (kernels/reference.py).

As in tests/test_kernels.py: triton.jit reads TRITON_INTERPRET when a kernel is defined, so this
process runs only what needs no interpreter (the references against HF transformers' MoE blocks,
the tile table) and the launcher below re-runs this file under the interpreter
(tests/triton_interpreter.py), where the kernels are compared with the references. Their sm_90
compile (spills, pipelined weight loads) is in `python -m strata.kernels.compile_check --strict`,
which tests/test_kernels.py runs.
To debug one case directly:  TRITON_INTERPRET=1 python -m pytest tests/test_fused_moe.py -k skew

The interpreter computes bfloat16 wrongly: float32 and float16 here, bf16 in tests/gpu/.
"""

from __future__ import annotations

import pytest
import torch

from strata.kernels.reference import fused_moe_reference, select_experts_reference
from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The references run many tiny ops: with two interpreted processes sharing two cores, torch's
    thread pool spends seconds waiting on itself instead."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


if not can_run_interpreted_here("strata.kernels.fused_moe"):

    @pytest.mark.triton_interpreter(seconds=4)  # its tests' time under the interpreter
    def test_fused_moe_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=300)

    # --- the oracle: the references are HF transformers' MoE blocks, exactly ----------------------

    def _hf_block(arch: str, norm_topk_prob: bool):
        from transformers import MixtralConfig, Qwen3MoeConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        # "eager": HF's expert loop, the math the references copy (from_pretrained would pick grouped_mm).
        if arch == "qwen3_moe":
            config = Qwen3MoeConfig(
                hidden_size=32,
                moe_intermediate_size=16,
                num_experts=8,
                num_experts_per_tok=3,
                norm_topk_prob=norm_topk_prob,
                experts_implementation="eager",
            )
            return Qwen3MoeSparseMoeBlock(config), 3
        config = MixtralConfig(
            hidden_size=32,
            intermediate_size=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            experts_implementation="eager",
        )
        return MixtralSparseMoeBlock(config), 2

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("arch,norm_topk_prob", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
    def test_references_equal_hf_sparse_moe_block(arch, norm_topk_prob, dtype):
        """Router + experts of the references reproduce HF's block bit for bit, bf16 rounding included
        (Qwen3-MoE rounds its routing weights to bf16, Mixtral keeps them float32)."""
        block, top_k = _hf_block(arch, norm_topk_prob)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in block.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
        block = block.to(dtype).eval()
        x = torch.randn(1, 9, 32, generator=gen).to(dtype)
        with torch.no_grad():
            want = block(x)[0]
            logits = torch.nn.functional.linear(x[0], block.gate.weight)
            weight_dtype = logits.dtype if arch == "qwen3_moe" else None
            weights, ids = select_experts_reference(logits, top_k, norm_topk_prob, weight_dtype=weight_dtype)
            got = fused_moe_reference(x[0], block.experts.gate_up_proj, block.experts.down_proj, weights, ids)
        assert torch.equal(got, want)
        assert weights.dtype == torch.float32 and ids.dtype == torch.int32
        if not norm_topk_prob:
            assert (weights.sum(-1) < 1).all()  # the flag did something

    def test_reference_expert_map_keeps_only_local_experts():
        """Two expert-parallel ranks' outputs add up to the whole layer's."""
        gen = torch.Generator().manual_seed(1)
        hidden, w13, w2 = (
            torch.randn(6, 16, generator=gen),
            torch.randn(8, 24, 16, generator=gen),
            torch.randn(8, 16, 12, generator=gen),
        )
        weights, ids = select_experts_reference(torch.randn(6, 8, generator=gen), 3, True)
        whole = fused_moe_reference(hidden, w13, w2, weights, ids)
        halves = []
        for start in (0, 5):
            expert_map = torch.full((8,), -1, dtype=torch.int32)
            count = 5 if start == 0 else 3
            expert_map[start : start + count] = torch.arange(count, dtype=torch.int32)
            local = slice(start, start + count)
            halves.append(fused_moe_reference(hidden, w13[local], w2[local], weights, ids, expert_map=expert_map))
        torch.testing.assert_close(halves[0] + halves[1], whole, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(halves[0], whole, atol=1e-3)

    # --- the tile table ---------------------------------------------------------------------------

    def test_config_table_small_tiles_for_decode_large_for_prefill():
        from strata.kernels.fused_moe import choose_moe_config, launch_variants
        from strata.kernels.moe_routing import max_padded_blocks

        assert choose_moe_config(1, 8, 128).block_m == 16  # Qwen3-30B-A3B decode
        assert choose_moe_config(16, 8, 128).block_m == 16
        assert choose_moe_config(256, 8, 128).block_m == 32  # 16 pairs an expert: most experts one block
        assert choose_moe_config(8192, 8, 128).block_m == 128  # prefill
        assert choose_moe_config(1, 2, 8).block_m == 16  # Mixtral decode
        assert choose_moe_config(4096, 2, 8).block_m == 128
        sizes = [choose_moe_config(t, 8, 128).block_m for t in (1, 16, 256, 512, 1024, 2048, 8192)]
        assert sizes == sorted(sizes)
        # Every tile obeys the tensor-core minimum (16) in M, N and K.
        for t in (1, 300, 700, 5000):
            config = choose_moe_config(t, 8, 128)
            assert min(config.block_m, config.gate_up.block_n, config.gate_up.block_k, config.down.block_k) >= 16
        # The worst case: every expert that gets a pair pads a block minus one row.
        assert max_padded_blocks(8, 128, 16) == 8  # one token, eight experts, a block each
        assert max_padded_blocks(2048, 128, 16) == (2048 + 128 * 15) // 16
        names = [v.name for v in launch_variants(hidden_size=2048, intermediate=768, num_experts=128, top_k=8)]
        assert len(names) == len(set(names)) and sum("gemm" in name for name in names) == 8

    @pytest.mark.parametrize("experts,top_k", [(128, 8), (8, 2), (64, 6)])
    def test_warm_up_token_counts_reach_every_variant(experts, top_k):
        """Every token count serving may see launches the variants of one of the warm-up counts."""
        from strata.kernels.fused_moe import _variant_key, warm_up_token_counts

        counts = warm_up_token_counts(experts, top_k)
        warmed = {_variant_key(tokens, experts, top_k) for tokens in counts}
        assert len(warmed) == len(counts) and counts[0] == 1
        for tokens in [*range(1, 3000), 4095, 8192, 16384, 65536]:
            assert _variant_key(tokens, experts, top_k) in warmed, tokens

else:
    from strata.kernels.fused_moe import (
        GemmTile,
        MoELaunchConfig,
        align_pairs_by_expert,
        expert_map_for_range,
        fused_moe,
        select_experts,
    )

    TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}
    # Small tiles keep the interpreter quick; 16 is the tensor-core minimum on a GPU anyway.
    SMALL = MoELaunchConfig(16, GemmTile(16, 16, 2, 1), GemmTile(16, 16, 2, 1))
    EVEN = MoELaunchConfig(16, GemmTile(32, 32, 4, 2), GemmTile(32, 32, 4, 2))  # every dim a multiple
    WIDE_M = MoELaunchConfig(32, GemmTile(16, 32, 4, 2, group_m=2), GemmTile(32, 16, 4, 2, group_m=2))

    def random_layer(tokens, hidden, intermediate, experts, dtype, seed=0):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, hidden, generator=gen).to(dtype)
        w13 = (torch.randn(experts, 2 * intermediate, hidden, generator=gen) / hidden**0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, intermediate, generator=gen) / intermediate**0.5).to(dtype)
        return x, w13, w2

    def routed(tokens, experts, top_k, seed=0):
        gen = torch.Generator().manual_seed(seed + 100)
        return select_experts_reference(torch.randn(tokens, experts, generator=gen) * 2, top_k, True)

    def check_layer(x, w13, w2, weights, ids, config=None, expert_map=None):
        got = fused_moe(x, w13, w2, weights, ids, config=config, expert_map=expert_map)
        want = fused_moe_reference(x, w13, w2, weights, ids, expert_map=expert_map)
        assert got.dtype == x.dtype and torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[x.dtype])
        return got

    # --- routing ----------------------------------------------------------------------------------

    @pytest.mark.parametrize(
        "tokens,experts,top_k,renormalize,logits_dtype,weight_dtype",
        [
            (37, 8, 2, True, torch.float32, None),  # Mixtral; several programs, the last one masked
            # Qwen3-MoE rounds the weights to the logits' dtype: bf16 on a GPU (tests/gpu), float16
            # here, as the interpreter rounds to bf16 wrongly.
            (5, 128, 8, True, torch.float16, torch.float16),
            (1, 128, 8, False, torch.float32, None),
            (3, 6, 1, False, torch.float32, None),  # E not a power of two, k = 1
        ],
    )
    def test_select_experts_matches_hf_router(tokens, experts, top_k, renormalize, logits_dtype, weight_dtype):
        gen = torch.Generator().manual_seed(tokens + experts)
        # Distinct logits: on ties torch.topk's choice is unspecified (the kernel takes the lower id).
        ranks = torch.stack([torch.randperm(experts, generator=gen) for _ in range(tokens)])
        logits = ((ranks - experts / 2) / 16).to(logits_dtype)  # exact in float16 and bf16
        weights, ids = select_experts(logits, top_k, renormalize, weight_dtype=weight_dtype)
        want_weights, want_ids = select_experts_reference(logits, top_k, renormalize, weight_dtype=weight_dtype)
        assert ids.dtype == torch.int32 and weights.dtype == torch.float32
        assert torch.equal(ids, want_ids)
        rtol = 2**-10 if weight_dtype is not None else 1e-6  # a rounding may land one step apart
        torch.testing.assert_close(weights, want_weights, rtol=rtol, atol=1e-7)

    def test_select_experts_ties_go_to_the_lower_expert():
        logits = torch.zeros(2, 8)
        logits[1, [2, 5]] = 1.0
        weights, ids = select_experts(logits, 3, True)
        assert ids.tolist() == [[0, 1, 2], [2, 5, 0]]
        torch.testing.assert_close(weights[0], torch.full((3,), 1 / 3))

    # --- grouping by expert -----------------------------------------------------------------------

    def assert_layout(layout, ids, num_local, expert_map=None):
        """Each local expert's pairs, ascending, in its own block_m-padded segment, in expert order."""
        block_m, num_pairs = layout.block_m, ids.numel()
        local = ids.flatten().long()
        if expert_map is not None:
            local = expert_map[local].long()
        rows = layout.sorted_pairs.tolist()
        start = 0
        for expert in range(num_local):
            pairs = torch.nonzero(local == expert).flatten().tolist()
            padded = -(-len(pairs) // block_m) * block_m
            segment = rows[start : start + padded]
            assert segment == pairs + [num_pairs] * (padded - len(pairs)), expert
            blocks = layout.block_experts[start // block_m : (start + padded) // block_m]
            assert (blocks == expert).all(), expert
            start += padded
        assert layout.padded_total.item() == start
        assert (layout.block_experts[start // block_m :] == -1).all()

    @pytest.mark.parametrize(
        "tokens,top_k,experts,block_m,skew",
        [
            (1, 2, 8, 16, False),  # decode: one chunk
            (50, 2, 8, 16, False),  # several chunks (the interpreter's chunk is 64 pairs)
            (40, 2, 8, 32, True),  # every token's first slot on one expert: a segment of several blocks
            (9, 8, 128, 16, False),  # Qwen3-MoE: most experts empty
        ],
    )
    def test_align_groups_pairs_by_expert(tokens, top_k, experts, block_m, skew):
        _, ids = routed(tokens, experts, top_k, seed=tokens)
        if skew:
            ids[:, 0] = 3
            ids[:, 1:] = torch.where(ids[:, 1:] == 3, 0, ids[:, 1:])
        layout = align_pairs_by_expert(ids, experts, block_m)
        assert_layout(layout, ids, experts)

    def test_align_drops_experts_of_other_ranks():
        _, ids = routed(30, 8, 3)
        expert_map = expert_map_for_range(8, 2, 6)
        layout = align_pairs_by_expert(ids, 4, 16, expert_map)
        assert_layout(layout, ids, 4, expert_map)
        assert (layout.sorted_pairs[: layout.padded_total.item()] < 90).sum() == (expert_map[ids.long()] >= 0).sum()

    # --- the whole layer --------------------------------------------------------------------------

    @pytest.mark.parametrize(
        "tokens,hidden,intermediate,experts,top_k,dtype,config",
        [
            (1, 64, 32, 8, 2, torch.float32, None),  # Mixtral-like decode, the table's tiles (K tail: H < BK)
            (16, 64, 64, 8, 2, torch.float32, EVEN),  # unmasked tiles: T, H, I multiples of the blocks
            (7, 80, 48, 8, 2, torch.float32, EVEN),  # masked: N and K tails in both GEMMs
            (33, 32, 32, 8, 8, torch.float16, WIDE_M),  # k = E; T not a multiple of BLOCK_M; grouped tiles
            (3, 32, 16, 128, 8, torch.float32, SMALL),  # Qwen3-MoE's routing on small dims
            (12, 48, 32, 8, 1, torch.float16, SMALL),  # k = 1
        ],
    )
    def test_fused_moe_matches_reference(tokens, hidden, intermediate, experts, top_k, dtype, config):
        x, w13, w2 = random_layer(tokens, hidden, intermediate, experts, dtype)
        weights, ids = routed(tokens, experts, top_k)
        check_layer(x, w13, w2, weights, ids, config)

    def test_all_tokens_to_one_expert():
        """Skewed routing: one expert gets every token (segments of several blocks), the others none."""
        x, w13, w2 = random_layer(40, 32, 32, 8, torch.float32, seed=2)
        ids = torch.stack([torch.full((40,), 5), torch.arange(40) % 2], dim=1).to(torch.int32)
        weights = torch.softmax(torch.randn(40, 2), dim=-1)
        check_layer(x, w13, w2, weights, ids, SMALL)

    def test_expert_parallel_ranks_add_up_to_the_layer():
        x, w13, w2 = random_layer(10, 32, 16, 8, torch.float32, seed=3)
        weights, ids = routed(10, 8, 2, seed=3)
        ids[0] = torch.tensor([6, 7], dtype=torch.int32)  # a token whose experts are all on the other rank
        parts = []
        for start, end in ((0, 6), (6, 8)):
            expert_map = expert_map_for_range(8, start, end)
            parts.append(check_layer(x, w13[start:end], w2[start:end], weights, ids, SMALL, expert_map))
        assert torch.equal(parts[0][0], torch.zeros(32))
        torch.testing.assert_close(
            parts[0] + parts[1], fused_moe_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5
        )

    def test_strided_rows_out_argument_and_reproducibility():
        """hidden as a view with a row stride, the result into a given `out` view; two runs are
        bit-identical (no atomics in the top-k sum); no tokens is no work."""
        x, w13, w2 = random_layer(9, 32, 16, 8, torch.float32, seed=4)
        weights, ids = routed(9, 8, 2, seed=4)
        wide = torch.zeros(9, 48)
        wide[:, 8:40] = x
        out_buffer = torch.full((9, 40), 7.0)
        out = fused_moe(wide[:, 8:40], w13, w2, weights, ids, out=out_buffer[:, 4:36], config=SMALL)
        assert out.data_ptr() == out_buffer[:, 4:36].data_ptr()
        torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
        assert (out_buffer[:, :4] == 7).all() and (out_buffer[:, 36:] == 7).all()
        assert torch.equal(fused_moe(x, w13, w2, weights, ids, config=SMALL), out)
        empty = fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
        assert empty.shape == (0, 32)

    # --- the rest of the cross product (STRATA_SLOW_TESTS=1) -----------------------------------------

    @pytest.mark.slow
    @pytest.mark.parametrize("tokens", [1, 15, 64, 100])
    @pytest.mark.parametrize("experts,top_k", [(8, 2), (16, 4), (128, 8)])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("config", [SMALL, EVEN, WIDE_M, None], ids=["small", "even", "wide_m", "table"])
    def test_fused_moe_cross_product(tokens, experts, top_k, dtype, config):
        x, w13, w2 = random_layer(tokens, 64, 32, experts, dtype, seed=tokens)
        weights, ids = routed(tokens, experts, top_k, seed=tokens)
        check_layer(x, w13, w2, weights, ids, config)
