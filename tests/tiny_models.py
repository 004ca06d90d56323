"""Tiny random Hugging Face checkpoints for tests (nothing is downloaded).

`write_tiny_model(path, arch)` builds a model with transformers' own classes and saves it
as safetensors, so it is both our loader's input and the HF oracle's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Weights drawn with a large std: random tiny models with HF's default 0.02 give almost
# flat logits, and greedy comparisons then flip on float rounding noise.
TINY_INIT_STD = 0.15

# Mistral's window is smaller than the test sequences, so sliding attention is exercised.
TINY_MISTRAL_SLIDING_WINDOW = 12
# Gemma 3's and Mixtral's too (Gemma 3 slides on its odd layers only).
TINY_GEMMA3_SLIDING_WINDOW = 10
TINY_MIXTRAL_SLIDING_WINDOW = 14

ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3_moe", "mixtral")
MOE_ARCHS = ("qwen3_moe", "mixtral")

_BASE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_config(arch: str = "llama", tokenizer: Any = None, **overrides: Any):
    """The transformers config of a tiny `arch` model (one of ARCHS)."""
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    kwargs: dict[str, Any] = dict(_BASE)
    if tokenizer is not None:
        kwargs.update(_tokenizer_ids(tokenizer))
    if arch == "llama":
        config_class = LlamaConfig
        # llama3 scaling with a short original context, so scaling changes the frequencies.
        kwargs["rope_parameters"] = dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
    elif arch == "mistral":
        config_class = MistralConfig
        kwargs["sliding_window"] = TINY_MISTRAL_SLIDING_WINDOW
        kwargs["rope_parameters"] = dict(rope_type="default", rope_theta=10000.0)
    elif arch == "qwen2":
        config_class = Qwen2Config
        kwargs["tie_word_embeddings"] = True
        kwargs["rope_parameters"] = dict(rope_type="default", rope_theta=1000000.0)
    elif arch == "qwen3":
        config_class = Qwen3Config
        # head_dim 32 with hidden 64 and 4 heads: q is wider than hidden, as head_dim is explicit.
        kwargs.update(head_dim=32, rope_parameters=dict(rope_type="default", rope_theta=1000000.0))
    elif arch == "gemma3":
        config_class = Gemma3TextConfig
        # Sliding on even layers, global on odd ones (Gemma 3 has five in six sliding), the global
        # ones with linear rope scaling as Gemma 3 4B+ have it, the local ones their own base; a
        # query_pre_attn_scalar that is not head_dim; GELU-tanh and tied embeddings by default.
        layers = overrides.get("num_hidden_layers", kwargs["num_hidden_layers"])
        kwargs.update(
            head_dim=32,
            sliding_window=TINY_GEMMA3_SLIDING_WINDOW,
            layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
            query_pre_attn_scalar=24,
            rope_parameters=dict(
                full_attention=dict(rope_type="linear", factor=4.0, rope_theta=100000.0),
                sliding_attention=dict(rope_type="default", rope_theta=1000.0),
            ),
        )
    elif arch == "qwen3_moe":
        config_class = Qwen3MoeConfig
        # 8 experts, 3 a token, renormalised; layer 1 keeps a dense MLP (mlp_only_layers).
        kwargs.update(
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        )
    elif arch == "mixtral":
        config_class = MixtralConfig
        kwargs.update(
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=48,
            sliding_window=TINY_MIXTRAL_SLIDING_WINDOW,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        )
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    kwargs.update(overrides)
    return config_class(**kwargs)


def build_tiny_model(arch: str = "llama", seed: int = 0, tokenizer: Any = None, **overrides: Any):
    """A float32 HF model with deterministic large-std random weights, in eval mode."""
    import transformers

    model_class = getattr(transformers, _MODEL_CLASSES[arch])
    # "eager": HF's expert loop, the math of our references (transformers 5 picks grouped_mm).
    config = tiny_config(arch, tokenizer, **overrides)
    config._experts_implementation = "eager"
    model = model_class(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                # Not all ones (Gemma's: not all zeros), so a swapped or missing norm weight
                # changes the output.
                param.copy_(0.1 * noise if arch == "gemma3" else 1.0 + 0.1 * noise)
            else:
                param.copy_(TINY_INIT_STD * noise)
    return model.eval()


_MODEL_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def load_hf_model(path: str | Path):
    """The HF oracle of a saved model, float32, eval mode; mixtures of experts run HF's eager
    expert loop, the math our references copy (from_pretrained would pick grouped_mm)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, experts_implementation="eager")
    except (TypeError, ValueError):  # a transformers without the option has only the eager loop
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


def write_tiny_model(
    path: str | Path,
    arch: str = "llama",
    seed: int = 0,
    tokenizer: Any = None,
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> Path:
    """Save a tiny `arch` model to `path` (config.json + safetensors, float32); return path.

    tokenizer: a `tokenizers.Tokenizer` or transformers tokenizer; the vocab size and the
    bos/eos ids follow it, and it is saved beside the model. max_shard_size: split the
    weights into several files with a model.safetensors.index.json (e.g. "200KB").
    overrides: any config field (num_hidden_layers=..., sliding_window=..., ...).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model(arch, seed, tokenizer, **overrides)
    save_kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **save_kwargs)
    if tokenizer is not None:
        if hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(path)
        else:
            tokenizer.save(str(path / "tokenizer.json"))
    return path


def _tokenizer_ids(tokenizer: Any) -> dict[str, Any]:
    """vocab_size, bos/eos/pad ids taken from a tokenizer."""
    if hasattr(tokenizer, "get_vocab_size"):  # tokenizers.Tokenizer
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        ids: dict[str, Any] = {"vocab_size": vocab_size}
        for key, token in (("bos_token_id", "<|begin_of_text|>"), ("eos_token_id", "<|end_of_text|>")):
            token_id = tokenizer.token_to_id(token)
            if token_id is not None:
                ids[key] = token_id
        ids.setdefault("bos_token_id", None)
        ids.setdefault("eos_token_id", None)
        ids["pad_token_id"] = None
        return ids
    return {
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def cpu_runner(shard, config, *, num_blocks: int = 64, **options: Any):
    """A float32 ModelRunner on CPU over one whole-model shard, its cache allocated; options
    override the small defaults (blocks of 4, 64 positions, 8 sequences) or add ModelRunner's."""
    from strata.services.worker.runner import ModelRunner

    settings = {"block_size": 4, "max_model_len": 64, "max_num_seqs": 8, **options}
    runner = ModelRunner(
        shard,
        config,
        stage_index=0,
        num_stages=1,
        device=torch.device("cpu"),
        dtype=torch.float32,
        **settings,
    )
    runner.init_cache(num_blocks)
    return runner
