"""Torch references for the Triton kernels in this package: the oracle their tests compare against.

Plain float32 math, one sequence at a time: slow, obvious, and free of host-sync concerns
(they call .tolist()), so never use them on a hot path.

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
    """Keys and values [seq_len, Hkv, D] of one sequence, in position order, as float32."""
    block_size = kv_cache.shape[3]
    positions = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_table_row.long()[positions // block_size]
    offsets = positions % block_size
    return kv_cache[0, blocks, :, offsets].float(), kv_cache[1, blocks, :, offsets].float()


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
    num_tokens, num_q_heads, _ = query.shape
    num_kv_heads = kv_cache.shape[2]
    group = num_q_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        q_begin, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        keys, values = gather_sequence_kv(kv_cache, block_tables[b], seq_len)
        # GQA: query head h reads kv head h // group.
        keys = keys.repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        q = query[q_begin:q_end].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_begin:q_end] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)
    return out


# --- decode hot path: RMSNorm, rotary embedding, SiLU-gated MLP activation -------------------
# These repeat services/worker/model.py's CPU math operation for operation, rounding to the
# activation dtype where it does (tests check both agree exactly), so a fused kernel that
# computes in float32 but rounds at the same points is compared against the HF-exact path.


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) with the normalisation in float32 and cast back before scaling (as HF)."""
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to the activation dtype."""
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual


def rotary_embedding_reference(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of query [T, Hq, D] and key [T, Hkv, D]; cos/sin caches [max_pos, D/2].

    Out of place; equals HF's x * cat(cos, cos) + rotate_half(x) * cat(sin, sin).
    """
    cos = cos_cache[positions].unsqueeze(1)
    sin = sin_cache[positions].unsqueeze(1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    return rotate(query), rotate(key)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] of shape [T, 2I] -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
