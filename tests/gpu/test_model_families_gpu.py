"""Qwen3, Gemma 3, Qwen3-MoE and Mixtral on a GPU: the new layers' kernels in bf16 against their
torch references (Gemma's norms and GELU-tanh, q/k norms fused into rotary), whole shards of the
presets' layer shapes fused against the torch path, a decode step with experts captured in a CUDA
graph, the worker's runner serving them from its decode and piecewise graphs (warm-up included),
and greedy decoding through the Triton kernels equal to transformers' generate() in float32
(Gemma at head_dim 256 there, the attention tiles chosen for it).

    python -m pytest tests/gpu/test_model_families_gpu.py -q -s

The CPU tests (tests/test_model_families.py, tests/test_fused_kernels.py) check the same against
HF and under the Triton interpreter, which cannot compute bf16.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.graph_capture import capture_graph
from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from tiny_models import load_hf_model, write_tiny_model  # noqa: E402

from strata.kernels.activation import gelu_tanh_and_mul  # noqa: E402
from strata.kernels.reference import (  # noqa: E402
    fused_add_rms_norm_reference,
    gelu_tanh_and_mul_reference,
    rms_norm_reference,
    rotary_embedding_reference,
    write_kv_cache_reference,
)
from strata.kernels.rmsnorm import fused_add_rms_norm, rms_norm  # noqa: E402
from strata.kernels.rotary import rotary_embedding_  # noqa: E402
from strata.services.worker.model.attention import allocate_kv_cache  # noqa: E402
from strata.services.worker.model.shard import CausalLMShard  # noqa: E402
from strata.services.worker.model.triton_backend import TritonAttentionBackend  # noqa: E402
from strata.services.worker.model.weights import dummy_config  # noqa: E402
from strata.services.worker.runner import ModelRunner  # noqa: E402
from tests.gpu import test_runner_gpu  # noqa: E402
from tests.gpu.test_runner_gpu import admit_plan, decode_plan  # noqa: E402
from tests.paged_inputs import SequenceChunk, build_step_inputs, set_fused_kernels  # noqa: E402
from tests.shard_pipeline import Pipeline, greedy_decode, hf_greedy, random_prompts, shuffled_block_tables  # noqa: E402

DEVICE = "cuda"
BLOCK_SIZE = 16


def identical_share(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1.6e-2)
    return (got == want).float().mean().item()


# --- the new kernels against their references, bf16 ----------------------------------------------


@pytest.mark.parametrize("hidden", [2048, 3840])
def test_gemma_norms_and_gelu_tanh_bf16(hidden):
    """Gemma's (1 + weight) norms and GELU-tanh round where HF rounds: on the GPU, whose tanh is
    torch's own (libdevice tanhf), all but a rare last bit are identical."""
    gen = torch.Generator(device=DEVICE).manual_seed(hidden)
    x = (torch.randn(512, hidden, device=DEVICE, generator=gen) * 3).bfloat16()
    residual = (torch.randn(512, hidden, device=DEVICE, generator=gen) * 10).bfloat16()
    weight = (torch.randn(hidden, device=DEVICE, generator=gen) * 0.3).bfloat16()
    assert identical_share(rms_norm(x, weight, 1e-6, True), rms_norm_reference(x, weight, 1e-6, True)) > 0.99
    normed, summed = fused_add_rms_norm(x, residual, weight, 1e-6, unit_offset=True)
    want_normed, want_summed = fused_add_rms_norm_reference(x, residual, weight, 1e-6, unit_offset=True)
    assert torch.equal(summed, want_summed) and identical_share(normed, want_normed) > 0.99
    gate_up = (torch.randn(512, 2 * 4 * hidden, device=DEVICE, generator=gen) * 3).bfloat16()
    assert identical_share(gelu_tanh_and_mul(gate_up), gelu_tanh_and_mul_reference(gate_up)) > 0.99


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,unit_offset", [(32, 8, 128, False), (16, 8, 256, True)], ids=["qwen3-8b", "gemma-3-12b"]
)
def test_rotary_with_qk_norm_bf16(heads, kv_heads, head_dim, unit_offset):
    """Qwen3's and Gemma's q/k norms in the rotary launch, with the KV write, against norm + rotary
    + write in torch."""
    gen = torch.Generator(device=DEVICE).manual_seed(head_dim)
    tokens, max_pos = 300, 8192
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE, generator=gen) * 2).bfloat16()
    q, k, v = (
        part.view(tokens, -1, head_dim) for part in qkv.split([heads * head_dim] + [kv_heads * head_dim] * 2, dim=-1)
    )
    angles = torch.rand(max_pos, head_dim // 2, device=DEVICE, generator=gen) * 6.3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE, generator=gen)
    offset = 0.0 if unit_offset else 1.0
    q_weight = (torch.randn(head_dim, device=DEVICE, generator=gen) * 0.3 + offset).bfloat16()
    k_weight = (torch.randn(head_dim, device=DEVICE, generator=gen) * 0.3 + offset).bfloat16()
    want_q, want_k = rotary_embedding_reference(
        positions,
        rms_norm_reference(q, q_weight, 1e-6, unit_offset),
        rms_norm_reference(k, k_weight, 1e-6, unit_offset),
        cos,
        sin,
    )
    slots = torch.randperm(64 * BLOCK_SIZE, device=DEVICE, generator=gen)[:tokens]
    cache = torch.zeros(2, 64, kv_heads, BLOCK_SIZE, head_dim, device=DEVICE, dtype=torch.bfloat16)
    want_cache = cache.clone()
    write_kv_cache_reference(want_k, v, want_cache, slots)
    norms = (q_weight, k_weight, 1e-6, unit_offset)
    rotary_embedding_(positions, q, k, cos, sin, value=v, kv_cache=cache, slot_mapping=slots, qk_norm=norms)
    # Closeness only (identical_share asserts it), as for Llama's rotary in test_fused_kernels_gpu:
    # the kernel keeps the normed q and k in float32 through the rotation, where torch rounds the
    # norm's output and each product to bf16 (bench/RESULTS.md has the identical share seen).
    identical_share(q, want_q)
    identical_share(cache, want_cache)


# --- shards of the presets' layer shapes: fused kernels vs the torch path, bf16 -------------------


def preset_config(name: str, num_layers: int):
    """The preset's layers (Gemma: one sliding and one global layer), a vocabulary of 8192;
    "mixtral": Mixtral 8x7B's layer shapes (Llama-3-8B's attention, 8 experts of 14336, top 2)."""
    if name == "mixtral":
        return dataclasses.replace(
            dummy_config("llama-3-8b"),
            architecture="MixtralForCausalLM",
            num_hidden_layers=num_layers,
            vocab_size=8192,
            rope_theta=1e6,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=14336,
        )
    config = dummy_config(name)
    layer_types = config.layer_types and (["sliding_attention", "full_attention"] * num_layers)[:num_layers]
    return dataclasses.replace(config, num_hidden_layers=num_layers, vocab_size=8192, layer_types=layer_types)


def preset_shard(name: str, num_layers: int) -> CausalLMShard:
    """preset_config's shard with random bf16 weights of the dummy initialiser's scale (norms
    around their unit: 0.5-1 for Llama's, 0-0.5 for Gemma's 1 + weight)."""
    config = preset_config(name, num_layers)
    shard = CausalLMShard(
        config, 0, num_layers, device=DEVICE, dtype=torch.bfloat16, attn_backend=TritonAttentionBackend()
    )
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    norm_base = 0.0 if config.norm_unit_offset else 0.5
    with torch.no_grad():
        for param_name, param in shard.named_parameters():
            if param_name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, device=DEVICE, generator=gen) * 0.5 + norm_base)
            else:
                param.copy_(torch.randn(param.shape, device=DEVICE, generator=gen) * 0.02)
    return shard.eval()


def run_steps(shard, prompts, blocks, decode_tokens):
    config = shard.config
    caches = allocate_kv_cache(
        config.num_hidden_layers,
        8 * len(prompts),
        BLOCK_SIZE,
        config.num_key_value_heads,
        config.head_dim,
        torch.bfloat16,
        DEVICE,
    )
    steps = [[SequenceChunk(p, 0, b) for p, b in zip(prompts, blocks)]]
    for i, tokens in enumerate(decode_tokens):
        steps.append([SequenceChunk([t], len(p) + i, b) for t, p, b in zip(tokens, prompts, blocks)])
    logits = []
    for chunks in steps:
        inputs = build_step_inputs(chunks, BLOCK_SIZE, device=DEVICE)
        hidden, residual = shard(inputs.input_ids, inputs.positions, None, None, caches, inputs.meta)
        logits.append(shard.compute_logits(hidden[inputs.logits_indices], residual[inputs.logits_indices]))
    return logits


def routed_experts(shard, run):
    """run()'s result, and per call of each layer of experts, each token's chosen experts (sorted)."""
    from strata.services.worker.model.moe import SparseMoE

    picks, hooks = [], []
    for layer in shard.layers:
        if isinstance(layer.mlp, SparseMoE):
            top_k = layer.mlp.top_k
            hooks.append(
                layer.mlp.gate.register_forward_hook(
                    lambda module, args, out, k=top_k: picks.append(out.float().topk(k, dim=-1).indices.sort(-1).values)
                )
            )
    try:
        return run(), picks
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("name", ["qwen3-8b", "gemma-3-12b", "qwen3-30b-a3b", "mixtral"])
def test_bf16_preset_layers_fused_match_torch_path(name):
    """64 sequences of up to 100 tokens (past nothing's window: Gemma's is 1,024 here, windows are
    the CPU tests' business), then 3 decode steps. Mixtral: the real 8x7B's layer shapes.

    With experts, a token whose router scores nearly tie may pick another expert on one path (the
    bf16 rounding of the layers before it differs): its logits then differ by a whole expert's
    output, not by rounding. Each step's rows are compared where the row's own token was routed
    alike in every layer, and the rows routed otherwise must stay a minority."""
    shard = preset_shard(name, 2)
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 101, (64,), generator=gen).tolist()
    prompts = [torch.randint(0, 8192, (n,), generator=gen).tolist() for n in lengths]
    blocks = [list(range(8 * i, 8 * i + 8)) for i in range(64)]
    decode_tokens = torch.randint(0, 8192, (3, 64), generator=gen).tolist()
    set_fused_kernels(shard, False)
    want, want_routes = routed_experts(shard, lambda: run_steps(shard, prompts, blocks, decode_tokens))
    set_fused_kernels(shard, None)
    got, got_routes = routed_experts(shard, lambda: run_steps(shard, prompts, blocks, decode_tokens))
    layers = len(want_routes) // len(want)  # layers of experts, each called once a step
    last_tokens = torch.tensor(lengths).cumsum(0) - 1  # each sequence's row in the prefill step
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.isfinite(g).all()
        alike = torch.ones(len(w), dtype=torch.bool, device=w.device)
        for layer in range(layers):
            a, b = got_routes[step * layers + layer], want_routes[step * layers + layer]
            same = (a == b).all(-1)
            alike &= same[last_tokens.to(same.device)] if step == 0 else same
        g, w = g[alike], w[alike]
        error = ((g.float() - w.float()).norm() / w.float().norm()).item()
        agree = (g.argmax(-1) == w.argmax(-1)).float().mean().item()
        print(
            f"{name} step {step}: {int(alike.sum())} of {len(alike)} rows routed alike, "
            f"their relative error {error:.2e}, greedy agreement {agree:.1%}"
        )
        assert alike.float().mean() >= 0.75, f"step {step}: only {int(alike.sum())} rows routed alike"
        # bf16 rounding differences between the kernels and the torch ops, grown through 2 random
        # layers (and earlier tokens routed otherwise, seen through attention).
        assert error < 5e-2, f"step {step}: relative error {error:.2e}"
        assert agree > 0.9, f"step {step}: greedy tokens agree on {agree:.1%}"


def test_moe_decode_step_replays_from_a_cuda_graph():
    """A decode step of two qwen3-30b-a3b layers (routing, alignment and both expert GEMMs)
    captured once, replayed with new tokens: equal to the eager step."""
    shard = preset_shard("qwen3-30b-a3b", 2)
    config = shard.config
    gen = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(0, 8192, (int(n),), generator=gen).tolist() for n in torch.randint(1, 60, (48,), generator=gen)
    ]
    blocks = [list(range(8 * i, 8 * i + 8)) for i in range(48)]
    caches = allocate_kv_cache(
        2, 8 * 48, BLOCK_SIZE, config.num_key_value_heads, config.head_dim, torch.bfloat16, DEVICE
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
    cuda_gen = torch.Generator(device=DEVICE).manual_seed(3)
    for _ in range(2):
        decode.input_ids.copy_(torch.randint(0, 8192, decode.input_ids.shape, device=DEVICE, generator=cuda_gen))
        graph.replay()
        replayed = [t.clone() for t in captured]
        for name, g, w in zip(("hidden", "residual", "logits"), replayed, step()):
            error = ((g.float() - w.float()).norm() / w.float().norm()).item()
            assert error < 1e-3, f"{name}: graph replay differs from the eager step by {error:.2e}"


# --- the worker's runner on them: decode graphs, piecewise graphs, warm-up ------------------------


@pytest.mark.parametrize("name", ["gemma-3-12b", "qwen3-30b-a3b"])
def test_runner_graphs_give_the_eager_tokens(name):
    """ModelRunner with decode and piecewise graphs (and the warm-up that compiles the fused-MoE
    variants) against one that runs every step eagerly, both fed the eager runner's tokens: the
    same greedy tokens after a prefill of mixed lengths and over 20 decode steps (but for rare
    flips where the graphs' padded batches pick other tiles than the eager steps)."""
    shard = preset_shard(name, 2)
    settings = [(0.0, 0, 11 + i) for i in range(6)]
    prompts = [
        torch.randint(3, 8192, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for n in (5, 17, 40, 33, 9, 60)
    ]

    def runner(graphs: bool) -> ModelRunner:
        r = ModelRunner(
            shard,
            shard.config,
            stage_index=0,
            num_stages=1,
            block_size=BLOCK_SIZE,
            max_model_len=BLOCK_SIZE * test_runner_gpu.BLOCKS_PER_SEQ,
            device=torch.device(DEVICE),
            dtype=torch.bfloat16,
            max_num_seqs=test_runner_gpu.MAX_SEQS,
            cuda_graph_max_batch=test_runner_gpu.MAX_SEQS if graphs else 0,
            piecewise_max_tokens=256 if graphs else 0,
        )
        r.init_cache(test_runner_gpu.MAX_SEQS * test_runner_gpu.BLOCKS_PER_SEQ)
        return r

    eager, graphed = runner(False), runner(True)
    assert graphed.graphs is not None and graphed.piecewise is not None
    tokens, others = (list(r.execute(admit_plan(settings, prompts)).finish().token_ids) for r in (eager, graphed))
    same, total = sum(a == b for a, b in zip(tokens, others)), len(tokens)
    lengths = [len(p) for p in prompts]
    for step in range(2, 22):
        got, other = (list(r.execute(decode_plan(step, lengths, tokens)).finish().token_ids) for r in (eager, graphed))
        same, total = same + sum(a == b for a, b in zip(got, other)), total + len(got)
        tokens, lengths = got, [x + 1 for x in lengths]
    assert same / total > 0.95, f"graphs and eager steps agree on {same}/{total} tokens"


# --- greedy through the kernels equals HF, float32 ------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {
        "qwen3": write_tiny_model(root / "qwen3", "qwen3", seed=7),
        # head_dim 256: the attention tiles of D > 128 (and Gemma's window of 10 in long prompts).
        "gemma3": write_tiny_model(root / "gemma3", "gemma3", seed=7, head_dim=256),
        "qwen3_moe": write_tiny_model(root / "qwen3_moe", "qwen3_moe", seed=7),
        "mixtral": write_tiny_model(root / "mixtral", "mixtral", seed=7),
    }


@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "qwen3_moe", "mixtral"])
def test_greedy_decoding_matches_hf_on_the_kernels(arch, num_stages, tiny_dirs):
    """Prompts of 300, 150 and 200 tokens in chunks beside decodes, then decodes alone (the decode
    graphs' kernels: split-KV attention, the fused MoE at decode tile sizes)."""
    hf = load_hf_model(tiny_dirs[arch])
    pipeline = Pipeline(
        tiny_dirs[arch],
        num_stages,
        device=DEVICE,
        block_size=BLOCK_SIZE,
        num_blocks=96,
        attn_backend=TritonAttentionBackend(),
    )
    prompts = random_prompts([300, 150, 200], pipeline.config.vocab_size, seed=2)
    tables = shuffled_block_tables([300, 150], seed=num_stages, block_size=BLOCK_SIZE, num_blocks=96)
    logits = pipeline.step([SequenceChunk(p, 0, t) for p, t in zip(prompts[:2], tables)], all_logits=True)
    with torch.no_grad():
        expected = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts[:2]])
    torch.testing.assert_close(logits.cpu(), expected, atol=2e-3, rtol=2e-3)
    pipeline = Pipeline(
        tiny_dirs[arch],
        num_stages,
        device=DEVICE,
        block_size=BLOCK_SIZE,
        num_blocks=96,
        attn_backend=TritonAttentionBackend(),
    )
    ours = greedy_decode(pipeline, prompts, [[300], [64, 86], [128, 72]], 24, pipeline.config.eos_token_id)
    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf_greedy(hf, prompt, 24)
