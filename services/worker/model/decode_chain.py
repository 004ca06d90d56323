"""The shard's forward for batch-1 decode steps: a chain of fused GEMV kernels.

Per layer, five launches instead of ten (kernels/decode_linear.py says why that matters at batch 1):

    qkv     = norm_linear(h)                     input RMSNorm in qkv's prologue
    attn    = Attention.attend(qkv)              rotary, KV write, split-KV attention and merge in one
                                                 launch (kernels/decode_attention.py, as small decode
                                                 batches do); where it does not serve (sliding windows,
                                                 cascades, small heads), three kernels
    h       = linear_add_residual(attn, o_proj)  the residual add in o_proj's epilogue
    gate_up = norm_linear(h)                     post-attention RMSNorm in gate_up's prologue
    h       = linear_add_residual(gate_up, down, silu_mul=True)

A layer of experts (Qwen3-MoE, Mixtral) runs as kernels/decode_moe.py's two launches: the
router GEMV with the post-attention RMSNorm in its prologue, then one persistent launch that
routes and streams every chosen expert's gate/up and down; its output and h go to the next
layer's qkv prologue as a (hidden, residual) pair, as a stage's first layer takes them. Q/k
norms (Qwen3) go into the one-launch decode attention, before its rotary.

h is the residual stream after each add (what the unfused path calls `residual` once the add is
done). The stage's interface stays the unfused one: the first layer takes the (hidden,
residual) pair as given (residual None on the first stage) and adds it in qkv's prologue; the
last layer returns (down's output, h), which the next stage or compute_logits adds and
normalises. On Hopper every kernel of the chain is a programmatic dependent launch
(kernels/dependent_launch.py).

With tensor parallelism o_proj and down are row-parallel: rank 0 adds the residual in the
epilogue as above, the other ranks only project, and one all-reduce sums them, so the residual is
added once (h + the ranks' partial products); the last layer's down output is all-reduced too.
The prologues read the replicated h. With the ipc one-shot, o_proj and down send their output
rows to the peers as each program ends, and the one-shot's launch only waits and adds
(kernels/one_shot_all_reduce.py, "Sent early"). NCCL's kernels break the chain's dependent
launches there.
"""

from __future__ import annotations

import torch

from strata.services.worker.model.moe import SparseMoE


def _kernels():
    # On first use: triton.jit reads TRITON_INTERPRET when the kernels are defined.
    from strata.kernels import decode_linear

    return decode_linear


def chain_serves(hidden: torch.Tensor, shard) -> bool:
    """Whether the chain can run this batch: layers it takes (no Gemma norms, activation or logit
    cap: ModelConfig.decode_chain_layout), one token, of a dtype and weights it takes."""
    return shard.config.decode_chain_layout and _kernels().use_decode_linear(
        hidden, shard.layers[0].self_attn.qkv_proj.weight
    )


def decode_chain_forward(
    shard,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    positions: torch.Tensor,
    kv_caches: list[torch.Tensor],
    meta,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CausalLMShard.forward's layers for a small batch; returns the unfused (hidden, residual) pair."""
    k = _kernels()
    last = len(shard.layers) - 1
    for i, (layer, kv_cache) in enumerate(zip(shard.layers, kv_caches)):
        attn, mlp = layer.self_attn, layer.mlp
        norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
        # The stage's first layer, and a layer after experts, add the pair; others get h, added already.
        qkv, h = k.norm_linear(
            hidden, attn.qkv_proj.weight, attn.qkv_proj.bias, norm1.weight, norm1.eps, residual=residual
        )
        out = attn.attend(qkv, positions, shard.rotary_for(layer), kv_cache, meta, shard.attn_backend)
        h = _add_row_parallel(k, shard.tp, out, attn.o_proj, h)
        if isinstance(mlp, SparseMoE):
            hidden, residual = mlp.forward_one_token(h, norm2), h  # the experts' all-reduce is the layer's own
            if i == last:
                return hidden, h
            continue
        gate_up, _ = k.norm_linear(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, norm2.weight, norm2.eps)
        if i == last:  # down's output and h go out as the unfused pair: no add here
            return _add_row_parallel(k, shard.tp, gate_up, mlp.down_proj, None, silu_mul=True), h
        hidden, residual = _add_row_parallel(k, shard.tp, gate_up, mlp.down_proj, h, silu_mul=True), None
    raise AssertionError("a shard has at least one layer")


def _add_row_parallel(k, tp, x: torch.Tensor, linear, h: torch.Tensor | None, silu_mul: bool = False):
    """linear(x) + h (h None: linear(x)): in the epilogue, or with tensor parallelism on rank 0
    only, then summed; the GEMV sends its rows to the peers itself where the one-shot takes them."""
    sender = None if tp is None else tp.early_sender(linear.weight.shape[0] * x.shape[0], x.dtype)
    send_to = None if sender is None else sender.exchange
    if h is not None and (tp is None or tp.rank == 0):
        y = k.linear_add_residual(x, linear.weight, linear.bias, h, silu_mul=silu_mul, send_to=send_to)
    else:
        y = (k.silu_mul_linear if silu_mul else k.plain_linear)(x, linear.weight, linear.bias, send_to=send_to)
    return y if tp is None else tp.all_reduce_(y, sent=sender)


def decode_chain_logits(shard, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """The last stage's final norm (of hidden + residual) in lm_head's prologue."""
    logits, _ = _kernels().norm_linear(
        hidden, shard.lm_head.weight, None, shard.norm.weight, shard.norm.eps, residual=residual
    )
    return logits
