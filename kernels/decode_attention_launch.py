"""How the one-launch decode attention (kernels/decode_attention.py) is launched: which decode steps
it serves against rotary + paged attention, its warps, and the kernel's shape constants. Measured
choices, each with the run it comes from.
"""

from __future__ import annotations

import torch
import triton

from strata.kernels.paged_attention import _device_sm_count


def decode_attention_supported(head_dim: int, dtype: torch.dtype) -> bool:
    """Head sizes whose rotary halves feed a tensor-core dot (>= 16 wide), up to the D = 128 its
    tiles were sized for (Gemma 3's D = 256 takes rotary + paged attention), and the dtypes it takes."""
    return (
        32 <= head_dim <= 128
        and head_dim & (head_dim - 1) == 0
        and dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


def kernel_constants(
    num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int, tile_n: int, splits: int
) -> dict:
    """The kernel's shape constexprs (also what tests/test_decode_attention.py compiles for sm_90)."""
    group = num_q_heads // num_kv_heads
    group_padded = triton.next_power_of_2(group)
    return dict(
        NUM_Q_HEADS=num_q_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        BLOCK_M=max(16, group_padded),
        HEAD_DIM=head_dim,
        HALF=head_dim // 2,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=splits,
        SPLITS_PADDED=triton.next_power_of_2(splits),
        GROUP_PADDED=group_padded,
        # The merge's acc chunk: GROUP_PADDED x SPLIT_CHUNK x D float32, 16 KB of registers.
        SPLIT_CHUNK=min(triton.next_power_of_2(splits), max(1, 4096 // (group_padded * head_dim))),
    )


# (Sequence, KV head) pairs per SM up to which the one launch beats rotary + paged attention (+
# merge), as `python -m strata.bench.decode_chain --batches 1,...,256` measured it on the 1B and 8B
# shapes (bench/RESULTS.md): the 1B (D = 64) to batch 64, the 8B (D = 128) to batch 16. Below this
# the launches' latency is what the fusion saves; above it the attention is bandwidth-bound and the
# rotary launch it saves is worth about what it loses.
MAX_PAIRS_PER_SM = {64: 4, 128: 1}

# Split launches at D = 128 take 8 warps up to this many pairs, 4 beyond. With few pairs each
# program streams a tile or two, latency-bound, and 8 warps issue its loads sooner; with more,
# programs share SMs and 8 warps' registers keep too few resident. The 8B's step with 4 warps
# against 8: 1.3% slower at batch 1 (8 pairs), 0.6-3.1% faster at batches 2-16 (bench/RESULTS.md,
# "A tensor-parallel rank alone on one GPU").
WIDE_PROGRAMS_MAX_PAIRS = 8


def decode_attention_serves(
    num_seqs: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether the one launch is the faster way for a decode step of num_seqs sequences (see
    MAX_PAIRS_PER_SM), and one it takes (decode_attention_supported)."""
    if not decode_attention_supported(head_dim, dtype):
        return False
    per_sm = MAX_PAIRS_PER_SM[64 if head_dim <= 64 else 128]
    return num_seqs * num_kv_heads <= per_sm * _device_sm_count(device)


def num_warps(head_dim: int, pairs: int) -> int:
    """2 warps at D <= 64 (as paged decode attention); at D = 128, 8 for a few (sequence, KV head)
    pairs, 4 beyond (WIDE_PROGRAMS_MAX_PAIRS; 2 would take 255 registers a thread, spilling)."""
    if head_dim < 128:
        return 2
    return 8 if pairs <= WIDE_PROGRAMS_MAX_PAIRS else 4
