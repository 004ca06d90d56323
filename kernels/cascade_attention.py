"""Cascade attention: a batch whose sequences share prefixes reads each shared prefix's KV once
per shared-KV run of sequences, not once per sequence (FlashInfer's cascade, generalised to many
runs).

A shared-KV run (shared_kv_runs.py) is consecutive sequences in the batch whose first prefix_len
keys are the same KV blocks (an offline prefix group, n > 1 siblings, prefix-cache hits) and whose
queries all lie past that prefix, so no query needs a causal mask inside it. Attention then splits
in two:

- the shared prefix (`_shared_prefix_kernel`): a program owns BLOCK_T query tokens of one run
  times one KV head, packs tokens x the GQA group's heads into the M rows of its dots (as the
  paged kernel does), and walks the prefix's keys through one member's block table. A decode batch
  of 16 members makes one 64-row tile per KV head: the prefix is read once for all 16. The prefix
  can be cut into PREFIX_SPLITS parts computed in parallel (few runs, long prefixes);
- each sequence's own keys past its prefix: the paged kernel with a per-sequence key start.

The prefix kernel runs first and writes unnormalised softmax partials (acc, max, sum), one part
per prefix split; the paged kernel then attends each sequence's own keys and, in its epilogue,
folds those parts into its result by log-sum-exp (the split-KV merge's arithmetic, without a third
launch or a round trip of the own keys' partials through memory). Sequences outside any run
(prefix length 0) read no parts, so one launch of each kernel serves a mixed batch. On Hopper the
paged kernel is a programmatic dependent launch: its programs start on the SMs that the prefix
kernel's last programs leave idle, and wait for that grid only before the merge.

Grid sizes depend on python ints only (the same numbering trick as the paged kernel: run r owns
tile indices [(start_r - start_0) // BLOCK_T + r, ...)), so the launches are CUDA-graph safe with
fixed upper bounds and empty padding runs.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from strata.kernels.attention_launch import AttentionLaunchConfig, choose_launch_config
from strata.kernels.kernel_launch import device_sm_count
from strata.kernels.paged_attention import (
    _INTERPRETED,
    _LOG2E,
    Partials,
    _find_sequence,
    attend_tiles,
    check_attention_inputs,
    launch_paged_attention,
)
from strata.kernels.shared_kv_runs import SharedKVRuns

__all__ = ["SharedKVRuns", "PrefixLaunchConfig", "cascade_attention", "choose_prefix_config"]


# Prefix splits are 1, 2, 4 or 8: each is a variant of both kernels and of the merge, compiled
# before serving (compile_serving_variants).
MAX_PREFIX_SPLITS = 8


@dataclass(frozen=True)
class PrefixLaunchConfig:
    block_t: int  # query tokens per program (x the GQA group's heads = the dot's rows)
    prefix_splits: int  # parts of the prefix computed in parallel
    tile_n: int = 64
    num_warps: int = 4
    # Two stages beat three and four at every shape swept (bench/cascade_attention.py --sweep;
    # figures: bench/RESULTS.md, "Figures moved from code comments").
    num_stages: int = 2
    # Launch the own keys' kernel as a programmatic dependent of the prefix kernel (Hopper and
    # later): its programs fill the SMs that the prefix kernel's last wave leaves idle, and wait
    # for the prefix's partials only in their epilogue.
    overlap: bool = True


def choose_prefix_config(
    *,
    num_runs: int,
    max_run_tokens: int,
    max_prefix_len: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    sm_count: int,
    prefix_splits: int | None = None,
) -> PrefixLaunchConfig:
    """64-row tiles as in the paged kernel's prefill path. Splits while fewer than ~2 programs
    per SM would stream the prefixes (each split adds a round trip of its partials), at least
    256 keys each, powers of two (each value is a compiled variant of both kernels). Programs
    with work: one per run and KV head, more for runs of over block_t tokens. At D = 256 half the
    keys per tile and twice the warps, as the paged kernel takes them (spill-free on sm_90)."""
    block_t = max(1, 64 // (num_q_heads // num_kv_heads))
    if not prefix_splits:
        programs = max(num_runs, triton.cdiv(max_run_tokens, block_t)) * num_kv_heads
        want = triton.cdiv(2 * sm_count, max(programs, 1))
        prefix_splits = max(1, min(want, max_prefix_len // 256, MAX_PREFIX_SPLITS))
        prefix_splits = 1 << (prefix_splits.bit_length() - 1)
    assert prefix_splits >= 1
    if head_dim > 128:
        return PrefixLaunchConfig(block_t=block_t, prefix_splits=prefix_splits, tile_n=32, num_warps=8)
    return PrefixLaunchConfig(block_t=block_t, prefix_splits=prefix_splits)


def choose_own_keys_config(**shape) -> AttentionLaunchConfig:
    """The paged kernel's launch for each sequence's own keys: single pass, and for decodes three
    stages instead of two, since a member's few own tiles leave no loop to pipeline across
    otherwise (measured faster for 512 members of ~225 own keys: bench/RESULTS.md). At D = 256,
    prefill blocks of 32 rows, not 64: merging the prefix's partials needs registers that the
    64-row tile leaves none of (it spills on sm_90; compile_check --strict)."""
    config = choose_launch_config(**shape, num_kv_splits=1)
    if config.block_q == 1:
        return dataclasses.replace(config, num_stages=3)
    if shape["head_dim"] > 128:
        return dataclasses.replace(config, block_q=max(1, 32 // (shape["num_q_heads"] // shape["num_kv_heads"])))
    return config


@triton.jit(do_not_specialize=["num_runs", "stride_block_table"])
def _shared_prefix_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    token_start_ptr,
    prefix_lens_ptr,
    table_rows_ptr,
    block_tables_ptr,
    num_runs,
    qk_scale_log2,
    stride_q_t,
    stride_q_h,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_PARTS: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if not INTERPRETED:
        # Every program of this grid running lets the own keys' kernel (a programmatic
        # dependent) start on the SMs that free up; it waits for this grid before its merge.
        gdc_launch_dependents()

    base = tl.load(token_start_ptr)
    r = _find_sequence(token_start_ptr, q_tile, num_runs, BLOCK_T, base)
    r_begin = tl.load(token_start_ptr + r)
    r_end = tl.load(token_start_ptr + r + 1)
    if BLOCK_T > 1:
        local_tile = q_tile - ((r_begin - base) // BLOCK_T + r)
    else:
        local_tile = q_tile - (r_begin - base)
    first_token = r_begin + local_tile * BLOCK_T
    if first_token >= r_end:
        return
    prefix_len = tl.load(prefix_lens_ptr + r)

    rows = tl.arange(0, BLOCK_M)
    token = first_token + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_T * GROUP) & (token < r_end)
    token = token.to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        query_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    # Every query lies past the prefix: the whole prefix is visible to each (no causal mask).
    q_pos = tl.full([BLOCK_M], 0, tl.int32) + prefix_len

    num_tiles = tl.cdiv(prefix_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_PARTS)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    block_table_row = block_tables_ptr + tl.load(table_rows_ptr + r).to(tl.int64) * stride_block_table
    kv_head_offset = kv_head.to(tl.int64) * stride_cache_head

    m_i, l_i, acc = attend_tiles(
        tile_begin,
        tile_end,
        0,
        q,
        m_i,
        l_i,
        acc,
        row_valid,
        q_pos,
        prefix_len,
        block_table_row,
        key_cache_ptr,
        value_cache_ptr,
        kv_head_offset,
        stride_cache_block,
        stride_cache_slot,
        qk_scale_log2,
        0,
        dims,
        BLOCK_SIZE,
        TILE_N,
        False,
        IEEE_DOT,
        INTERPRETED,
    )

    part = (token * NUM_Q_HEADS + head) * NUM_PARTS + split
    tl.store(partial_max_ptr + part, m_i, mask=row_valid)
    tl.store(partial_sum_ptr + part, l_i, mask=row_valid)
    tl.store(partial_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None])


def cascade_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    runs: SharedKVRuns,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    config: AttentionLaunchConfig | None = None,
    prefix_config: PrefixLaunchConfig | None = None,
) -> torch.Tensor:
    """Same result as paged_attention (no sliding window), with each run's shared prefix read once.

    runs' token ranges must be consecutive and cover exactly the sequences with a nonzero
    seq_prefix_lens; every member computes only tokens past its prefix (num_computed >= prefix).
    The own keys run single-pass: the parallelism of long shared contexts comes from the prefix
    splits, and fewer variants need compiling."""
    check_attention_inputs(query, kv_cache, query_start_loc, seq_lens, block_tables)
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(-1) == 1
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs, num_kv_heads = seq_lens.shape[0], kv_cache.shape[2]
    assert runs.seq_prefix_lens.shape == (num_seqs,) and runs.token_start.shape == (runs.num_runs + 1,)
    if num_tokens == 0 or num_seqs == 0:
        return out
    sm_count = device_sm_count(query.device)
    if config is None:
        config = choose_own_keys_config(
            num_seqs=num_seqs,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            sm_count=sm_count,
        )
    if prefix_config is None:
        prefix_config = choose_prefix_config(
            num_runs=runs.num_runs,
            max_run_tokens=runs.max_run_tokens,
            max_prefix_len=runs.max_prefix_len,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            sm_count=sm_count,
            prefix_splits=runs.prefix_splits,
        )
    partials = Partials.allocate(query, prefix_config.prefix_splits)
    launch_shared_prefix(query, kv_cache, block_tables, runs, scale, prefix_config, partials)
    overlap = prefix_config.overlap and bool(runs.num_runs) and _has_pdl(query.device)
    launch_paged_attention(
        query,
        kv_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        config,
        out,
        partials,
        seq_prefix_lens=runs.seq_prefix_lens,
        dependent_launch=overlap,
    )
    return out


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: sm90 and later."""
    return device.type == "cuda" and not _INTERPRETED and torch.cuda.get_device_capability(device)[0] >= 9


def launch_shared_prefix(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    runs: SharedKVRuns,
    scale: float,
    prefix_config: PrefixLaunchConfig,
    partials: Partials,
) -> None:
    """The prefix kernel alone: each run's shared prefix attended once, into partials' parts."""
    if not runs.num_runs:
        return
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[2]
    block_t = prefix_config.block_t
    group = num_q_heads // num_kv_heads
    num_tiles = runs.max_run_tokens // block_t + runs.num_runs if block_t > 1 else runs.max_run_tokens
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _shared_prefix_kernel[(num_tiles, num_kv_heads, prefix_config.prefix_splits)](
        query,
        key_cache,
        value_cache,
        partials.acc,
        partials.max,
        partials.sum,
        runs.token_start,
        runs.prefix_lens,
        runs.table_rows,
        block_tables,
        runs.num_runs,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(2),
        key_cache.stride(1),
        block_tables.stride(0),
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[3],
        BLOCK_T=block_t,
        BLOCK_M=max(16, triton.next_power_of_2(block_t * group)),
        TILE_N=prefix_config.tile_n,
        NUM_PARTS=partials.parts,
        IEEE_DOT=query.dtype == torch.float32,
        INTERPRETED=_INTERPRETED,
        num_warps=prefix_config.num_warps,
        num_stages=prefix_config.num_stages,
    )


def compile_serving_variants(kv_cache: torch.Tensor, num_q_heads: int) -> None:
    """Launches every variant an eager step can need (decode and prefill query blocks, each
    prefix split count) on a tiny batch that reads block 0 and writes nothing to the cache,
    so none compiles mid-serving. Decode graphs compile theirs when captured."""
    num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[4]
    device = kv_cache.device

    def ints(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    for q_lens in ((1, 1), (3, 1)):
        query = torch.zeros(sum(q_lens), num_q_heads, head_dim, dtype=kv_cache.dtype, device=device)
        seq_lens = ints(*(q + 1 for q in q_lens))  # one shared key, then each member's own
        runs = SharedKVRuns(
            token_start=ints(0, sum(q_lens)),
            prefix_lens=ints(1),
            table_rows=ints(0),
            seq_prefix_lens=ints(1, 1),
            max_run_tokens=sum(q_lens),
            max_prefix_len=1,
        )
        prefix_config = choose_prefix_config(
            num_runs=1,
            max_run_tokens=1,
            max_prefix_len=1,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            sm_count=1,
        )
        splits = 1
        while splits <= MAX_PREFIX_SPLITS:
            cascade_attention(
                query,
                kv_cache,
                ints(0, q_lens[0], sum(q_lens)),
                seq_lens,
                ints(0, 0).view(2, 1),
                runs,
                max(q_lens),
                2,
                1.0,
                prefix_config=dataclasses.replace(prefix_config, prefix_splits=splits),
            )
            splits *= 2
