"""Build a stage's CausalLMShard from an HF checkpoint directory, or with random weights.

Only the tensors of the stage's layer range are read from the safetensors files.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from strata.services.worker.model.attention import AttentionBackend
from strata.services.worker.model.model_config import ModelConfig
from strata.services.worker.model.shard import CausalLMShard
from strata.services.worker.model.sharding import RankSlices, local_config

DUMMY = "dummy"
DUMMY_STD = 0.02

# The real checkpoints' config.json values (the Hub's Qwen/Qwen3-8B, Qwen/Qwen3-30B-A3B and
# google/gemma-3-12b-it's text_config, with their generation_config's eos ids), as
# ModelConfig.from_dict reads them; tests/test_model_families.py counts each preset's parameters
# against transformers' own model of the same config.
DUMMY_PRESETS: dict[str, dict] = {
    "llama-3.2-1b": dict(
        architecture="LlamaForCausalLM",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        eos_token_id=[128001, 128008, 128009],
        bos_token_id=128000,
        torch_dtype="bfloat16",
    ),
    "llama-3-8b": dict(
        architecture="LlamaForCausalLM",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        eos_token_id=[128001],
        bos_token_id=128000,
        torch_dtype="bfloat16",
    ),
    "qwen3-8b": dict(
        architecture="Qwen3ForCausalLM",
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        qk_norm=True,
        eos_token_id=[151645, 151643],
        bos_token_id=151643,
        torch_dtype="bfloat16",
    ),
    "qwen3-30b-a3b": dict(
        architecture="Qwen3MoeForCausalLM",
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,  # a dense layer's (none: every layer has experts)
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        qk_norm=True,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        router_weights_in_model_dtype=True,
        eos_token_id=[151645, 151643],
        bos_token_id=151643,
        torch_dtype="bfloat16",
    ),
    "gemma-3-12b": dict(
        architecture="Gemma3ForCausalLM",
        hidden_size=3840,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        intermediate_size=15360,
        vocab_size=262208,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_scaling=dict(rope_type="linear", factor=8.0),
        rope_local_theta=10000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        sliding_window=1024,
        # sliding_window_pattern 6: five sliding layers, then a global one.
        layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(48)],
        hidden_act="gelu_pytorch_tanh",
        qk_norm=True,
        norm_unit_offset=True,
        sandwich_norms=True,
        embedding_scale=3840**0.5,
        query_pre_attn_scalar=256.0,
        eos_token_id=[1, 106],
        bos_token_id=2,
        torch_dtype="bfloat16",
    ),
}


def dummy_config(name: str) -> ModelConfig:
    """A preset ModelConfig for random-weight benchmarks (a name of DUMMY_PRESETS)."""
    if name not in DUMMY_PRESETS:
        raise ValueError(f"unknown dummy preset {name!r}; known: {', '.join(DUMMY_PRESETS)}")
    return ModelConfig(**copy.deepcopy(DUMMY_PRESETS[name]))


_preset = dummy_config  # load_shard's `dummy_config` argument shadows the function


def load_shard(
    model: str | Path,
    stage_index: int,
    num_stages: int,
    dtype: torch.dtype | str,
    device: torch.device | str,
    dummy_config: ModelConfig | str | None = None,
    seed: int = 0,
    attn_backend: AttentionBackend | None = None,
    first_layers: int = 0,
    tp=None,
) -> tuple[CausalLMShard, ModelConfig]:
    """The shard of pipeline stage `stage_index` out of `num_stages`, and the model config.

    `model` is an HF checkpoint directory (config.json + *.safetensors) or "dummy", which
    builds random weights for `dummy_config` (a ModelConfig or a preset name). first_layers: only
    the model's first layers (plus its final norm and lm_head), as a draft model. tp: this rank's
    tensor-parallel group: the shard is the rank's slice (model/sharding.py), read from the
    checkpoint alone (safetensors slices), and the config returned is the rank's (its heads and
    intermediate sizes; the vocabulary the model's).
    """
    dtype = _as_dtype(dtype)
    is_dummy = str(model) == DUMMY
    if is_dummy:
        if dummy_config is None:
            raise ValueError('model "dummy" needs a dummy_config (ModelConfig or preset name)')
        config = _preset(dummy_config) if isinstance(dummy_config, str) else dummy_config
    else:
        config = ModelConfig.from_dir(model)
    if first_layers:
        config = config.first_layers(first_layers)
    start, end = config.layer_range(stage_index, num_stages)
    rank, size = (tp.rank, tp.size) if tp is not None else (0, 1)
    slices = RankSlices(config, rank, size)
    local = local_config(config, size)
    shard = CausalLMShard(local, start, end, device=device, dtype=dtype, attn_backend=attn_backend, tp=tp)

    if is_dummy:
        loaded = shard.load_weights(_dummy_tensors(shard, seed, device, slices))
    else:
        sliced = (slices.take,) if size > 1 else ()  # (one rank reads whole tensors)
        loaded = shard.load_weights(iter_checkpoint_tensors(model, shard.wants_weight, *sliced))
    missing = shard.expected_weight_names() - loaded
    if missing:
        raise ValueError(
            f"checkpoint {model} lacks {len(missing)} tensors for layers [{start}, {end}), e.g. {sorted(missing)[:5]}"
        )
    shard.loaded_weight_names = loaded
    shard.fingerprint = model_fingerprint(model, config, seed)  # (the whole model's: every rank the same)
    shard.eval()
    return shard, local


def iter_checkpoint_tensors(
    model_dir: str | Path, wanted: Callable[[str], bool], take=None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for each wanted tensor, opening only files that hold one.
    take(name, slice, shape): the part of the tensor to read (RankSlices.take: a
    tensor-parallel rank reads only its bytes); default the whole."""
    model_dir = Path(model_dir)
    index_file = model_dir / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
        names_by_file: dict[str, list[str]] = {}
        for name, file_name in weight_map.items():
            if wanted(name):
                names_by_file.setdefault(file_name, []).append(name)
        for file_name, names in sorted(names_by_file.items()):
            with safe_open(model_dir / file_name, framework="pt", device="cpu") as f:
                for name in names:
                    yield name, _read(f, name, take)
        return
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if wanted(name):
                    yield name, _read(f, name, take)


def _read(f, name: str, take) -> torch.Tensor:
    if take is None:
        return f.get_tensor(name)
    part = f.get_slice(name)
    return take(name, part, part.get_shape())


def model_fingerprint(model: str | Path, config: ModelConfig, seed: int = 0) -> str:
    """A short id of the weights, used to salt prefix-cache keys.

    Checkpoints: hash of config.json plus each weight file's name, size and mtime.
    Dummy models: "dummy-<seed>-<config hash>".
    """
    config_hash = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode()).hexdigest()[:8]
    if str(model) == DUMMY:
        return f"dummy-{seed}-{config_hash}"
    model_dir = Path(model)
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors*")):
        stat = path.stat()
        digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:16]


def _dummy_tensors(
    shard: CausalLMShard, seed: int, device: torch.device | str, slices: RankSlices | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Random HF-named tensors: norms at 1 (Gemma's, which scale by 1 + weight, at 0), everything
    else N(0, DUMMY_STD).

    Each tensor's generator is seeded from (seed, name), so a layer gets the same weights
    however the model is split into stages; and into tensor-parallel ranks (slices): each draws
    the whole tensor and keeps its part.
    """
    if torch.device(device).type == "meta":  # shapes only (memory planning, tests)
        for name in sorted(shard.expected_weight_names()):
            yield name, torch.empty(shard.weight_shape(name), device="meta")
        return
    generator = torch.Generator(device=device)
    for name in sorted(shard.expected_weight_names()):
        shape = shard.weight_shape(name)
        if name.endswith("norm.weight"):
            unit = 0.0 if shard.config.norm_unit_offset else 1.0
            yield name, torch.full(shape, unit, device=device)
            continue
        generator.manual_seed(_name_seed(seed, name))
        whole = slices.global_shape(name, shape) if slices is not None else shape
        tensor = torch.empty(whole, device=device, dtype=torch.float32).normal_(0.0, DUMMY_STD, generator=generator)
        yield name, slices.take(name, tensor, tensor.shape) if slices is not None else tensor


def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:7], "little")


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
    resolved = getattr(torch, aliases.get(dtype, dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved
