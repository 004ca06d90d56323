"""Where each tensor of an HF checkpoint goes in a stage's shard: every architecture's weight names
in one place.

A checkpoint name maps to a Destination: a parameter of the shard (its path in the module tree)
and, for the fused ones, the part it fills: one expert of the stacked experts, and rows of the
q / k / v parts of qkv_proj or of the gate / up halves of a gate_up_proj.

Some checkpoints hold tensors in another form than the Hub's. transformers 5 keeps a model's
experts fused ([E, 2I, H] gate_up_proj, [E, H, I] down_proj, Mixtral's under mlp. instead of
block_sparse_moe.), and some of its versions save them so; the Hub has one tensor per expert and
projection. Such an Alternative fills what several Hub names would (its `covers`), so a stage is
complete with either form.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.services.worker.model.model_config import ModelConfig


@dataclass(frozen=True)
class Destination:
    param: str  # the shard's parameter, e.g. "layers.2.self_attn.qkv_proj.weight"
    expert: int | None = None  # index along dim 0 of stacked experts
    rows: tuple[int, int] | None = None  # [start, end) along the next dim (a fused projection's part)


@dataclass(frozen=True)
class Alternative:
    destination: Destination
    covers: tuple[str, ...]  # the Hub names it stands for


def checkpoint_names(
    config: ModelConfig, start_layer: int, end_layer: int
) -> tuple[dict[str, Destination], dict[str, Alternative]]:
    """The Hub names of the tensors layers [start, end) of the model need (with the embeddings on
    the first stage, the final norm and lm_head on the last), and the alternatives to them."""
    names: dict[str, Destination] = {}
    alternatives: dict[str, Alternative] = {}
    is_first, is_last = start_layer == 0, end_layer == config.num_hidden_layers
    if is_first:
        names["model.embed_tokens.weight"] = Destination("embed_tokens.weight")
    if is_last:
        names["model.norm.weight"] = Destination("norm.weight")
        # A tied checkpoint may still hold lm_head.weight (a copy of the embedding): unused.
        if config.tie_word_embeddings:
            names.setdefault("model.embed_tokens.weight", Destination("lm_head.weight"))
        else:
            names["lm_head.weight"] = Destination("lm_head.weight")
    for layer in range(start_layer, end_layer):
        _layer_names(config, layer, f"model.layers.{layer}.", f"layers.{layer - start_layer}.", names, alternatives)
    return names, alternatives


def _layer_names(
    config: ModelConfig,
    layer: int,
    prefix: str,
    param: str,
    names: dict[str, Destination],
    alternatives: dict[str, Alternative],
) -> None:
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.sandwich_norms:
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    if config.qk_norm:
        norms += ["self_attn.q_norm", "self_attn.k_norm"]
    for norm in norms:
        names[f"{prefix}{norm}.weight"] = Destination(f"{param}{norm}.weight")

    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    parts = {
        "q_proj": (0, q_size),
        "k_proj": (q_size, q_size + kv_size),
        "v_proj": (q_size + kv_size, q_size + 2 * kv_size),
    }
    for proj, rows in parts.items():
        for kind in ("weight", "bias") if config.attention_bias else ("weight",):
            names[f"{prefix}self_attn.{proj}.{kind}"] = Destination(f"{param}self_attn.qkv_proj.{kind}", rows=rows)
    for kind in ("weight", "bias") if config.o_proj_bias else ("weight",):
        names[f"{prefix}self_attn.o_proj.{kind}"] = Destination(f"{param}self_attn.o_proj.{kind}")

    if config.is_moe_layer(layer):
        _expert_names(config, prefix, param, names, alternatives)
        return
    inter = config.intermediate_size
    for kind in ("weight", "bias") if config.mlp_bias else ("weight",):
        gate_up = f"{param}mlp.gate_up_proj.{kind}"
        names[f"{prefix}mlp.gate_proj.{kind}"] = Destination(gate_up, rows=(0, inter))
        names[f"{prefix}mlp.up_proj.{kind}"] = Destination(gate_up, rows=(inter, 2 * inter))
        names[f"{prefix}mlp.down_proj.{kind}"] = Destination(f"{param}mlp.down_proj.{kind}")


def _expert_names(
    config: ModelConfig,
    prefix: str,
    param: str,
    names: dict[str, Destination],
    alternatives: dict[str, Alternative],
) -> None:
    """Qwen3-MoE: mlp.gate + mlp.experts.{e}.{gate,up,down}_proj; Mixtral: block_sparse_moe.gate +
    block_sparse_moe.experts.{e}.{w1,w3,w2} (gate, up, down). Both: the fused transformers 5 form."""
    inter = config.moe_intermediate_size
    gate_up, down = f"{param}mlp.experts.gate_up_proj", f"{param}mlp.experts.down_proj"
    if config.architecture == "MixtralForCausalLM":
        hub, projections = f"{prefix}block_sparse_moe.", ("w1", "w3", "w2")
    else:
        hub, projections = f"{prefix}mlp.", ("gate_proj", "up_proj", "down_proj")
    router = f"{hub}gate.weight"
    names[router] = Destination(f"{param}mlp.gate.weight")
    if router != f"{prefix}mlp.gate.weight":
        alternatives[f"{prefix}mlp.gate.weight"] = Alternative(names[router], (router,))
    gate_ups, downs = [], []
    for e in range(config.num_experts):
        gate_name, up_name, down_name = (f"{hub}experts.{e}.{p}.weight" for p in projections)
        names[gate_name] = Destination(gate_up, expert=e, rows=(0, inter))
        names[up_name] = Destination(gate_up, expert=e, rows=(inter, 2 * inter))
        names[down_name] = Destination(down, expert=e)
        gate_ups += [gate_name, up_name]
        downs.append(down_name)
    alternatives[f"{prefix}mlp.experts.gate_up_proj"] = Alternative(Destination(gate_up), tuple(gate_ups))
    alternatives[f"{prefix}mlp.experts.down_proj"] = Alternative(Destination(down), tuple(downs))
