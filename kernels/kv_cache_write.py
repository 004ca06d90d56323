"""Write the new tokens' keys and values into the paged KV cache: one Triton kernel for both.

One program per token moves its [Hkv, D] key and value rows into slot_mapping[t]; a slot of -1
(padding, e.g. a CUDA-graph batch padded to a fixed size) is skipped, so the launch shape only
depends on the number of tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.reference import write_kv_cache_reference

__all__ = ["write_kv_cache", "write_kv_cache_reference"]


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, HEADS_PADDED)
    dims = tl.arange(0, HEAD_DIM)
    head_mask = (heads < NUM_KV_HEADS)[:, None]

    key = tl.load(key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :], mask=head_mask)
    value = tl.load(
        value_ptr + token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :], mask=head_mask
    )
    cache_offsets = (
        block * stride_cache_block + offset * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]
    )
    tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=head_mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=head_mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value [T, Hkv, D] at slot_mapping [T] (int64, -1 = skip) of kv_cache [2, NB, Hkv, BS, D]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, (value.shape, key.shape)
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, kv_cache.shape
    assert kv_cache.shape[2] == num_kv_heads and kv_cache.shape[4] == head_dim, (kv_cache.shape, key.shape)
    assert slot_mapping.shape == (num_tokens,), slot_mapping.shape
    assert head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two, got {head_dim}"
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        # key_cache is [NB, Hkv, BS, D]: block, slot-in-block, head strides.
        key_cache.stride(0),
        key_cache.stride(2),
        key_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PADDED=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[3],
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )
