"""The adds of the two-rank copy-engine all-reduce (tensor_parallel/copy_all_reduce.py): a rank's
part plus the peer's, which the peer's copy engine wrote into this rank's receive buffer.

Nothing here waits: the stream that launches these waited (cuStreamWaitValue32, in the GPU's
front end, no SM held) for the word the peer's stream wrote after its copy. A kernel that spun on
a flag instead held the SMs that the signals of the next pieces needed, and stalled for
milliseconds (bench/RESULTS.md, session 19).

The sum is taken in float32 and rounded to x's dtype: a sum of two terms is the same bits in either
order, so both ranks hold the same sum, and it is what NCCL returns. The norm variant then adds the
residual and normalises the row as rmsnorm.py does, rounded at the same points as the one-shot's
norm variant (kernels/one_shot_all_reduce.py): the launch after a row-parallel linear and the
norm's own become one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.rmsnorm import rms_norm_row, row_warps

BLOCK = 4096  # elements a program of the plain sum (8 KB of bf16)
WARPS = 8


@triton.jit
def _add_kernel(x_ptr, peer_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    peer = tl.load(peer_ptr + offs, mask=mask, cache_modifier=".cg")  # (.cg: not an L1 line of the last call)
    tl.store(x_ptr + offs, (x.to(tl.float32) + peer.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, peer_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):  # fmt: skip
    """A row a program: both ranks' rows summed and rounded to x's dtype, plus the residual,
    stored as the residual stream and normalised."""
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    offs = tl.program_id(0).to(tl.int64) * HIDDEN + cols
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    peer = tl.load(peer_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    h = (x.to(tl.float32) + peer.to(tl.float32)).to(x.dtype)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
    tl.store(residual_out_ptr + offs, h, mask=mask)
    out = rms_norm_row(h, weight, HIDDEN, eps, UNIT_OFFSET)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_(x: torch.Tensor, peer: torch.Tensor) -> None:
    """x += peer (flat, contiguous), summed in float32."""
    n = x.numel()
    _add_kernel[(triton.cdiv(n, BLOCK),)](x, peer, n, BLOCK=BLOCK, num_warps=WARPS)


def add_rms_norm(
    x: torch.Tensor,
    peer: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    out: torch.Tensor,
    residual_out: torch.Tensor,
) -> None:
    """out = rms_norm(x + peer (+ residual)), residual_out = that sum (+ residual), for contiguous
    [rows, hidden] x, residual, out and residual_out, and peer of as many elements; residual_out may
    be x or residual (a program reads its row before it writes it)."""
    rows, hidden = x.shape
    block = triton.next_power_of_2(hidden)
    add = residual is not None
    _add_rms_norm_kernel[(rows,)](
        x,
        peer,
        residual if add else x,
        weight,
        out,
        residual_out,
        eps,
        HIDDEN=hidden,
        BLOCK=block,
        ADD_RESIDUAL=add,
        UNIT_OFFSET=unit_offset,
        num_warps=row_warps(block),  # rmsnorm.py's: the same order of the sum of squares, the same bits
    )
