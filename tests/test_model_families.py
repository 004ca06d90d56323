"""Qwen3, Gemma 3, Qwen3-MoE and Mixtral shards against Hugging Face transformers (float32, CPU):
tiny random models of each, chained in-process over 1 to 4 pipeline stages (tests/test_model_shard.py
does the same for Llama, Mistral and Qwen2), their configs as the Hub writes them, the checkpoint
forms of their experts, and the benchmark presets of their real shapes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from strata.services.worker.model.model_config import ModelConfig
from strata.services.worker.model.shard import CausalLMShard
from strata.services.worker.model.weights import dummy_config, load_shard
from tests.paged_inputs import SequenceChunk
from tests.shard_pipeline import Pipeline, greedy_decode, hf_greedy, random_prompts, shuffled_block_tables
from tests.tiny_models import (
    MOE_ARCHS,
    TINY_GEMMA3_SLIDING_WINDOW,
    TINY_MIXTRAL_SLIDING_WINDOW,
    load_hf_model,
    write_tiny_model,
)

FAMILIES = ["qwen3", "gemma3", "qwen3_moe", "mixtral"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {arch: write_tiny_model(root / arch, arch, seed=7) for arch in FAMILIES}


@pytest.fixture(scope="module")
def hf_models(tiny_dirs):
    return {arch: load_hf_model(path) for arch, path in tiny_dirs.items()}


def prefill_logits(pipeline: Pipeline, prompts: list[list[int]], seed: int) -> torch.Tensor:
    tables = shuffled_block_tables([len(p) for p in prompts], seed=seed)
    return pipeline.step([SequenceChunk(p, 0, t) for p, t in zip(prompts, tables)], all_logits=True)


# ---- model vs HF -----------------------------------------------------------------------


# 4 stages: one layer each, so every layer kind (Gemma's sliding and global, Qwen3-MoE's experts
# and its dense layer 1) is a first, a middle and a last stage's somewhere.
@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
@pytest.mark.parametrize("arch", FAMILIES)
def test_prefill_logits_match_hf(arch, num_stages, tiny_dirs, hf_models):
    hf = hf_models[arch]
    prompts = random_prompts([5, 16, 23], hf.config.vocab_size, seed=1)  # 23: past the sliding windows
    logits = prefill_logits(Pipeline(tiny_dirs[arch], num_stages), prompts, seed=num_stages)
    expected = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "arch,num_stages",
    [
        ("qwen3", 1),
        ("gemma3", 3),
        ("qwen3_moe", 2),
        ("mixtral", 3),
        # Behind the slow marker: each architecture keeps a stage count above, and the prefill
        # test covers every split.
        pytest.param("qwen3", 3, marks=pytest.mark.slow),
        pytest.param("gemma3", 1, marks=pytest.mark.slow),
        pytest.param("qwen3_moe", 3, marks=pytest.mark.slow),
        pytest.param("mixtral", 1, marks=pytest.mark.slow),
    ],
)
def test_greedy_decoding_matches_hf_generate(arch, num_stages, tiny_dirs, hf_models):
    """Chunked prefill beside decodes, block tables out of order, 30 + 14 positions: well past the
    windows of Gemma's sliding layers and Mixtral's."""
    hf = hf_models[arch]
    pipeline = Pipeline(tiny_dirs[arch], num_stages)
    prompts = random_prompts([7, 16, 30], hf.config.vocab_size, seed=2)
    ours = greedy_decode(pipeline, prompts, [[7], [6, 10], [9, 5, 16]], 14, pipeline.config.eos_token_id)
    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf_greedy(hf, prompt, 14)


def test_windows_and_local_rotary_are_exercised(tiny_dirs, hf_models):
    """The tiny Gemma 3 diverges from HF without its sliding windows or with one rotary table
    for all layers, Mixtral without its window: those tests are not vacuous."""
    prompt = random_prompts([30], 512, seed=3)[0]
    for arch, window in (("gemma3", TINY_GEMMA3_SLIDING_WINDOW), ("mixtral", TINY_MIXTRAL_SLIDING_WINDOW)):
        expected = hf_models[arch](torch.tensor([prompt])).logits[0]
        pipeline = Pipeline(tiny_dirs[arch], 1)
        torch.testing.assert_close(prefill_logits(pipeline, [prompt], 0), expected, atol=1e-4, rtol=1e-4)
        sliding = [layer.self_attn for layer in pipeline.shards[0].layers if layer.self_attn.sliding_window]
        assert sliding and all(attn.sliding_window == window for attn in sliding)
        for attn in sliding:
            attn.sliding_window = None
        logits = prefill_logits(pipeline, [prompt], 0)
        torch.testing.assert_close(logits[:window], expected[:window], atol=1e-4, rtol=1e-4)
        assert (logits[window:] - expected[window:]).abs().max() > 1e-2
    pipeline = Pipeline(tiny_dirs["gemma3"], 1)
    assert [layer.self_attn.local_rotary for layer in pipeline.shards[0].layers] == [True, False, True, False]
    pipeline.shards[0].local_rotary = pipeline.shards[0].rotary
    expected = hf_models["gemma3"](torch.tensor([prompt])).logits[0]
    assert (prefill_logits(pipeline, [prompt], 0) - expected).abs().max() > 1e-2


def test_gemma_final_logit_softcapping_matches_hf(tmp_path):
    """Gemma 3's configs leave it null, HF applies it when set: so do we."""
    model_dir = write_tiny_model(tmp_path / "capped", "gemma3", seed=5, final_logit_softcapping=3.0)
    hf = load_hf_model(model_dir)
    prompts = random_prompts([9, 4], hf.config.vocab_size, seed=4)
    logits = prefill_logits(Pipeline(model_dir, 2), prompts, seed=1)
    expected = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert expected.abs().max() < 3.0
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


# ---- checkpoints -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fused_expert_tensors_load_as_the_per_expert_ones(arch, tiny_dirs, tmp_path):
    """transformers 5's fused form (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj,
    Mixtral's router under mlp.) fills the same parameters as the Hub's one tensor per expert."""
    source = tiny_dirs[arch]
    config = ModelConfig.from_dir(source)
    tensors = load_file(source / "model.safetensors")
    hub = "block_sparse_moe" if arch == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for layer in range(config.num_hidden_layers):
        if not config.is_moe_layer(layer):
            continue
        prefix = f"model.layers.{layer}."
        experts = [
            [tensors.pop(f"{prefix}{hub}.experts.{e}.{n}.weight") for n in names] for e in range(config.num_experts)
        ]
        tensors[f"{prefix}mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in experts])
        tensors[f"{prefix}mlp.experts.down_proj"] = torch.stack([d for _, _, d in experts])
        tensors[f"{prefix}mlp.gate.weight"] = tensors.pop(f"{prefix}{hub}.gate.weight")
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((source / "config.json").read_text())
    save_file(tensors, fused / "model.safetensors")
    prompts = random_prompts([11, 6], config.vocab_size, seed=6)
    for stages in (1, 2):
        want = prefill_logits(Pipeline(source, stages), prompts, seed=2)
        assert torch.equal(prefill_logits(Pipeline(fused, stages), prompts, seed=2), want)


def test_sharded_moe_checkpoint_reads_only_each_stage_experts(tmp_path, monkeypatch):
    """Per-expert tensors spread over several files: each stage opens only what its layers need
    and ends up complete; a missing expert is named."""
    from strata.services.worker.model import weights as weights_module

    model_dir = write_tiny_model(tmp_path / "sharded", "qwen3_moe", seed=3, max_shard_size="60KB")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2
    hf = load_hf_model(model_dir)
    prompts = random_prompts([8], hf.config.vocab_size, seed=7)
    read = []
    real = weights_module.iter_checkpoint_tensors

    def recording(path, wanted):
        for name, tensor in real(path, wanted):
            read.append(name)
            yield name, tensor

    monkeypatch.setattr(weights_module, "iter_checkpoint_tensors", recording)
    logits = prefill_logits(Pipeline(model_dir, 2), prompts, seed=3)
    torch.testing.assert_close(logits, hf(torch.tensor(prompts)).logits[0], atol=1e-4, rtol=1e-4)
    assert sorted(read) == sorted(set(read)) == sorted(index)  # every tensor read once, by one stage
    del index["model.layers.2.mlp.experts.5.up_proj.weight"]
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    with pytest.raises(ValueError, match="experts.5.up_proj"):
        load_shard(model_dir, 1, 2, torch.float32, "cpu")


# ---- configs as the Hub writes them ----------------------------------------------------

# The published config.json values of the presets' checkpoints (Qwen/Qwen3-8B,
# Qwen/Qwen3-30B-A3B, google/gemma-3-12b-it's text_config, transformers 4.5x spelling).
HUB_CONFIGS = {
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        attention_bias=False,
        hidden_act="silu",
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=36,
        bos_token_id=151643,
        eos_token_id=151645,
        torch_dtype="bfloat16",
    ),
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        vocab_size=151936,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rope_scaling=None,
        rms_norm_eps=1e-6,
        attention_bias=False,
        hidden_act="silu",
        tie_word_embeddings=False,
        use_sliding_window=False,
        sliding_window=None,
        bos_token_id=151643,
        eos_token_id=151645,
        torch_dtype="bfloat16",
    ),
    "gemma-3-12b": dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        vocab_size=262208,
        hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=131072,
        query_pre_attn_scalar=256,
        rms_norm_eps=1e-6,
        rope_local_base_freq=10000,
        rope_scaling={"factor": 8.0, "rope_type": "linear"},
        rope_theta=1000000,
        sliding_window=1024,
        sliding_window_pattern=6,
        final_logit_softcapping=None,
        attn_logit_softcapping=None,
        bos_token_id=2,
        eos_token_id=[1, 106],
        torch_dtype="bfloat16",
    ),
}


@pytest.mark.parametrize("name", list(HUB_CONFIGS))
def test_presets_are_the_hub_configs_and_transformers_shapes(name, tmp_path):
    """Each preset is what from_dict reads from its checkpoint's config (the generation config's
    eos ids added), and has exactly as many parameters as transformers' model of that config."""
    import transformers

    hub = HUB_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps(hub))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    read = ModelConfig.from_dir(tmp_path)
    if name.startswith("qwen3"):
        assert read == dummy_config(name)
    else:  # Gemma's generation config lists its own eos ids
        assert read.to_dict() | {"eos_token_id": [1, 106]} == dummy_config(name).to_dict()
    config_class = {"qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig", "gemma3_text": "Gemma3TextConfig"}
    hf_config = getattr(transformers, config_class[hub["model_type"]])(
        **{k: v for k, v in hub.items() if k not in ("architectures", "model_type")}
    )
    with torch.device("meta"):
        hf = getattr(transformers, hub["architectures"][0])(hf_config)
    ours = CausalLMShard(read, 0, read.num_hidden_layers, device="meta")
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())


def test_gemma_config_forms():
    """transformers 5's per-layer-type rope_parameters and layer_types read as the 4.5x form does;
    an explicit tie default; Gemma 3 1B's pattern."""
    old = dict(HUB_CONFIGS["gemma-3-12b"], num_hidden_layers=12)
    new = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    new.pop("sliding_window_pattern")
    new["layer_types"] = ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 5 + ["full_attention"]
    new["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    assert ModelConfig.from_dict(new) == ModelConfig.from_dict(old)
    config = ModelConfig.from_dict(old)
    assert config.tie_word_embeddings and config.attention_scale == 256**-0.5
    assert [config.sliding_window_for_layer(i) for i in (0, 4, 5, 11)] == [1024, 1024, None, None]
    assert [config.local_rotary_for_layer(i) for i in (0, 5)] == [True, False]
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0} and config.rope_local_theta == 10000.0
    qwen3 = ModelConfig.from_dict(HUB_CONFIGS["qwen3-8b"])
    assert not config.decode_chain_layout and qwen3.qk_norm and qwen3.decode_chain_layout


def test_config_refuses_what_it_cannot_serve():
    gemma = HUB_CONFIGS["gemma-3-12b"]
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration"):
        ModelConfig.from_dict(dict(gemma, architectures=["Gemma3ForConditionalGeneration"]))
    with pytest.raises(ValueError, match="bidirectional"):
        ModelConfig.from_dict(dict(gemma, use_bidirectional_attention=True))
    with pytest.raises(ValueError, match="sliding layers"):
        ModelConfig.from_dict(
            dict(gemma, rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}})
        )
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_dict(dict(gemma, hidden_activation="gelu"))
    with pytest.raises(ValueError, match="SiLU"):
        ModelConfig.from_dict(dict(HUB_CONFIGS["qwen3-30b-a3b"], hidden_act="gelu_pytorch_tanh"))
    with pytest.raises(ValueError, match="rope"):
        ModelConfig.from_dict(dict(HUB_CONFIGS["qwen3-8b"], rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_moe_layer_rules_and_windows():
    """Qwen3-MoE's dense layers (mlp_only_layers, decoder_sparse_step) and sliding windows
    (all layers, when asked), Mixtral's window."""
    moe = dict(HUB_CONFIGS["qwen3-30b-a3b"], num_hidden_layers=6, mlp_only_layers=[0], decoder_sparse_step=2)
    config = ModelConfig.from_dict(moe)
    assert [config.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, True]
    assert config.sliding_window is None
    slid = ModelConfig.from_dict(dict(moe, use_sliding_window=True, sliding_window=64))
    assert [slid.sliding_window_for_layer(i) for i in range(6)] == [64] * 6
    mixtral = dict(
        architectures=["MixtralForCausalLM"],
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=100,
        sliding_window=4096,
    )
    config = ModelConfig.from_dict(mixtral)
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (8, 2, 96)
    assert config.norm_topk_prob and not config.router_weights_in_model_dtype
    assert config.sliding_window_for_layer(1) == 4096
    assert ModelConfig.from_dict(dict(mixtral, sliding_window=None)).sliding_window is None


def test_warm_up_calls_a_layer_of_experts_at_every_variant_count(monkeypatch):
    """graphs/warm_up.py runs one layer of experts at each token count whose fused-MoE call
    launches a kernel variant no other does (kernels/fused_moe.py's warm_up_token_counts); a dense
    shard runs none."""
    from strata.kernels.fused_moe import warm_up_token_counts
    from strata.services.worker.graphs.warm_up import warm_up_experts
    from strata.services.worker.model.moe import SparseMoE

    config = ModelConfig.from_dict(
        dict(HUB_CONFIGS["qwen3-30b-a3b"], num_hidden_layers=2, hidden_size=64, num_experts=16, num_experts_per_tok=4)
    )
    calls = []
    monkeypatch.setattr(SparseMoE, "forward", lambda self, x: calls.append((self, x.shape)))
    shard = CausalLMShard(config, 0, 2, device="meta")
    warm_up_experts(shard, torch.bfloat16, torch.device("meta"))
    assert [shape for _, shape in calls] == [(t, 64) for t in warm_up_token_counts(16, 4)]
    assert all(moe is shard.layers[0].mlp for moe, _ in calls)
    calls.clear()
    warm_up_experts(
        CausalLMShard(ModelConfig.from_dict(HUB_CONFIGS["qwen3-8b"] | {"num_hidden_layers": 1}), 0, 1, device="meta"),
        torch.bfloat16,
        torch.device("meta"),
    )
    assert not calls


def test_every_preset_is_listed_where_users_look():
    """`--model`'s help (strata serve, strata bench) and the README name every dummy preset."""
    from strata.bench.cluster_flags import add_common_flags
    from strata.flags import FLAGS
    from strata.services.worker.model.weights import DUMMY_PRESETS

    parser = argparse.ArgumentParser()
    add_common_flags(parser)
    bench_help = next(a.help for a in parser._actions if a.dest == "model")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for name in DUMMY_PRESETS:
        assert name in FLAGS["model"].help and name in bench_help and name in readme, name
