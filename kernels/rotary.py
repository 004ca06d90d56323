"""Rotate-half (GPT-NeoX / HF Llama) rotary embedding of queries and keys, in place, one kernel.

The torch path indexes the cos/sin tables by position (2 gathers), then per tensor slices,
multiplies, adds and concatenates (~8 kernels for q and k). Here one program per token loads its
position's cos/sin row once and rotates every query and key head of that token where they lie,
typically strided views of the fused qkv projection, so nothing is allocated.

Each product and sum is rounded to the activation dtype as the torch ops do: with bf16 inputs the
result equals the torch path bit for bit (products of two bf16 values are exact in float32).
No host synchronisation: capturable in a CUDA graph for any (padded) token count. Positions are
clamped into the table, so a padding token holding a stale or garbage position never reads out of
bounds (the torch path would raise instead).

Given the weights of q and k norms (Qwen3, Gemma 3), each head of the token is RMS-normalised
over its head_dim before it is rotated, rounded where HF's Qwen3RMSNorm / Gemma3RMSNorm round: the
norm costs no launch and no pass over q and k of its own.

Given a KV cache, the same launch also stores the token's rotated keys and its values into their
cache slot (what kernels/kv_cache_write.py does alone): the keys go from registers straight to the
cache, never back into the projection. At batch 1 every launch is a few microseconds of latency
however little it moves, so fusing the two saves one launch per layer (16-32 per decode step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from strata.kernels.dependent_launch import dependent_launch_supported, launch_options
from strata.kernels.reference import rotary_embedding_reference

__all__ = ["rotary_embedding_", "rotary_embedding_reference"]


@triton.jit
def _rotated_heads(
    base_ptr,
    stride_head,
    cos,
    sin,
    norm_ptr,
    norm_eps,
    NUM_HEADS: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,
    QK_NORM: tl.constexpr,
    NORM_UNIT_OFFSET: tl.constexpr,
):
    """The halves (x1 cos - x2 sin, x2 cos + x1 sin) of every head of one token, in its dtype,
    with the mask of real (head, dim) pairs; with QK_NORM, of each head RMS-normalised first."""
    heads = tl.arange(0, HEADS_PADDED)
    dims = tl.arange(0, HALF_PADDED)
    mask = (heads < NUM_HEADS)[:, None] & (dims < HALF)[None, :]
    first_ptrs = base_ptr + heads[:, None] * stride_head + dims[None, :]
    x1 = tl.load(first_ptrs, mask=mask, other=0.0)
    x2 = tl.load(first_ptrs + HALF, mask=mask, other=0.0)
    if QK_NORM:
        w1, w2 = norm_weight_halves(norm_ptr, dims, HALF)
        x1, x2 = normed_halves(x1, x2, w1, w2, norm_eps, HALF, NORM_UNIT_OFFSET)
    first, second = rotate_halves(x1, x2, cos, sin)
    return first, second, mask


@triton.jit
def norm_weight_halves(weight_ptr, dims, HALF: tl.constexpr):
    """A q/k norm's weight [2 HALF] as its halves [1, len(dims)] in float32 (padding zero), for
    normed_halves. Shared with kernels/decode_attention.py, which loads them before its wait."""
    w1 = tl.load(weight_ptr + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(weight_ptr + HALF + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
    return w1, w2


@triton.jit
def normed_halves(x1, x2, w1, w2, eps, HALF: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """Both halves of each head [heads, HALF] RMS-normalised over the head (2 HALF values) with
    the weight's halves w1, w2 (norm_weight_halves), in x's dtype, rounded as kernels/rmsnorm.py's
    rows (padding zero). Shared with kernels/decode_attention.py."""
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    inv_rms = tl.math.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)[:, None]
    if UNIT_OFFSET:  # Gemma: (1 + w) * normed, nothing rounded in between
        return (a * inv_rms * (1.0 + w1)).to(dtype), (b * inv_rms * (1.0 + w2)).to(dtype)
    # Qwen3 (Llama's RMSNorm): the normed head rounded to x's dtype, then times the weight.
    normed1 = (a * inv_rms).to(dtype).to(tl.float32)
    normed2 = (b * inv_rms).to(dtype).to(tl.float32)
    return (w1 * normed1).to(dtype), (w2 * normed2).to(dtype)


@triton.jit
def rotate_halves(x1, x2, cos, sin):
    """(x1 cos - x2 sin, x2 cos + x1 sin) in x's dtype, each product rounded to it first as the
    torch ops round (cos, sin: float32, broadcastable). Shared with kernels/decode_attention.py."""
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    x1_cos = (x1 * cos).to(dtype).to(tl.float32)
    x2_sin = (x2 * sin).to(dtype).to(tl.float32)
    x2_cos = (x2 * cos).to(dtype).to(tl.float32)
    x1_sin = (x1 * sin).to(dtype).to(tl.float32)
    return (x1_cos - x2_sin).to(dtype), (x2_cos + x1_sin).to(dtype)


@triton.jit
def _store_halves(
    base_ptr,
    stride_head,
    first,
    second,
    mask,
    HEADS_PADDED: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PADDED)
    dims = tl.arange(0, HALF_PADDED)
    first_ptrs = base_ptr + heads[:, None] * stride_head + dims[None, :]
    tl.store(first_ptrs, first.to(base_ptr.dtype.element_ty), mask=mask)
    tl.store(first_ptrs + HALF, second.to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    query_ptr,
    key_ptr,
    value_ptr,
    cos_ptr,
    sin_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    q_norm_ptr,
    k_norm_ptr,
    norm_eps,
    stride_query_t,
    stride_query_h,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_cos,
    stride_sin,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    num_positions,
    NUM_Q_HEADS: tl.constexpr,
    Q_HEADS_PADDED: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    KV_HEADS_PADDED: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PADDED: tl.constexpr,
    WRITE_KV: tl.constexpr = False,
    BLOCK_SIZE: tl.constexpr = 1,
    PDL: tl.constexpr = False,
    QK_NORM: tl.constexpr = False,
    NORM_UNIT_OFFSET: tl.constexpr = False,
):
    token = tl.program_id(0).to(tl.int64)
    if PDL:
        gdc_launch_dependents()
    # Positions (a step input) and the tables are no kernel's output: read before the wait.
    position = tl.load(positions_ptr + token).to(tl.int64)
    position = tl.minimum(tl.maximum(position, 0), num_positions - 1)
    dims = tl.arange(0, HALF_PADDED)
    dim_mask = dims < HALF
    cos = tl.load(cos_ptr + position * stride_cos + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + position * stride_sin + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
    if PDL:
        gdc_wait()  # q, k, v come from the projection before this launch
    query = query_ptr + token * stride_query_t
    q1, q2, q_mask = _rotated_heads(
        query,
        stride_query_h,
        cos,
        sin,
        q_norm_ptr,
        norm_eps,
        NUM_Q_HEADS,
        Q_HEADS_PADDED,
        HALF,
        HALF_PADDED,
        QK_NORM,
        NORM_UNIT_OFFSET,
    )
    _store_halves(query, stride_query_h, q1, q2, q_mask, Q_HEADS_PADDED, HALF, HALF_PADDED)
    key = key_ptr + token * stride_key_t
    k1, k2, kv_mask = _rotated_heads(
        key,
        stride_key_h,
        cos,
        sin,
        k_norm_ptr,
        norm_eps,
        NUM_KV_HEADS,
        KV_HEADS_PADDED,
        HALF,
        HALF_PADDED,
        QK_NORM,
        NORM_UNIT_OFFSET,
    )
    if not WRITE_KV:
        _store_halves(key, stride_key_h, k1, k2, kv_mask, KV_HEADS_PADDED, HALF, HALF_PADDED)
    else:
        # The cache page of (block, KV head) is [BLOCK_SIZE, D]; slot -1 = padding, not stored.
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            slot_offset = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot
            _store_halves(
                key_cache_ptr + slot_offset, stride_cache_head, k1, k2, kv_mask, KV_HEADS_PADDED, HALF, HALF_PADDED
            )
            heads = tl.arange(0, KV_HEADS_PADDED)
            value = value_ptr + token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :]
            v1 = tl.load(value, mask=kv_mask)
            v2 = tl.load(value + HALF, mask=kv_mask)
            _store_halves(
                value_cache_ptr + slot_offset, stride_cache_head, v1, v2, kv_mask, KV_HEADS_PADDED, HALF, HALF_PADDED
            )


def rotary_embedding_(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    *,
    value: torch.Tensor | None = None,
    kv_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None,
) -> None:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] in place by positions [T] (int32/int64).

    cos_cache / sin_cache: [max_pos, D/2] in the activation dtype. query and key may be strided
    views (e.g. of one fused qkv tensor) but must not overlap; the last dim must be contiguous.

    With kv_cache [2, num_blocks, Hkv, block_size, D] (value [T, Hkv, D] and slot_mapping [T]
    int64 given too): the rotated keys and the values are stored at slot_mapping (slots < 0
    skipped) as write_kv_cache would, and key itself is left unrotated.

    qk_norm (q weight [D], k weight [D], eps, unit_offset): each head of query and key is
    RMS-normalised with its weight first (rms_norm_reference's rounding; unit_offset: Gemma's).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    half = head_dim // 2
    assert head_dim % 2 == 0 and key.shape == (num_tokens, num_kv_heads, head_dim), (query.shape, key.shape)
    assert positions.shape == (num_tokens,), positions.shape
    assert cos_cache.shape[1] == half and sin_cache.shape == cos_cache.shape, (cos_cache.shape, sin_cache.shape)
    assert query.dtype == key.dtype, (query.dtype, key.dtype)
    assert query.stride(-1) == 1 and key.stride(-1) == 1, "head dims must be contiguous"
    assert cos_cache.stride(-1) == 1 and sin_cache.stride(-1) == 1
    write_kv = kv_cache is not None
    assert write_kv == (value is not None) == (slot_mapping is not None), "value, kv_cache and slot_mapping go together"
    if write_kv:
        assert value.shape == key.shape and value.stride(-1) == 1, (value.shape, key.shape)
        assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
        assert kv_cache.shape[2] == num_kv_heads and kv_cache.shape[4] == head_dim, (kv_cache.shape, key.shape)
        assert kv_cache.stride(-1) == 1 and slot_mapping.shape == (num_tokens,), slot_mapping.shape
    if qk_norm is not None:
        assert qk_norm[0].shape == qk_norm[1].shape == (head_dim,), (qk_norm[0].shape, head_dim)
    if num_tokens == 0:
        return
    q_heads_padded = triton.next_power_of_2(num_q_heads)
    half_padded = triton.next_power_of_2(half)
    # ~8 query elements per thread: 4 warps for 32 heads of 64, 8 for 64 heads of 128.
    num_warps = min(8, max(1, q_heads_padded * half_padded // 256))
    key_cache, value_cache = (kv_cache[0], kv_cache[1]) if write_kv else (key, key)
    pdl = dependent_launch_supported(query.device)
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        value if write_kv else key,
        cos_cache,
        sin_cache,
        key_cache,
        value_cache,
        slot_mapping if write_kv else positions,
        qk_norm[0] if qk_norm else cos_cache,  # not read without QK_NORM
        qk_norm[1] if qk_norm else cos_cache,
        qk_norm[2] if qk_norm else 0.0,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0) if write_kv else 0,
        value.stride(1) if write_kv else 0,
        cos_cache.stride(0),
        sin_cache.stride(0),
        # key_cache is [NB, Hkv, BS, D]: block, slot-in-block, head strides.
        *((key_cache.stride(0), key_cache.stride(2), key_cache.stride(1)) if write_kv else (0, 0, 0)),
        cos_cache.shape[0],
        NUM_Q_HEADS=num_q_heads,
        Q_HEADS_PADDED=q_heads_padded,
        NUM_KV_HEADS=num_kv_heads,
        KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HALF=half,
        HALF_PADDED=half_padded,
        WRITE_KV=write_kv,
        BLOCK_SIZE=kv_cache.shape[3] if write_kv else 1,
        PDL=pdl,
        QK_NORM=qk_norm is not None,
        NORM_UNIT_OFFSET=bool(qk_norm and qk_norm[3]),
        num_warps=num_warps,
        **launch_options(pdl),
    )
