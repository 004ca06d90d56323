"""Model hyper-parameters read from a Hugging Face checkpoint's config.json.

Only decoder-only Llama-family architectures are supported (Llama, Mistral, Qwen2):
they share one layer layout and differ in qkv bias and sliding-window attention.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# config.json "model_type" -> architecture, for configs that omit "architectures".
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

_SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or a dict with "rope_type" in ("default", "llama3") and that type's parameters.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (always on for Qwen2)
    o_proj_bias: bool = False  # Llama's attention_bias also covers o_proj; Qwen2's does not
    mlp_bias: bool = False
    sliding_window: int | None = None
    # Per-layer "full_attention" / "sliding_attention"; None means every layer uses sliding_window.
    layer_types: list[str] | None = None
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", "default")
            if rope_type not in _SUPPORTED_ROPE_TYPES:
                raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {_SUPPORTED_ROPE_TYPES}")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError("layer_types must have one entry per layer")

    def first_layers(self, num_layers: int) -> ModelConfig:
        """The model cut to its first num_layers layers (with its final norm and lm_head): a draft
        model that shares the target's weights and tokenizer."""
        if not 1 <= num_layers <= self.num_hidden_layers:
            raise ValueError(f"a draft of {num_layers} layers: the model has {self.num_hidden_layers}")
        layer_types = self.layer_types[:num_layers] if self.layer_types is not None else None
        return dataclasses.replace(self, num_hidden_layers=num_layers, layer_types=layer_types)

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read config.json, plus the eos ids of generation_config.json when present."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        config = cls.from_dict(json.loads(config_file.read_text()))
        generation_file = path / "generation_config.json"
        if generation_file.is_file():
            extra_eos = _as_id_list(json.loads(generation_file.read_text()).get("eos_token_id"))
            config.eos_token_id = config.eos_token_id + [i for i in extra_eos if i not in config.eos_token_id]
        return config

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        architecture = _architecture_of(d)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        hidden_size = int(d["hidden_size"])
        num_heads = int(d["num_attention_heads"])
        num_layers = int(d["num_hidden_layers"])
        hidden_act = d.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; only 'silu' is supported")

        # transformers 5 writes "rope_parameters" (with rope_theta inside); older
        # checkpoints have top-level "rope_theta" and "rope_scaling".
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
        rope_scaling = _normalise_rope_scaling(rope)

        sliding_window, layer_types = _sliding_window_of(d, architecture, num_layers)
        attention_bias = True if is_qwen2 else bool(d.get("attention_bias", False))

        return cls(
            architecture=architecture,
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(d.get("head_dim") or hidden_size // num_heads),
            intermediate_size=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=sliding_window,
            layer_types=layer_types,
            eos_token_id=_as_id_list(d.get("eos_token_id")),
            bos_token_id=d.get("bos_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- derived values ----------------------------------------------------------------

    def sliding_window_for_layer(self, layer_index: int) -> int | None:
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer_index] == "sliding_attention":
            return self.sliding_window
        return None

    def layer_range(self, stage_index: int, num_stages: int) -> tuple[int, int]:
        """Contiguous layers [start, end) of one pipeline stage; earlier stages take the remainder."""
        if num_stages < 1 or num_stages > self.num_hidden_layers:
            raise ValueError(
                f"num_stages must be in [1, {self.num_hidden_layers}] (one layer per stage at least), got {num_stages}"
            )
        if not 0 <= stage_index < num_stages:
            raise ValueError(f"stage_index {stage_index} out of range for {num_stages} stages")
        base, extra = divmod(self.num_hidden_layers, num_stages)
        start = stage_index * base + min(stage_index, extra)
        end = start + base + (1 if stage_index < extra else 0)
        return start, end


def _architecture_of(d: dict[str, Any]) -> str:
    architectures = d.get("architectures") or []
    if architectures:
        for arch in architectures:
            if arch in SUPPORTED_ARCHITECTURES:
                return arch
        raise ValueError(
            f"unsupported architecture {architectures[0]!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    model_type = d.get("model_type")
    if model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    raise ValueError(
        f"unsupported model_type {model_type!r} (no 'architectures' in config); "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _normalise_rope_scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    """Return None for plain RoPE, else the scaling dict with a "rope_type" key."""
    if not rope:
        return None
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    if rope_type == "default":
        return None
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: {_SUPPORTED_ROPE_TYPES}")
    if rope_type == "llama3":
        missing = {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
        missing -= rope.keys()
        if missing:
            raise ValueError(f"llama3 rope scaling misses {sorted(missing)}")
    return {"rope_type": rope_type, **rope}


def _sliding_window_of(d: dict[str, Any], architecture: str, num_layers: int) -> tuple[int | None, list[str] | None]:
    window = d.get("sliding_window")
    if architecture == "LlamaForCausalLM":
        return None, None
    if architecture == "Qwen2ForCausalLM":
        # Qwen2 only slides when asked, and then only from max_window_layers on.
        if not d.get("use_sliding_window", False) or window is None:
            return None, None
        layer_types = d.get("layer_types")
        if layer_types is None:
            first_sliding = int(d.get("max_window_layers", num_layers))
            layer_types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
        return int(window), list(layer_types)
    # Mistral: one window for every layer (null disables it).
    if d.get("use_sliding_window") is False or window is None:
        return None, None
    return int(window), None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]
