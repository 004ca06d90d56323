"""CausalLMShard over a paged KV cache against Hugging Face transformers (float32).

Each architecture is loaded as 1, 2 and 3 pipeline stages chained in-process.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from tiny_models import TINY_MISTRAL_SLIDING_WINDOW, write_tiny_model

from strata.services.worker.model import weights as weights_module
from strata.services.worker.model.attention import (
    TorchAttentionBackend,
    allocate_kv_cache,
    kv_cache_bytes_per_block,
)
from strata.services.worker.model.model_config import ModelConfig
from strata.services.worker.model.shard import CausalLMShard
from strata.services.worker.model.weights import (
    dummy_config,
    iter_checkpoint_tensors,
    load_shard,
    model_fingerprint,
)
from tests.paged_inputs import SequenceChunk, build_step_inputs
from tests.shard_pipeline import (
    Pipeline,
    greedy_decode,
    hf_greedy,
    random_prompts,
    shuffled_block_tables,
)

ARCHS = ["llama", "mistral", "qwen2"]
STAGE_COUNTS = [1, 2, 3]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_model(root / arch, arch, seed=7) for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_models(tiny_dirs):
    from transformers import AutoModelForCausalLM

    return {
        arch: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval() for arch, path in tiny_dirs.items()
    }


# ---- model vs HF -----------------------------------------------------------------------


@pytest.mark.parametrize("num_stages", STAGE_COUNTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_hf(arch, num_stages, tiny_dirs, hf_models):
    hf = hf_models[arch]
    pipeline = Pipeline(tiny_dirs[arch], num_stages)
    lengths = [5, 16, 23]  # 16: exactly four full blocks
    prompts = random_prompts(lengths, hf.config.vocab_size, seed=1)
    tables = shuffled_block_tables(lengths, seed=num_stages)
    chunks = [SequenceChunk(p, 0, t) for p, t in zip(prompts, tables)]

    logits = pipeline.step(chunks, all_logits=True)

    expected = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert logits.dtype == torch.float32
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_stages", STAGE_COUNTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decoding_matches_hf_generate(arch, num_stages, tiny_dirs, hf_models):
    hf = hf_models[arch]
    pipeline = Pipeline(tiny_dirs[arch], num_stages)
    prompts = random_prompts([7, 16, 22], hf.config.vocab_size, seed=2)
    # Prefill in 1, 2 and 3 chunks of uneven sizes, crossing block boundaries.
    chunk_plans = [[7], [6, 10], [9, 5, 8]]
    max_new_tokens = 14  # 22 + 14 positions: well past Mistral's sliding window

    ours = greedy_decode(pipeline, prompts, chunk_plans, max_new_tokens, pipeline.config.eos_token_id)

    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf_greedy(hf, prompt, max_new_tokens)


def test_mistral_sliding_window_is_exercised(tiny_dirs, hf_models):
    """Without its window the tiny Mistral diverges from HF: the window test is not vacuous."""
    hf = hf_models["mistral"]
    assert hf.config.sliding_window == TINY_MISTRAL_SLIDING_WINDOW
    pipeline = Pipeline(tiny_dirs["mistral"], 1)
    for layer in pipeline.shards[0].layers:
        assert layer.self_attn.sliding_window == TINY_MISTRAL_SLIDING_WINDOW
        layer.self_attn.sliding_window = None
    prompt = random_prompts([30], hf.config.vocab_size, seed=3)[0]
    logits = pipeline.step([SequenceChunk(prompt, 0, shuffled_block_tables([30], 0)[0])], all_logits=True)
    expected = hf(torch.tensor([prompt])).logits[0]
    window = TINY_MISTRAL_SLIDING_WINDOW
    torch.testing.assert_close(logits[:window], expected[:window], atol=1e-4, rtol=1e-4)
    assert (logits[window:] - expected[window:]).abs().max() > 1e-2


# ---- reference attention vs dense attention -------------------------------------------


def dense_attention(q, k, v, q_positions, scale, sliding_window):
    """Per-query-token oracle: q [Tq, Hq, D] over k/v [S, Hkv, D] of one sequence."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = torch.empty_like(q)
    for t, pos in enumerate(q_positions):
        lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
        keys, values = k[lo : pos + 1], v[lo : pos + 1]  # [n, H, D]
        scores = torch.einsum("hd,nhd->hn", q[t].double(), keys.double()) * scale
        out[t] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values.double()).float()
    return out


@pytest.mark.parametrize("sliding_window", [None, 3, 8])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_reference_attention_matches_dense(num_q_heads, num_kv_heads, sliding_window):
    torch.manual_seed(0)
    head_dim, block_size, num_blocks = 16, 4, 40
    # (cached, new): a fresh prefill, decodes at and after a block boundary, chunks with context.
    shapes = [(0, 5), (3, 1), (4, 1), (7, 9), (16, 1), (0, 1), (11, 13)]
    backend = TorchAttentionBackend()
    kv_cache = torch.zeros(2, num_blocks, num_kv_heads, block_size, head_dim)
    ids = torch.randperm(num_blocks).tolist()
    keys, values, tables = [], [], []
    for cached, new in shapes:
        n = cached + new
        count = -(-n // block_size)
        tables.append(ids[:count])
        ids = ids[count:]
        keys.append(torch.randn(n, num_kv_heads, head_dim))
        values.append(torch.randn(n, num_kv_heads, head_dim))

    # Write the cached context in one step, then the new tokens through the step's slot mapping.
    for step in ("cached", "new"):
        chunks, ks, vs = [], [], []
        for (cached, new), table, k, v in zip(shapes, tables, keys, values):
            lo, hi = (0, cached) if step == "cached" else (cached, cached + new)
            if hi > lo:
                chunks.append(SequenceChunk([0] * (hi - lo), lo, table))
                ks.append(k[lo:hi])
                vs.append(v[lo:hi])
        inputs = build_step_inputs(chunks, block_size)
        backend.write_kv(torch.cat(ks), torch.cat(vs), kv_cache, inputs.meta.slot_mapping)

    query = torch.randn(sum(new for _, new in shapes), num_q_heads, head_dim)
    meta = inputs.meta  # the "new" step covers every sequence
    scale = head_dim**-0.5
    out = backend.forward(query, kv_cache, meta, scale, sliding_window)

    starts = meta.query_start_loc.tolist()
    for b, (cached, new) in enumerate(shapes):
        q = query[starts[b] : starts[b + 1]]
        expected = dense_attention(q, keys[b], values[b], range(cached, cached + new), scale, sliding_window)
        torch.testing.assert_close(out[starts[b] : starts[b + 1]], expected, atol=1e-5, rtol=1e-5)


def test_write_kv_skips_negative_slots():
    backend = TorchAttentionBackend()
    kv_cache = torch.zeros(2, 3, 2, 4, 8)  # 3 blocks of 4 slots, 2 KV heads
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    backend.write_kv(key, value, kv_cache, torch.tensor([5, -1, 0]))
    flat = kv_cache.transpose(2, 3).reshape(2, 12, 2, 8)  # [2, slot, head, dim]
    assert torch.equal(flat[0, 5], key[0]) and torch.equal(flat[1, 5], value[0])
    assert torch.equal(flat[0, 0], key[2]) and torch.equal(flat[1, 0], value[2])
    written = torch.zeros(12, dtype=torch.bool)
    written[[0, 5]] = True
    assert (flat[:, ~written] == 0).all()


def test_kv_cache_allocation_and_size():
    caches = allocate_kv_cache(3, 10, 16, 8, 64, torch.bfloat16, "cpu")
    assert len(caches) == 3
    assert caches[0].shape == (2, 10, 8, 16, 64) and caches[0].dtype == torch.bfloat16
    assert caches[0].data_ptr() != caches[1].data_ptr()
    per_block = kv_cache_bytes_per_block(3, 16, 8, 64, torch.bfloat16)
    assert per_block * 10 == sum(c.numel() * c.element_size() for c in caches)


def test_build_step_inputs_slots_and_positions():
    chunks = [SequenceChunk([1, 2, 3], 2, [7, 3]), SequenceChunk([9], 4, [5, 0])]
    inputs = build_step_inputs(chunks, block_size=4)
    assert inputs.positions.tolist() == [2, 3, 4, 4]
    # Positions 2, 3 in block 7; position 4 in block 3; the decode at 4 in block 0.
    assert inputs.meta.slot_mapping.tolist() == [30, 31, 12, 0]
    assert inputs.meta.query_start_loc.tolist() == [0, 3, 4]
    assert inputs.meta.seq_lens.tolist() == [5, 5]
    assert inputs.logits_indices.tolist() == [2, 3]
    assert (inputs.meta.max_query_len, inputs.meta.max_seq_len) == (3, 5)
    assert inputs.meta.query_start_loc.dtype == torch.int32
    assert inputs.meta.slot_mapping.dtype == torch.int64


# ---- weight loading --------------------------------------------------------------------


def _layer_indices(names) -> set[int]:
    return {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}


@pytest.mark.parametrize("arch", ARCHS)
def test_load_shard_reads_only_its_layer_range(arch, tiny_dirs):
    tied = arch == "qwen2"
    expected_ranges = [(0, 2), (2, 3), (3, 4)]  # 4 layers over 3 stages
    for stage, (start, end) in enumerate(expected_ranges):
        shard, config = load_shard(tiny_dirs[arch], stage, 3, torch.float32, "cpu")
        assert (shard.start_layer, shard.end_layer) == (start, end)
        assert len(shard.layers) == end - start
        assert _layer_indices(shard.loaded_weight_names) == set(range(start, end))
        loads_embedding = stage == 0 or (stage == 2 and tied)
        assert ("model.embed_tokens.weight" in shard.loaded_weight_names) == loads_embedding
        assert ("model.norm.weight" in shard.loaded_weight_names) == (stage == 2)
        assert ("lm_head.weight" in shard.loaded_weight_names) == (stage == 2 and not tied)
        params = dict(shard.named_parameters())
        assert ("embed_tokens.weight" in params) == (stage == 0)
        assert ("lm_head.weight" in params) == (stage == 2)
        assert ("norm.weight" in params) == (stage == 2)
    if tied:  # the last stage's head is the embedding matrix, without owning an embedding
        name = "model.embed_tokens.weight"
        read = dict(iter_checkpoint_tensors(tiny_dirs[arch], lambda n: n == name))
        assert list(read) == [name]
        assert torch.equal(shard.lm_head.weight, read[name])


def test_sharded_checkpoint_opens_only_needed_files(tmp_path, monkeypatch, hf_models):
    model_dir = write_tiny_model(tmp_path / "sharded", "llama", seed=7, max_shard_size="100KB")
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 2

    opened = []
    real_safe_open = weights_module.safe_open

    def recording_safe_open(path, *args, **kwargs):
        opened.append(os.path.basename(path))
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr(weights_module, "safe_open", recording_safe_open)
    shard, _ = load_shard(model_dir, 1, 3, torch.float32, "cpu")
    needed_files = {file for name, file in weight_map.items() if name in shard.loaded_weight_names}
    assert set(opened) == needed_files
    assert len(opened) == len(needed_files) < len(set(weight_map.values()))

    # The sharded copy of the same weights gives the same logits as HF.
    pipeline = Pipeline(model_dir, 2)
    prompt = random_prompts([9], 512, seed=4)[0]
    logits = pipeline.step([SequenceChunk(prompt, 0, [4, 1, 9])], all_logits=True)
    torch.testing.assert_close(logits, hf_models["llama"](torch.tensor([prompt])).logits[0], atol=1e-4, rtol=1e-4)


def test_load_shard_rejects_incomplete_checkpoint(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = write_tiny_model(tmp_path / "m", "llama")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    load_shard(model_dir, 0, 2, torch.float32, "cpu")  # layers 0-1: unaffected
    with pytest.raises(ValueError, match="up_proj"):
        load_shard(model_dir, 1, 2, torch.float32, "cpu")


def test_load_weights_rejects_shape_mismatch(tiny_dirs):
    shard, _ = load_shard(tiny_dirs["llama"], 0, 1, torch.float32, "cpu")
    with pytest.raises(ValueError, match="shape"):
        shard.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(3, 3))])


# ---- dummy weights, presets, fingerprints ---------------------------------------------


def small_dummy_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )


def test_dummy_weights_are_deterministic_and_split_independent():
    config = small_dummy_config()
    whole = Pipeline("dummy", 1, dummy_config=config, seed=5)
    split = Pipeline("dummy", 3, dummy_config=config, seed=5)
    other_seed = Pipeline("dummy", 1, dummy_config=config, seed=6)
    prompt = list(range(10, 30))
    chunk = [SequenceChunk(prompt, 0, [3, 0, 7, 5, 1])]
    logits = whole.step(chunk, all_logits=True)
    assert torch.isfinite(logits).all()
    torch.testing.assert_close(split.step(chunk, all_logits=True), logits, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(other_seed.step(chunk, all_logits=True), logits)
    weight = whole.shards[0].layers[0].mlp.down_proj.weight
    assert abs(weight.std().item() - 0.02) < 0.002


def test_dummy_preset_by_name_and_parameter_counts():
    shard, config = load_shard("dummy", 1, 2, torch.bfloat16, "meta", dummy_config="llama-3.2-1b")
    assert config.num_hidden_layers == 16 and (shard.start_layer, shard.end_layer) == (8, 16)
    assert shard.lm_head.weight.shape == (128256, 2048)

    def num_params(name: str) -> int:
        cfg = dummy_config(name)
        whole = CausalLMShard(cfg, 0, cfg.num_hidden_layers, device="meta")
        return sum(p.numel() for p in whole.parameters())  # tied weights counted once

    assert num_params("llama-3.2-1b") == 1_235_814_400
    assert num_params("llama-3-8b") == 8_030_261_248
    assert dummy_config("llama-3-8b").head_dim == 128
    with pytest.raises(ValueError):
        dummy_config("gpt-5")


def test_fingerprints(tiny_dirs, tmp_path):
    config = small_dummy_config()
    assert model_fingerprint("dummy", config, seed=3).startswith("dummy-3-")
    assert model_fingerprint("dummy", config, seed=3) != model_fingerprint("dummy", config, seed=4)
    model_dir = write_tiny_model(tmp_path / "fp", "llama")
    cfg = ModelConfig.from_dir(model_dir)
    before = model_fingerprint(model_dir, cfg)
    assert before == model_fingerprint(model_dir, cfg)
    weights_file = model_dir / "model.safetensors"
    stat = weights_file.stat()
    os.utime(weights_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert model_fingerprint(model_dir, cfg) != before
    shard, _ = load_shard(model_dir, 0, 1, torch.float32, "cpu")
    assert shard.fingerprint == model_fingerprint(model_dir, cfg)


# ---- config parsing --------------------------------------------------------------------


def _hf_style_config(**fields):
    base = dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        num_hidden_layers=10,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        rms_norm_eps=1e-5,
        max_position_embeddings=1024,
    )
    base.update(fields)
    return base


def test_config_reads_pre_v5_rope_fields_and_eos_union(tmp_path):
    d = _hf_style_config(
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        eos_token_id=128001,
        bos_token_id=128000,
        torch_dtype="bfloat16",
        tie_word_embeddings=True,
    )
    (tmp_path / "config.json").write_text(json.dumps(d))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    config = ModelConfig.from_dir(tmp_path)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 32.0
    assert config.eos_token_id == [128001, 128009]
    assert config.head_dim == 16 and config.tie_word_embeddings and config.torch_dtype == "bfloat16"
    assert ModelConfig.from_dict(_hf_style_config(rope_scaling={"type": "default"})).rope_scaling is None


def test_config_from_tiny_checkpoints(tiny_dirs):
    llama = ModelConfig.from_dir(tiny_dirs["llama"])
    assert llama.architecture == "LlamaForCausalLM" and llama.sliding_window is None
    assert llama.rope_scaling["original_max_position_embeddings"] == 64
    assert not llama.attention_bias
    mistral = ModelConfig.from_dir(tiny_dirs["mistral"])
    assert mistral.sliding_window == TINY_MISTRAL_SLIDING_WINDOW
    assert mistral.sliding_window_for_layer(3) == TINY_MISTRAL_SLIDING_WINDOW
    qwen2 = ModelConfig.from_dir(tiny_dirs["qwen2"])
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.tie_word_embeddings
    assert qwen2.sliding_window is None and qwen2.rope_theta == 1000000.0


def test_config_sliding_window_variants():
    mistral_null = _hf_style_config(architectures=["MistralForCausalLM"], sliding_window=None)
    assert ModelConfig.from_dict(mistral_null).sliding_window is None
    qwen_off = _hf_style_config(architectures=["Qwen2ForCausalLM"], sliding_window=32, use_sliding_window=False)
    assert ModelConfig.from_dict(qwen_off).sliding_window is None
    qwen_on = _hf_style_config(
        architectures=["Qwen2ForCausalLM"], sliding_window=32, use_sliding_window=True, max_window_layers=6
    )
    config = ModelConfig.from_dict(qwen_on)
    assert [config.sliding_window_for_layer(i) for i in (0, 5, 6, 9)] == [None, None, 32, 32]


def test_config_rejects_unsupported_models():
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_dict(_hf_style_config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="rope"):
        ModelConfig.from_dict(_hf_style_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_dict(_hf_style_config(hidden_act="gelu"))


def test_layer_range_splits_evenly_with_earlier_stages_larger():
    config = ModelConfig.from_dict(_hf_style_config())  # 10 layers
    assert [config.layer_range(s, 3) for s in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [config.layer_range(s, 4) for s in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert config.layer_range(0, 1) == (0, 10)
    assert [config.layer_range(s, 10) for s in range(10)] == [(i, i + 1) for i in range(10)]
    with pytest.raises(ValueError):
        config.layer_range(0, 11)
    with pytest.raises(ValueError):
        config.layer_range(3, 3)
