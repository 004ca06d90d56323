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
    """The transformers config of a tiny `arch` model ("llama", "mistral" or "qwen2")."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

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
    else:
        raise ValueError(f"unknown tiny arch {arch!r}")
    kwargs.update(overrides)
    return config_class(**kwargs)


def build_tiny_model(arch: str = "llama", seed: int = 0, tokenizer: Any = None, **overrides: Any):
    """A float32 HF model with deterministic large-std random weights, in eval mode."""
    from transformers import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

    model_class = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}[arch]
    config = tiny_config(arch, tokenizer, **overrides)
    model = model_class(config).to(torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                # Not all ones, so a swapped or missing norm weight changes the output.
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(TINY_INIT_STD * noise)
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
