"""Token embedding with the decode lookahead's placeholders resolved, in one kernel.

A plan sent before the previous step's token reached the scheduler carries a placeholder (< 0)
for it; that token is still on this worker, in `last_sampled` at the sequence's state row. The
torch path resolves it with three kernels (an index, a compare, a where) before the embedding's
gather; at decode batch 1 each of those is a latency-bound launch of a microsecond or two on the
step's critical path, so here one program per token reads its id (or the placeholder's token)
and copies that row of the table.

It lets the next kernel launch early (PDL): the decode chain's first GEMV then streams its
weights while this one runs, and waits for it only where it reads the embedded row.

A tensor-parallel rank holds a slice of the table (vocab_offset, vocab_valid): ids outside it
give rows of zeros, which the ranks' all-reduce then fills in. In torch that was eight launches
(the shift, two compares, the clamp, the gather, the mask's cast and product), ~25 us of a TP2
rank's batch-16 step (bench/RESULTS.md, session 21) where the whole table takes one launch of 2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from strata.kernels.dependent_launch import dependent_launch_supported
from strata.kernels.reference import embed_tokens_reference

__all__ = ["embed_tokens", "embed_tokens_reference"]


@triton.jit
def _embed_tokens_kernel(
    ids_ptr,
    token_rows_ptr,
    last_sampled_ptr,
    weight_ptr,
    out_ptr,
    stride_weight,
    stride_out,
    vocab_offset,
    vocab_valid,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    RESOLVE: tl.constexpr,
    SLICE: tl.constexpr,  # the table holds ids [vocab_offset, vocab_offset + vocab_valid): zeros elsewhere
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    token_id = tl.load(ids_ptr + token)
    if RESOLVE:
        if token_id < 0:
            token_id = tl.load(last_sampled_ptr + tl.load(token_rows_ptr + token))
    if SLICE:
        token_id -= vocab_offset
        inside = (token_id >= 0) & (token_id < vocab_valid)
        token_id = tl.where(inside, token_id, 0)
    row = weight_ptr + token_id.to(tl.int64) * stride_weight
    for start in tl.static_range(0, HIDDEN, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < HIDDEN
        if SLICE:
            values = tl.load(row + cols, mask=mask & inside, other=0.0)
        else:
            values = tl.load(row + cols, mask=mask)
        tl.store(out_ptr + token * stride_out + cols, values, mask=mask)


def embed_tokens(
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    token_rows: torch.Tensor | None = None,
    last_sampled: torch.Tensor | None = None,
    *,
    vocab_offset: int = 0,
    vocab_valid: int | None = None,
) -> torch.Tensor:
    """weight[input_ids] as [T, hidden]; with token_rows and last_sampled, an id < 0 is replaced
    by last_sampled[token_rows] first (embed_tokens_reference). vocab_valid: weight's first
    vocab_valid rows are ids vocab_offset onwards, and an id outside them gives a row of zeros."""
    assert input_ids.dim() == 1 and weight.dim() == 2 and weight.stride(1) == 1, (input_ids.shape, weight.shape)
    resolve = token_rows is not None
    num_tokens, hidden = input_ids.shape[0], weight.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=weight.dtype, device=weight.device)
    if num_tokens == 0:
        return out
    block = min(4096, triton.next_power_of_2(hidden))
    _embed_tokens_kernel[(num_tokens,)](
        input_ids,
        token_rows if resolve else input_ids,
        last_sampled if resolve else input_ids,
        weight,
        out,
        weight.stride(0),
        out.stride(0),
        vocab_offset,
        vocab_valid or 0,
        HIDDEN=hidden,
        BLOCK=block,
        RESOLVE=resolve,
        SLICE=vocab_valid is not None,
        PDL=dependent_launch_supported(weight.device),
        num_warps=max(1, min(8, block // 512)),
    )
    return out
