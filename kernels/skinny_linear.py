"""The linears of a small decode batch (2-16 rows) as one Triton GEMM each, where cuBLAS splits K
and reduces in a second launch, and SiLU-and-mul before down_proj is a launch of its own.

A tensor-parallel rank's GEMMs are half as wide as one GPU's: at 16 rows cuBLAS streamed o_proj's
16 MB at 2.3 TB/s and qkv's 25 MB at 2.7 (bench/RESULTS.md, "Where the rank's step loses against
half of one GPU's"), and its split-K reduce, the SiLU and the norms did not shrink at all. Here a
program owns BLOCK_N output columns for every row and walks the whole of K (no split, no second
launch), its W tiles streamed by the software pipeliner; down_proj's [gate | up] operand is
activated as it is loaded. It is a programmatic dependent launch (kernels/dependent_launch.py):
its successor launches while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from strata.kernels.activation import silu_mul
from strata.kernels.dependent_launch import dependent_launch_supported, launch_options

MAX_ROWS = 16  # one tensor-core tile of rows


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int = 32
    block_k: int = 256
    num_stages: int = 4
    num_warps: int = 4


@triton.jit
def _skinny_linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    stride_x,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SILU_MUL: tl.constexpr,  # x is [gate | up] of 2K columns: silu(gate) * up, rounded, is the operand
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # columns past N re-read the last row, never stored
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PDL:
        gdc_wait()
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * K + offs_k[None, :])
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        if SILU_MUL:
            up = tl.load(x_ptr + offs_m[:, None] * stride_x + K + offs_k[None, :], mask=m_mask[:, None], other=0.0)
            x = silu_mul(x, up).to(w.dtype)
        acc = tl.dot(x, tl.trans(w), acc)
    out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_n < N)[None, :])


def skinny_linear(
    x: torch.Tensor, weight: torch.Tensor, *, silu_mul: bool = False, config: SkinnyConfig | None = None
) -> torch.Tensor:
    """F.linear(x, weight) for x of at most MAX_ROWS rows (silu_mul: x is [gate | up] and the
    operand silu(gate) * up). K must be a multiple of the config's block_k."""
    config = config or SkinnyConfig()
    m = x.shape[0]
    n, k = weight.shape
    assert m <= MAX_ROWS and x.stride(1) == 1 and weight.is_contiguous(), (x.shape, x.stride(), weight.shape)
    assert x.shape[1] == (2 * k if silu_mul else k) and k % config.block_k == 0, (x.shape, weight.shape, config)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    pdl = dependent_launch_supported(x.device)
    _skinny_linear_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        weight,
        out,
        m,
        n,
        x.stride(0),
        K=k,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SILU_MUL=silu_mul,
        NUM_STAGES=config.num_stages,
        PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    return out
