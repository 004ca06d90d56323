"""Fused decode-path kernels (RMSNorm + residual add, rotary embedding with q/k norms, the gated
activations) on CPU.

As in tests/test_kernels.py, triton.jit reads TRITON_INTERPRET when a kernel is defined, so this
process only runs what needs no interpreter (the model's HF-exact CPU modules against the torch
references they call, the CPU path never touching Triton, and an sm_90 compile of every kernel
without a GPU) and re-runs this file with TRITON_INTERPRET=1 in a fresh process, where the
kernels are compared with their references and a whole shard forward runs through them.
To debug one case directly:  TRITON_INTERPRET=1 python -m pytest tests/test_fused_kernels.py -k rotary

The interpreter computes bfloat16 wrongly: float32 and float16 here, bf16 in tests/gpu/.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch

from strata.kernels.reference import (
    fused_add_rms_norm_reference,
    gelu_tanh_and_mul_reference,
    rms_norm_reference,
    rotary_embedding_reference,
    silu_and_mul_reference,
    write_kv_cache_reference,
)
from strata.services.worker.model import layers as layers_module
from strata.services.worker.model.attention import allocate_kv_cache
from strata.services.worker.model.layers import MLP, RMSNorm, RotaryEmbedding
from strata.services.worker.model.model_config import ModelConfig
from strata.services.worker.model.shard import CausalLMShard
from tests.paged_inputs import SequenceChunk, build_step_inputs, set_fused_kernels
from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter

REPO_ROOT = Path(__file__).resolve().parents[1]
KERNEL_MODULES = ("strata.kernels.rmsnorm", "strata.kernels.rotary", "strata.kernels.activation")


def tiny_config(**overrides) -> ModelConfig:
    """Llama with llama3 RoPE scaling by default; head counts that are not powers of two."""
    fields = dict(
        architecture="LlamaForCausalLM",
        hidden_size=96,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=160,
        vocab_size=97,
        rms_norm_eps=1e-5,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
        ),
        max_position_embeddings=128,
    )
    return ModelConfig(**{**fields, **overrides})


def random_shard(config: ModelConfig, dtype=torch.float32) -> CausalLMShard:
    """A whole-model shard with large random weights (and norm weights that are not all ones)."""
    shard = CausalLMShard(config, 0, config.num_hidden_layers, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in shard.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    return shard.eval()


if not can_run_interpreted_here(*KERNEL_MODULES):

    @pytest.mark.triton_interpreter(seconds=32)  # its tests' time under the interpreter
    def test_fused_kernels_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=300)

    # --- the model's torch path is the references, exactly (bf16 rounding points included) ------
    # model.py calls kernels/reference.py rather than keeping a copy; these check its wiring
    # (weights, eps, cos/sin tables, the [gate | up] layout) and catch a copy creeping back.

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_norm_references_equal_model_rmsnorm(dtype):
        gen = torch.Generator().manual_seed(1)
        norm = RMSNorm(96, 1e-5, "cpu", dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.rand(96, generator=gen) + 0.5)
        x = (torch.randn(7, 96, generator=gen) * 3).to(dtype)
        residual = torch.randn(7, 96, generator=gen).to(dtype)
        assert torch.equal(norm(x), rms_norm_reference(x, norm.weight, 1e-5))
        got, got_residual = norm.add_and_norm(x, residual)
        want, want_residual = fused_add_rms_norm_reference(x, residual, norm.weight, 1e-5)
        assert torch.equal(got, want) and torch.equal(got_residual, want_residual)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_rotary_reference_equals_model_rotary(dtype):
        rotary = RotaryEmbedding(tiny_config(), "cpu", dtype)
        gen = torch.Generator().manual_seed(2)
        q = torch.randn(5, 6, 16, generator=gen).to(dtype)
        k = torch.randn(5, 2, 16, generator=gen).to(dtype)
        positions = torch.tensor([0, 3, 17, 127, 64])
        got_q, got_k = rotary(positions, q, k)
        want_q, want_k = rotary_embedding_reference(positions, q, k, rotary.cos, rotary.sin)
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
        assert not torch.equal(got_q[1:], q[1:])  # the rotation did something (position 0 is identity)

    def test_silu_and_mul_reference_equals_model_mlp_activation():
        """The reference's [gate | up] order is the MLP's fused gate_up layout."""
        config = tiny_config()
        mlp = MLP(config, "cpu", torch.float32)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for param in mlp.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
        x = torch.randn(4, config.hidden_size, generator=gen)
        want = mlp.down_proj(silu_and_mul_reference(mlp.gate_up_proj(x)))
        assert torch.equal(mlp(x), want)
        swapped = mlp.down_proj(silu_and_mul_reference(mlp.gate_up_proj(x).roll(160, dims=-1)))
        assert not torch.allclose(mlp(x), swapped)

    def test_cpu_forward_never_touches_triton(monkeypatch):
        """By default the CPU path is the torch references: the kernels are not even imported."""

        def no_kernels():
            raise AssertionError("fused kernels used on CPU")

        monkeypatch.setattr(layers_module, "_fused_kernels", no_kernels)
        shard = random_shard(tiny_config())
        inputs = build_step_inputs([SequenceChunk([5, 9, 11], 0, [0])], block_size=4)
        caches = allocate_kv_cache(2, 4, 4, 2, 16, torch.float32, "cpu")
        hidden, residual = shard(inputs.input_ids, inputs.positions, None, None, caches, inputs.meta)
        assert torch.isfinite(shard.compute_logits(hidden, residual)).all()

    # --- compiled for an H100 without a GPU -----------------------------------------------------

    def _compile_sm90(kernel, signature: dict, constexprs: dict, num_warps: int):
        """triton.compile for sm_90 with Llama-like constants; returns (registers, spill bytes)."""
        from triton.compiler import ASTSource

        from strata.kernels import compile_check

        names = kernel.arg_names
        full_signature = {name: signature.get(name, "constexpr" if name in constexprs else "i32") for name in names}
        attrs = {
            (names.index(name),): [["tt.divisibility", 16]]
            for name in names
            if name.endswith("_ptr") or (name.startswith("stride") and name in full_signature)
        }
        source = ASTSource(
            kernel, full_signature, attrs=attrs, constexprs={(names.index(k),): v for k, v in constexprs.items()}
        )
        _, registers, spills = compile_check.compile_for_sm90(source, num_warps)
        return registers, spills

    @pytest.mark.parametrize("dtype", ["bf16", "fp16"])
    def test_fused_kernels_compile_for_sm90_without_spills(dtype):
        assert os.environ.get("TRITON_INTERPRET") != "1"
        from triton.runtime.interpreter import InterpretedFunction

        from strata.kernels import activation, embedding, rmsnorm, rotary

        assert not isinstance(rmsnorm._rms_norm_kernel, InterpretedFunction)
        data = "*" + dtype
        # Llama 1B, 70B; Qwen2 7B; Gemma 3 12B (its norms scale by 1 + weight)
        for hidden, num_warps, unit_offset in [(2048, 4, False), (8192, 16, False), (3584, 8, False), (3840, 8, True)]:
            for add in (True, False):
                regs, spills = _compile_sm90(
                    rmsnorm._rms_norm_kernel,
                    dict(
                        x_ptr=data, residual_ptr=data, weight_ptr=data, out_ptr=data, residual_out_ptr=data, eps="fp32"
                    ),
                    dict(
                        HIDDEN=hidden, BLOCK=1 << (hidden - 1).bit_length(), ADD_RESIDUAL=add, UNIT_OFFSET=unit_offset
                    ),
                    num_warps,
                )
                assert spills == 0, (hidden, add, regs, spills)
        # Llama 1B, 70B, Qwen2 7B; Qwen3 8B and Gemma 3 12B with their q/k norms (Gemma's 1 + weight).
        for heads, kv_heads, head_dim, num_warps, norm in [
            (32, 8, 64, 4, None),
            (64, 8, 128, 8, None),
            (28, 4, 128, 8, None),
            (32, 8, 128, 8, "qwen3"),
            (16, 8, 256, 8, "gemma3"),
        ]:
            for write_kv in (False, True):
                regs, spills = _compile_sm90(
                    rotary._rotary_kernel,
                    dict(
                        positions_ptr="*i64",
                        query_ptr=data,
                        key_ptr=data,
                        value_ptr=data,
                        cos_ptr=data,
                        sin_ptr=data,
                        key_cache_ptr=data,
                        value_cache_ptr=data,
                        slot_mapping_ptr="*i64",
                        q_norm_ptr=data,
                        k_norm_ptr=data,
                        norm_eps="fp32",
                    ),
                    dict(
                        QK_NORM=norm is not None,
                        NORM_UNIT_OFFSET=norm == "gemma3",
                        NUM_Q_HEADS=heads,
                        Q_HEADS_PADDED=1 << (heads - 1).bit_length(),
                        NUM_KV_HEADS=kv_heads,
                        KV_HEADS_PADDED=kv_heads,
                        HALF=head_dim // 2,
                        HALF_PADDED=head_dim // 2,
                        WRITE_KV=write_kv,
                        BLOCK_SIZE=16,
                    ),
                    num_warps,
                )
                assert spills == 0, (heads, head_dim, write_kv, regs, spills)
        for gelu_tanh in (False, True):
            regs, spills = _compile_sm90(
                activation._act_and_mul_kernel,
                dict(gate_up_ptr=data, out_ptr=data),
                dict(INTERMEDIATE=8192, BLOCK=1024, GELU_TANH=gelu_tanh),
                4,
            )
            assert spills == 0, (regs, spills)
        for (hidden, num_warps), vocab_slice in itertools.product([(2048, 4), (4096, 8)], [False, True]):
            regs, spills = _compile_sm90(
                embedding._embed_tokens_kernel,
                dict(ids_ptr="*i64", token_rows_ptr="*i64", last_sampled_ptr="*i64", weight_ptr=data, out_ptr=data),
                dict(HIDDEN=hidden, BLOCK=hidden, RESOLVE=True, SLICE=vocab_slice, PDL=True),
                num_warps,
            )
            assert spills == 0, (hidden, regs, spills)

else:
    from strata.kernels.activation import gelu_tanh_and_mul, silu_and_mul
    from strata.kernels.embedding import embed_tokens, embed_tokens_reference
    from strata.kernels.rmsnorm import fused_add_rms_norm, rms_norm
    from strata.kernels.rotary import rotary_embedding_

    TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=2e-3)}

    def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
        assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
        if dtype == torch.float16:
            # Rounding at the same points as torch: all but a rare last-bit flip are identical.
            same = (got == want).float().mean().item()
            assert same > 0.99, f"only {same:.1%} bit-identical to the reference"

    # --- RMSNorm ------------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("hidden", [64, 96, 2048])
    @pytest.mark.parametrize("num_rows", [1, 7])
    def test_fused_add_rms_norm_matches_reference(dtype, hidden, num_rows):
        gen = torch.Generator().manual_seed(hidden + num_rows)
        # x is a strided view (every other row of a wider tensor), like a gathered slice.
        x_storage = (torch.randn(num_rows, 2, hidden + 8, generator=gen) * 4).to(dtype)
        x = x_storage[:, 1, :hidden]
        residual = torch.randn(num_rows, hidden, generator=gen).to(dtype)
        weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
        x_before, residual_before = x.clone(), residual.clone()
        normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
        want_normed, want_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
        assert torch.equal(new_residual, want_residual)  # the add is rounded exactly as torch's
        assert_matches(normed, want_normed, dtype)
        assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
        # In place (the piecewise graphs' residual stream): the same sum, into residual itself.
        normed_in_place, summed = fused_add_rms_norm(x, residual, weight, 1e-5, residual_out=residual)
        assert summed is residual and torch.equal(residual, want_residual) and torch.equal(normed_in_place, normed)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("hidden", [64, 200])
    def test_rms_norm_matches_reference(dtype, hidden):
        gen = torch.Generator().manual_seed(hidden)
        x = (torch.randn(5, hidden, generator=gen) * 3 + 1).to(dtype)
        weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
        got = rms_norm(x, weight, 1e-6)
        assert_matches(got, rms_norm_reference(x, weight, 1e-6), dtype)
        # Rows really are normalised: mean square of got / weight is ~1 per row.
        mean_square = (got.float() / weight.float()).pow(2).mean(-1)
        torch.testing.assert_close(mean_square, torch.ones(5), atol=1e-2, rtol=0)

    def test_rms_norm_float32_weight_promotes_like_torch():
        gen = torch.Generator().manual_seed(4)
        x = torch.randn(3, 64, generator=gen).to(torch.float16)
        weight = torch.rand(64, generator=gen) + 0.5
        got = rms_norm(x, weight, 1e-6)
        want = rms_norm_reference(x, weight, 1e-6)
        assert got.dtype == want.dtype == torch.float32
        # The normed row is rounded to float16 before the float32 weight: float16's tolerance
        # (a rare last-bit flip of that rounding; the inputs were unseeded and flipped one in 192).
        assert_matches(got, want, torch.float16)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_unit_offset_norms_match_reference(dtype):
        """Gemma's norm: (1 + weight) * normalised, in float32, rounded once; with and without the add."""
        gen = torch.Generator().manual_seed(11)
        x = (torch.randn(6, 96, generator=gen) * 3).to(dtype)
        residual = torch.randn(6, 96, generator=gen).to(dtype)
        weight = (torch.randn(96, generator=gen) * 0.3).to(dtype)  # around 0, as Gemma's are
        got = rms_norm(x, weight, 1e-6, unit_offset=True)
        assert_matches(got, rms_norm_reference(x, weight, 1e-6, unit_offset=True), dtype)
        normed, summed = fused_add_rms_norm(x, residual, weight, 1e-6, unit_offset=True)
        want_normed, want_summed = fused_add_rms_norm_reference(x, residual, weight, 1e-6, unit_offset=True)
        assert torch.equal(summed, want_summed)
        assert_matches(normed, want_normed, dtype)
        assert not torch.allclose(got.float(), rms_norm(x, weight, 1e-6).float(), atol=1e-2)  # the offset counts

    def test_zero_rows():
        x = torch.empty(0, 64)
        normed, residual = fused_add_rms_norm(x, x.clone(), torch.ones(64), 1e-6)
        assert normed.shape == residual.shape == (0, 64)
        assert silu_and_mul(torch.empty(0, 32)).shape == (0, 16)
        rotary_embedding_(
            torch.empty(0, dtype=torch.long),
            torch.empty(0, 2, 8),
            torch.empty(0, 1, 8),
            torch.ones(4, 4),
            torch.zeros(4, 4),
        )

    # --- embedding ----------------------------------------------------------------------------

    @pytest.mark.parametrize("hidden", [72, 2048, 5000])
    def test_embed_tokens_resolves_placeholders_like_the_reference(hidden):
        gen = torch.Generator().manual_seed(hidden)
        weight = torch.randn(50, hidden, generator=gen).to(torch.float16)
        ids = torch.tensor([3, -1, 49, -1, 0])  # -1: a decode lookahead's placeholder
        token_rows = torch.tensor([0, 2, 1, 4, 3])
        last_sampled = torch.tensor([7, 8, 11, 12, 13, 0])
        got = embed_tokens(ids, weight, token_rows, last_sampled)
        assert torch.equal(got, embed_tokens_reference(ids, weight, token_rows, last_sampled))
        assert torch.equal(got[[1, 3]], weight[[11, 13]])
        plain = ids.clamp(min=0)
        assert torch.equal(embed_tokens(plain, weight), weight[plain])
        assert embed_tokens(torch.empty(0, dtype=torch.long), weight).shape == (0, hidden)

    @pytest.mark.parametrize("rank", [0, 1, 2])
    def test_embed_tokens_of_a_vocabulary_slice_gives_zeros_outside_it(rank):
        # Three ranks of 24 rows over a vocabulary of 60: the last holds 12 real ids and 12 of padding.
        from strata.services.worker.tensor_parallel.vocab import VocabShard

        gen = torch.Generator().manual_seed(rank)
        table = torch.randn(72, 96, generator=gen).to(torch.float16)
        shard = VocabShard(60, rank, 3)
        weight = table[shard.offset : shard.offset + shard.local].contiguous()
        ids = torch.tensor([0, 23, 24, -1, 47, 48, 59, 30, -1])
        token_rows, last_sampled = torch.arange(9), torch.tensor([0, 0, 0, 50, 0, 0, 0, 0, 5])
        got = embed_tokens(ids, weight, token_rows, last_sampled, vocab_offset=shard.offset, vocab_valid=shard.valid)
        resolved = torch.where(ids < 0, last_sampled, ids)
        inside = (resolved >= shard.offset) & (resolved < shard.offset + shard.valid)
        want = torch.where(inside[:, None], table[resolved], torch.zeros(()).to(torch.float16))
        assert torch.equal(got, want) and not torch.signbit(got[~inside]).any()  # +0.0: the sum's exact
        # The ranks' rows sum to the whole table's: each id is one rank's.
        if rank == 0:
            total = sum(
                embed_tokens(resolved, table[s.offset : s.offset + s.local], vocab_offset=s.offset, vocab_valid=s.valid)
                for s in (VocabShard(60, r, 3) for r in range(3))
            )
            assert torch.equal(total, table[resolved])

    def test_a_ranks_embedding_takes_one_launch_with_the_torch_paths_rows(monkeypatch):
        # services/worker/model/layers.py's Embedding of a vocabulary slice, before its all-reduce.
        from strata.services.worker.model import layers
        from strata.services.worker.model.layers import Embedding
        from strata.services.worker.tensor_parallel.vocab import VocabShard

        class Unsummed:  # the rank's own rows (the group's sum is tested with the group)
            def all_reduce_(self, x):
                return x

        launches = []
        kernels = layers._fused_kernels()
        one_launch = kernels.embed_tokens
        monkeypatch.setattr(kernels, "embed_tokens", lambda *a, **kw: launches.append(kw) or one_launch(*a, **kw))

        shard = VocabShard(100, 1, 2)  # ids 64-99 real, 100-127 padding
        embedding = Embedding(shard.local, 32, "cpu", torch.float16, vocab=shard, reduce=Unsummed())
        embedding.weight.data.copy_(torch.randn(shard.local, 32, generator=torch.Generator().manual_seed(0)))
        ids = torch.tensor([3, 64, 99, -1, 70])
        placeholders = (torch.arange(5), torch.tensor([0, 0, 0, 80, 0]))
        rows = {}
        for fused in (True, False):
            embedding.fused_kernels = fused
            rows[fused] = embedding(ids, placeholders)
        assert launches == [dict(vocab_offset=64, vocab_valid=36)]  # the fused pass's one launch, the torch pass none
        assert torch.equal(rows[True], rows[False])
        assert torch.equal(rows[True][3], embedding.weight[80 - 64]) and not rows[True][0].any()

    # --- rotary -------------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 2, 16), (6, 2, 64), (1, 1, 128), (5, 5, 12)])
    @pytest.mark.parametrize("positions_dtype", [torch.int64, torch.int32])
    def test_rotary_in_place_on_fused_qkv_views(dtype, num_q_heads, num_kv_heads, head_dim, positions_dtype):
        gen = torch.Generator().manual_seed(num_q_heads * head_dim)
        num_tokens, max_pos, half = 9, 300, head_dim // 2
        q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
        qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, num_q_heads, head_dim)
        k = k.view(num_tokens, num_kv_heads, head_dim)
        angles = torch.rand(max_pos, half, generator=gen) * 6.3
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        positions = torch.randint(0, max_pos, (num_tokens,), generator=gen).to(positions_dtype)
        positions[0] = max_pos - 1
        want_q, want_k = rotary_embedding_reference(positions.long(), q, k, cos, sin)
        v_before = v.clone()
        rotary_embedding_(positions, q, k, cos, sin)
        assert torch.equal(v, v_before), "wrote into the value part of qkv"
        if dtype == torch.float16:  # same rounding points as the torch ops: bit-identical
            assert torch.equal(q, want_q) and torch.equal(k, want_k)
        else:
            assert_matches(q, want_q, dtype)
            assert_matches(k, want_k, dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim,block_size", [(4, 2, 16, 4), (6, 3, 12, 8)])
    def test_rotary_writes_rotated_keys_and_values_to_the_cache(dtype, num_q_heads, num_kv_heads, head_dim, block_size):
        """The fused store equals rotary then write_kv_cache: rotated keys and the values land in
        their slots, slot -1 (padding) writes nothing, and the projection's key part is left alone."""
        gen = torch.Generator().manual_seed(head_dim + block_size)
        num_tokens, max_pos, half = 6, 100, head_dim // 2
        q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
        qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
        q, k, v = (part.view(num_tokens, -1, head_dim) for part in qkv.split([q_size, kv_size, kv_size], dim=-1))
        angles = torch.rand(max_pos, half, generator=gen) * 6.3
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
        slots = torch.tensor([5, 0, -1, 17, 3 * block_size - 1, 9])
        cache = torch.randn(2, 6, num_kv_heads, block_size, head_dim, generator=gen).to(dtype)
        want_cache = cache.clone()
        want_q, want_k = rotary_embedding_reference(positions, q, k, cos, sin)
        write_kv_cache_reference(want_k, v, want_cache, slots)
        k_before = k.clone()
        rotary_embedding_(positions, q, k, cos, sin, value=v, kv_cache=cache, slot_mapping=slots)
        assert torch.equal(k, k_before), "rotated the keys in place as well"
        assert_matches(q, want_q, dtype)
        assert_matches(cache, want_cache, dtype)
        if dtype == torch.float16:
            assert torch.equal(cache, want_cache)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("unit_offset", [False, True], ids=["qwen3-norm", "gemma-norm"])
    @pytest.mark.parametrize("write_kv", [False, True])
    def test_rotary_with_qk_norm_matches_norm_then_rotary(dtype, unit_offset, write_kv):
        """Qwen3's and Gemma 3's q/k norms fused into the rotary launch equal RMSNorm of each head,
        then rotary (and the cache write), as the torch path computes them."""
        gen = torch.Generator().manual_seed(21 + unit_offset)
        num_tokens, heads, kv_heads, head_dim, max_pos = 5, 6, 2, 32, 64
        qkv = (torch.randn(num_tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 2).to(dtype)
        q, k, v = (
            part.view(num_tokens, -1, head_dim)
            for part in qkv.split([heads * head_dim] + [kv_heads * head_dim] * 2, -1)
        )
        angles = torch.rand(max_pos, head_dim // 2, generator=gen) * 6.3
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
        q_weight = (torch.randn(head_dim, generator=gen) * 0.3 + (0 if unit_offset else 1)).to(dtype)
        k_weight = (torch.randn(head_dim, generator=gen) * 0.3 + (0 if unit_offset else 1)).to(dtype)
        normed_q = rms_norm_reference(q, q_weight, 1e-6, unit_offset)
        normed_k = rms_norm_reference(k, k_weight, 1e-6, unit_offset)
        want_q, want_k = rotary_embedding_reference(positions, normed_q, normed_k, cos, sin)
        norms = (q_weight, k_weight, 1e-6, unit_offset)
        if write_kv:
            slots = torch.tensor([3, -1, 0, 9, 14])
            cache = torch.zeros(2, 4, kv_heads, 4, head_dim, dtype=dtype)
            want_cache = cache.clone()
            write_kv_cache_reference(want_k, v, want_cache, slots)
            rotary_embedding_(positions, q, k, cos, sin, value=v, kv_cache=cache, slot_mapping=slots, qk_norm=norms)
            assert_matches(cache, want_cache, dtype)
        else:
            rotary_embedding_(positions, q, k, cos, sin, qk_norm=norms)
            assert_matches(k, want_k, dtype)
        assert_matches(q, want_q, dtype)

    def test_rotary_with_model_tables_and_garbage_padding_positions():
        """The model's [max_pos, D/2] tables; padding tokens with out-of-table positions are clamped."""
        config = tiny_config()
        rotary = RotaryEmbedding(config, "cpu", torch.float32)
        gen = torch.Generator().manual_seed(5)
        q = torch.randn(7, 6, 16, generator=gen)
        k = torch.randn(7, 2, 16, generator=gen)
        positions = torch.tensor([3, 50, 127, 9, 0, -5, 10**6])
        clamped = positions.clamp(0, config.max_position_embeddings - 1)
        want_q, want_k = rotary_embedding_reference(clamped, q, k, rotary.cos, rotary.sin)
        rotary_embedding_(positions, q, k, rotary.cos, rotary.sin)
        assert_matches(q, want_q, torch.float32)
        assert_matches(k, want_k, torch.float32)

    # --- SiLU and mul -------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("intermediate", [128, 300, 1500])
    def test_silu_and_mul_matches_reference(dtype, intermediate):
        gen = torch.Generator().manual_seed(intermediate)
        storage = (torch.randn(4, 2 * intermediate + 16, generator=gen) * 4).to(dtype)
        gate_up = storage[:, 16:]  # strided rows
        want = silu_and_mul_reference(gate_up)
        assert_matches(silu_and_mul(gate_up), want, dtype)
        out_storage = torch.full((4, intermediate + 3), 7.0, dtype=dtype)
        out = out_storage[:, :intermediate]
        assert silu_and_mul(gate_up, out=out).data_ptr() == out.data_ptr()
        assert_matches(out, want, dtype)
        assert torch.all(out_storage[:, intermediate:] == 7.0), "wrote outside the out view"

    @pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(200) = inf is the point
    def test_silu_saturates_without_nan():
        gate_up = torch.tensor([[-200.0, 100.0, 0.0, 3.0, 2.0, -1.5]])
        got = silu_and_mul(gate_up)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, silu_and_mul_reference(gate_up))

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the saturated tanh is the point
    def test_gelu_tanh_and_mul_matches_reference(dtype):
        """Gemma's activation, saturating values included. Close, not bit for bit: the interpreter
        has no libdevice tanh (the GPU's, torch's own: tests/gpu/test_model_families_gpu.py)."""
        gen = torch.Generator().manual_seed(13)
        gate_up = (torch.randn(5, 2 * 300, generator=gen) * 4).to(dtype)
        gate_up[0, :4] = torch.tensor([-60.0, 60.0, 0.0, 1e-4])
        got, want = gelu_tanh_and_mul(gate_up), gelu_tanh_and_mul_reference(gate_up)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[dtype])
        assert not torch.allclose(silu_and_mul(gate_up).float(), gelu_tanh_and_mul(gate_up).float(), atol=1e-2)

    # --- a whole shard through the kernels ----------------------------------------------------

    class Counted:
        """A kernel whose launches (kernel[grid](...)) are recorded."""

        def __init__(self, kernel, launches: list):
            self.kernel, self.launches = kernel, launches

        def __getitem__(self, grid):
            self.launches.append(grid)
            return self.kernel[grid]

    @pytest.mark.parametrize("head_dim", [16, 32], ids=["three-kernel-attention", "decode-attention"])
    @pytest.mark.parametrize("arch", ["llama", "qwen2"])
    def test_shard_forward_with_fused_kernels_matches_torch_path(arch, head_dim, monkeypatch):
        """Prefill then a batch-2 decode step over a paged cache, fused (forced on CPU) vs the
        HF-exact torch path. With heads of 32 the decode step's attention is one launch
        (kernels/decode_attention.py) instead of rotary + paged attention."""
        config = (
            tiny_config(head_dim=head_dim)
            if arch == "llama"
            else tiny_config(
                head_dim=head_dim,
                architecture="Qwen2ForCausalLM",
                attention_bias=True,
                tie_word_embeddings=True,
                rope_scaling=None,
            )
        )
        shard = random_shard(config)
        calls = {}
        kernels = layers_module._fused_kernels()
        for name in ("rms_norm", "fused_add_rms_norm", "rotary_embedding_", "silu_and_mul"):
            monkeypatch.setattr(kernels, name, _counting(getattr(kernels, name), name, calls))
        from strata.kernels import decode_attention

        attention_launches = []
        monkeypatch.setattr(
            decode_attention,
            "_decode_attention_kernel",
            Counted(decode_attention._decode_attention_kernel, attention_launches),
        )

        steps = [
            [SequenceChunk([5, 9, 11, 3, 7], 0, [2, 0]), SequenceChunk([1, 2, 60], 0, [1])],
            [SequenceChunk([4], 5, [2, 0]), SequenceChunk([8], 3, [1, 3])],
        ]
        results = {}
        for fused in (False, True):
            set_fused_kernels(shard, fused)
            caches = allocate_kv_cache(
                config.num_hidden_layers, 4, 4, config.num_key_value_heads, config.head_dim, torch.float32, "cpu"
            )
            outputs = []
            for chunks in steps:
                inputs = build_step_inputs(chunks, block_size=4)
                hidden, residual = shard(inputs.input_ids, inputs.positions, None, None, caches, inputs.meta)
                logits = shard.compute_logits(hidden[inputs.logits_indices], residual[inputs.logits_indices])
                outputs += [hidden, residual, logits]
            results[fused] = outputs + [caches[-1]]
        # Per step: the first input norm has no residual, then 3 add+norms in the layers, 1 final.
        # Rotary runs on its own in the prefill's 2 layers, and in the decode step's unless the one
        # launch took it.
        one_launch = head_dim == 32
        assert calls == {
            "rms_norm": 2,
            "fused_add_rms_norm": 8,
            "rotary_embedding_": 2 if one_launch else 4,
            "silu_and_mul": 4,
        }
        assert [grid[:2] for grid in attention_launches] == (
            [(2, config.num_key_value_heads)] * 2 if one_launch else []
        )
        for got, want in zip(results[True], results[False]):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)

    # The options Qwen3, Gemma 3 and Qwen3-MoE add to the layers (model_config.py), on tiny_config's shape.
    FAMILIES = {
        "qwen3": dict(architecture="Qwen3ForCausalLM", qk_norm=True, rope_scaling=None),
        "gemma3": dict(
            architecture="Gemma3ForCausalLM",
            qk_norm=True,
            norm_unit_offset=True,
            sandwich_norms=True,
            embedding_scale=96**0.5,
            hidden_act="gelu_pytorch_tanh",
            query_pre_attn_scalar=24.0,
            rope_local_theta=1000.0,
            rope_scaling=dict(rope_type="linear", factor=4.0),
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=True,
            final_logit_softcapping=30.0,
        ),
        "qwen3_moe": dict(
            architecture="Qwen3MoeForCausalLM",
            qk_norm=True,
            rope_scaling=None,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            router_weights_in_model_dtype=True,
            mlp_only_layers=[1],
        ),
    }

    @pytest.mark.parametrize("family", list(FAMILIES))
    def test_new_families_through_the_kernels_match_torch_path(family, monkeypatch):
        """Qwen3's q/k norms fused into rotary, Gemma 3's norms, GELU-tanh, local rotary table and
        logit cap, Qwen3-MoE's routing and fused experts (kernels/fused_moe.py): a prefill, a
        decode step over a paged cache and a batch-1 one, fused (forced on CPU) vs the HF-exact
        torch path. The batch-1 decode chain, forced on too, takes Qwen3's and Qwen3-MoE's layers
        (experts behind their own norm) and declines Gemma's; the decode steps' attention is the
        one-launch decode attention (q/k norms in it) but in Gemma's sliding layer."""
        from strata.kernels import decode_attention, decode_linear, decode_moe, fused_moe

        config = tiny_config(**FAMILIES[family], head_dim=32)
        shard = random_shard(config)
        calls = {}
        kernels = layers_module._fused_kernels()
        for name in ("rotary_embedding_", "gelu_tanh_and_mul", "silu_and_mul"):
            monkeypatch.setattr(kernels, name, _counting(getattr(kernels, name), name, calls))
        monkeypatch.setattr(fused_moe, "fused_moe", _counting(fused_moe.fused_moe, "fused_moe", calls))
        monkeypatch.setattr(decode_moe, "decode_moe", _counting(decode_moe.decode_moe, "decode_moe", calls))
        gemvs, one_launch = [], []
        monkeypatch.setattr(decode_linear, "_decode_linear_kernel", Counted(decode_linear._decode_linear_kernel, gemvs))
        monkeypatch.setattr(
            decode_attention, "_decode_attention_kernel", Counted(decode_attention._decode_attention_kernel, one_launch)
        )
        steps = [
            [SequenceChunk([5, 9, 11, 3, 7, 2, 8], 0, [2, 0]), SequenceChunk([1, 2, 60], 0, [1])],
            [SequenceChunk([4], 7, [2, 0]), SequenceChunk([8], 3, [1, 3])],
            [SequenceChunk([6], 8, [2, 0, 3])],
        ]
        results = {}
        for fused in (False, True):
            set_fused_kernels(shard, fused)
            shard.decode_chain = fused
            caches = allocate_kv_cache(2, 4, 4, config.num_key_value_heads, config.head_dim, torch.float32, "cpu")
            outputs = []
            for chunks in steps:
                inputs = build_step_inputs(chunks, block_size=4)
                hidden, residual = shard(inputs.input_ids, inputs.positions, None, None, caches, inputs.meta)
                logits = shard.compute_logits(hidden[inputs.logits_indices], residual[inputs.logits_indices])
                outputs += [hidden, residual, logits]
            results[fused] = outputs + [caches[-1]]
        # Three steps of two layers: rotary (with the q/k norms) in every layer of the prefill and
        # of the decode steps' layers that the one launch does not take (Gemma's sliding layer 0),
        # and the MLPs. The batch-1 step of Qwen3 and Qwen3-MoE takes the decode chain (its dense
        # MLP is GEMVs, with SiLU in down's prologue); Gemma's is declined.
        chained = family != "gemma3"
        one_launch_layers = 1 if family == "gemma3" else 2
        assert calls["rotary_embedding_"] == 2 + 2 * (2 - one_launch_layers)
        assert len(one_launch) == 2 * one_launch_layers and bool(gemvs) == chained
        mlp = "gelu_tanh_and_mul" if family == "gemma3" else "silu_and_mul"
        dense_layers = 1 if family == "qwen3_moe" else 2  # layer 1 only: layer 0 has experts
        assert calls[mlp] == dense_layers * (2 if chained else 3)
        # The batch-1 step's experts are the chain's GEMVs (kernels/decode_moe.py), the others fused_moe.
        assert calls.get("fused_moe", 0) == (2 if family == "qwen3_moe" else 0)
        assert calls.get("decode_moe", 0) == (1 if family == "qwen3_moe" else 0)
        for got, want in zip(results[True], results[False]):
            torch.testing.assert_close(got, want, atol=5e-5, rtol=5e-5)

    def test_piecewise_pieces_through_the_kernels_match_the_forward():
        """services/worker/graphs/piecewise_graphs.py's pieces (run uncaptured) on the fused kernels: the
        in-place rotary and residual add leave the queries and the residual stream where the
        next piece and attention read them (tests/test_piecewise_graphs.py: the torch path)."""
        from tests.piecewise_steps import run_mixed_steps

        shard = random_shard(tiny_config(max_position_embeddings=256))
        set_fused_kernels(shard, True)
        # Shorter prompts than the torch-path test's (the interpreter's cost grows with the padded
        # rows): still prefills across blocks, a placeholder decode, and padding in both steps
        # (55 rows padded to 64, then 12 to 64).
        run = dict(num_blocks=32, max_tokens=256, capture=False, device="cpu", dtype=torch.float32)
        run["lengths"] = (20, 5, 30, 9)
        with torch.inference_mode():
            eager, eager_caches = run_mixed_steps([shard], piecewise=False, **run)
            pieces, piece_caches = run_mixed_steps([shard], piecewise=True, **run)
        for (h_e, r_e), (h_p, r_p) in zip(eager, pieces):
            torch.testing.assert_close(h_p, h_e, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(r_p, r_e, atol=2e-5, rtol=2e-5)
        for cache_e, cache_p in zip(eager_caches[0], piece_caches[0]):
            torch.testing.assert_close(cache_p, cache_e, atol=2e-5, rtol=2e-5)

    @pytest.mark.parametrize(
        "arch,head_dim",
        [
            ("llama", 16),
            ("qwen2", 32),
            # Behind the slow marker: each arch and each attention path keeps a case above (the
            # architectures differ in the GEMVs' bias and tied head, not in the attention path).
            pytest.param("llama", 32, marks=pytest.mark.slow),
            pytest.param("qwen2", 16, marks=pytest.mark.slow),
            ("qwen3_moe", 32),
        ],
        ids=[
            "llama-three-kernel-attention",
            "qwen2-decode-attention",
            "llama-decode-attention",
            "qwen2-three-kernel-attention",
            "qwen3-moe-experts-then-dense",
        ],
    )
    def test_decode_chain_matches_torch_path_across_stages(arch, head_dim, monkeypatch):
        """The batch-1 chain (services/worker/model/decode_chain.py), forced on CPU, over a prefill (which
        it leaves to the unfused path) and two decode steps: whole model, and split in two stages that pass the unfused
        (hidden, residual) pair between them, against the HF-exact torch path. Heads of 32 take the one-launch
        decode attention (kernels/decode_attention.py), heads of 16 the three kernels. Qwen3-MoE: a layer of
        experts in the chain, last of its stage or followed by a dense one."""
        options = {
            "llama": {},
            "qwen2": dict(
                architecture="Qwen2ForCausalLM", attention_bias=True, tie_word_embeddings=True, rope_scaling=None
            ),
            "qwen3_moe": FAMILIES["qwen3_moe"],  # layer 0 of experts (the first stage's last), q/k norms
        }
        config = tiny_config(num_hidden_layers=2, head_dim=head_dim, **options[arch])
        whole = random_shard(config)
        # Two layers (each GEMV launch costs the interpreter about 0.3 s): one stage holds both, or
        # each of two stages one.
        first, second = CausalLMShard(config, 0, 1), CausalLMShard(config, 1, 2)
        first.embed_tokens, first.layers = whole.embed_tokens, torch.nn.ModuleList(whole.layers[:1])
        second.layers, second.norm, second.lm_head = torch.nn.ModuleList(whole.layers[1:]), whole.norm, whole.lm_head
        steps = [
            [SequenceChunk([5, 9, 11, 3, 7], 0, [2, 0])],
            [SequenceChunk([4], 5, [2, 0])],
            [SequenceChunk([6], 6, [2, 0])],
        ]

        def run(stages, chain):
            for stage in stages:
                set_fused_kernels(stage, chain)
                stage.decode_chain = chain
            caches = allocate_kv_cache(
                config.num_hidden_layers, 4, 4, config.num_key_value_heads, config.head_dim, torch.float32, "cpu"
            )
            outputs = []
            for chunks in steps:
                inputs = build_step_inputs(chunks, block_size=4)
                hidden, residual, layer = None, None, 0
                for stage in stages:
                    hidden, residual = stage(
                        inputs.input_ids if stage.is_first else None,
                        inputs.positions,
                        hidden,
                        residual,
                        caches[layer : layer + stage.num_layers],
                        inputs.meta,
                    )
                    layer += stage.num_layers
                logits = stages[-1].compute_logits(hidden[inputs.logits_indices], residual[inputs.logits_indices])
                outputs += [hidden + residual, logits]
            return outputs + [caches[-1]]

        want = run([whole], False)
        from strata.kernels import decode_attention, decode_linear

        launches, attention_launches = [], []
        monkeypatch.setattr(
            decode_linear, "_decode_linear_kernel", Counted(decode_linear._decode_linear_kernel, launches)
        )
        monkeypatch.setattr(
            decode_attention,
            "_decode_attention_kernel",
            Counted(decode_attention._decode_attention_kernel, attention_launches),
        )
        for stages in ([whole], [first, second]):
            launches.clear()
            attention_launches.clear()
            for got, expected in zip(run(stages, True), want):
                torch.testing.assert_close(got, expected, atol=5e-5, rtol=5e-5)
            # The two decode steps (the prefill's 5 tokens are past the chain's one): 4 GEMVs a dense
            # layer (qkv, o_proj, gate_up, down), 3 a layer of experts (qkv, o_proj, the router: its
            # experts are kernels/decode_moe.py's), and lm_head's; the prefill's sampled row: lm_head's.
            gemvs = 4 * config.num_hidden_layers - (1 if arch == "qwen3_moe" else 0)
            assert len(launches) == 2 * (gemvs + 1) + 1
            one_launch = head_dim == 32  # q/k norms (Qwen3-MoE) included
            assert len(attention_launches) == (2 * config.num_hidden_layers if one_launch else 0)


def _counting(fn, name: str, calls: dict):
    """fn, counting its calls in calls[name]."""

    def counted(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **kwargs)

    return counted
