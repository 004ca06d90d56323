"""The draw of rows under sampling controls (grammar bitmasks, penalties and biases), in one pass
over the logits, without a float32 copy of them.

A controlled row r of the logits draws exactly the token the sampler's fused Gumbel-max draw
(kernels/gumbel_sampling.py) draws from the float32 logits with the controls applied, i.e. from

    z[t] = -inf                      where the row's grammar bitmask forbids t (or t >= mask_vocab)
    z[t] = patch value of t          at the row's penalised tokens (kernels/penalties.py,
                                     penalty_patches, which set logits[r, t] = -inf there)
    z[t] = logits[r, t]              elsewhere

Each program (row, split) scans its split of the logits as the sampler's kernel does, with the
bitmask bit of each token, then the row's patch entries that fall in its split, and keeps the
best (value, token) with the first token winning ties; the row's last split merges (the
sampler's _merge_splits). The value arithmetic is the sampler's own function, so the tokens
are bit-identical to the general path (float32 copy, penalties, mask, draw).

The decode graphs draw their other rows in the graph and skip these (gumbel_argmax's skip), so
a controlled decode step costs one draw over the vocabulary, not two.
"""

from __future__ import annotations

import torch
from torch import Tensor

from strata.kernels.gumbel_sampling import HAVE_TRITON, _launch_shape, gumbel_from_keys, gumbel_row_keys

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from strata.kernels.arrival_counters import arrival_counters
    from strata.kernels.gumbel_sampling import (
        _INTERPRETED,
        _merge_splits,
        _perturbed_tl,
        _row_keys_tl,
    )
    from strata.kernels.kernel_launch import device_sm_count

_NEG_INF = float("-inf")


def bitmask_allows(mask: Tensor, vocab: int, mask_vocab: int) -> Tensor:
    """bool [n, vocab] from xgrammar's int32 bitmask [n, ceil(mask_vocab / 32)] (bit t % 32 of
    word t // 32 set: t allowed); tokens at or past mask_vocab are forbidden."""
    shifts = torch.arange(32, device=mask.device, dtype=torch.int32)
    bits = ((mask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    allowed = torch.zeros((mask.shape[0], vocab), dtype=torch.bool, device=mask.device)
    width = min(vocab, mask_vocab)
    allowed[:, :width] = bits[:, :width]
    return allowed


def apply_bitmask_(logits: Tensor, mask: Tensor, rows: Tensor, mask_vocab: int) -> None:
    """logits[rows[i], t] = -inf where mask[i] forbids t (the general path's mask; one launch on
    CUDA, torch ops elsewhere)."""
    n = rows.numel()
    if n == 0:
        return
    if HAVE_TRITON and (logits.is_cuda or _interpreted(logits)) and logits.stride(-1) == 1:
        block = 2048
        _apply_bitmask_kernel[(n, triton.cdiv(logits.shape[1], block))](
            logits,
            logits.stride(0),
            rows,
            mask.contiguous(),
            mask.shape[1],
            mask_vocab,
            logits.shape[1],
            BLOCK=block,
        )
        return
    allowed = bitmask_allows(mask, logits.shape[-1], mask_vocab)
    logits[rows] = logits[rows].masked_fill(~allowed, _NEG_INF)


def controlled_draw_reference(
    logits: Tensor,
    rows: Tensor,
    seeds: Tensor,
    positions: Tensor,
    inv_temperature: Tensor,
    greedy: Tensor,
    tokens: Tensor,
    mask: tuple[Tensor, Tensor, int] | None = None,
    patch: tuple[Tensor, Tensor, Tensor] | None = None,
    store: tuple[Tensor, Tensor] | None = None,
) -> None:
    """Torch reference of controlled_draw (same arguments): the float32 rows with the patch and
    the mask applied, then the sampler's Gumbel-max draw."""
    if rows.numel() == 0:
        return
    rows = rows.to(torch.int64)
    z = logits[rows].float()
    if patch is not None:
        patch_tok, patch_val, patch_index = patch
        for i in range(rows.shape[0]):
            p = int(patch_index[i])
            if p >= 0:
                keep = patch_tok[p] >= 0
                z[i, patch_tok[p][keep].long()] = patch_val[p][keep]
    if mask is not None:
        bitmask, mask_index, mask_vocab = mask
        masked = torch.nonzero(mask_index >= 0).flatten()
        if masked.numel():
            allowed = bitmask_allows(bitmask[mask_index[masked].long()], z.shape[-1], mask_vocab)
            z[masked] = z[masked].masked_fill(~allowed, _NEG_INF)
    key_a, key_b = gumbel_row_keys(seeds[rows], positions[rows])
    perturbed = z * inv_temperature[rows].unsqueeze(1) + gumbel_from_keys(key_a, key_b, z.shape[-1])
    drawn = torch.where(greedy[rows].bool(), z.argmax(dim=-1), perturbed.argmax(dim=-1))
    tokens[rows] = drawn
    if store is not None:
        out, store_rows = store
        out[store_rows[rows]] = drawn


if HAVE_TRITON:

    @triton.jit(do_not_specialize=["mask_stride", "mask_vocab"])
    def _apply_bitmask_kernel(
        logits_ptr, row_stride, rows_ptr, mask_ptr, mask_stride, mask_vocab, vocab_size, BLOCK: tl.constexpr
    ):
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_vocab = cols < vocab_size
        row = tl.load(rows_ptr + i)
        words = tl.load(mask_ptr + i * mask_stride + (cols >> 5), mask=in_vocab & (cols < mask_vocab), other=0)
        forbidden = in_vocab & (((words >> (cols & 31)) & 1) == 0)
        ptrs = logits_ptr + row.to(tl.int64) * row_stride + cols
        tl.store(ptrs, tl.full((BLOCK,), float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty), mask=forbidden)

    @triton.jit(do_not_specialize=["mask_stride", "mask_vocab", "patch_width"])
    def _controlled_draw_kernel(
        logits_ptr,
        row_stride,
        rows_ptr,
        seeds_ptr,
        positions_ptr,
        inv_temp_ptr,
        greedy_ptr,
        mask_ptr,
        mask_stride,
        mask_index_ptr,
        mask_vocab,
        patch_tok_ptr,
        patch_val_ptr,
        patch_index_ptr,
        patch_width,
        best_val_ptr,
        best_idx_ptr,
        arrivals_ptr,
        token_ptr,
        store_rows_ptr,
        store_ptr,
        vocab_size,
        num_splits,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        SPLITS_PADDED: tl.constexpr,
        STORE: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        i = tl.program_id(0)  # the i-th controlled row ...
        split = tl.program_id(1)
        row = tl.load(rows_ptr + i)  # ... is this row of the logits
        key_a, key_b = _row_keys_tl(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
        inv_t = tl.load(inv_temp_ptr + row)
        greedy = tl.load(greedy_ptr + row)
        mask_row = tl.load(mask_index_ptr + i)  # -1: no bitmask
        has_mask = mask_row >= 0
        mask_base = mask_ptr + tl.maximum(mask_row, 0).to(tl.int64) * mask_stride
        row_ptr = logits_ptr + row.to(tl.int64) * row_stride
        start = split * CHUNK
        # The logits in tiles of [BLOCK / 32 bitmask words, 32 tokens]: each word is loaded once
        # and its bits broadcast along the tile's rows (a load per token cost as much as the draw).
        WORDS: tl.constexpr = BLOCK // 32
        bit = tl.arange(0, 32)[None, :]
        tile = tl.arange(0, WORDS)[:, None] * 32 + bit
        best_vals = tl.full((WORDS, 32), float("-inf"), tl.float32)
        best_cols = tl.full((WORDS, 32), 2147483647, tl.int32)
        x_next = tl.load(row_ptr + start + tile, mask=start + tile < vocab_size, other=float("-inf"))
        for offset in range(0, CHUNK, BLOCK):
            cols = start + offset + tile
            in_vocab = cols < vocab_size
            x = x_next.to(tl.float32)
            next_cols = cols + BLOCK
            x_next = tl.load(
                row_ptr + next_cols, mask=(next_cols < vocab_size) & (offset + BLOCK < CHUNK), other=float("-inf")
            )
            word = (start + offset) // 32 + tl.arange(0, WORDS)
            words = tl.load(mask_base + word, mask=has_mask & (word < mask_stride), other=0)
            allowed = (mask_row < 0) | ((((words[:, None] >> bit) & 1) != 0) & (cols < mask_vocab))
            x = tl.where(allowed, x, float("-inf"))
            val = x
            if greedy == 0:
                val = _perturbed_tl(x, cols, key_a, key_b, inv_t, INTERPRETED)
            val = tl.where(in_vocab, val, float("-inf"))
            better = val > best_vals  # strict: each lane keeps its first maximum
            best_vals = tl.where(better, val, best_vals)
            best_cols = tl.where(better, cols, best_cols)
        best = tl.max(tl.max(best_vals, axis=1), axis=0)
        best_col = tl.min(tl.min(tl.where(best_vals == best, best_cols, 2147483647), axis=1), axis=0)
        patch_row = tl.load(patch_index_ptr + i)  # -1: no penalised tokens
        if patch_row >= 0:
            patch_base = patch_row.to(tl.int64) * patch_width
            p0 = 0
            while p0 < patch_width:  # (the interpreter cannot take tensor bounds in range())
                p = p0 + tl.arange(0, BLOCK)
                t = tl.load(patch_tok_ptr + patch_base + p, mask=p < patch_width, other=-1)
                inside = (t >= start) & (t < start + CHUNK) & (t < vocab_size)
                t = tl.where(inside, t, start)
                y = tl.load(patch_val_ptr + patch_base + p, mask=inside, other=float("-inf"))
                words = tl.load(mask_base + (t >> 5), mask=inside & has_mask & (t < mask_vocab), other=0)
                allowed = (mask_row < 0) | ((((words >> (t & 31)) & 1) != 0) & (t < mask_vocab))
                y = tl.where(allowed, y, float("-inf"))
                val = y
                if greedy == 0:
                    val = _perturbed_tl(y, t, key_a, key_b, inv_t, INTERPRETED)
                val = tl.where(inside, val, float("-inf"))
                block_best = tl.max(val, axis=0)
                block_col = tl.min(tl.where((val == block_best) & inside, t, 2147483647), axis=0)
                # Patch tokens come in any order: the first token wins a tie here too.
                better = (block_best > best) | ((block_best == best) & (block_col < best_col))
                best = tl.where(better, block_best, best)
                best_col = tl.where(better, block_col, best_col)
                p0 += BLOCK
        best_col = tl.where(best == float("-inf"), start, best_col)  # nothing above -inf: the split's start
        part = i * num_splits + split
        tl.store(best_val_ptr + part, best)
        tl.store(best_idx_ptr + part, best_col)
        tl.debug_barrier()  # every thread's stores are done before the release below
        arrived = tl.atomic_add(arrivals_ptr + i, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            first = i * num_splits  # this row's partials; its token goes to tokens[row]
            token = _merge_splits(
                best_val_ptr + first,
                best_idx_ptr + first,
                best_val_ptr,
                best_val_ptr,
                token_ptr + row,
                token_ptr,
                0,
                num_splits,
                SPLITS_PADDED,
                False,
            )
            if STORE:  # the worker's last_sampled, by state row
                tl.store(store_ptr + tl.load(store_rows_ptr + row), token)
            tl.store(arrivals_ptr + i, 0)  # ready for the next launch


def controlled_draw(
    logits: Tensor,
    rows: Tensor,
    seeds: Tensor,
    positions: Tensor,
    inv_temperature: Tensor,
    greedy: Tensor,
    tokens: Tensor,
    mask: tuple[Tensor, Tensor, int] | None = None,
    patch: tuple[Tensor, Tensor, Tensor] | None = None,
    store: tuple[Tensor, Tensor] | None = None,
) -> None:
    """Draws logits row rows[i] under its controls into tokens[rows[i]] (int64), one launch, no
    host sync. seeds, positions, inv_temperature and greedy (uint8/bool) are indexed by logits
    row, as the decode graphs hold them. mask: (bitmask int32 [m, W], mask_index int32 [n]: row i's
    bitmask row or -1, mask_vocab: tokens past it are forbidden where a bitmask applies).
    patch: (patch_tok int32 [p, C], patch_val float32 [p, C], patch_index int32 [n]: row i's patch
    row or -1), as kernels/penalties.penalty_patches leaves them. store (out, store_rows): also
    out[store_rows[rows[i]]] = the token. Rows must be unfiltered (no top-k/top-p/min-p)."""
    n = rows.shape[0]
    if n == 0:
        return
    if not (HAVE_TRITON and logits.is_cuda) and not _interpreted(logits):
        controlled_draw_reference(logits, rows, seeds, positions, inv_temperature, greedy, tokens, mask, patch, store)
        return
    if logits.stride(-1) != 1:
        raise ValueError("controlled_draw needs logits contiguous by row")
    vocab = logits.shape[1]
    device = logits.device
    chunk, block, num_warps, _ = _launch_shape(n, vocab, device_sm_count(device))
    num_splits = triton.cdiv(vocab, chunk)
    best_val = torch.empty((n, num_splits), device=device, dtype=torch.float32)
    best_idx = torch.empty((n, num_splits), device=device, dtype=torch.int32)
    none_i32 = torch.full((n,), -1, dtype=torch.int32, device=device) if mask is None or patch is None else None
    bitmask, mask_index, mask_vocab = mask if mask is not None else (best_idx, none_i32, 0)
    patch_tok, patch_val, patch_index = patch if patch is not None else (best_idx, best_val, none_i32)
    out, store_rows = store if store is not None else (tokens, rows)
    _controlled_draw_kernel[(n, num_splits)](
        logits,
        logits.stride(0),
        rows,
        seeds,
        positions,
        inv_temperature,
        greedy.view(torch.uint8),
        bitmask,
        bitmask.shape[1] if bitmask.dim() == 2 else 0,
        mask_index,
        mask_vocab,
        patch_tok,
        patch_val,
        patch_index,
        patch_tok.shape[1] if patch_tok.dim() == 2 else 0,
        best_val,
        best_idx,
        arrival_counters(device, n, "controlled_draw"),
        tokens,
        store_rows,
        out,
        vocab,
        num_splits,
        CHUNK=chunk,
        BLOCK=block,
        SPLITS_PADDED=triton.next_power_of_2(num_splits),
        STORE=store is not None,
        INTERPRETED=_INTERPRETED,
        num_warps=num_warps,
    )


def _interpreted(logits: Tensor) -> bool:
    return HAVE_TRITON and _INTERPRETED and not logits.is_cuda
