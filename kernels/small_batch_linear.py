"""The linears of a small decode batch (2-16 rows) as one Triton GEMM each, whose weights start
streaming before the kernel ahead of it has ended.

At 16 rows a linear is a stream of its weights, and the small ones never reach full bandwidth:
cuBLAS streamed a tensor-parallel rank's o_proj (16 MB) at 2.3 TB/s and its qkv at 2.7 against
gate_up's 3.9 (bench/RESULTS.md, "What the 16-stream gap is made of"): the ramp at each kernel's
start and the tail at its end are a larger share of a shorter kernel. A whole-K Triton GEMM alone
was no faster than cuBLAS (6a0ed9c). What it can do that cuBLAS cannot is be a programmatic
dependent launch (kernels/dependent_launch.py): launched while the kernel before it runs, each
program loads the first FIRST_K columns of its W rows before gdc_wait, so the weights stream
while that kernel (the all-reduce's one-shot, the attention, a norm) still waits on its own
latency. Then it reads x and walks the rest of K with W tiles software-pipelined, tensor-core dots
over x padded to 16 rows; no split-K, so no reduce launch.

Only where cuBLAS would otherwise run at such a batch, and behind `enabled` (off by default, set by
benchmarks' A/B) until two GPUs have measured it in the served step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

from strata.kernels.dependent_launch import dependent_launch_supported, launch_options

MAX_ROWS = 16  # one tensor-core tile of rows
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)  # float32 would take TF32 dots, not F.linear's sums
enabled = False  # (module docstring) benchmarks set it for their A/B


@dataclass(frozen=True)
class SmallBatchConfig:
    block_n: int = 16  # output columns (W rows) a program owns
    block_k: int = 256  # K a pipelined step
    first_k: int = 512  # W columns loaded before the wait (0: none, the A/B's baseline)
    num_stages: int = 4
    num_warps: int = 4


def choose_config(*, n: int, k: int) -> SmallBatchConfig:
    """16 W rows a program up to N = 8,192 (a rank's qkv: 192 programs, enough to fill the GPU
    twice), 32 past it (gate_up); the first 512 columns before the wait, or all of a K that small."""
    return SmallBatchConfig(block_n=16 if n <= 8192 else 32, first_k=min(512, k))


@triton.jit
def _small_batch_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_x,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FIRST_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
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
    if FIRST_K > 0:
        # Constant data, so loaded before the wait: it streams while the kernel before this one runs.
        first = tl.arange(0, FIRST_K)
        w_first = tl.load(w_ptr + rows[:, None] * K + first[None, :])
    if PDL:
        gdc_wait()
    if FIRST_K > 0:
        x_first = tl.load(x_ptr + offs_m[:, None] * stride_x + first[None, :], mask=m_mask[:, None], other=0.0)
        acc = tl.dot(x_first, tl.trans(w_first), acc)
    for k in tl.range(FIRST_K, K, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + rows[:, None] * K + offs_k[None, :])
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    n_mask = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# Decided when the kernel is defined, as triton.jit decides (TRITON_INTERPRET read at decoration).
_INTERPRETED = isinstance(_small_batch_linear_kernel, InterpretedFunction)


def serves(x: torch.Tensor, weight: torch.Tensor, config: SmallBatchConfig | None = None) -> bool:
    """Whether small_batch_linear takes F.linear(x, weight): switched on, 2-16 rows of a supported
    dtype with unit column stride, a contiguous 2-D weight whose K the config's steps divide (CUDA
    tensors, or any under the interpreter)."""
    if not enabled or x.dim() != 2 or not 2 <= x.shape[0] <= MAX_ROWS or x.stride(1) != 1:
        return False
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype or not (x.is_cuda or _INTERPRETED):
        return False
    if weight.dim() != 2 or not weight.is_contiguous() or weight.shape[1] != x.shape[1]:
        return False
    n, k = weight.shape
    config = config or choose_config(n=n, k=k)
    return (k - config.first_k) % config.block_k == 0 and config.first_k & (config.first_k - 1) == 0


def small_batch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: SmallBatchConfig | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x of at most MAX_ROWS rows (see serves). Launch shapes depend
    on python ints only: capturable in CUDA graphs."""
    m = x.shape[0]
    n, k = weight.shape
    config = config or choose_config(n=n, k=k)
    assert m <= MAX_ROWS and x.stride(1) == 1 and weight.is_contiguous() and x.shape[1] == k, (x.shape, weight.shape)
    assert (k - config.first_k) % config.block_k == 0, (k, config)
    assert bias is None or (bias.shape == (n,) and bias.stride(0) == 1)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    pdl = dependent_launch_supported(x.device)
    _small_batch_linear_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        x.stride(0),
        K=k,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        FIRST_K=config.first_k,
        HAS_BIAS=bias is not None,
        NUM_STAGES=config.num_stages,
        PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    return out
