"""Paged attention over a mixed batch of prefill chunks and decodes, in one Triton kernel.

How the work is cut:
- A program owns (a block of BLOCK_Q query tokens of one sequence) x (one KV head). Its M
  dimension packs those tokens with every query head of the KV head's GQA group (row r is token
  r // GROUP, head r % GROUP), so each K/V tile is loaded once for the whole group.
- The query blocks of all sequences are numbered back to back; sequence b owns the indices
  [qsl[b] // BLOCK_Q + b, qsl[b+1] // BLOCK_Q + b + 1), a superset of the blocks it needs, so the
  grid (num_tokens // BLOCK_Q + num_seqs) depends only on python ints, and a program finds its
  sequence by binary search over query_start_loc (no host sync, CUDA-graph safe).
- Keys are walked in tiles of TILE_N positions; each position's physical block comes from the
  block table, so a tile may span several pages (small test block sizes) or part of one.
- kv_cache is [2, num_blocks, num_kv_heads, block_size, head_dim]: the page of one (block, KV
  head) is a contiguous block_size * head_dim run. The kernel only sees block / slot / head
  strides, so the address math does not depend on that order.
- Online softmax in float32, in the log2 domain (exp2 with scale * log2(e) folded in). Key tiles
  that every row of the program sees in full (below its first query's position) run without the
  bounds and causal masks; only the tiles on the diagonal, and windowed ones, take them.

Split-KV: for decode batches too small to fill the GPU (B * Hkv small, long contexts), each
program's key range is cut into NUM_SPLITS parts computed in parallel; they write unnormalised
(acc, max, sum) partials, and a second kernel merges them. The same kernel serves both paths;
NUM_SPLITS == 1 writes the final output directly.

The new tokens' keys/values must already be in kv_cache (call write_kv_cache first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

from strata.kernels.attention_launch import AttentionLaunchConfig, choose_launch_config
from strata.kernels.dependent_launch import dependent_launch_supported, launch_options
from strata.kernels.kernel_launch import device_sm_count
from strata.kernels.reference import paged_attention_reference

__all__ = ["paged_attention", "paged_attention_reference"]

_LOG2E = 1.4426950408889634


@triton.jit
def _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr, base=0):
    """Largest b with ((qsl[b] - base) // BLOCK_Q + b) <= q_block: the sequence owning this query
    block (base: the first token of the numbered range; cascade_attention numbers groups so)."""
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(query_start_loc_ptr + mid) - base
        if BLOCK_Q > 1:
            start = start // BLOCK_Q + mid
        if start <= q_block:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _attend_tile(
    first_key,
    q,
    m_i,
    l_i,
    acc,
    row_valid,
    q_pos,
    kv_end,
    block_table_row,
    key_cache_ptr,
    value_cache_ptr,
    kv_head_offset,
    stride_cache_block,
    stride_cache_slot,
    qk_scale_log2,
    sliding_window,
    dims,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """One online-softmax step over key positions [first_key, first_key + TILE_N), those below kv_end.
    MASKED=False: a tile every row may see in full (below the causal diagonal of the program's
    first query, inside kv_end, no window): no masks on the loads or the scores."""
    k_pos = first_key + tl.arange(0, TILE_N)
    if MASKED:
        k_valid = k_pos < kv_end
        page = tl.load(block_table_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
    else:
        page = tl.load(block_table_row + k_pos // BLOCK_SIZE).to(tl.int64)
    slot_offset = page * stride_cache_block + (k_pos % BLOCK_SIZE) * stride_cache_slot + kv_head_offset
    if MASKED:
        k = tl.load(key_cache_ptr + slot_offset[None, :] + dims[:, None], mask=k_valid[None, :], other=0.0)
        v = tl.load(value_cache_ptr + slot_offset[:, None] + dims[None, :], mask=k_valid[:, None], other=0.0)
    else:
        k = tl.load(key_cache_ptr + slot_offset[None, :] + dims[:, None])
        v = tl.load(value_cache_ptr + slot_offset[:, None] + dims[None, :])

    if IEEE_DOT:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    if MASKED:
        s = s * qk_scale_log2
        allowed = row_valid[:, None] & k_valid[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(allowed, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v, m_i, l_i, acc, IEEE_DOT)
    else:
        m_i, l_i, acc = _unmasked_softmax_step(s, v, m_i, l_i, acc, qk_scale_log2, IEEE_DOT)
    return m_i, l_i, acc


@triton.jit
def attend_tiles(
    tile_begin,
    tile_end,
    first_key,
    q,
    m_i,
    l_i,
    acc,
    row_valid,
    q_pos,
    kv_end,
    block_table_row,
    key_cache_ptr,
    value_cache_ptr,
    kv_head_offset,
    stride_cache_block,
    stride_cache_slot,
    qk_scale_log2,
    sliding_window,
    dims,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    INTERPRETED: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """_attend_tile over tiles [tile_begin, tile_end) of keys from first_key (shared with
    kernels/cascade_attention.py)."""
    if INTERPRETED:
        # The interpreter (triton 3.6 + numpy 2.x) cannot take tensor bounds in range().
        tile = tile_begin
        while tile < tile_end:
            m_i, l_i, acc = _attend_tile(
                first_key + tile * TILE_N,
                q,
                m_i,
                l_i,
                acc,
                row_valid,
                q_pos,
                kv_end,
                block_table_row,
                key_cache_ptr,
                value_cache_ptr,
                kv_head_offset,
                stride_cache_block,
                stride_cache_slot,
                qk_scale_log2,
                sliding_window,
                dims,
                BLOCK_SIZE,
                TILE_N,
                USE_WINDOW,
                IEEE_DOT,
                MASKED,
            )
            tile += 1
    else:
        # A for loop, so the compiler can software-pipeline the K/V loads (num_stages).
        for tile in range(tile_begin, tile_end):
            m_i, l_i, acc = _attend_tile(
                first_key + tile * TILE_N,
                q,
                m_i,
                l_i,
                acc,
                row_valid,
                q_pos,
                kv_end,
                block_table_row,
                key_cache_ptr,
                value_cache_ptr,
                kv_head_offset,
                stride_cache_block,
                stride_cache_slot,
                qk_scale_log2,
                sliding_window,
                dims,
                BLOCK_SIZE,
                TILE_N,
                USE_WINDOW,
                IEEE_DOT,
                MASKED,
            )
    return m_i, l_i, acc


@triton.jit
def _unmasked_softmax_step(s, v, m_i, l_i, acc, qk_scale_log2, IEEE_DOT: tl.constexpr):
    """online_softmax_step for raw scores with nothing masked: the scale goes into the max and
    into one fused multiply-add per score (s * scale - max), as in FlashAttention-2."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale_log2 - m_new[:, None])
    l_i, acc = _accumulate(p, alpha, v, l_i, acc, IEEE_DOT)
    return m_new, l_i, acc


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, IEEE_DOT: tl.constexpr):
    """Fold a tile's masked scores s [M, N] (log2 domain) and values v [N, D] into the running max,
    sum and accumulator; P is rounded to v's dtype for the dot. Shared with kernels/decode_attention.py."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i, acc = _accumulate(p, alpha, v, l_i, acc, IEEE_DOT)
    return m_new, l_i, acc


@triton.jit
def _accumulate(p, alpha, v, l_i, acc, IEEE_DOT: tl.constexpr):
    """The running sum and accumulator rescaled by alpha, plus the tile's probabilities p and p @ v."""
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return l_i, acc * alpha[:, None] + pv


# Runtime ints are not specialised (== 1, % 16): one compiled variant serves every batch. That
# includes the block-table row stride, which follows the step's longest sequence in eager steps:
# specialised, widths of 1, of a multiple of 16 and of anything else each compiled a variant,
# about a second each, mid-serving.
@triton.jit(do_not_specialize=["num_seqs", "sliding_window", "stride_block_table"])
def _paged_attention_kernel(
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    seq_prefix_lens_ptr,
    num_seqs,
    qk_scale_log2,
    sliding_window,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PREFIX_PARTS: tl.constexpr = 0,
    PDL: tl.constexpr = False,
    FULL_TILES_UNMASKED: tl.constexpr = True,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # launched as a programmatic dependent: let the next kernel's programs start early
        gdc_launch_dependents()

    if BLOCK_Q == 1:
        # Decode batches hold one token per sequence: try token t -> sequence t before the binary
        # search, whose ~log2(B) dependent loads each program would otherwise wait out before
        # its first K/V load (a program of a short context runs only a few tiles).
        seq = tl.minimum(q_block, num_seqs - 1)
        if (tl.load(query_start_loc_ptr + seq) != q_block) | (tl.load(query_start_loc_ptr + seq + 1) != q_block + 1):
            seq = _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    else:
        seq = _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    if BLOCK_Q > 1:
        local_block = q_block - (q_begin // BLOCK_Q + seq)
    else:
        local_block = q_block - q_begin
    first_token = local_block * BLOCK_Q
    if first_token >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    token_in_seq = first_token + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (token_in_seq < q_len)
    q_pos = context_len + token_in_seq
    token = (q_begin + token_in_seq).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)

    # The indices above are step inputs; the queries and this step's keys are the previous
    # kernels' output. (A cascade's own-keys kernel follows the prefix kernel, which wrote
    # neither: it waits only where it reads the prefix's partials.)
    if PDL and PREFIX_PARTS == 0:
        gdc_wait()
    q = tl.load(
        query_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )

    # Key range this block of queries can see: causal end, sliding-window start, and in a
    # cascade (PREFIX_PARTS > 0) the end of the sequence's shared prefix, which
    # cascade_attention's prefix kernel attends once for the whole group.
    last_token = tl.minimum(first_token + BLOCK_Q, q_len) - 1
    kv_end = context_len + last_token + 1
    kv_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(context_len + first_token - sliding_window + 1, 0)
    if PREFIX_PARTS > 0:
        kv_start = tl.load(seq_prefix_lens_ptr + seq)
    # Tiles start at kv_start, not at a multiple of TILE_N: a cascade member's ~200 own keys past
    # a 2,000-key prefix take 4 tiles, not 5 (programs this short wait out every iteration).
    tile_begin = 0
    tile_end = tl.cdiv(kv_end - kv_start, TILE_N)
    if NUM_SPLITS > 1:
        tiles_per_split = tl.cdiv(tile_end, NUM_SPLITS)
        tile_begin = split * tiles_per_split
        tile_end = tl.minimum(tile_begin + tiles_per_split, tile_end)

    # The running max starts at a finite floor, not -inf: a row whose keys are all masked in a
    # tile then gets exp2(-inf - floor) = 0 instead of NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    kv_head_offset = kv_head.to(tl.int64) * stride_cache_head

    # Tiles every row sees in full (keys up to the block's first query position) skip the
    # masks; only the tiles on the causal diagonal (and any with a window) take them.
    full_tiles = tile_begin
    if FULL_TILES_UNMASKED and not USE_WINDOW:
        full_tiles = (context_len + first_token + 1 - kv_start) // TILE_N
        full_tiles = tl.minimum(tl.maximum(full_tiles, tile_begin), tile_end)

    m_i, l_i, acc = attend_tiles(
        tile_begin,
        full_tiles,
        kv_start,
        q,
        m_i,
        l_i,
        acc,
        row_valid,
        q_pos,
        kv_end,
        block_table_row,
        key_cache_ptr,
        value_cache_ptr,
        kv_head_offset,
        stride_cache_block,
        stride_cache_slot,
        qk_scale_log2,
        sliding_window,
        dims,
        BLOCK_SIZE,
        TILE_N,
        USE_WINDOW,
        IEEE_DOT,
        INTERPRETED,
        MASKED=False,
    )
    m_i, l_i, acc = attend_tiles(
        full_tiles,
        tile_end,
        kv_start,
        q,
        m_i,
        l_i,
        acc,
        row_valid,
        q_pos,
        kv_end,
        block_table_row,
        key_cache_ptr,
        value_cache_ptr,
        kv_head_offset,
        stride_cache_block,
        stride_cache_slot,
        qk_scale_log2,
        sliding_window,
        dims,
        BLOCK_SIZE,
        TILE_N,
        USE_WINDOW,
        IEEE_DOT,
        INTERPRETED,
    )

    if PREFIX_PARTS > 0:
        # Cascade: fold in the shared prefix's partials, which the prefix kernel wrote before this
        # launch ([T, Hq, PREFIX_PARTS(, D)]), by log-sum-exp; a sequence outside any group has
        # kv_start == 0 and reads nothing (max = floor, sum = 0: weight exactly 0). Launched as a
        # programmatic dependent (cascade_attention), this kernel's programs may start while the
        # prefix kernel's last ones run: wait for that grid only here (a no-op otherwise).
        if not INTERPRETED:
            gdc_wait()
        has_prefix = row_valid & (kv_start > 0)
        row_part = (token * NUM_Q_HEADS + head) * PREFIX_PARTS
        for j in tl.static_range(PREFIX_PARTS):
            part_max = tl.load(partial_max_ptr + row_part + j, mask=has_prefix, other=-1.0e30)
            part_sum = tl.load(partial_sum_ptr + row_part + j, mask=has_prefix, other=0.0)
            part_acc = tl.load(
                partial_acc_ptr + (row_part + j)[:, None] * HEAD_DIM + dims[None, :],
                mask=has_prefix[:, None],
                other=0.0,
            )
            m_new = tl.maximum(m_i, part_max)
            alpha = tl.exp2(m_i - m_new)
            beta = tl.exp2(part_max - m_new)
            acc = acc * alpha[:, None] + part_acc * beta[:, None]
            l_i = l_i * alpha + part_sum * beta
            m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )
    else:
        # Partials are laid out [T, Hq, NUM_SPLITS(, D)], contiguous.
        part = (token * NUM_Q_HEADS + head) * NUM_SPLITS + split
        tl.store(partial_max_ptr + part, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + part, l_i, mask=row_valid)
        tl.store(partial_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None])


@triton.jit
def _merge_kv_splits_kernel(
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    stride_o_t,
    stride_o_h,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()  # the partials are the attention kernel's output
    splits = tl.arange(0, SPLITS_PADDED)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM)
    base = (token * NUM_Q_HEADS + head) * NUM_SPLITS
    # Empty splits carry max = floor and sum = 0, so their weight below is exactly 0.
    m = tl.load(partial_max_ptr + base + splits, mask=split_valid, other=-1.0e30)
    sums = tl.load(partial_sum_ptr + base + splits, mask=split_valid, other=0.0)
    acc = tl.load(
        partial_acc_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :], mask=split_valid[:, None], other=0.0
    )
    weight = tl.exp2(m - tl.max(m, axis=0))
    total = tl.sum(weight * sums, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.maximum(total, 1e-30)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + dims, out.to(out_ptr.dtype.element_ty))


# Decided at definition time, like triton.jit itself (TRITON_INTERPRET read when decorating).
_INTERPRETED = isinstance(_paged_attention_kernel, InterpretedFunction)


def paged_attention(
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
    *,
    num_kv_splits: int | None = None,
    config: AttentionLaunchConfig | None = None,
    min_query_len: int = 1,
) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over each sequence's paged context; returns [T, Hq, D].

    max_query_len / max_seq_len are host-side upper bounds (python ints) that only shape the
    launch; under CUDA graphs pass fixed bounds; so does min_query_len, the shortest query (1 when
    unknown). num_kv_splits: None picks single-pass or split-KV
    automatically, 1 forces single-pass, n > 1 forces n splits. config overrides every heuristic
    (benchmarks, tests).
    """
    check_attention_inputs(query, kv_cache, query_start_loc, seq_lens, block_tables)
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(-1) == 1
    assert sliding_window is None or sliding_window > 0, f"sliding_window must be None or > 0, got {sliding_window}"
    if query.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    if config is None:
        config = choose_launch_config(
            num_seqs=seq_lens.shape[0],
            num_q_heads=query.shape[1],
            num_kv_heads=kv_cache.shape[2],
            head_dim=query.shape[2],
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            sm_count=device_sm_count(query.device),
            num_kv_splits=num_kv_splits,
            min_query_len=min_query_len,
        )
    partials = Partials.allocate(query, config.num_kv_splits) if config.num_kv_splits > 1 else None
    pdl = dependent_launch_supported(query.device)
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
        sliding_window=sliding_window,
        dependent_launch=pdl,
    )
    if partials is not None:
        merge_partials(partials, out, dependent_launch=pdl)
    return out


def check_attention_inputs(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> None:
    num_seqs = seq_lens.shape[0]
    head_dim = query.shape[2]
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[4] == head_dim, kv_cache.shape
    assert head_dim & (head_dim - 1) == 0 and head_dim >= 16, f"head_dim must be a power of two >= 16, got {head_dim}"
    assert query.shape[1] % kv_cache.shape[2] == 0, (query.shape, kv_cache.shape)
    assert query_start_loc.shape == (num_seqs + 1,) and block_tables.shape[0] == num_seqs
    assert query.dtype == kv_cache.dtype, (query.dtype, kv_cache.dtype)
    assert query.stride(-1) == 1 and kv_cache.stride(-1) == 1 and block_tables.stride(-1) == 1


@dataclass
class Partials:
    """Unnormalised softmax partials of each (token, query head) over several key ranges: split-KV
    parts (merge_partials combines them by log-sum-exp) or, in a cascade, the shared prefix's
    parts (the paged kernel folds them into its own result)."""

    acc: torch.Tensor  # float32 [T, Hq, parts, D]: sum of exp2(score - max) * value
    max: torch.Tensor  # float32 [T, Hq, parts]: running max of the scores (log2 domain)
    sum: torch.Tensor  # float32 [T, Hq, parts]: sum of exp2(score - max)

    @staticmethod
    def allocate(query: torch.Tensor, parts: int) -> Partials:
        num_tokens, num_q_heads, head_dim = query.shape
        stats = torch.empty((num_tokens, num_q_heads, parts), dtype=torch.float32, device=query.device)
        return Partials(
            torch.empty((num_tokens, num_q_heads, parts, head_dim), dtype=torch.float32, device=query.device),
            stats,
            torch.empty_like(stats),
        )

    @property
    def parts(self) -> int:
        return self.max.shape[2]


def launch_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    config: AttentionLaunchConfig,
    out: torch.Tensor,
    partials: Partials | None,
    *,
    sliding_window: int | None = None,
    seq_prefix_lens: torch.Tensor | None = None,
    dependent_launch: bool = False,
) -> None:
    """The attention kernel alone: into out, or with split-KV into partials (merge_partials then).
    Cascade (seq_prefix_lens [B] given): each sequence skips its first seq_prefix_lens keys and
    merges partials, the shared prefix's parts written by the prefix kernel, into out; a
    sequence whose prefix length is 0 reads none of them. dependent_launch: a programmatic
    dependent launch (Hopper, kernels/dependent_launch.py): it may begin before the previous
    kernel ends, and waits for it before its first query load (a cascade's, for the prefix's
    partials only)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    assert config.tile_n >= 16 and config.tile_n & (config.tile_n - 1) == 0
    splits = config.num_kv_splits
    cascade = seq_prefix_lens is not None
    assert (partials is not None) == (splits > 1 or cascade), "split-KV writes partials, a cascade reads them"
    assert not (cascade and (splits > 1 or sliding_window)), "a cascade's own keys run single-pass, unwindowed"
    block_m = max(16, triton.next_power_of_2(config.block_q * group))
    if config.block_q > 1:
        num_q_blocks = num_tokens // config.block_q + num_seqs
    else:
        num_q_blocks = num_tokens
    part_acc, part_max, part_sum = (out, out, out) if partials is None else (partials.acc, partials.max, partials.sum)
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, splits)](
        query,
        key_cache,
        value_cache,
        out,
        part_acc,
        part_max,
        part_sum,
        query_start_loc,
        seq_lens,
        block_tables,
        seq_lens if seq_prefix_lens is None else seq_prefix_lens,
        num_seqs,
        scale * _LOG2E,
        sliding_window if sliding_window is not None else 0,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        # key_cache is [NB, Hkv, BS, D]: block, slot-in-block, head strides.
        key_cache.stride(0),
        key_cache.stride(2),
        key_cache.stride(1),
        block_tables.stride(0),
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_Q=config.block_q,
        BLOCK_M=block_m,
        TILE_N=config.tile_n,
        NUM_SPLITS=splits,
        USE_WINDOW=sliding_window is not None,
        IEEE_DOT=query.dtype == torch.float32,
        INTERPRETED=_INTERPRETED,
        PREFIX_PARTS=partials.parts if cascade else 0,
        PDL=dependent_launch,
        FULL_TILES_UNMASKED=config.unmasked_full_tiles,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(dependent_launch),
    )


def merge_partials(partials: Partials, out: torch.Tensor, *, dependent_launch: bool = False) -> None:
    """out[t, h] = the softmax-weighted sum over all of partials' key ranges (log-sum-exp merge)."""
    num_tokens, num_q_heads, parts, head_dim = partials.acc.shape
    _merge_kv_splits_kernel[(num_tokens, num_q_heads)](
        out,
        partials.acc,
        partials.max,
        partials.sum,
        out.stride(0),
        out.stride(1),
        NUM_Q_HEADS=num_q_heads,
        HEAD_DIM=head_dim,
        NUM_SPLITS=parts,
        SPLITS_PADDED=triton.next_power_of_2(parts),
        PDL=dependent_launch,
        num_warps=4 if head_dim >= 128 else 2,
        **launch_options(dependent_launch),
    )
