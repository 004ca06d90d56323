"""Fused decode-path kernels on a real GPU: bf16 (which the CPU interpreter cannot check), real
model shapes, CUDA-graph capture with a padded batch, and a bf16 shard forward with the kernels
against the same shard on the torch path.

    python -m pytest tests/gpu/test_fused_kernels_gpu.py -q -s     (-s shows the timings)

Oracle: the torch references in kernels/reference.py, run on the GPU in the same dtype; they
round where the model's torch path rounds, so most outputs are bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from tests.graph_capture import capture_graph
from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from strata.kernels.activation import silu_and_mul  # noqa: E402
from strata.kernels.reference import (  # noqa: E402
    fused_add_rms_norm_reference,
    rms_norm_reference,
    rotary_embedding_reference,
    silu_and_mul_reference,
    write_kv_cache_reference,
)
from strata.kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402
from strata.kernels.rotary import rotary_embedding_  # noqa: E402
from strata.services.worker.model.attention import allocate_kv_cache  # noqa: E402
from strata.services.worker.model.layers import RotaryEmbedding  # noqa: E402
from strata.services.worker.model.model_config import ModelConfig  # noqa: E402
from tests.gpu_shards import llama_1b_like, random_bf16_shard  # noqa: E402
from tests.paged_inputs import SequenceChunk, build_step_inputs, set_fused_kernels  # noqa: E402

DEVICE = "cuda"
# Elementwise: one rounding step of the dtype. Bit-identical share: only a rare last-bit flip
# (float32 reduction order, approximate exp/rsqrt) may differ from the torch path.
TOLERANCE = {
    torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2, identical=0.99),
    torch.float16: dict(atol=2e-3, rtol=2e-3, identical=0.99),
    torch.float32: dict(atol=1e-5, rtol=1e-5, identical=0.0),
}


def assert_matches(got: torch.Tensor, want: torch.Tensor, min_identical: float | None = None) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, want.dtype, got.shape, want.shape)
    tol = TOLERANCE[got.dtype]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=tol["atol"], rtol=tol["rtol"])
    identical = (got == want).float().mean().item()
    need = tol["identical"] if min_identical is None else min_identical
    assert identical >= need, f"only {identical:.2%} bit-identical to the torch path"


def randn(*shape, dtype, gen, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE, generator=gen) * scale).to(dtype)


# --- each kernel against its reference ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [2048, 3584, 4096, 8192])
@pytest.mark.parametrize("num_rows", [1, 3, 256, 4096])
def test_fused_add_rms_norm(dtype, hidden, num_rows):
    gen = torch.Generator(device=DEVICE).manual_seed(hidden + num_rows)
    x = randn(num_rows, hidden, dtype=dtype, gen=gen, scale=3.0)
    residual = randn(num_rows, hidden, dtype=dtype, gen=gen, scale=10.0)
    weight = (torch.rand(hidden, device=DEVICE, generator=gen) + 0.5).to(dtype)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    want_normed, want_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, want_residual)
    assert_matches(normed, want_normed)
    assert_matches(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(32, 8, 64), (32, 8, 128), (64, 8, 128), (28, 4, 128)])
@pytest.mark.parametrize("num_tokens", [1, 256, 3000])
def test_rotary_in_place_on_qkv_views(dtype, num_q_heads, num_kv_heads, head_dim, num_tokens):
    gen = torch.Generator(device=DEVICE).manual_seed(num_q_heads * head_dim + num_tokens)
    config = ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=num_q_heads * head_dim,
        num_hidden_layers=1,
        num_attention_heads=num_q_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=64,
        vocab_size=64,
        rope_theta=500000.0,
        max_position_embeddings=8192,
    )
    rotary = RotaryEmbedding(config, DEVICE, dtype)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, gen=gen)
    q = qkv[:, :q_size].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v_before = qkv[:, q_size + kv_size :].clone()
    positions = torch.randint(0, 8192, (num_tokens,), device=DEVICE, generator=gen)
    want_q, want_k = rotary_embedding_reference(positions, q, k, rotary.cos, rotary.sin)
    rotary_embedding_(positions, q, k, rotary.cos, rotary.sin)
    assert torch.equal(qkv[:, q_size + kv_size :], v_before)
    # Not bit-exact on the GPU (seen on an H200): the compiler contracts multiply-adds into FMAs,
    # so only closeness is required.
    assert_matches(q, want_q, min_identical=0.0)
    assert_matches(k, want_k, min_identical=0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(32, 8, 64), (32, 8, 128), (28, 4, 128)])
@pytest.mark.parametrize("num_tokens", [1, 256, 3000])
def test_rotary_stores_rotated_keys_and_values_in_the_cache(dtype, num_q_heads, num_kv_heads, head_dim, num_tokens):
    """The fused store (the model's path) against rotary + write_kv_cache references, padding
    slots (-1) included; the cache outside the written slots is untouched."""
    gen = torch.Generator(device=DEVICE).manual_seed(num_q_heads * head_dim + num_tokens + 1)
    block_size, num_blocks = 16, (num_tokens + 40) // 16 + 2
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, dtype=dtype, gen=gen)
    q, k, v = (part.view(num_tokens, -1, head_dim) for part in qkv.split([q_size, kv_size, kv_size], dim=-1))
    angles = torch.rand(8192, head_dim // 2, device=DEVICE, generator=gen) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, 8192, (num_tokens,), device=DEVICE, generator=gen)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE, generator=gen)[:num_tokens]
    slots[::7] = -1
    cache = randn(2, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, gen=gen)
    want_cache = cache.clone()
    want_q, want_k = rotary_embedding_reference(positions, q, k, cos, sin)
    write_kv_cache_reference(want_k, v, want_cache, slots)
    rotary_embedding_(positions, q, k, cos, sin, value=v, kv_cache=cache, slot_mapping=slots)
    assert_matches(q, want_q, min_identical=0.0)  # FMA contraction: close, not bit-exact (see above)
    assert_matches(cache, want_cache, min_identical=0.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("intermediate", [8192, 14336, 4864, 300])
@pytest.mark.parametrize("num_tokens", [1, 256, 2048])
def test_silu_and_mul(dtype, intermediate, num_tokens):
    gen = torch.Generator(device=DEVICE).manual_seed(intermediate + num_tokens)
    gate_up = randn(num_tokens, 2 * intermediate, dtype=dtype, gen=gen, scale=4.0)
    assert_matches(silu_and_mul(gate_up), silu_and_mul_reference(gate_up))


# --- CUDA graphs ---------------------------------------------------------------------------------


def test_kernels_capture_in_cuda_graph_with_padded_batch():
    """Capture all three kernels once for 64 token slots; replays with new data and positions match.

    Capture fails on any host synchronisation; the 64 slots hold 50 real tokens and 14 padding ones.
    """
    dtype, num_slots, hidden, intermediate = torch.bfloat16, 64, 2048, 8192
    num_q_heads, num_kv_heads, head_dim = 32, 8, 64
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = randn(num_slots, hidden, dtype=dtype, gen=gen)
    residual = randn(num_slots, hidden, dtype=dtype, gen=gen)
    weight = (torch.rand(hidden, device=DEVICE, generator=gen) + 0.5).to(dtype)
    qkv = randn(num_slots, q_size + 2 * kv_size, dtype=dtype, gen=gen)
    gate_up = randn(num_slots, 2 * intermediate, dtype=dtype, gen=gen)
    positions = torch.zeros(num_slots, dtype=torch.long, device=DEVICE)
    angles = torch.rand(4096, head_dim // 2, device=DEVICE, generator=gen) * 6.3
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q = qkv[:, :q_size].view(num_slots, num_q_heads, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_slots, num_kv_heads, head_dim)

    def step():
        normed, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
        rotary_embedding_(positions, q, k, cos, sin)
        return normed, new_residual, silu_and_mul(gate_up)

    graph, outputs = capture_graph(step)

    for _replay in range(3):
        for tensor in (x, residual, qkv, gate_up):
            tensor.copy_(randn(*tensor.shape, dtype=dtype, gen=gen))
        positions.zero_()  # padding slots sit at position 0
        positions[:50] = torch.randint(0, 4096, (50,), device=DEVICE, generator=gen)
        fresh_q, fresh_k = q.clone(), k.clone()
        graph.replay()
        torch.cuda.synchronize()
        want_normed, want_residual = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
        want_q, want_k = rotary_embedding_reference(positions, fresh_q, fresh_k, cos, sin)
        assert_matches(outputs[0], want_normed)
        assert torch.equal(outputs[1], want_residual)
        # Closeness only, as in test_rotary_in_place_on_qkv_views: FMA contraction on the GPU.
        assert_matches(q, want_q, min_identical=0.0)
        assert_matches(k, want_k, min_identical=0.0)
        assert_matches(outputs[2], silu_and_mul_reference(gate_up))


# --- a bf16 shard: fused kernels vs the torch path -------------------------------------------------

BLOCK_SIZE = 16


def prompts_and_blocks(num_seqs: int, seed: int):
    """Prompt token ids of 1-40 tokens per sequence and 4 private KV blocks each."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 41, (num_seqs,), generator=gen).tolist()
    prompts = [torch.randint(0, 8192, (n,), generator=gen).tolist() for n in lengths]
    blocks = [list(range(4 * i, 4 * i + 4)) for i in range(num_seqs)]
    return prompts, blocks


def run_steps(shard, config, prompts, blocks, decode_tokens: list[list[int]]):
    """Prefill all prompts in one step, then one decode step per entry of decode_tokens.

    The decoded tokens are given, not sampled, so both paths see the same inputs at every step.
    """
    caches = allocate_kv_cache(
        config.num_hidden_layers,
        4 * len(prompts),
        BLOCK_SIZE,
        config.num_key_value_heads,
        config.head_dim,
        torch.bfloat16,
        DEVICE,
    )
    steps = [[SequenceChunk(p, 0, b) for p, b in zip(prompts, blocks)]]
    for i, tokens in enumerate(decode_tokens):
        steps.append([SequenceChunk([t], len(p) + i, b) for t, p, b in zip(tokens, prompts, blocks)])
    outputs = []
    for chunks in steps:
        inputs = build_step_inputs(chunks, BLOCK_SIZE, device=DEVICE)
        hidden, residual = shard(inputs.input_ids, inputs.positions, None, None, caches, inputs.meta)
        logits = shard.compute_logits(hidden[inputs.logits_indices], residual[inputs.logits_indices])
        outputs.append((hidden, residual, logits))
    return outputs


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_bf16_shard_forward_fused_matches_torch_path():
    """256 sequences: a mixed-length prefill step and 3 decode steps, through 3 Llama-1B layers."""
    config = llama_1b_like()
    shard = random_bf16_shard(config)
    prompts, blocks = prompts_and_blocks(256, seed=1)
    decode_tokens = torch.randint(0, 8192, (3, 256), generator=torch.Generator().manual_seed(2)).tolist()
    set_fused_kernels(shard, False)
    want = run_steps(shard, config, prompts, blocks, decode_tokens)
    set_fused_kernels(shard, None)  # the default: fused because the tensors are on CUDA
    got = run_steps(shard, config, prompts, blocks, decode_tokens)
    errors = {
        (step, name): relative_error(g, w)
        for step, (got_step, want_step) in enumerate(zip(got, want))
        for name, g, w in zip(("hidden", "residual", "logits"), got_step, want_step)
    }
    print("relative errors:", {f"{step} {name}": f"{e:.2e}" for (step, name), e in errors.items()})
    for step, (got_step, want_step) in enumerate(zip(got, want)):
        for name, g, w in zip(("hidden", "residual", "logits"), got_step, want_step):
            assert g.shape == w.shape and g.dtype == w.dtype
            assert torch.isfinite(g).all(), (step, name)
            # The torch rotary rounds each bf16 product and sum, the fused kernel once in float32:
            # ~1-ulp differences in q and k, grown through 3 random layers (H200: 1.0-1.7e-2).
            assert errors[step, name] < 3e-2, f"step {step} {name}: relative error {errors[step, name]:.2e}"
        # Random weights give flat logits (top-2 gaps of a few bf16 steps): allow rare greedy flips.
        agree = (got_step[2].argmax(-1) == want_step[2].argmax(-1)).float().mean().item()
        assert agree > 0.9, f"step {step}: greedy tokens agree on {agree:.1%} of sequences"


def test_bf16_shard_decode_step_is_cuda_graph_capturable():
    """A decode step of the fused shard captured in a CUDA graph equals the eager step, twice."""
    config = llama_1b_like(num_layers=2)
    shard = random_bf16_shard(config)
    prompts, blocks = prompts_and_blocks(32, seed=2)
    caches = allocate_kv_cache(
        config.num_hidden_layers,
        4 * len(prompts),
        BLOCK_SIZE,
        config.num_key_value_heads,
        config.head_dim,
        torch.bfloat16,
        DEVICE,
    )
    prefill = build_step_inputs([SequenceChunk(p, 0, b) for p, b in zip(prompts, blocks)], BLOCK_SIZE, device=DEVICE)
    shard(prefill.input_ids, prefill.positions, None, None, caches, prefill.meta)
    decode = build_step_inputs(
        [SequenceChunk([7], len(p), b) for p, b in zip(prompts, blocks)], BLOCK_SIZE, device=DEVICE
    )

    def step():
        hidden, residual = shard(decode.input_ids, decode.positions, None, None, caches, decode.meta)
        return hidden, residual, shard.compute_logits(hidden, residual)

    graph, captured = capture_graph(step)

    gen = torch.Generator(device=DEVICE).manual_seed(3)
    for _ in range(2):
        # New tokens at the same positions: the graph and the eager step write the same KV slots.
        decode.input_ids.copy_(torch.randint(0, 8192, decode.input_ids.shape, device=DEVICE, generator=gen))
        graph.replay()
        replayed = [t.clone() for t in captured]
        eager = step()
        for name, g, w in zip(("hidden", "residual", "logits"), replayed, eager):
            error = relative_error(g, w)
            assert error < 1e-3, f"{name}: graph replay differs from eager by {error:.2e}"


# --- speed: the point of fusing ------------------------------------------------------------------


def _graph_time_us(fn, iterations: int = 50) -> float:
    """GPU time per call of fn, captured `iterations` times in one CUDA graph (no launch overhead)."""
    graph, _ = capture_graph(fn, calls=iterations)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (5 * iterations)


def test_fused_kernels_beat_the_torch_path_at_decode_batch_256():
    dtype, tokens, hidden, intermediate = torch.bfloat16, 256, 2048, 8192
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x, residual = randn(tokens, hidden, dtype=dtype, gen=gen), randn(tokens, hidden, dtype=dtype, gen=gen)
    weight = torch.ones(hidden, device=DEVICE, dtype=dtype)
    config = llama_1b_like(num_layers=1)
    rotary = RotaryEmbedding(config, DEVICE, dtype)
    qkv = randn(tokens, 48 * 64, dtype=dtype, gen=gen)
    q, k = qkv[:, :2048].view(tokens, 32, 64), qkv[:, 2048:2560].view(tokens, 8, 64)
    positions = torch.randint(0, 4096, (tokens,), device=DEVICE, generator=gen)
    gate_up = randn(tokens, 2 * intermediate, dtype=dtype, gen=gen)
    pairs = {
        "add+rmsnorm": (
            lambda: fused_add_rms_norm(x, residual, weight, 1e-5),
            lambda: fused_add_rms_norm_reference(x, residual, weight, 1e-5),
        ),
        "rotary": (
            lambda: rotary_embedding_(positions, q, k, rotary.cos, rotary.sin),
            lambda: rotary_embedding_reference(positions, q, k, rotary.cos, rotary.sin),
        ),
        "silu_and_mul": (lambda: silu_and_mul(gate_up), lambda: silu_and_mul_reference(gate_up)),
    }
    for name, (fused, torch_path) in pairs.items():
        fused_us, torch_us = _graph_time_us(fused), _graph_time_us(torch_path)
        print(f"{name:<14} fused {fused_us:7.2f} us   torch path {torch_us:7.2f} us")
        assert fused_us < torch_us, f"{name}: fused {fused_us:.2f} us is not faster than {torch_us:.2f} us"
