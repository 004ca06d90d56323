"""RMSNorm, optionally fused with the residual add before it: one Triton program per token row.

The unfused torch path (HF's math) costs ~6 kernels per norm: to(float32), pow, mean, rsqrt,
mul, to(dtype), mul by the weight, plus the residual add. Here a row is read once, the sum of
squares is accumulated in float32, and the results are rounded to the activation dtype at the
same points as the torch path (the residual sum, the normalised row, the weighted output), so
the two agree to float32 rounding of the reduction.

No host synchronisation and a launch shape that only depends on the number of rows: safe to
capture in a CUDA graph for any (padded) batch size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from strata.kernels.dependent_launch import dependent_launch_supported, launch_options
from strata.kernels.reference import fused_add_rms_norm_reference, rms_norm_reference

__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_reference", "rms_norm", "rms_norm_reference"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    if PDL:  # its successor (the small-batch GEMM) may start streaming its weights now
        gdc_launch_dependents()
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    # Issued first, not after the reduction: a decode row is latency-bound, and the weight's load
    # (constant data, before the wait) then overlaps x's instead of following the sum.
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if PDL:
        gdc_wait()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # The torch path adds in the activation dtype: round the sum the same way.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    out = rms_norm_row(x, weight, HIDDEN, eps, UNIT_OFFSET)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_row(x, weight, HIDDEN: tl.constexpr, eps, UNIT_OFFSET: tl.constexpr = False):
    """weight * rms_normalise(x) of one whole row (padding zero), in float32 (also decode_linear's
    prologue). Float32 statistics; HF casts the normalised row back to the input dtype before
    scaling by the weight, and so does this. UNIT_OFFSET: (1 + weight) * rms_normalise(x) with
    nothing rounded in between (Gemma's norm)."""
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / HIDDEN
    if UNIT_OFFSET:
        return (x32 * tl.math.rsqrt(variance + eps)) * (1.0 + weight.to(tl.float32))
    normed = (x32 * tl.math.rsqrt(variance + eps)).to(x.dtype)
    return weight.to(tl.float32) * normed.to(tl.float32)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    residual_out: torch.Tensor | None = None,
    unit_offset: bool = False,
):
    assert x.dim() == 2, f"expected [T, hidden], got {tuple(x.shape)}"
    num_rows, hidden = x.shape
    assert weight.shape == (hidden,) and weight.stride(0) == 1, (weight.shape, hidden)
    assert x.stride(-1) == 1, "rows must be contiguous"
    out = torch.empty(x.shape, dtype=norm_output_dtype(x, weight, unit_offset), device=x.device)
    if residual is None:
        residual_out = None
    else:
        assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, residual.dtype)
        assert residual.stride(-1) == 1, "rows must be contiguous"
        if residual_out is None:
            residual_out = torch.empty_like(x, memory_format=torch.contiguous_format)
        assert residual_out.shape == x.shape and residual_out.stride(-1) == 1, residual_out.shape
    if num_rows == 0:
        return out, residual_out
    block = triton.next_power_of_2(hidden)
    add = residual is not None
    pdl = dependent_launch_supported(x.device)
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if add else x,
        weight,
        out,
        residual_out if add else out,
        x.stride(0),
        residual.stride(0) if add else 0,
        out.stride(0),
        residual_out.stride(0) if add else 0,
        eps,
        HIDDEN=hidden,
        BLOCK=block,
        ADD_RESIDUAL=add,
        UNIT_OFFSET=unit_offset,
        PDL=pdl,
        num_warps=row_warps(block),
        **launch_options(pdl),
    )
    return out, residual_out


def norm_output_dtype(x: torch.Tensor, weight: torch.Tensor, unit_offset: bool) -> torch.dtype:
    """weight * normed.to(x.dtype) promotes like torch would (bf16 weights give bf16 output);
    Gemma's norm returns x's dtype."""
    return x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)


def row_warps(block: int) -> int:
    """~16 elements a thread: 4 warps for hidden 2048, 16 for 8192. The warps set the order of the
    row's sum of squares, so every kernel that norms a row as this one does takes the same."""
    return min(16, max(1, block // 512))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """weight * rms_normalise(x) for x [T, hidden]; float32 statistics, output in x's dtype.
    unit_offset: (1 + weight) * rms_normalise(x), rounded once (Gemma)."""
    out, _ = _launch(x, None, weight, eps, unit_offset=unit_offset)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual_out: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; x and residual are left untouched
    unless residual_out is residual (in place is safe: a program reads its whole row first)."""
    return _launch(x, residual, weight, eps, residual_out, unit_offset)
