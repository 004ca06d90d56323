"""Torch references for the Triton kernels in this package: the oracle their tests compare against,
and the worker's CPU path (its torch attention backend and the model's torch code call them).

Plain math (attention in float32, one sequence at a time): slow, obvious, and free of host-sync
concerns (they call .tolist()), so never use them on the GPU's hot path.

Layout shared with the kernels:
  kv_cache      [2, num_blocks, num_kv_heads, block_size, head_dim]  (0 = keys, 1 = values)
  slot_mapping  int64 [T]: block_id * block_size + offset of each new token, -1 = skip
                (a (block, offset) number: a slot's heads are not adjacent in memory)
  query_start_loc int32 [B+1], seq_lens int32 [B] (cached + new tokens), block_tables int32 [B, max_blocks]
Token i of sequence b (q_len = qsl[b+1] - qsl[b]) sits at position seq_lens[b] - q_len + i and sees
keys at positions p with  position - sliding_window < p <= position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value [T, Hkv, D] into kv_cache at slot_mapping; slots < 0 are skipped."""
    block_size = kv_cache.shape[3]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    # Block and offset indices around the head slice: the indexed result is [T, Hkv, D].
    kv_cache[0, blocks, :, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[1, blocks, :, offsets] = value[keep].to(kv_cache.dtype)


def gather_sequence_kv(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [Hkv, seq_len, D] of one sequence, in position order, as float32."""
    num_kv_heads, block_size, head_dim = kv_cache.shape[2:]
    blocks = block_table_row[: -(-seq_len // block_size)].long()
    # Whole pages, then the tail of the last one cut: [2, blocks, Hkv, block_size, D] -> [2, Hkv, S, D].
    kv = kv_cache[:, blocks].transpose(1, 2).reshape(2, num_kv_heads, -1, head_dim)[:, :, :seq_len].float()
    return kv[0], kv[1]


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as strata.kernels.paged_attention.paged_attention, computed in float32 per sequence.

    max_query_len / max_seq_len are accepted for signature parity and not needed here.
    """
    del max_query_len, max_seq_len
    num_q_heads, head_dim = query.shape[1:]
    num_kv_heads = kv_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_begin, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        keys, values = gather_sequence_kv(kv_cache, block_tables[b], seq_len)
        # GQA: query head h reads KV head h // group. The group's heads are contiguous, so one
        # batched matmul per KV head covers them (faster on CPU than repeating K and V per head):
        # q [Hkv, group * q_len, D].
        q = query[q_begin:q_end].float().view(q_len, num_kv_heads, group, head_dim)
        q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
        scores = torch.bmm(q, keys.transpose(1, 2)) * scale  # [Hkv, group * q_len, S]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.view(num_kv_heads, group, q_len, seq_len).masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * q_len, seq_len)
        o = torch.bmm(probs, values).view(num_kv_heads, group, q_len, head_dim)
        out[q_begin:q_end] = o.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, head_dim).to(out.dtype)
    return out


def _attend_with_lse(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, allowed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T) v, logsumexp(q k^T)) for q [Hkv, R, D] over keys/values [Hkv, S, D]."""
    scores = torch.bmm(q, keys.transpose(1, 2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), values), torch.logsumexp(scores, dim=-1)


def cascade_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    groups,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """strata.kernels.cascade_attention's contract, computed as it is cut: each group's shared
    prefix attended once for all its queries (through one member's block table), each sequence's
    own keys past its prefix causally, the two merged by log-sum-exp. Equals
    paged_attention_reference when the groups are what they claim to be."""
    del max_query_len, max_seq_len
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[2]
    group = num_q_heads // num_kv_heads

    def heads_first(q: torch.Tensor) -> torch.Tensor:  # [n, Hq, D] -> [Hkv, group * n, D]
        n = q.shape[0]
        return q.float().view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, -1, head_dim)

    def tokens_first(o: torch.Tensor, n: int) -> torch.Tensor:  # the inverse, for [Hkv, group * n, ...]
        o = o.reshape(num_kv_heads, group, n, -1).permute(2, 0, 1, 3)
        return o.reshape(n, num_q_heads, -1)

    device = query.device
    own = torch.zeros(num_tokens, num_q_heads, head_dim, device=device)
    own_lse = torch.full((num_tokens, num_q_heads), float("-inf"), device=device)
    starts, prefixes = query_start_loc.tolist(), groups.seq_prefix_lens.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_begin, q_end, prefix = starts[b], starts[b + 1], prefixes[b]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        keys, values = gather_sequence_kv(kv_cache, block_tables[b], seq_len)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
        allowed = (torch.arange(prefix, seq_len, device=device)[None, :] <= q_pos[:, None]).repeat(group, 1)
        o, lse = _attend_with_lse(
            heads_first(query[q_begin:q_end]), keys[:, prefix:], values[:, prefix:], scale, allowed
        )
        own[q_begin:q_end] = tokens_first(o, q_len)
        own_lse[q_begin:q_end] = tokens_first(lse[..., None], q_len)[..., 0]

    merged = own
    token_start, rows = groups.token_start.tolist(), groups.table_rows.tolist()
    for g, prefix in enumerate(groups.prefix_lens.tolist()):
        begin, end = token_start[g], token_start[g + 1]
        if end == begin or prefix == 0:
            continue
        keys, values = gather_sequence_kv(kv_cache, block_tables[rows[g]], prefix)
        o, lse = _attend_with_lse(heads_first(query[begin:end]), keys, values, scale)
        o, lse = tokens_first(o, end - begin), tokens_first(lse[..., None], end - begin)[..., 0]
        total = torch.logaddexp(own_lse[begin:end], lse)
        merged[begin:end] = (
            own[begin:end] * (own_lse[begin:end] - total).exp()[..., None] + o * (lse - total).exp()[..., None]
        )
    if out is None:
        out = torch.empty_like(query)
    out.copy_(merged)
    return out


# --- decode hot path: RMSNorm, rotary embedding, SiLU-gated MLP activation -------------------
# services/worker/model/shard.py's torch path (CPU) is these functions, which follow HF transformers
# operation for operation, rounding to the activation dtype where it does: float32 greedy
# decoding equals HF's generate() (tests/test_model_shard.py), and a fused kernel that computes
# in float32 but rounds at the same points is compared against the HF-exact path.


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """weight * (x / rms(x)) with the normalisation in float32 and cast back before scaling (as HF's
    Llama). unit_offset: (1 + weight) * (x / rms(x)) all in float32, rounded once (HF's Gemma3RMSNorm)."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    if unit_offset:
        return (x32 * torch.rsqrt(variance + eps) * (1.0 + weight.float())).to(x.dtype)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to the activation dtype."""
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps, unit_offset), new_residual


def rotary_embedding_reference(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of query [T, Hq, D] and key [T, Hkv, D]; cos/sin caches [max_pos, D/2].

    Out of place; equals HF's x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), without the concats.
    """
    cos = cos_cache[positions].unsqueeze(1)
    sin = sin_cache[positions].unsqueeze(1)
    return _rotate_half(query, cos, sin), _rotate_half(key, cos, sin)


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] of shape [T, 2I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (HF's gelu_pytorch_tanh, Gemma's MLP) for gate_up = [gate | up] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def embed_tokens_reference(
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    token_rows: torch.Tensor | None = None,
    last_sampled: torch.Tensor | None = None,
) -> torch.Tensor:
    """weight[input_ids]; with token_rows and last_sampled, a placeholder id (< 0) is first replaced
    by the token the worker sampled last for that state row: last_sampled[token_rows]."""
    if token_rows is not None:
        input_ids = torch.where(input_ids < 0, last_sampled[token_rows], input_ids)
    return torch.nn.functional.embedding(input_ids, weight)


def logprob_rows_reference(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """Per row of logits [R, V] (any float dtype: compared as they are, reduced in float32) and
    its token `targets[r]`: (logsumexp float32 [R], rank int64 [R]: the entries at least as large
    as the token's, the token's logit float32 [R], top values float32 [R, k], top ids int64
    [R, k], largest first)."""
    log_norm = torch.logsumexp(logits.float(), dim=-1)
    target = logits.gather(1, targets.unsqueeze(1))
    ranks = (logits >= target).sum(dim=-1)
    if k:
        top_values, top_ids = logits.topk(k, dim=-1)
    else:
        top_values = logits.new_empty((logits.shape[0], 0))
        top_ids = torch.empty((logits.shape[0], 0), dtype=torch.int64, device=logits.device)
    return log_norm, ranks, target.squeeze(1).float(), top_values.float(), top_ids


# --- mixture of experts: routing and the experts' MLPs (kernels/fused_moe.py) -------------------
# HF transformers' (5.x) Qwen3MoeSparseMoeBlock and MixtralSparseMoeBlock, operation by operation,
# so in float32 the outputs are identical to HF's and in bf16 they round where HF rounds:
# - router: softmax over the logits in float32, top-k of the probabilities, optionally divided by
#   their sum (Qwen3-MoE's norm_topk_prob; Mixtral always). Qwen3-MoE then casts the weights to the
#   logits' dtype (bf16 when serving); Mixtral 5.x keeps them float32. `weight_dtype` says which.
# - experts, in ascending id order: gather the expert's tokens (slot-major, as torch.where on HF's
#   [k, T] mask orders them), gate_up linear, silu(gate) * up, down linear (each rounded to the
#   hidden dtype), times the routing weight, index_add_ into a zeroed output in the hidden dtype.
# Weights are stacked as HF 5.x stores them: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I].
# Host-synchronising (nonzero, per-expert loops): the CPU path, tests and benchmarks' naive baseline.


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
