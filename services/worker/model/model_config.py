"""Model hyper-parameters read from a Hugging Face checkpoint's config.json.

Decoder-only architectures of one layer layout (attention, then an MLP or a mixture of experts,
each behind an RMSNorm and a residual add), whose differences are options of the layers:
- Llama, Mistral, Qwen2: qkv bias (Qwen2), sliding windows (Mistral, Qwen2 when asked).
- Qwen3: RMSNorm on each head's query and key before rotary (qk_norm), an explicit head_dim.
- Gemma 3 (text): qk_norm, RMSNorm scaling by 1 + weight (norm_unit_offset), norms after the
  attention and the MLP besides before them (sandwich_norms), embeddings times sqrt(hidden),
  GELU-tanh, the attention scale from query_pre_attn_scalar, and five sliding layers in six
  with a rotary base of their own (rope_local_theta).
- Qwen3-MoE, Mixtral: a mixture of experts in place of the MLP (num_experts > 0), on every
  layer but Qwen3-MoE's mlp_only_layers (and those decoder_sparse_step skips).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)

# config.json "model_type" -> architecture, for configs that omit "architectures".
_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

_SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
# The MLP activations the layers have kernels for (HF's ACT2FN names).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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
    # None, or a dict with "rope_type" in ("llama3", "linear") and that type's parameters.
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
    # The MLP's activation (HF's name): "silu" (SiLU-gated) or "gelu_pytorch_tanh" (Gemma).
    hidden_act: str = "silu"
    # Qwen3, Gemma 3: RMSNorm over each head's query and key (q_norm, k_norm) before rotary.
    qk_norm: bool = False
    # Gemma: every RMSNorm scales by (1 + weight), in float32 (Gemma3RMSNorm).
    norm_unit_offset: bool = False
    # Gemma: the attention's and the MLP's outputs are normalised before their residual adds
    # (post_attention_layernorm, post_feedforward_layernorm), the MLP's input by its own norm
    # (pre_feedforward_layernorm); without, post_attention_layernorm is the MLP's input norm.
    sandwich_norms: bool = False
    # Gemma: embeddings are multiplied by this (sqrt(hidden_size)), rounded to the model dtype first.
    embedding_scale: float | None = None
    # Gemma: the attention scale is query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    # Gemma 3: sliding layers rotate with this base and no scaling (rope_scaling is the global
    # layers'); None: every layer rotates with rope_theta and rope_scaling.
    rope_local_theta: float | None = None
    # Gemma: logits = cap * tanh(logits / cap) after lm_head when set (null in Gemma 3's configs).
    final_logit_softcapping: float | None = None
    # Mixture of experts (Qwen3-MoE, Mixtral): num_experts routed experts of moe_intermediate_size,
    # num_experts_per_tok chosen per token, their softmax weights renormalised to sum 1 when
    # norm_topk_prob. 0 experts: a dense MLP on every layer.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Qwen3-MoE rounds the routing weights to the router logits' dtype (bf16 when serving);
    # Mixtral (transformers 5) keeps them float32.
    router_weights_in_model_dtype: bool = False
    # Qwen3-MoE: layers with a dense MLP (of intermediate_size) instead of the experts; and only
    # every decoder_sparse_step-th layer has experts.
    mlp_only_layers: list[int] = field(default_factory=list)
    decoder_sparse_step: int = 1

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
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
                raise ValueError(
                    f"a mixture of experts needs 1 <= num_experts_per_tok ({self.num_experts_per_tok}) <= num_experts "
                    f"({self.num_experts}) and moe_intermediate_size > 0 ({self.moe_intermediate_size})"
                )
            if self.hidden_act != "silu":
                raise ValueError(f"experts with hidden_act {self.hidden_act!r}: the fused MoE kernel runs SiLU only")
            if self.decoder_sparse_step < 1:
                raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

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
        is_gemma = architecture == "Gemma3ForCausalLM"
        hidden_size = int(d["hidden_size"])
        num_heads = int(d["num_attention_heads"])
        num_layers = int(d["num_hidden_layers"])
        # Gemma names its activation hidden_activation (HF's Gemma3MLP reads only that).
        hidden_act = (d.get("hidden_activation") or "gelu_pytorch_tanh") if is_gemma else d.get("hidden_act", "silu")

        if is_gemma:
            rope_theta, rope_scaling, rope_local_theta = _gemma_rope(d)
        else:
            # transformers 5 writes "rope_parameters" (with rope_theta inside); older
            # checkpoints have top-level "rope_theta" and "rope_scaling".
            rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
            rope_theta = float(rope.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
            rope_scaling, rope_local_theta = _normalise_rope_scaling(rope), None

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
            # Gemma 3 ties by default (HF's Gemma3TextConfig), the others do not.
            tie_word_embeddings=bool(d.get("tie_word_embeddings", is_gemma)),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(d.get("mlp_bias", False)),
            sliding_window=sliding_window,
            layer_types=layer_types,
            eos_token_id=_as_id_list(d.get("eos_token_id")),
            bos_token_id=d.get("bos_token_id"),
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            hidden_act=hidden_act,
            rope_local_theta=rope_local_theta,
            **_family_options(d, architecture, hidden_size, num_layers),
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

    def local_rotary_for_layer(self, layer_index: int) -> bool:
        """Whether the layer rotates with the local base (Gemma 3's sliding layers)."""
        return self.rope_local_theta is not None and self.sliding_window_for_layer(layer_index) is not None

    def is_moe_layer(self, layer_index: int) -> bool:
        """Whether the layer's MLP is the mixture of experts (HF's Qwen3MoeDecoderLayer rule)."""
        return (
            self.num_experts > 0
            and layer_index not in self.mlp_only_layers
            and (layer_index + 1) % self.decoder_sparse_step == 0
        )

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def decode_chain_layout(self) -> bool:
        """Layers the batch-1 decode chain's fused GEMVs take: Llama's plain RMSNorm, two norms a
        layer and SiLU-gated MLPs, dense or of experts, with or without q/k norms (Qwen3, Qwen3-MoE,
        Mixtral); not Gemma's unit-offset and sandwich norms, GELU or logit soft-capping."""
        return not (
            self.norm_unit_offset or self.sandwich_norms or self.hidden_act != "silu" or self.final_logit_softcapping
        )

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


def _family_options(d: dict[str, Any], architecture: str, hidden_size: int, num_layers: int) -> dict[str, Any]:
    """The ModelConfig fields that Qwen3, Gemma 3 and the mixtures of experts add."""
    if architecture == "Qwen3ForCausalLM":
        return dict(qk_norm=True)
    if architecture == "Gemma3ForCausalLM":
        if d.get("use_bidirectional_attention"):
            raise ValueError("Gemma 3 with use_bidirectional_attention (an encoder) is not a causal LM Strata serves")
        # attn_logit_softcapping: HF's Gemma3Attention never passes it to the attention (and Gemma
        # 3's published configs set it null), so, as HF, it changes nothing.
        cap = d.get("final_logit_softcapping")
        return dict(
            qk_norm=True,
            norm_unit_offset=True,
            sandwich_norms=True,
            embedding_scale=hidden_size**0.5,
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
            final_logit_softcapping=float(cap) if cap else None,
        )
    if architecture == "Qwen3MoeForCausalLM":
        sparse_step = int(d.get("decoder_sparse_step", 1))
        dense = [int(i) for i in d.get("mlp_only_layers") or []]
        return dict(
            qk_norm=True,
            num_experts=int(d.get("num_experts", d.get("num_local_experts", 128))),
            num_experts_per_tok=int(d.get("num_experts_per_tok", 8)),
            moe_intermediate_size=int(d.get("moe_intermediate_size", 768)),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            router_weights_in_model_dtype=True,
            mlp_only_layers=[i for i in dense if 0 <= i < num_layers],
            decoder_sparse_step=sparse_step,
        )
    if architecture == "MixtralForCausalLM":
        # Mixtral's experts are of intermediate_size, and it always renormalises the top-k.
        return dict(
            num_experts=int(d.get("num_local_experts", 8)),
            num_experts_per_tok=int(d.get("num_experts_per_tok", 2)),
            moe_intermediate_size=int(d["intermediate_size"]),
            norm_topk_prob=True,
        )
    return {}


def _gemma_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(global theta, global scaling, local theta) of a Gemma 3 config. transformers 5 writes
    rope_parameters per layer type; older configs rope_theta, rope_local_base_freq and a
    rope_scaling of the global layers (HF's Gemma3TextConfig.convert_rope_params_to_dict)."""
    by_type = d.get("rope_parameters") or {}
    if "full_attention" in by_type or "sliding_attention" in by_type:
        full = dict(by_type.get("full_attention") or {})
        local = dict(by_type.get("sliding_attention") or {})
    else:
        full = dict(d.get("rope_scaling") or {})
        local = {}
    theta = float(full.pop("rope_theta", None) or d.get("rope_theta") or 1_000_000.0)
    local_theta = float(local.pop("rope_theta", None) or d.get("rope_local_base_freq") or 10_000.0)
    if _normalise_rope_scaling(local) is not None:
        raise ValueError(f"Gemma 3's sliding layers with rope scaling {local}: only their plain rotary is supported")
    return theta, _normalise_rope_scaling(full), local_theta


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
    required = {"llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}}
    missing = required.get(rope_type, {"factor"}) - rope.keys()
    if missing:
        raise ValueError(f"{rope_type} rope scaling misses {sorted(missing)}")
    return {"rope_type": rope_type, **rope}


def _sliding_window_of(d: dict[str, Any], architecture: str, num_layers: int) -> tuple[int | None, list[str] | None]:
    window = d.get("sliding_window")
    if architecture == "LlamaForCausalLM":
        return None, None
    if architecture == "Gemma3ForCausalLM":
        # layer_types as written, or the pattern older configs give: every n-th layer is global.
        layer_types = d.get("layer_types")
        if layer_types is None:
            pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
        if window is None:
            return None, None
        return int(window), list(layer_types)
    if architecture == "Qwen3MoeForCausalLM":
        # HF's Qwen3-MoE slides on every layer, and only when asked.
        if not d.get("use_sliding_window", False) or window is None:
            return None, None
        return int(window), None
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # Qwen2 and Qwen3 only slide when asked, and then only from max_window_layers on.
        if not d.get("use_sliding_window", False) or window is None:
            return None, None
        layer_types = d.get("layer_types")
        if layer_types is None:
            first_sliding = int(d.get("max_window_layers", num_layers))
            layer_types = ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
        return int(window), list(layer_types)
    # Mistral, Mixtral: one window for every layer (null disables it).
    if d.get("use_sliding_window") is False or window is None:
        return None, None
    return int(window), None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]
