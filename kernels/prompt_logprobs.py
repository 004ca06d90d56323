"""The row statistics of prompt logprobs in one read of the logits: per row of logits [R, V] (any
float dtype) and a token per row, the row's logsumexp, the number of entries at least as large as
the token's (its rank) and the k largest entries with their ids.

One program per (row, tile of BLOCK entries) reads its tile once and writes the tile's maximum,
its sum of exp below that maximum, its count, and its own k largest (k rounds of max and mask
in registers); torch merges the tiles ([R, tiles] partials: a handful of small ops). The torch
reference (kernels/reference.py) upcasts a float32 copy of the logits and reads them about five
times, more than the lm_head that made them once a vocabulary is large.
"""

from __future__ import annotations

import torch

from strata.kernels.reference import logprob_rows_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["logprob_rows", "logprob_rows_reference"]

BLOCK = 2048
# Top counts the kernel is compiled for: a row's k is served by the next one up (fewer variants).
_K_VARIANTS = (0, 1, 2, 5, 10, 20)

if triton is not None:

    @triton.jit
    def _logprob_rows_kernel(
        logits_ptr,
        stride,
        targets_ptr,
        max_ptr,
        sum_ptr,
        count_ptr,
        top_values_ptr,
        top_ids_ptr,
        vocab,
        num_tiles,
        BLOCK: tl.constexpr,
        K: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        offsets = tl.arange(0, BLOCK)
        cols = tile * BLOCK + offsets
        valid = cols < vocab
        base = logits_ptr + row * stride
        x = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32)
        target = tl.load(base + tl.load(targets_ptr + row)).to(tl.float32)
        out = row * num_tiles + tile
        m = tl.max(x, axis=0)
        shift = tl.where(m == float("-inf"), 0.0, m)  # a tile of -inf only: its sum is 0
        tl.store(max_ptr + out, m)
        tl.store(sum_ptr + out, tl.sum(tl.exp(x - shift), axis=0))
        tl.store(count_ptr + out, tl.sum((valid & (x >= target)).to(tl.int32), axis=0))
        for j in tl.static_range(K):
            value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            tl.store(top_values_ptr + out * K + j, value)
            tl.store(top_ids_ptr + out * K + j, tile * BLOCK + index)
            x = tl.where(offsets == index, float("-inf"), x)


def logprob_rows(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """logprob_rows_reference's results (logsumexp, rank, top values, top ids) from one read of
    the logits, for k up to 20."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    variant = next(v for v in _K_VARIANTS if v >= k)
    tiles = triton.cdiv(vocab, BLOCK)
    device = logits.device
    maxima = torch.empty((rows, tiles), dtype=torch.float32, device=device)
    sums = torch.empty_like(maxima)
    counts = torch.empty((rows, tiles), dtype=torch.int32, device=device)
    top_values = torch.empty((rows, tiles * variant), dtype=torch.float32, device=device)
    top_ids = torch.empty((rows, tiles * variant), dtype=torch.int32, device=device)
    if rows:
        _logprob_rows_kernel[(rows, tiles)](
            logits,
            logits.stride(0),
            targets,
            maxima,
            sums,
            counts,
            top_values,
            top_ids,
            vocab,
            tiles,
            BLOCK=BLOCK,
            K=variant,
            num_warps=8,
        )
    top = maxima.amax(dim=1, keepdim=True)
    shift = torch.where(top == float("-inf"), 0.0, top)
    log_norm = (shift + (sums * torch.exp(maxima - shift)).sum(dim=1, keepdim=True).log()).squeeze(1)
    ranks = counts.sum(dim=1, dtype=torch.int64)
    if not k:
        return log_norm, ranks, top_values[:, :0], top_ids[:, :0].long()
    values, picked = top_values.topk(k, dim=1)
    return log_norm, ranks, values, top_ids.gather(1, picked).long()
