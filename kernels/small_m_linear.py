"""y = x @ W.T (+ bias) for a few rows of x (decode batches of 1..16): a memory-bound Triton GEMV.

At M <= 16 a linear layer is a stream over its weight: every byte of W [N, K] is read once and
used M times, so the floor is W's bytes over the copy bandwidth. What keeps a kernel off that
floor is too few bytes in flight (HBM latency x bandwidth: ~3-4 MB on an H100/H200, half of a
2048 x 2048 bf16 matrix), so the launch is shaped to keep enough W loads outstanding on every SM.

How the work is cut:
- A program owns BLOCK_N rows of W (one N tile) and one K range (split), walked in BLOCK_K steps.
  Each step loads a [BLOCK_N, BLOCK_K] tile with K innermost (W is row-major: a warp reads whole
  16-byte vectors, 512 contiguous bytes per row at BLOCK_K = 256 bf16) and x's [M, BLOCK_K] slice,
  which stays in L2.
- Dot path (the default, any M): tl.dot(W tile, x tile^T), i.e. W is the MMA's wide "A" side
  (BLOCK_N >= 16 rows) and x, padded to 16 masked rows (shared memory but no traffic for the
  padding), its narrow "B" side. Tensor cores make the M-fold reuse free (15/16 of the MMA is
  wasted at M = 1, still far below the load time), and the software pipeliner keeps
  num_stages - 1 W tiles per program in flight through shared memory (cp.async): what the
  launch heuristic sizes.
- FMA path (M == 1 only, chosen by config; benchmarks compare it): products accumulate
  elementwise in a [BLOCK_N, BLOCK_K] float32 tile, summed over K once at the end, so the loop
  holds no cross-thread reduction. x is loaded through a [BLOCK_N, BLOCK_K] broadcast pointer
  (L1 hits) to land in W's register layout: loaded as [BLOCK_K] it needs a shared-memory
  relayout and a CTA barrier per step. Triton does not pipeline these loads.
- Split-K: when even 16-row tiles give fewer programs than SMs (N <= 2048 on 132 SMs), the K
  range is cut into SPLIT_K parts, each writing float32 partials [SPLIT_K, M, N]; a second kernel
  sums them in split order (deterministic, no atomics), adds the bias and rounds once to x's
  dtype, as the single pass does.
- K is a constexpr: static trip counts (no tensor bounds in range(), so no interpreter special
  case) and no K mask when K splits into whole tiles. A model has two or three K, one compiled
  variant each; M is not specialised, so one variant serves every batch size. Rows past N are
  clamped to N - 1 (re-read, never stored) to keep the W loads unmasked.

Launches depend only on python ints (M, N, K, SM count): no autotuning, capturable in a graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from strata.kernels.paged_attention import _device_sm_count

__all__ = ["LinearLaunchConfig", "choose_linear_config", "small_m_linear", "use_small_m_linear"]

MAX_M = 16
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# W bytes to keep in flight per SM: H200 4.8 TB/s x ~0.8 us loaded latency / 132 SMs ~ 29 KB;
# the rest is headroom for latency under load.
IN_FLIGHT_PER_SM = 48 * 1024
MAX_SHARED = 160 * 1024  # per program, of the 227 KB an sm_90 block may use


@dataclass(frozen=True)
class LinearLaunchConfig:
    """Tile shapes and launch knobs; choose_linear_config picks them from python ints only."""

    block_n: int  # rows of W per program
    block_k: int  # K per loop step
    split_k: int = 1  # 1 = single pass; > 1 = float32 partials + a reduce kernel
    use_dot: bool = True  # False: elementwise FMA path (M == 1 only)
    num_warps: int = 4
    num_stages: int = 4  # dot path: num_stages - 1 W tiles in flight per program


def choose_linear_config(
    *, n: int, k: int, sm_count: int, element_size: int = 2, split_k: int | None = None
) -> LinearLaunchConfig:
    """Shape heuristics (no autotune: launches must stay capturable and deterministic). M plays
    no part: the dot path pads it to 16 rows, and one config per weight keeps variants few.

    - BLOCK_K: 512 bytes of a row per step, halved (down to 64) until it divides K (no masked tail).
    - BLOCK_N: 32 rows when that gives >= 2 programs per SM, else 16 (wider: fewer programs, each
      a longer run; two or more per SM overlap one's ramp and tail with another's loads). 64 rows
      would switch to wgmma, which holds num_stages (not num_stages - 1) tiles in shared memory,
      leaving room for one program per SM (bench_linear.py --sweep times it).
    - SPLIT_K: only when 16-row tiles leave SMs without a program; powers of two (each is a
      compiled variant), keeping >= 2 steps per split. split_k: None = automatic, n = forced.
    - num_stages: enough tiles in flight for IN_FLIGHT_PER_SM over the programs an SM holds.
    """
    block_k = 512 // element_size
    while k % block_k and block_k > 64:
        block_k //= 2
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    block_n = 32 if triton.cdiv(n, 32) >= 2 * sm_count else 16
    programs = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    if split_k is None:
        split_k = 1
        while programs * split_k < sm_count and steps >= 4 * split_k:
            split_k *= 2
    per_sm = min(2.0, programs * split_k / sm_count)
    tile_bytes = block_n * block_k * element_size
    stages = 1 + max(2, -(-IN_FLIGHT_PER_SM // int(per_sm * tile_bytes)))
    # Shared memory: a W tile + an x tile (16 padded rows) per stage (counting num_stages buffers,
    # as wgmma would; mma.sync uses num_stages - 1); no more stages than steps + 1.
    stage_bytes = (block_n + 16) * block_k * element_size
    stages = min(stages, 6, MAX_SHARED // stage_bytes, 1 + triton.cdiv(steps, split_k))
    return LinearLaunchConfig(
        block_n=block_n, block_k=block_k, split_k=split_k, use_dot=True, num_warps=4, num_stages=max(2, stages)
    )


@triton.jit(do_not_specialize=["M"])
def _small_m_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partial_acc_ptr,
    M,
    N,
    stride_xm,
    stride_om,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STEPS_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_tile = w_ptr + rows_n[:, None] * K + offs_k[None, :]
    if USE_DOT:
        x_tile = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        x_rows = (offs_m < M)[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        x_tile = x_ptr + (rows_n * 0)[:, None] + offs_k[None, :]  # row 0, in W's layout
        x_rows = True
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)

    k_first = split * (STEPS_PER_SPLIT * BLOCK_K)
    for step in range(STEPS_PER_SPLIT):
        k0 = k_first + step * BLOCK_K
        if EVEN_K:
            w = tl.load(w_tile + k0)
            x = tl.load(x_tile + k0, mask=x_rows, other=0.0)
        else:
            k_valid = ((k0 + offs_k) < K)[None, :]
            w = tl.load(w_tile + k0, mask=k_valid, other=0.0)
            x = tl.load(x_tile + k0, mask=x_rows & k_valid, other=0.0)
        if USE_DOT:
            if IEEE_DOT:
                acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc += w.to(tl.float32) * x.to(tl.float32)

    if USE_DOT:
        y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        y = tl.sum(acc, axis=1)[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(partial_acc_ptr + (split * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :], y, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _reduce_splits_kernel(
    partial_acc_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    m = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = offs_n < N
    y = tl.zeros([BLOCK], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):  # fixed order: bit-identical run to run
        y += tl.load(partial_acc_ptr + (split * M + m).to(tl.int64) * N + offs_n, mask=valid, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=valid)


def use_small_m_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether small_m_linear can serve F.linear(x, weight): CUDA tensors, 1..16 rows of x, a
    supported dtype shared by both, a contiguous 2-D weight and unit-stride rows of x."""
    if not (x.is_cuda and weight.is_cuda and x.dtype in SUPPORTED_DTYPES and weight.dtype == x.dtype):
        return False
    if weight.dim() != 2 or not weight.is_contiguous() or x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        return False
    return x.stride(-1) == 1 and weight.shape[1] > 0 and 1 <= x.numel() // weight.shape[1] <= MAX_M


def small_m_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    split_k: int | None = None,
    config: LinearLaunchConfig | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] of at most 16 rows, weight [N, K] contiguous.

    Float32 accumulation, one rounding to x's dtype. split_k: None = automatic, 1 = single pass,
    n > 1 = forced. config overrides every heuristic (benchmarks, tests).
    """
    n, k = weight.shape
    assert x.shape[-1] == k and weight.is_contiguous() and weight.dtype == x.dtype, (x.shape, weight.shape)
    assert x.dtype in SUPPORTED_DTYPES and k > 0, (x.dtype, k)
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    assert m <= MAX_M and x2.stride(-1) == 1, f"small_m_linear serves at most {MAX_M} unit-stride rows, got {m}"
    assert bias is None or (bias.shape == (n,) and bias.stride(0) == 1), bias.shape
    if out is None:
        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    assert out.shape == (*x.shape[:-1], n) and out.dtype == x.dtype and out.is_contiguous(), (out.shape, out.dtype)
    if m == 0:
        return out
    if config is None:
        config = choose_linear_config(
            n=n, k=k, sm_count=_device_sm_count(x.device), element_size=x.element_size(), split_k=split_k
        )
    assert config.use_dot or m == 1, "the FMA path serves one row"
    out2 = out.view(m, n)
    steps = triton.cdiv(k, config.block_k)
    steps_per_split = triton.cdiv(steps, config.split_k)
    partials = None
    if config.split_k > 1:
        partials = torch.empty((config.split_k, m, n), dtype=torch.float32, device=x.device)
    _small_m_linear_kernel[(triton.cdiv(n, config.block_n), config.split_k)](
        x2,
        weight,
        weight if bias is None else bias,
        out2,
        out2 if partials is None else partials,
        m,
        n,
        x2.stride(0),
        out2.stride(0),
        K=k,
        BLOCK_M=16 if config.use_dot else 1,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        STEPS_PER_SPLIT=steps_per_split,
        SPLIT_K=config.split_k,
        # Whole tiles everywhere: K is a multiple of BLOCK_K and the steps divide among the splits.
        EVEN_K=k % config.block_k == 0 and steps_per_split * config.split_k == steps,
        HAS_BIAS=bias is not None,
        USE_DOT=config.use_dot,
        IEEE_DOT=x.dtype == torch.float32,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if partials is not None:
        block = min(1024, triton.next_power_of_2(n))
        _reduce_splits_kernel[(triton.cdiv(n, block), m)](
            partials,
            partials if bias is None else bias,
            out2,
            m,
            n,
            out2.stride(0),
            SPLIT_K=config.split_k,
            BLOCK=block,
            HAS_BIAS=bias is not None,
            num_warps=4,
        )
    return out
