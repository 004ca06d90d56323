"""Torch references for the fused mixture-of-experts layer (kernels/fused_moe.py): the oracle its
tests compare against, and a CPU path for the model code.

Kept apart from kernels/reference.py only while that file is being edited elsewhere; it belongs
there, beside the other references.

The math is HF transformers' (5.x) Qwen3MoeSparseMoeBlock and MixtralSparseMoeBlock, operation by
operation, so in float32 the outputs are identical to HF's and in bf16 they round where HF rounds:
- router: softmax over the logits in float32, top-k of the probabilities, optionally divided by
  their sum (Qwen3-MoE's norm_topk_prob; Mixtral always). Qwen3-MoE then casts the weights to the
  logits' dtype (bf16 when serving); Mixtral 5.x keeps them float32. `weight_dtype` says which.
- experts, in ascending id order: gather the expert's tokens (slot-major, as torch.where on HF's
  [k, T] mask orders them), gate_up linear, silu(gate) * up, down linear (each rounded to the
  hidden dtype), times the routing weight, index_add_ into a zeroed output in the hidden dtype.
Weights are stacked as HF 5.x stores them: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I].

Host-synchronising (nonzero, per-expert loops): tests, CPU and benchmarks' naive baseline only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["select_experts_reference", "fused_moe_reference"]


def select_experts_reference(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, *, weight_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's router on [T, E] logits -> (weights float32 [T, k], expert ids int32 [T, k]).

    weight_dtype: round the weights to this dtype as Qwen3MoeTopKRouter does (the logits' dtype);
    None keeps float32 (MixtralTopKRouter). The result is float32 either way."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    if weight_dtype is not None:
        weights = weights.to(weight_dtype).float()
    return weights, ids.to(torch.int32)


def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as strata.kernels.fused_moe.fused_moe: HF's expert loop.

    hidden [T, H]; w13 [E_local, 2I, H]; w2 [E_local, H, I]; topk_weights [T, k] (float32, or any
    dtype HF would multiply in); topk_ids [T, k] global expert ids. expert_map [E_global] int32
    maps a global id to this rank's local expert, -1 for experts held elsewhere (they add nothing);
    None means ids are local. Returns [T, H] in hidden's dtype (written into `out` if given)."""
    num_experts = w13.shape[0] if expert_map is None else expert_map.shape[0]
    intermediate = w2.shape[2]
    result = torch.zeros_like(hidden)
    expert_mask = F.one_hot(topk_ids.long(), num_classes=num_experts).permute(2, 1, 0)  # [E, k, T]
    hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    local_ids = hit[:, 0].tolist() if expert_map is None else expert_map[hit[:, 0]].tolist()
    for (expert,), local in zip(hit.tolist(), local_ids):
        if local < 0:
            continue  # held by another expert-parallel rank
        slot, token = torch.where(expert_mask[expert])
        gate_up = F.linear(hidden[token], w13[local])
        gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
        expert_out = F.linear(F.silu(gate) * up, w2[local])
        expert_out = expert_out * topk_weights[token, slot, None]
        result.index_add_(0, token, expert_out.to(result.dtype))
    if out is None:
        return result
    out.copy_(result)
    return out
