"""How the attention kernels are launched, from python ints only (launches stay capturable and
deterministic: no autotune): paged attention's tiles, warps and KV splits
(kernels/paged_attention.py), and which decode steps the one-launch decode attention serves and
with what (kernels/decode_attention.py). Measured choices, each with the run it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from strata.kernels.kernel_launch import device_sm_count


@dataclass(frozen=True)
class AttentionLaunchConfig:
    """Tile shapes and launch knobs; choose_launch_config picks them from python ints only."""

    block_q: int  # query tokens per program
    tile_n: int  # key positions per inner-loop step (>= 16 for tl.dot)
    num_kv_splits: int  # 1 = single pass; > 1 = split-KV + reduce
    num_warps: int = 4
    num_stages: int = 3
    unmasked_full_tiles: bool = True  # False: every tile takes the causal masks (benchmarks' baseline)


MAX_KV_SPLITS = 64  # the most splits the heuristic picks (each a compiled variant)
# The programs per SM that a latency-bound decode launch's KV splits aim at (choose_launch_config).
# 4 was the fastest whole 8B step at batches 8 and 16, one GPU and a TP2 rank, against 2, 8 and 16
# (bench/RESULTS.md, session 22).
KV_SPLIT_PROGRAMS_PER_SM = 4


def choose_launch_config(
    *,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_query_len: int,
    max_seq_len: int,
    sm_count: int,
    num_kv_splits: int | None = None,
    min_query_len: int = 1,
) -> AttentionLaunchConfig:
    """Shape heuristics (no autotune: launches must stay capturable and deterministic).

    num_kv_splits: None = automatic, 1 = force the single-pass kernel, n > 1 = force n splits.
    min_query_len: the shortest query of the launch (a host-side bound, 1 when unknown).
    """
    group = num_q_heads // num_kv_heads
    # Aim for 64 rows (tokens x group heads) in the dot; a decode-only batch uses one token per
    # program (rows padded to 16). Only these two values: each block_q is a compiled variant, and
    # one per query length would compile (for a second each) in the middle of serving. Tiles of
    # 64 keys, 3 stages: the K/V loads (including the block-table gather they depend on) are
    # software-pipelined; this stays spill-free at D=128.
    block_q = 1 if max_query_len == 1 else max(1, 64 // group)
    if num_kv_splits is None:
        num_kv_splits = 1
        programs = num_seqs * num_kv_heads
        if max_query_len == 1 and programs < 2 * sm_count:
            # Too few programs to keep every SM's loads in flight: cut each context into splits,
            # aiming at ~4 programs per SM, down to one 64-key tile per split. A program of a few
            # tiles is latency-bound (each tile waits on a block-table load, then on K/V), so more,
            # shorter splits win at batch 1, merge included (bench_attention.py --cases small;
            # figures: bench/RESULTS.md, "Figures moved from code comments").
            want = triton.cdiv(KV_SPLIT_PROGRAMS_PER_SM * sm_count, programs)
            most = triton.next_power_of_2(triton.cdiv(max_seq_len, 64))
            num_kv_splits = min(want, most, MAX_KV_SPLITS)
            # Powers of two only: bounds the number of compiled variants.
            num_kv_splits = 1 << (num_kv_splits.bit_length() - 1)
    assert num_kv_splits >= 1
    if head_dim > 128:
        # D = 256 (Gemma 3): the D <= 128 tiles spill at twice the head width on sm_90. Half the
        # keys per tile and twice the warps keep each thread's share of K, V and the accumulator
        # as it was, spill-free (compile_check --strict).
        if block_q == 1:
            return AttentionLaunchConfig(block_q=1, tile_n=32, num_kv_splits=num_kv_splits, num_warps=4, num_stages=2)
        return AttentionLaunchConfig(block_q=block_q, tile_n=32, num_kv_splits=num_kv_splits, num_warps=8, num_stages=3)
    if block_q == 1:
        # Decode: a 16-row dot per tile, so the loads are the whole job; 2 warps per program keep
        # more programs resident per SM, which was faster at every batch swept (bench_attention.py;
        # figures: bench/RESULTS.md, "Figures moved from code comments").
        return AttentionLaunchConfig(block_q=1, tile_n=64, num_kv_splits=num_kv_splits, num_warps=2, num_stages=2)
    if head_dim <= 128 and min_query_len >= 128 // group:
        # Prefill where every sequence fills a 128-row block: 8 warps, 2 stages, faster than 64
        # rows, 4 warps, 3 stages on every prefill case measured, D = 128 included
        # (bench_attention.py --cases prefill --candidates). Not beside short queries: decodes in
        # the launch (one token in a block of 32) leave most of the 128 rows idle, and the 64-row
        # launch was faster there (--cases mixed). Figures: bench/RESULTS.md, "Figures moved from
        # code comments".
        return AttentionLaunchConfig(
            block_q=max(1, 128 // group), tile_n=64, num_kv_splits=num_kv_splits, num_warps=8, num_stages=2
        )
    return AttentionLaunchConfig(block_q=block_q, tile_n=64, num_kv_splits=num_kv_splits, num_warps=4, num_stages=3)


# ---------------------------------------------------------------- the one-launch decode attention


def decode_attention_supported(head_dim: int, dtype: torch.dtype) -> bool:
    """Head sizes whose rotary halves feed a tensor-core dot (>= 16 wide), up to the D = 128 its
    tiles were sized for (Gemma 3's D = 256 takes rotary + paged attention), and the dtypes it takes."""
    return (
        32 <= head_dim <= 128
        and head_dim & (head_dim - 1) == 0
        and dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


def decode_kernel_constants(
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
    return num_seqs * num_kv_heads <= per_sm * device_sm_count(device)


def decode_num_warps(head_dim: int, pairs: int) -> int:
    """2 warps at D <= 64 (as paged decode attention); at D = 128, 8 for a few (sequence, KV head)
    pairs, 4 beyond (WIDE_PROGRAMS_MAX_PAIRS; 2 would take 255 registers a thread, spilling)."""
    if head_dim < 128:
        return 2
    return 8 if pairs <= WIDE_PROGRAMS_MAX_PAIRS else 4
