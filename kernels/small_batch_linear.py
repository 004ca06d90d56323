"""The linears of a small decode batch (2-16 rows) as one Triton GEMM each: split-K whose last
program merges the splits in the same launch, SiLU-and-mul in gate_up's epilogue, and the first
weight tile loaded before the dependent-launch wait.

At 16 rows a linear is a stream of its weights, and cuBLAS pays three fixed costs for the small
ones (bench/RESULTS.md, "What the 16-stream gap is made of"): a split-K reduce launch after two
of qkv, o_proj and down (64 launches an 8B step, 116 us), the separate SiLU-and-mul launch (32, 52 us),
and each GEMM's ramp, which a library kernel cannot overlap with the kernel before it. They do
not shrink with tensor parallelism, so they hold a rank's step above half of one GPU's.

- Split-K without the reduce launch. A program owns BLOCK_N output columns and one of SPLIT_K
  ranges of K: enough programs to fill the GPU at a rank's narrow shapes without re-reading x
  per 16 columns (x is [16, K], as large as 16 rows of W). Each split stores its float32 partial,
  bumps its column block's arrival counter (kernels/arrival_counters.py) and the last to arrive
  sums the partials in split order, so the result does not depend on which split came last.
- SiLU-and-mul in the epilogue. A program of gate_up loads gate's rows and up's rows for the same
  output columns and writes silu(gate) * up: down reads [16, I] and the activation launch goes.
- Weights before the wait. With PDL (kernels/dependent_launch.py) each program loads its first W
  tile before gdc_wait, while the kernel ahead of it (the one-shot all-reduce, the attention, the
  norm or gate_up) still runs.

Rounding follows F.linear then F.silu(gate) * up: the projection is rounded to the activation
dtype before the activation, the activation before the product. Only summation orders differ.
Launch shapes depend on python ints only: capturable in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

from strata.kernels.activation import silu_mul
from strata.kernels.arrival_counters import arrival_counters
from strata.kernels.dependent_launch import dependent_launch_supported, launch_options

__all__ = ["MAX_ROWS", "SmallBatchConfig", "choose_config", "serves", "small_batch_linear"]

MAX_ROWS = 16  # one tensor-core tile of rows
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)  # float32 would take TF32 dots, not F.linear's sums
enabled = True  # benchmarks' A/B turns it off


@dataclass(frozen=True)
class SmallBatchConfig:
    block_n: int = 64  # output columns a program owns
    block_k: int = 256  # K a pipelined step
    split_k: int = 1  # ranges of K, each a program of its own
    num_stages: int = 4
    num_warps: int = 4


# The best config of each shape it serves, from `python -m strata.bench.small_batch_linear` at 16
# rows on one H200 (bench/RESULTS.md, "A small-batch GEMM"), keyed by (W rows, K, silu_mul). Shapes
# not here take cuBLAS: a config that is not tuned for a shape was up to 1.3x slower than cuBLAS
# at it, and the best one was never more than 1.03x slower.
TUNED = {
    # Llama-3.1-8B (Mistral-7B), one GPU
    (6144, 4096, False): SmallBatchConfig(64, 128, 4, 4, 2),  # 1.02x cuBLAS
    (4096, 4096, False): SmallBatchConfig(64, 256, 4, 3),  # 1.22x
    (28672, 4096, True): SmallBatchConfig(32, 256, 1, 3),  # 1.01x, and no SiLU launch (2 warps spilled)
    (4096, 14336, False): SmallBatchConfig(64, 256, 2, 4),  # 1.07x
    # Llama-3.1-8B (Mistral-7B), a rank of two
    (3072, 4096, False): SmallBatchConfig(32, 256, 4, 4, 2),  # 1.30x
    (4096, 2048, False): SmallBatchConfig(32, 256, 4, 3),  # 0.97x alone, after a PDL primary in a step
    (14336, 4096, True): SmallBatchConfig(64, 256, 1, 3),  # 1.06x, and no SiLU launch
    (4096, 7168, False): SmallBatchConfig(64, 256, 4, 3),  # 1.17x
    # Qwen3-8B's MLP (its qkv and o_proj are the 8B's), one GPU (session 19's sweep)
    (24576, 4096, True): SmallBatchConfig(32, 128, 1, 4),  # 1.05x
    (4096, 12288, False): SmallBatchConfig(64, 256, 2, 4),  # 1.07x
    # Qwen3-8B's MLP, a rank of two (split 1 where split 2 was as fast: no partial sums to merge)
    (12288, 4096, True): SmallBatchConfig(32, 128, 1, 4),  # 1.08x
    (4096, 6144, False): SmallBatchConfig(64, 256, 4, 3),  # 1.16x
    # Llama-3.2-1B, one GPU
    (3072, 2048, False): SmallBatchConfig(64, 256, 4, 3),  # 1.03x
    (2048, 2048, False): SmallBatchConfig(32, 256, 4, 3),  # 1.05x
    (16384, 2048, True): SmallBatchConfig(32, 256, 1, 3),  # 1.15x
    (2048, 8192, False): SmallBatchConfig(32, 256, 8, 3),  # 1.16x
    # Llama-3.2-1B, a rank of two
    (1536, 2048, False): SmallBatchConfig(32, 256, 4, 3),  # 1.08x
    (2048, 1024, False): SmallBatchConfig(32, 256, 2, 3),  # 1.05x
    (8192, 2048, True): SmallBatchConfig(32, 256, 2, 3),  # 1.14x
    (2048, 4096, False): SmallBatchConfig(32, 256, 8, 3),  # 1.23x
}


def choose_config(*, rows: int, k: int, silu_mul: bool = False) -> SmallBatchConfig | None:
    """The tuned config of a W of `rows` x `k`, or None (cuBLAS serves it)."""
    return TUNED.get((rows, k, silu_mul))


@triton.jit
def _small_batch_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    arrivals_ptr,
    M,
    stride_x,
    stride_out,
    N: tl.constexpr,  # output columns; with SILU_MUL W has 2N rows, gate's then up's
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # columns past N re-read the last row, never stored
    K_SPLIT: tl.constexpr = K // SPLIT_K
    offs_k = pid_k * K_SPLIT + tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None] * K + offs_k[None, :]
    up_ptrs = w_ptrs + N * K
    x_ptrs = x_ptr + offs_m[:, None] * stride_x + offs_k[None, :]
    # The first tile: W is constant, so it streams before the wait, while the kernel ahead runs.
    w = tl.load(w_ptrs)
    if SILU_MUL:
        u = tl.load(up_ptrs)
    if PDL:
        gdc_wait()
    x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
    acc = tl.dot(x, tl.trans(w))
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if SILU_MUL:
        acc_up = tl.dot(x, tl.trans(u))
    for i in tl.range(1, K_SPLIT // BLOCK_K, num_stages=NUM_STAGES):
        step = i * BLOCK_K
        w = tl.load(w_ptrs + step)
        x = tl.load(x_ptrs + step, mask=m_mask[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        if SILU_MUL:
            u = tl.load(up_ptrs + step)
            acc_up = tl.dot(x, tl.trans(u), acc_up)
    if SPLIT_K > 1:
        # [SPLIT_K, BLOCK_M, 2N]: gate's (or the only) partial, then up's.
        width: tl.constexpr = 2 * N if SILU_MUL else N
        part = partial_ptr + offs_m[:, None] * width + offs_n[None, :]
        tl.store(part + pid_k * BLOCK_M * width, acc, mask=n_mask[None, :])
        if SILU_MUL:
            tl.store(part + pid_k * BLOCK_M * width + N, acc_up, mask=n_mask[None, :])
        tl.debug_barrier()  # every thread's partial is stored before the release below
        arrived = tl.atomic_add(arrivals_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            # In split order, whichever split came last: the sums do not depend on arrival.
            acc = tl.load(part, mask=n_mask[None, :], other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                acc += tl.load(part + s * BLOCK_M * width, mask=n_mask[None, :], other=0.0, cache_modifier=".cg")
            if SILU_MUL:
                acc_up = tl.load(part + N, mask=n_mask[None, :], other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT_K):
                    acc_up += tl.load(
                        part + s * BLOCK_M * width + N, mask=n_mask[None, :], other=0.0, cache_modifier=".cg"
                    )
            _epilogue(acc, acc_up, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_out, N, SILU_MUL, HAS_BIAS)
            tl.store(arrivals_ptr + pid_n, 0)  # ready for the next launch
    else:
        _epilogue(acc, acc_up, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_out, N, SILU_MUL, HAS_BIAS)


@triton.jit
def _epilogue(
    acc,
    acc_up,
    bias_ptr,
    out_ptr,
    offs_m,
    offs_n,
    m_mask,
    n_mask,
    stride_out,
    N: tl.constexpr,
    SILU_MUL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if SILU_MUL:
            acc_up += tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(dtype)
    if SILU_MUL:  # the projection rounded first, as gate_up's output is before F.silu(gate) * up
        y = silu_mul(y, acc_up.to(dtype)).to(dtype)
    tl.store(out_ptr + offs_m[:, None] * stride_out + offs_n[None, :], y, mask=m_mask[:, None] & n_mask[None, :])


# Decided when the kernel is defined, as triton.jit decides (TRITON_INTERPRET read at decoration).
_INTERPRETED = isinstance(_small_batch_linear_kernel, InterpretedFunction)


def serves(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool = False) -> bool:
    """Whether small_batch_linear takes F.linear(x, weight) (with silu_mul, and the activation
    after it): switched on, 2-16 rows of a supported dtype with unit column stride, a contiguous
    W of a tuned shape (CUDA tensors, or any under the interpreter)."""
    if not enabled or x.dim() != 2 or not 2 <= x.shape[0] <= MAX_ROWS or x.stride(1) != 1:
        return False
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype or not (x.is_cuda or _INTERPRETED):
        return False
    if weight.dim() != 2 or not weight.is_contiguous() or weight.shape[1] != x.shape[1]:
        return False
    return choose_config(rows=weight.shape[0], k=weight.shape[1], silu_mul=silu_mul) is not None


def small_batch_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_mul: bool = False,
    config: SmallBatchConfig | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x of at most MAX_ROWS rows (see serves); with silu_mul,
    silu(gate) * up of that [gate | up] projection, [M, N / 2]."""
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    config = config or choose_config(rows=weight.shape[0], k=k, silu_mul=silu_mul)
    assert config is not None and k % (config.split_k * config.block_k) == 0, (weight.shape, config)
    assert m <= MAX_ROWS and x.stride(1) == 1 and weight.is_contiguous() and weight.shape[1] == k, (
        x.shape,
        weight.shape,
    )
    assert bias is None or (bias.shape == (weight.shape[0],) and bias.stride(0) == 1)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(n, config.block_n)
    partial = out
    if config.split_k > 1:
        partial = torch.empty(
            (config.split_k, MAX_ROWS, 2 * n if silu_mul else n), dtype=torch.float32, device=x.device
        )
    pdl = dependent_launch_supported(x.device)
    _small_batch_linear_kernel[(blocks, config.split_k)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        partial,
        arrival_counters(x.device, blocks, "small_batch_linear"),
        m,
        x.stride(0),
        out.stride(0),
        N=n,
        K=k,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        SPLIT_K=config.split_k,
        SILU_MUL=silu_mul,
        HAS_BIAS=bias is not None,
        NUM_STAGES=config.num_stages,
        PDL=pdl,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    return out
