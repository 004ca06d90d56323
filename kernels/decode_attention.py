"""Decode attention in one launch: rotary, the KV-cache write, split-KV attention and the split merge
for one new token per sequence: the attention of the batch-1 decode chain (services/worker/model/decode_chain.py)
and of every decode step small enough to be latency-bound (kernels/attention_launch.py says
which, and how it is launched; Attention.attend in services/worker/model/layers.py decides).

Why: at batch 1 a layer's attention ran as three kernels (rotary + KV write, paged attention,
merge of the splits), each a few microseconds of latency that waits for the one before it, and
together they held a large share of the layer's critical path while the projections around them
stream their weights near the copy floor (bench/RESULTS.md, "Figures moved from code comments").

How the work is cut: one program per (sequence, KV head, split of the cached keys).
- Before the dependent-launch wait (kernels/dependent_launch.py) a program reads only what no
  kernel of this step writes: the step inputs and the first tile of its *cached* keys and
  values (positions before the new token's, written by earlier steps). Its K/V stream thus
  starts while the qkv projection is still running. (Split launches only: unsplit ones, full
  waves of bandwidth-bound programs, keep those registers free for more resident programs.)
- After the wait: the query heads of the KV head's GQA group, loaded raw from the projection,
  RMS-normalised per head where the layer has q/k norms (Qwen3; Gemma 3's scale by 1 + weight;
  their weights read before the wait) and rotated in registers, with kernels/rotary.py's helpers
  and rounding. Scores are two dots, one per rotary half (q . k = q1 . k1 + q2 . k2), so the
  halves never need re-interleaving.
- The new token: a split of its own (the last split when the context fills them all) norms and
  rotates its key as the queries, stores key and value to the cache slot, and folds them into
  its softmax directly (one more score per query row). No program reads a slot this launch
  writes, so none waits for another's store.
- Under CUDA graphs the split count follows max_model_len, not the context: splits past the
  context's tiles and the new token's leave at once; only those that took part merge.
- The merge: every split stores its unnormalised partials (acc, max, sum), then (after a CTA
  barrier) bumps an arrival counter of its (sequence, KV head) with an acq_rel atomic. The split
  that arrives last reads every partial back from L2 in a few wide loads, merges them by
  log-sum-exp, writes the output and resets the counter to 0 for the next layer, whose attention
  only starts its atomics after this launch has completed. No spinning, so no order of programs
  can deadlock.

Scores in float32 in the log2 domain, exactly as kernels/paged_attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

from strata.kernels import attention_launch as launch
from strata.kernels.arrival_counters import arrival_counters
from strata.kernels.dependent_launch import dependent_launch_supported, launch_options
from strata.kernels.kernel_launch import device_sm_count
from strata.kernels.paged_attention import _LOG2E, online_softmax_step
from strata.kernels.rotary import norm_weight_halves, normed_halves, rotate_halves

__all__ = ["compile_serving_variants", "decode_attention"]


@triton.jit
def _load_kv_tile(
    first_key,
    cached,
    block_table_row,
    key_cache_ptr,
    value_cache_ptr,
    kv_head_offset,
    stride_cache_block,
    stride_cache_slot,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HALF: tl.constexpr,
):
    """Cached keys [first_key, first_key + TILE_N) below `cached`: the keys' rotary halves
    [HALF, TILE_N] each, the values [TILE_N, 2 HALF], and which positions are real."""
    k_pos = first_key + tl.arange(0, TILE_N)
    k_valid = k_pos < cached
    page = tl.load(block_table_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
    slot = page * stride_cache_block + (k_pos % BLOCK_SIZE) * stride_cache_slot + kv_head_offset
    half_dims = tl.arange(0, HALF)
    k1 = tl.load(key_cache_ptr + slot[None, :] + half_dims[:, None], mask=k_valid[None, :], other=0.0)
    k2 = tl.load(key_cache_ptr + slot[None, :] + HALF + half_dims[:, None], mask=k_valid[None, :], other=0.0)
    dims = tl.arange(0, 2 * HALF)
    v = tl.load(value_cache_ptr + slot[:, None] + dims[None, :], mask=k_valid[:, None], other=0.0)
    return k1, k2, v, k_valid


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, position, stride_cos, stride_sin, HALF: tl.constexpr):
    """The rotary table rows [1, HALF] of a position, in float32."""
    half_dims = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + position * stride_cos + half_dims).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + position * stride_sin + half_dims).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _new_token_kv(
    token_qkv,
    kv_head,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
):
    """The new token's key halves [1, HALF] (not yet rotated) and value [HEAD_DIM] from its qkv row."""
    half_dims = tl.arange(0, HALF)
    key_ptr = token_qkv + (NUM_Q_HEADS + kv_head) * HEAD_DIM
    kn1 = tl.load(key_ptr + half_dims)[None, :]
    kn2 = tl.load(key_ptr + HALF + half_dims)[None, :]
    vn = tl.load(token_qkv + (NUM_Q_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + tl.arange(0, HEAD_DIM))
    return kn1, kn2, vn


@triton.jit
def _attend_cached(q1, q2, k1, k2, v, k_valid, m_i, l_i, acc, qk_scale_log2, IEEE_DOT: tl.constexpr):
    """One online-softmax step over a tile of cached keys (all before the query: no causal mask)."""
    if IEEE_DOT:
        s = tl.dot(q1, k1, input_precision="ieee") + tl.dot(q2, k2, input_precision="ieee")
    else:
        s = tl.dot(q1, k1) + tl.dot(q2, k2)
    s = tl.where(k_valid[None, :], s * qk_scale_log2, float("-inf"))
    return online_softmax_step(s, v, m_i, l_i, acc, IEEE_DOT)


@triton.jit
def _decode_attention_kernel(
    qkv_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    q_norm_ptr,
    k_norm_ptr,
    norm_eps,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    arrivals_ptr,
    qk_scale_log2,
    num_positions,
    stride_qkv_t,
    stride_o_t,
    stride_cos,
    stride_sin,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_block_table,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
    GROUP_PADDED: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PDL: tl.constexpr = False,
    QK_NORM: tl.constexpr = False,
    NORM_UNIT_OFFSET: tl.constexpr = False,
):
    seq = tl.program_id(0)  # = its token: one new token per sequence
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:
        gdc_launch_dependents()
    half_dims = tl.arange(0, HALF)
    dims = tl.arange(0, HEAD_DIM)

    # Step inputs and cached keys: nothing this step's kernels write, so read before the wait.
    cached = tl.maximum(tl.load(seq_lens_ptr + seq) - 1, 0)  # keys before the new token
    num_tiles = tl.cdiv(cached, TILE_N)
    tiles_per_split = tl.maximum(tl.cdiv(num_tiles, NUM_SPLITS), 1)
    # Under CUDA graphs NUM_SPLITS follows max_model_len, not this context: the splits that hold
    # the context's tiles, plus one more for the new token while the grid has one to spare (else
    # the last split takes it too), take part; the rest leave at once.
    parts = tl.minimum(tl.cdiv(num_tiles, tiles_per_split) + 1, NUM_SPLITS)
    if split >= parts:
        return
    position = tl.load(positions_ptr + seq).to(tl.int64)
    position = tl.minimum(tl.maximum(position, 0), num_positions - 1)  # padding rows: any valid row
    cos, sin = _cos_sin(cos_ptr, sin_ptr, position, stride_cos, stride_sin, HALF)
    slot = tl.load(slot_mapping_ptr + seq)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    kv_head_offset = kv_head.to(tl.int64) * stride_cache_head
    # The new token's own split (and split 0 when nothing is cached) has no tile: past `cached`,
    # fully masked, nothing read.
    # Split launches hold their first tile in registers across the wait; unsplit ones (full waves)
    # stream every tile through the pipelined loop instead, keeping registers for resident programs.
    if NUM_SPLITS > 1:
        k1, k2, v, k_valid = _load_kv_tile(
            tile_begin * TILE_N,
            cached,
            block_table_row,
            key_cache_ptr,
            value_cache_ptr,
            kv_head_offset,
            stride_cache_block,
            stride_cache_slot,
            BLOCK_SIZE,
            TILE_N,
            HALF,
        )
    if QK_NORM:  # the norms' weights (the new key's in split launches only, as its K/V below)
        q_w1, q_w2 = norm_weight_halves(q_norm_ptr, half_dims, HALF)
        if NUM_SPLITS > 1:
            k_w1, k_w2 = norm_weight_halves(k_norm_ptr, half_dims, HALF)
    if PDL:
        gdc_wait()  # qkv is the projection's output

    rows = tl.arange(0, BLOCK_M)
    row_valid = rows < GROUP
    head = kv_head * GROUP + rows
    token_qkv = qkv_ptr + seq.to(tl.int64) * stride_qkv_t
    q_ptrs = token_qkv + head[:, None] * HEAD_DIM + half_dims[None, :]
    q1 = tl.load(q_ptrs, mask=row_valid[:, None], other=0.0)
    q2 = tl.load(q_ptrs + HALF, mask=row_valid[:, None], other=0.0)
    # The new token's key and value: in split launches (latency-bound) loaded beside the queries,
    # one L2 round trip for both; in unsplit ones (full waves, bandwidth-bound) after the tiles,
    # so that no register holds them (or cos and sin) across the loop. Only split parts - 1 uses them.
    if NUM_SPLITS > 1:
        kn1, kn2, vn = _new_token_kv(token_qkv, kv_head, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, HALF)
    if QK_NORM:  # padding rows are zeros and stay zeros
        q1, q2 = normed_halves(q1, q2, q_w1, q_w2, norm_eps, HALF, NORM_UNIT_OFFSET)
    q1, q2 = rotate_halves(q1, q2, cos, sin)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # a finite floor: masked rows stay NaN-free
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    loop_begin = tile_begin
    if NUM_SPLITS > 1:
        if tile_begin < tile_end:
            m_i, l_i, acc = _attend_cached(q1, q2, k1, k2, v, k_valid, m_i, l_i, acc, qk_scale_log2, IEEE_DOT)
        loop_begin = tile_begin + 1
    if INTERPRETED:  # the interpreter cannot take tensor bounds in range()
        tile = loop_begin
        while tile < tile_end:
            k1, k2, v, k_valid = _load_kv_tile(
                tile * TILE_N,
                cached,
                block_table_row,
                key_cache_ptr,
                value_cache_ptr,
                kv_head_offset,
                stride_cache_block,
                stride_cache_slot,
                BLOCK_SIZE,
                TILE_N,
                HALF,
            )
            m_i, l_i, acc = _attend_cached(q1, q2, k1, k2, v, k_valid, m_i, l_i, acc, qk_scale_log2, IEEE_DOT)
            tile += 1
    else:
        for tile in range(loop_begin, tile_end):
            k1, k2, v, k_valid = _load_kv_tile(
                tile * TILE_N,
                cached,
                block_table_row,
                key_cache_ptr,
                value_cache_ptr,
                kv_head_offset,
                stride_cache_block,
                stride_cache_slot,
                BLOCK_SIZE,
                TILE_N,
                HALF,
            )
            m_i, l_i, acc = _attend_cached(q1, q2, k1, k2, v, k_valid, m_i, l_i, acc, qk_scale_log2, IEEE_DOT)

    if split == parts - 1:
        # The new token: norm and rotate its key, store key and value in the cache, attend to them.
        if NUM_SPLITS == 1:
            kn1, kn2, vn = _new_token_kv(token_qkv, kv_head, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, HALF)
            cos, sin = _cos_sin(cos_ptr, sin_ptr, position, stride_cos, stride_sin, HALF)
            if QK_NORM:
                k_w1, k_w2 = norm_weight_halves(k_norm_ptr, half_dims, HALF)
        if QK_NORM:
            kn1, kn2 = normed_halves(kn1, kn2, k_w1, k_w2, norm_eps, HALF, NORM_UNIT_OFFSET)
        kn1, kn2 = rotate_halves(kn1, kn2, cos, sin)
        if slot >= 0:  # -1: a padding row, nothing stored
            cache_slot = (
                (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_slot + kv_head_offset
            )
            tl.store(key_cache_ptr + cache_slot + half_dims[None, :], kn1)
            tl.store(key_cache_ptr + cache_slot + HALF + half_dims[None, :], kn2)
            tl.store(value_cache_ptr + cache_slot + dims, vn)
        s = tl.sum(q1.to(tl.float32) * kn1.to(tl.float32), axis=1) + tl.sum(
            q2.to(tl.float32) * kn2.to(tl.float32), axis=1
        )
        s = s * qk_scale_log2
        m_new = tl.maximum(m_i, s)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + p
        # p rounded to the value dtype, as the tiles' P @ V dot takes it.
        acc = acc * alpha[:, None] + p.to(vn.dtype).to(tl.float32)[:, None] * vn.to(tl.float32)[None, :]
        m_i = m_new

    out_rows = out_ptr + seq.to(tl.int64) * stride_o_t + head[:, None] * HEAD_DIM + dims[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_rows, (acc / tl.maximum(l_i, 1e-30)[:, None]).to(out_ptr.dtype.element_ty), mask=row_valid[:, None]
        )
    else:
        # Partials [T, Hq, NUM_SPLITS(, D)]; then the last split of this (sequence, KV head) merges.
        base = (seq.to(tl.int64) * NUM_Q_HEADS + head) * NUM_SPLITS
        tl.store(partial_max_ptr + base + split, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + base + split, l_i, mask=row_valid)
        tl.store(partial_acc_ptr + (base + split)[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None])
        tl.debug_barrier()  # every thread's partials are stored before the release below
        counter = arrivals_ptr + seq * NUM_KV_HEADS + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == parts - 1:
            _merge_splits(
                out_ptr,
                partial_acc_ptr,
                partial_max_ptr,
                partial_sum_ptr,
                seq,
                kv_head,
                parts,
                stride_o_t,
                NUM_Q_HEADS,
                GROUP,
                GROUP_PADDED,
                HEAD_DIM,
                NUM_SPLITS,
                SPLITS_PADDED,
                SPLIT_CHUNK,
            )
            tl.store(counter, 0)  # ready for the next layer's launch


@triton.jit
def _merge_splits(
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    seq,
    kv_head,
    parts,
    stride_o_t,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PADDED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PADDED: tl.constexpr,
    SPLIT_CHUNK: tl.constexpr,
):
    """The group's output from the first `parts` splits' partials, by log-sum-exp. The loads are wide (all
    splits' max and sum at once, SPLIT_CHUNK splits' acc per step): a loop of one split per step
    would wait out an L2 round trip per split. .cg reads from L2, where the other programs
    stored, never from a stale L1 line."""
    rows = tl.arange(0, GROUP_PADDED)
    row_valid = rows < GROUP
    dims = tl.arange(0, HEAD_DIM)
    base = (seq.to(tl.int64) * NUM_Q_HEADS + kv_head * GROUP + rows) * NUM_SPLITS  # [GROUP_PADDED]
    splits = tl.arange(0, SPLITS_PADDED)
    both = row_valid[:, None] & (splits < parts)[None, :]
    m_all = tl.load(partial_max_ptr + base[:, None] + splits[None, :], mask=both, other=-1.0e30, cache_modifier=".cg")
    l_all = tl.load(partial_sum_ptr + base[:, None] + splits[None, :], mask=both, other=0.0, cache_modifier=".cg")
    m_max = tl.max(m_all, axis=1)
    total = tl.sum(tl.exp2(m_all - m_max[:, None]) * l_all, axis=1)
    merged = tl.zeros([GROUP_PADDED, HEAD_DIM], dtype=tl.float32)
    first = 0
    while first < parts:  # as many chunks as splits took part, not as the grid has (a while: the interpreter too)
        chunk = first + tl.arange(0, SPLIT_CHUNK)
        valid = row_valid[:, None] & (chunk < parts)[None, :]
        part = base[:, None] + chunk[None, :]  # [GROUP_PADDED, SPLIT_CHUNK]
        weight = tl.exp2(
            tl.load(partial_max_ptr + part, mask=valid, other=-1.0e30, cache_modifier=".cg") - m_max[:, None]
        )
        acc = tl.load(
            partial_acc_ptr + part[:, :, None] * HEAD_DIM + dims[None, None, :],
            mask=valid[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )
        merged += tl.sum(acc * weight[:, :, None], axis=1)
        first += SPLIT_CHUNK
    head = kv_head * GROUP + rows
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_o_t + head[:, None] * HEAD_DIM + dims[None, :],
        (merged / tl.maximum(total, 1e-30)[:, None]).to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


_INTERPRETED = isinstance(_decode_attention_kernel, InterpretedFunction)


def _arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 counters, one per (sequence, KV head); each launch leaves them at 0."""
    return arrival_counters(device, count, "decode_attention")


def decode_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_q_heads: int,
    scale: float,
    max_seq_len: int,
    num_kv_splits: int | None = None,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None,
) -> torch.Tensor:
    """Attention output [T, Hq * D] for qkv [T, (Hq + 2 Hkv) * D], one new token per sequence (T = B).

    Rotates the queries and keys by positions [T] (cos/sin tables [max_pos, D/2]), stores the
    rotated keys and the values in kv_cache [2, NB, Hkv, BS, D] at slot_mapping [T] (slots < 0
    skipped), and attends over each sequence's seq_lens[b] keys, the new one included. Equal to
    rotary_embedding_ + paged_attention up to float32 summation order. max_seq_len: a host-side
    bound that only picks the split count (under CUDA graphs a fixed one). qk_norm (q weight [D],
    k weight [D], eps, unit_offset): each query and key head RMS-normalised first, as
    rotary_embedding_'s qk_norm.
    """
    num_tokens = qkv.shape[0]
    num_kv_heads, block_size, head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    assert launch.decode_attention_supported(head_dim, qkv.dtype), (head_dim, qkv.dtype)
    assert qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1, qkv.shape
    assert seq_lens.shape == (num_tokens,) and positions.shape == (num_tokens,) and slot_mapping.shape == (num_tokens,)
    assert block_tables.shape[0] == num_tokens and block_tables.stride(1) == 1
    assert kv_cache.dtype == qkv.dtype and kv_cache.stride(-1) == 1 and cos_cache.shape[1] == head_dim // 2
    assert cos_cache.stride(1) == 1 and sin_cache.stride(1) == 1 and num_q_heads % num_kv_heads == 0
    if qk_norm is not None:
        assert qk_norm[0].shape == qk_norm[1].shape == (head_dim,), (qk_norm[0].shape, head_dim)
    out = torch.empty(num_tokens, num_q_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return out
    config = launch.choose_launch_config(
        num_seqs=num_tokens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_query_len=1,
        max_seq_len=max_seq_len,
        sm_count=device_sm_count(qkv.device),
        num_kv_splits=num_kv_splits,
    )
    splits = config.num_kv_splits
    if splits > 1:
        stats = torch.empty(num_tokens, num_q_heads, splits, dtype=torch.float32, device=qkv.device)
        partial_acc = torch.empty(num_tokens, num_q_heads, splits, head_dim, dtype=torch.float32, device=qkv.device)
        partial_max, partial_sum = stats, torch.empty_like(stats)
        arrivals = _arrival_counters(qkv.device, num_tokens * num_kv_heads)
    else:
        partial_acc = partial_max = partial_sum = out  # not read: the program writes its output
        arrivals = seq_lens
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    pdl = dependent_launch_supported(qkv.device)
    _decode_attention_kernel[(num_tokens, num_kv_heads, splits)](
        qkv,
        positions,
        cos_cache,
        sin_cache,
        qk_norm[0] if qk_norm else cos_cache,  # not read without QK_NORM
        qk_norm[1] if qk_norm else cos_cache,
        qk_norm[2] if qk_norm else 0.0,
        key_cache,
        value_cache,
        slot_mapping,
        seq_lens,
        block_tables,
        out,
        partial_acc,
        partial_max,
        partial_sum,
        arrivals,
        scale * _LOG2E,
        cos_cache.shape[0],
        qkv.stride(0),
        out.stride(0),
        cos_cache.stride(0),
        sin_cache.stride(0),
        # key_cache is [NB, Hkv, BS, D]: block, slot-in-block, head strides.
        key_cache.stride(0),
        key_cache.stride(2),
        key_cache.stride(1),
        block_tables.stride(0),
        **launch.decode_kernel_constants(num_q_heads, num_kv_heads, head_dim, block_size, config.tile_n, splits),
        IEEE_DOT=qkv.dtype == torch.float32,
        INTERPRETED=_INTERPRETED,
        PDL=pdl,
        QK_NORM=qk_norm is not None,
        NORM_UNIT_OFFSET=bool(qk_norm and qk_norm[3]),
        num_warps=launch.decode_num_warps(head_dim, num_tokens * num_kv_heads),
        num_stages=2,
        **launch_options(pdl),
    )
    return out


def compile_serving_variants(
    kv_cache: torch.Tensor, num_q_heads: int, qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None
) -> None:
    """Launches every split count an eager decode step can pick (powers of two up to launch.MAX_KV_SPLITS,
    see choose_launch_config), at both warp counts (decode_num_warps), on sequences with no cached keys
    that write nothing (slot -1), so none compiles mid-serving. Decode graphs compile theirs when
    captured. qk_norm: the layers' (decode_attention's argument), whose variant their steps launch."""
    num_kv_heads, head_dim, device = kv_cache.shape[2], kv_cache.shape[4], kv_cache.device
    if not launch.decode_attention_supported(head_dim, kv_cache.dtype):
        return
    table = torch.zeros(1, head_dim // 2, dtype=kv_cache.dtype, device=device)
    for num_seqs in (1, launch.WIDE_PROGRAMS_MAX_PAIRS // num_kv_heads + 1):
        qkv = torch.zeros(num_seqs, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=kv_cache.dtype, device=device)
        zero = torch.zeros(num_seqs, dtype=torch.int64, device=device)
        splits = 1
        while splits <= launch.MAX_KV_SPLITS:
            decode_attention(
                qkv,
                zero,
                table,
                table,
                kv_cache,
                torch.ones(num_seqs, dtype=torch.int32, device=device),
                torch.zeros(num_seqs, 1, dtype=torch.int32, device=device),
                zero - 1,
                num_q_heads=num_q_heads,
                scale=1.0,
                max_seq_len=1,
                num_kv_splits=splits,
                qk_norm=qk_norm,
            )
            splits *= 2
