"""The decoder layer: input norm, attention, then the MLP or the mixture of experts behind its
norm, each with its residual add (layers.py's blocks, moe.py's experts).

The layer is cut at attention (before_attention, after_attention) for the piecewise CUDA graphs
(graphs/piecewise_graphs.py): what comes before and after it has launches that depend only on the
token count.
"""

from __future__ import annotations

import torch
from torch import nn

from strata.services.worker.model.attention import AttentionBackend, AttentionMetadata
from strata.services.worker.model.layers import MLP, Attention, RotaryEmbedding, rms_norm_for
from strata.services.worker.model.model_config import ModelConfig
from strata.services.worker.model.moe import SparseMoE


class DecoderLayer(nn.Module):
    """input norm, attention, then the MLP (or the experts) behind its norm, each with its residual
    add. With sandwich_norms (Gemma) the attention's and the MLP's outputs are normalised before
    their adds too, and the MLP's input norm is pre_feedforward_layernorm (HF's names, so that
    post_attention_layernorm is what each checkpoint calls it)."""

    def __init__(self, config: ModelConfig, layer_index: int, device, dtype, reduce=None) -> None:
        """reduce: the tensor-parallel group that sums the row-parallel outputs (o_proj, down,
        the experts'); config then the rank's (model/sharding.py)."""
        super().__init__()
        hidden = config.hidden_size
        self.input_layernorm = rms_norm_for(config, hidden, device, dtype)
        self.self_attn = Attention(config, layer_index, device, dtype, reduce=reduce)
        self.post_attention_layernorm = rms_norm_for(config, hidden, device, dtype)
        self.sandwich_norms = config.sandwich_norms
        if self.sandwich_norms:
            self.pre_feedforward_layernorm = rms_norm_for(config, hidden, device, dtype)
            self.post_feedforward_layernorm = rms_norm_for(config, hidden, device, dtype)
        moe = config.is_moe_layer(layer_index)
        self.mlp = SparseMoE(config, device, dtype, reduce=reduce) if moe else MLP(config, device, dtype, reduce=reduce)
        self.reduce = reduce if reduce is not None and reduce.size > 1 else None
        # Row-parallel outputs go unsummed into the norm after them, which sums them in its own
        # launch where the group's one-shot takes them (RMSNorm.add_and_norm's reduce): o_proj's
        # always, a dense MLP's into the next layer's input norm (Gemma's norm after the MLP, and
        # the experts, want the sum).
        self.defers_output_reduce = self.reduce is not None and not self.sandwich_norms and not moe

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        input_reduce=None,
        defer_output: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = self.before_attention(hidden, residual, input_reduce=input_reduce)
        attn = self.self_attn.attend(qkv, positions, rotary, kv_cache, meta, backend)
        return self.after_attention(attn, residual, defer_output=defer_output)

    def before_attention(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        in_place: bool = False,
        qkv_out: torch.Tensor | None = None,
        input_reduce=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input norm (with the residual add) and the qkv projection: (qkv, residual).
        input_reduce: the group over which hidden, the previous layer's deferred output
        (output_reduce), is still to be summed."""
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual, in_place, reduce=input_reduce)
        return self.self_attn.qkv_proj(hidden, out=qkv_out), residual

    def after_attention(
        self, attn: torch.Tensor, residual: torch.Tensor, in_place: bool = False, defer_output: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, the MLP's input norm (with the residual add) and the MLP: (hidden, residual).
        defer_output: a dense MLP's output stays this rank's partial; the next layer's
        before_attention sums it (input_reduce = output_reduce(True))."""
        if not self.sandwich_norms:
            out = self.self_attn.o_proj(attn, reduce=False)
            hidden, residual = self.post_attention_layernorm.add_and_norm(out, residual, in_place, reduce=self.reduce)
            if defer_output and self.defers_output_reduce:
                return self.mlp(hidden, reduce=False), residual
            return self.mlp(hidden), residual
        out = self.post_attention_layernorm(self.self_attn.o_proj(attn))
        hidden, residual = self.pre_feedforward_layernorm.add_and_norm(out, residual, in_place)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual

    def output_reduce(self, defer_output: bool):
        """The group over which after_attention(defer_output=...)'s hidden is still to be summed."""
        return self.reduce if defer_output and self.defers_output_reduce else None
