"""A tensor-parallel rank's slice of the model (Megatron's layout): what sizes its layers have and
which part of each checkpoint tensor it reads.

- Attention: the query heads split evenly (column-parallel q); the KV heads split too, or, when
  the ranks outnumber them, each rank holds the one its query heads use (replicated, as vLLM's
  QKVParallelLinear); o_proj takes the rank's heads' columns (row-parallel) and its output is
  summed over the ranks by one all-reduce. Qwen3's and Gemma's q/k norms are per head: whole.
- MLP: gate and up rows of the rank's part of the intermediate size, down's columns of it, one
  all-reduce; each expert of a mixture the same way (its intermediate dim), the router whole.
- Vocabulary: embedding and lm_head rows of the rank's slice (tensor_parallel/vocab.py), padded;
  the embedding's rows are summed over the ranks (one holds each token), the head's logits stay
  sliced for the sampler (sampling/sharded.py).
- Norms whole; a bias after a row-parallel linear on rank 0 only (it is added once in the sum).

The layers are built from `local_config`, the model's config with the rank's head counts and
intermediate sizes, so every size that follows from them (the qkv and gate/up layouts, the KV
cache, the attention's launch shapes) is the rank's without further arguments. `take` cuts a
checkpoint tensor (or a safetensors slice, which reads only those bytes) to the rank's part.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from strata.services.worker.model.model_config import ModelConfig
from strata.services.worker.tensor_parallel.vocab import VocabShard

# How each checkpoint tensor splits over the ranks, by its Hub name (every architecture's; the
# fused experts of transformers 5 too). Anything else is whole on every rank.
_SPLITS = (
    (re.compile(r"self_attn\.q_proj\.(weight|bias)$"), "rows"),
    (re.compile(r"self_attn\.[kv]_proj\.(weight|bias)$"), "kv"),
    (re.compile(r"self_attn\.o_proj\.weight$"), "cols"),
    (re.compile(r"(self_attn\.o_proj|mlp\.down_proj)\.bias$"), "rank0"),
    (re.compile(r"mlp\.(gate_proj|up_proj)\.(weight|bias)$"), "rows"),
    (re.compile(r"mlp\.down_proj\.weight$"), "cols"),
    (re.compile(r"experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$"), "rows"),
    (re.compile(r"experts\.\d+\.(down_proj|w2)\.weight$"), "cols"),
    (re.compile(r"mlp\.experts\.gate_up_proj$"), "experts_gate_up"),
    (re.compile(r"mlp\.experts\.down_proj$"), "experts_down"),
    (re.compile(r"^(model\.embed_tokens|lm_head)\.weight$"), "vocab"),
)


def split_of(name: str) -> str | None:
    for pattern, kind in _SPLITS:
        if pattern.search(name):
            return kind
    return None


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """A clear error when the model's heads or intermediate sizes do not split into `size` ranks."""
    if size == 1:
        return
    problems = []
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        problems.append(f"{heads} attention heads do not divide into {size} ranks")
    if kv % size and size % kv:
        problems.append(f"{kv} KV heads neither divide into {size} ranks nor divide {size} (to replicate them)")
    dense = not config.num_experts or any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    if dense and config.intermediate_size % size:
        problems.append(f"the MLP's intermediate size {config.intermediate_size} does not divide into {size} ranks")
    if config.num_experts and config.moe_intermediate_size % size:
        problems.append(
            f"the experts' intermediate size {config.moe_intermediate_size} does not divide into {size} ranks"
        )
    if problems:
        raise ValueError(f"--tensor-parallel-size {size}: " + "; ".join(problems))


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The config of one rank's layers: its query and KV heads, its part of each intermediate
    size (the vocabulary stays the model's: the sampler and the plans speak of whole ids)."""
    if size == 1:
        return config
    check_tensor_parallel(config, size)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=max(1, config.num_key_value_heads // size),
        intermediate_size=config.intermediate_size // size if config.intermediate_size % size == 0 else 0,
        moe_intermediate_size=config.moe_intermediate_size // size,
    )


class RankSlices:
    """Which part of each checkpoint tensor rank `rank` of `size` holds, for a model of `config`
    (the whole model's)."""

    def __init__(self, config: ModelConfig, rank: int, size: int):
        self.config, self.rank, self.size = config, rank, size
        self.vocab = VocabShard(config.vocab_size, rank, size)

    def _kv_rows(self) -> tuple[int, int]:
        heads, d = self.config.num_key_value_heads, self.config.head_dim
        if self.size <= heads:
            local = heads // self.size
            first = self.rank * local
        else:  # replicated: the rank holds the KV head its query heads use
            local, first = 1, self.rank // (self.size // heads)
        return first * d, (first + local) * d

    def take(self, name: str, x, shape) -> torch.Tensor:
        """The rank's part of checkpoint tensor `name` of global `shape`, from `x` (a tensor, or a
        safetensors slice: only the part is read)."""
        kind = split_of(name) if self.size > 1 else None
        r, t = self.rank, self.size
        if kind is None:
            return x[:]
        if kind == "rows":
            n = shape[0] // t
            return x[r * n : (r + 1) * n]
        if kind == "cols":
            n = shape[-1] // t
            return x[:, r * n : (r + 1) * n]
        if kind == "kv":
            a, b = self._kv_rows()
            return x[a:b]
        if kind == "rank0":
            whole = x[:]
            return whole if r == 0 else torch.zeros_like(whole)
        if kind == "experts_gate_up":  # [E, 2I, H]: the rank's rows of the gate half, then of the up half
            inter = shape[1] // 2
            n = inter // t
            return torch.cat([x[:, r * n : (r + 1) * n], x[:, inter + r * n : inter + (r + 1) * n]], dim=1)
        if kind == "experts_down":  # [E, H, I]
            n = shape[2] // t
            return x[:, :, r * n : (r + 1) * n]
        if kind == "vocab":  # rows of the rank's vocabulary slice, padding rows zero
            v = self.vocab
            rows = x[v.offset : v.offset + v.valid]
            out = torch.zeros((v.local, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
            out[: v.valid] = rows
            return out
        raise AssertionError(kind)

    def global_shape(self, name: str, local_shape: torch.Size) -> tuple[int, ...]:
        """The checkpoint tensor's whole shape from the rank's part of it (random weights draw the
        whole tensor and take the part, so that any number of ranks serves the same model)."""
        kind = split_of(name) if self.size > 1 else None
        shape = list(local_shape)
        if kind == "rows":
            shape[0] *= self.size
        elif kind == "cols":
            shape[-1] *= self.size
        elif kind == "kv":
            shape[0] = self.config.num_key_value_heads * self.config.head_dim
        elif kind == "experts_gate_up":
            shape[1] *= self.size
        elif kind == "experts_down":
            shape[2] *= self.size
        elif kind == "vocab":
            shape[0] = self.config.vocab_size
        return tuple(shape)
