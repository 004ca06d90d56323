"""The mixture of experts that replaces the MLP in Qwen3-MoE and Mixtral layers.

    logits = gate(x)                                  the router, [T, E]
    weights, ids = top-k of softmax(logits)           renormalised when the config says (norm_topk_prob)
    out = sum over the k chosen experts e of weight * down_e(silu(gate_e(x)) * up_e(x))

On CUDA the Triton kernels of kernels/fused_moe.py (one routing launch, then the tokens grouped by
expert and both GEMMs without a loop over experts, no host synchronisation: it runs inside the
decode and piecewise CUDA graphs); elsewhere their torch references (HF's expert loop).

The experts' weights are stacked as transformers 5 holds them: gate_up_proj [E, 2I, H] (each
expert's gate rows, then its up rows) and down_proj [E, H, I]. Room for the parallel layouts to
come: tensor parallelism shards I (rows of each half of gate_up_proj, columns of down_proj; the
kernel takes any I), expert parallelism holds a range of experts and sets expert_map (global id
-> local expert, -1 elsewhere: those pairs add nothing here and come from the other ranks' sums).
"""

from __future__ import annotations

import torch
from torch import nn

from strata.kernels.reference import fused_moe_reference, select_experts_reference
from strata.services.worker.model.layers import FusedKernelSwitch, Linear, empty_param
from strata.services.worker.model.model_config import ModelConfig


class FusedExperts(nn.Module):
    """The E experts' SiLU-gated MLPs as two stacked parameters (HF 5's Qwen3MoeExperts layout)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, device, dtype) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = empty_param(num_experts, 2 * intermediate_size, hidden_size, device=device, dtype=dtype)
        self.down_proj = empty_param(num_experts, hidden_size, intermediate_size, device=device, dtype=dtype)


class SparseMoE(FusedKernelSwitch, nn.Module):
    """Router (gate) and experts of one layer: HF's Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock."""

    def __init__(self, config: ModelConfig, device, dtype, reduce=None) -> None:
        """reduce: tensor parallelism's group, over which the experts' outputs are summed (each
        rank holds its part of every expert's intermediate dim: model/sharding.py)."""
        super().__init__()
        self.reduce = reduce if reduce is not None and reduce.size > 1 else None
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        # Qwen3-MoE rounds the routing weights to the logits' dtype; Mixtral keeps them float32.
        self.round_weights = config.router_weights_in_model_dtype
        self.gate = Linear(config.hidden_size, config.num_experts, False, device, dtype)
        self.experts = FusedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size, device, dtype)
        # Expert parallelism: [E] int32 global id -> local expert (-1: another rank's). None: all here.
        self.expert_map: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weight_dtype = logits.dtype if self.round_weights else None
        w13, w2 = self.experts.gate_up_proj, self.experts.down_proj
        if self._use_fused(x):
            from strata.kernels.fused_moe import fused_moe  # Triton: imported on first use
            from strata.kernels.moe_routing import select_experts

            weights, ids = select_experts(logits, self.top_k, self.renormalize, weight_dtype=weight_dtype)
            out = fused_moe(x, w13, w2, weights, ids, expert_map=self.expert_map)
        else:
            weights, ids = select_experts_reference(logits, self.top_k, self.renormalize, weight_dtype=weight_dtype)
            out = fused_moe_reference(x, w13, w2, weights, ids, expert_map=self.expert_map)
        return out if self.reduce is None else self.reduce.all_reduce_(out)

    def forward_one_token(self, h: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """forward(norm(h)) for the decode chain's one token: the router GEMV with the norm in its
        prologue and one launch for the rest (kernels/decode_moe.py) where they serve, else the
        norm and forward."""
        from strata.kernels import decode_moe  # Triton: imported on first use

        w13, w2 = self.experts.gate_up_proj, self.experts.down_proj
        if not decode_moe.decode_moe_serves(h, w13, w2, self.top_k, self.gate.weight.shape[0]):
            return self(norm(h))
        out = decode_moe.decode_moe(
            h,
            norm.weight,
            norm.eps,
            self.gate.weight,
            w13,
            w2,
            top_k=self.top_k,
            renormalize=self.renormalize,
            weight_dtype=h.dtype if self.round_weights else None,
            expert_map=self.expert_map,
        )
        return out if self.reduce is None else self.reduce.all_reduce_(out)
