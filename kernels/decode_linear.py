"""The linear layers of a small decode batch (1..16 rows) as one chain of GEMV kernels that
absorb the elementwise work around them and launch as programmatic dependents.

At batch 1 a Llama-3.2-1B layer's weights stream in ~28 us of floor, but a layer of separate
kernels (norm, qkv, rotary, attention, o_proj, add + norm, gate_up, SiLU, down) took ~70 us on an
H200: every kernel boundary drains the GPU, launches the next grid and ramps its loads up again,
and qkv (12.6 MB) or o_proj (8.4 MB) stream in 2-3 us, too short to reach full bandwidth on their
own. This module cuts both costs:

- Fewer kernels. The RMSNorm moves into the prologue of the projection that consumes it, the
  SiLU-and-mul into down_proj's, and the residual add into the epilogue of the projection that
  produces the addend (o_proj, down_proj). That epilogue also writes each output tile's sum of
  squares, per row, so the next norm only sums N / BLOCK_N partials instead of re-reading the
  row: a layer is qkv, rotary, attention (+ split merge), o_proj, gate_up, down.
- Weights before the wait. Each program issues the load of the first PREFETCH columns of its W
  rows (constant data) before gdc_wait, so with PDL (kernels/dependent_launch.py) that stream
  overlaps the previous kernel's tail instead of starting after it.

Rounding follows the unfused path: the projection output is rounded to the activation dtype
before the residual add, the sum is rounded, the normalised row is rounded before the weight
multiply, SiLU is rounded before the product, as HF does. Only summation orders differ (the dot
over K, the sum of squares), as they do between any two GEMM kernels.

How the work is cut: a program owns BLOCK_N rows of W and walks all of K (no split-K: a second
reduce launch is what this module exists to remove); x's rows, padded to 16 masked rows, are the
narrow side of a tensor-core dot (tl.dot(W tile, x tile^T)), as in kernels/small_m_linear.py.
Launch shapes depend on python ints only (N, K, SM count): capturable in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

from strata.kernels.dependent_launch import dependent_launch_supported, launch_options
from strata.kernels.paged_attention import _device_sm_count
from strata.kernels.reference import fused_add_rms_norm_reference, rms_norm_reference, silu_and_mul_reference

__all__ = ["DecodeLinearConfig", "choose_decode_linear_config", "linear_add_residual", "linear_add_residual_reference",
           "norm_linear", "norm_linear_reference", "plain_linear", "silu_mul_linear", "silu_mul_linear_reference",
           "use_decode_linear", "MAX_ROWS"]

MAX_ROWS = 16  # the dot pads x to 16 rows; past that the batched GEMMs (cuBLAS) take over
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
IN_FLIGHT_PER_SM = 48 * 1024  # W bytes to keep in flight per SM (HBM latency x bandwidth / SMs, with headroom)
MAX_SHARED = 160 * 1024

# What the prologue makes of x before the dot.
_PLAIN, _NORM, _NORM_FROM_STATS, _SILU_MUL = 0, 1, 2, 3


@dataclass(frozen=True)
class DecodeLinearConfig:
    block_n: int  # rows of W per program
    block_k: int  # K per loop step
    prefetch: int  # columns of W loaded before gdc_wait (a power of two <= K, or 0)
    num_warps: int = 4
    num_stages: int = 3


def choose_decode_linear_config(*, n: int, k: int, sm_count: int, element_size: int = 2) -> DecodeLinearConfig:
    """16 W rows per program, 32 once that still gives >= 4 programs per SM (fewer, longer
    streams; less re-reading of x); BLOCK_K = 512 bytes of a row (halved until it divides K);
    stages to keep IN_FLIGHT_PER_SM bytes of W loading; a prefetch of 8 KB per program."""
    block_n = 32 if triton.cdiv(n, 32) >= 4 * sm_count else 16
    block_k = 512 // element_size
    while k % block_k and block_k > 32:
        block_k //= 2
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    per_sm = min(2.0, triton.cdiv(n, block_n) / sm_count)
    tile_bytes = block_n * block_k * element_size
    stages = 1 + max(1, -(-IN_FLIGHT_PER_SM // int(max(per_sm, 1.0) * tile_bytes)))
    stages = max(2, min(stages, 5, MAX_SHARED // ((block_n + 16) * block_k * element_size)))
    prefetch = 0
    if k >= 16:
        prefetch = min(1 << (k.bit_length() - 1), max(16, 8192 // (block_n * element_size)))
    return DecodeLinearConfig(block_n=block_n, block_k=block_k, prefetch=prefetch, num_stages=stages)


@triton.jit
def _operand(x_ptr, res_ptr, norm_w_ptr, offs_m, m_mask, k0, rstd, stride_x, stride_res, K: tl.constexpr,
             WIDTH: tl.constexpr, EVEN_K: tl.constexpr, PROLOGUE: tl.constexpr, ADD_RESIDUAL: tl.constexpr):
    """Columns [k0, k0 + WIDTH) of the dot's x operand [16, WIDTH], the prologue applied."""
    ks = k0 + tl.arange(0, WIDTH)
    k_mask = ks < K
    if EVEN_K:
        mask = m_mask[:, None]
    else:
        mask = m_mask[:, None] & k_mask[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_x + ks[None, :], mask=mask, other=0.0)
    if PROLOGUE == 3:  # silu(gate) * up over [gate | up] rows of 2K
        up = tl.load(x_ptr + offs_m[:, None] * stride_x + K + ks[None, :], mask=mask, other=0.0)
        gate = x.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(x.dtype)
        x = (act.to(tl.float32) * up.to(tl.float32)).to(x.dtype)
    elif PROLOGUE == 1 or PROLOGUE == 2:
        if ADD_RESIDUAL:
            r = tl.load(res_ptr + offs_m[:, None] * stride_res + ks[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        w = tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0)
        normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
        x = (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _dot(acc, w, x, IEEE_DOT: tl.constexpr, INTERPRETED: tl.constexpr):
    if INTERPRETED:  # the interpreter's dot gets 16-bit floats wrong; their products are exact in float32
        return tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    if IEEE_DOT:
        return tl.dot(w, tl.trans(x), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc)


@triton.jit(do_not_specialize=["M"])
def _decode_linear_kernel(
    x_ptr, res_ptr, norm_w_ptr, stats_ptr, w_ptr, bias_ptr, out_ptr, res_out_ptr, stats_out_ptr,
    M, N, stride_x, stride_res, stride_out, stride_res_out, eps,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    PROLOGUE: tl.constexpr,  # 0 x, 1 rms_norm(x (+ res)), 2 rms_norm(x) from stats partials, 3 silu_mul(x)
    ADD_RESIDUAL: tl.constexpr,  # prologue 1: x + res, which program 0 stores to res_out
    STAT_PARTS: tl.constexpr,  # prologue 2: the partials in stats [STAT_PARTS, 16]
    STAT_PARTS_PADDED: tl.constexpr,
    EPILOGUE_RESIDUAL: tl.constexpr,  # out = round(y) + res, and out's sums of squares to stats_out
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    BLOCK_M: tl.constexpr = 16
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N re-read the last one, never stored
    w_rows = w_ptr + rows[:, None] * K
    if PREFETCH > 0:  # constant data: issued before the wait, so it streams during the previous kernel
        w_first = tl.load(w_rows + tl.arange(0, PREFETCH)[None, :])
    if PDL:
        gdc_wait()

    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1:  # the row's statistics, here: a pass over x (from L2)
        squares = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            mask = m_mask[:, None] & (ks < K)[None, :]
            h = tl.load(x_ptr + offs_m[:, None] * stride_x + ks[None, :], mask=mask, other=0.0)
            if ADD_RESIDUAL:
                r = tl.load(res_ptr + offs_m[:, None] * stride_res + ks[None, :], mask=mask, other=0.0)
                h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
                tl.store(res_out_ptr + offs_m[:, None] * stride_res_out + ks[None, :], h, mask=mask & (pid == 0))
            h32 = h.to(tl.float32)
            squares += tl.sum(h32 * h32, axis=1)
        rstd = tl.math.rsqrt(squares / K + eps)
    elif PROLOGUE == 2:  # the producer's per-tile partials: a few hundred floats
        parts = tl.arange(0, STAT_PARTS_PADDED)
        partials = tl.load(stats_ptr + parts[:, None] * BLOCK_M + offs_m[None, :],
                           mask=(parts < STAT_PARTS)[:, None], other=0.0)
        rstd = tl.math.rsqrt(tl.sum(partials, axis=0) / K + eps)

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if PREFETCH > 0:
        x_first = _operand(x_ptr, res_ptr, norm_w_ptr, offs_m, m_mask, 0, rstd, stride_x, stride_res, K, PREFETCH,
                           True, PROLOGUE, ADD_RESIDUAL)
        acc = _dot(acc, w_first, x_first, IEEE_DOT, INTERPRETED)
    EVEN_K: tl.constexpr = (K - PREFETCH) % BLOCK_K == 0
    for k0 in range(PREFETCH, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :])
        else:
            w = tl.load(w_rows + ks[None, :], mask=(ks < K)[None, :], other=0.0)
        x = _operand(x_ptr, res_ptr, norm_w_ptr, offs_m, m_mask, k0, rstd, stride_x, stride_res, K, BLOCK_K,
                     EVEN_K, PROLOGUE, ADD_RESIDUAL)
        acc = _dot(acc, w, x, IEEE_DOT, INTERPRETED)

    y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    mask = m_mask[:, None] & (offs_n < N)[None, :]
    y = y.to(out_ptr.dtype.element_ty)
    if EPILOGUE_RESIDUAL:
        r = tl.load(res_ptr + offs_m[:, None] * stride_res + offs_n[None, :], mask=mask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
        y32 = tl.where(mask, y.to(tl.float32), 0.0)
        tl.store(stats_out_ptr + pid * BLOCK_M + offs_m, tl.sum(y32 * y32, axis=1))
    tl.store(out_ptr + offs_m[:, None] * stride_out + offs_n[None, :], y, mask=mask)


# Decided when the kernel is defined, as triton.jit decides (TRITON_INTERPRET read at decoration).
_INTERPRETED = isinstance(_decode_linear_kernel, InterpretedFunction)


def use_decode_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the chain can serve F.linear(x, weight): 1..16 unit-stride rows of a supported
    dtype shared with a contiguous 2-D weight (CUDA tensors, or any under the interpreter)."""
    if not (x.dtype in SUPPORTED_DTYPES and weight.dtype == x.dtype and (x.is_cuda or _INTERPRETED)):
        return False
    if weight.dim() != 2 or not weight.is_contiguous() or x.dim() != 2 or x.stride(-1) != 1:
        return False
    return 1 <= x.shape[0] <= MAX_ROWS


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, k: int, prologue: int,
            residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
            stats: torch.Tensor | None = None, add_residual_after: bool = False,
            config: DecodeLinearConfig | None = None):
    n = weight.shape[0]
    m = x.shape[0]
    assert weight.shape == (n, k) and weight.is_contiguous() and weight.dtype == x.dtype, (weight.shape, k)
    assert x.dim() == 2 and x.stride(-1) == 1 and 1 <= m <= MAX_ROWS, (x.shape, x.stride())
    assert bias is None or (bias.shape == (n,) and bias.stride(0) == 1)
    if config is None:
        config = choose_decode_linear_config(n=n, k=k, sm_count=_device_sm_count(x.device),
                                             element_size=x.element_size())
    assert config.prefetch == 0 or (config.prefetch & (config.prefetch - 1) == 0 and config.prefetch <= k), config
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    programs = triton.cdiv(n, config.block_n)
    res_out = stats_out = None
    if prologue == _NORM and residual is not None:
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if add_residual_after:
        assert residual.shape == (m, n) and residual.stride(-1) == 1
        stats_out = torch.empty((programs, 16), dtype=torch.float32, device=x.device)
    if residual is not None:
        assert residual.dtype == x.dtype and residual.stride(-1) == 1
    stat_parts = 0 if stats is None else stats.shape[0]
    pdl = dependent_launch_supported(x.device)
    _decode_linear_kernel[(programs,)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else weight,
        stats if stats is not None else out, weight, bias if bias is not None else weight, out,
        res_out if res_out is not None else out, stats_out if stats_out is not None else out,
        m, n, x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        res_out.stride(0) if res_out is not None else 0, eps,
        K=k,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        PREFETCH=config.prefetch,
        PROLOGUE=prologue,
        ADD_RESIDUAL=res_out is not None,
        STAT_PARTS=stat_parts,
        STAT_PARTS_PADDED=triton.next_power_of_2(max(1, stat_parts)),
        EPILOGUE_RESIDUAL=add_residual_after,
        HAS_BIAS=bias is not None,
        PDL=pdl,
        IEEE_DOT=x.dtype == torch.float32,
        INTERPRETED=_INTERPRETED,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **launch_options(pdl),
    )
    return out, res_out, stats_out


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 config: DecodeLinearConfig | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias)."""
    return _launch(x, weight, bias, k=x.shape[1], prologue=_PLAIN, config=config)[0]


def norm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, *, residual: torch.Tensor | None = None, stats: torch.Tensor | None = None,
                config: DecodeLinearConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """F.linear(rms_norm(x + residual), weight, bias) and x + residual (x itself when residual
    is None): the layer's input norm fused into its first projection.

    stats: x's sums of squares as partials [P, 16] from linear_add_residual (x is then that
    call's sum and residual must be None); without them the kernel computes them from x."""
    if stats is not None:
        assert residual is None, "stats describe x itself: its residual was added already"
        out = _launch(x, weight, bias, k=x.shape[1], prologue=_NORM_FROM_STATS, norm_weight=norm_weight, eps=eps,
                      stats=stats, config=config)[0]
        return out, x
    out, res_out, _ = _launch(x, weight, bias, k=x.shape[1], prologue=_NORM, residual=residual,
                              norm_weight=norm_weight, eps=eps, config=config)
    return out, (x if res_out is None else res_out)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    config: DecodeLinearConfig | None = None) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight, bias) for gate_up = [gate | up] rows [M, 2K]."""
    return _launch(gate_up, weight, bias, k=gate_up.shape[1] // 2, prologue=_SILU_MUL, config=config)[0]


def linear_add_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                        *, silu_mul: bool = False, config: DecodeLinearConfig | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, stats): h = F.linear(x, weight, bias) (rounded) + residual, rounded, and h's per-row
    sums of squares as partials [P, 16] for norm_linear. silu_mul: x is [gate | up]."""
    k = x.shape[1] // 2 if silu_mul else x.shape[1]
    out, _, stats = _launch(x, weight, bias, k=k, prologue=_SILU_MUL if silu_mul else _PLAIN, residual=residual,
                            add_residual_after=True, config=config)
    return out, stats


# ---- torch references (the tests' oracle) ---------------------------------------------------

def norm_linear_reference(x, weight, bias, norm_weight, eps, *, residual=None):
    if residual is None:
        return F.linear(rms_norm_reference(x, norm_weight, eps), weight, bias), x
    normed, summed = fused_add_rms_norm_reference(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), summed


def silu_mul_linear_reference(gate_up, weight, bias=None):
    return F.linear(silu_and_mul_reference(gate_up), weight, bias)


def linear_add_residual_reference(x, weight, bias, residual, *, silu_mul=False):
    """(h, per-row sums of squares of h [M])."""
    y = F.linear(silu_and_mul_reference(x) if silu_mul else x, weight, bias)
    h = y + residual
    return h, h.float().pow(2).sum(-1)
