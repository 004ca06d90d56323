"""The linear layers of a batch-1 decode step as one chain of GEMV kernels that
absorb the elementwise work around them and launch as programmatic dependents.

At batch 1 a layer of separate kernels (norm, qkv, rotary, attention, o_proj, add + norm,
gate_up, SiLU, down) took over twice its weights' streaming floor: every kernel boundary drains
the GPU, launches the next grid and ramps its loads up again, and a projection such as qkv or
o_proj streams its few MB too briefly to reach full bandwidth on its own (figures:
bench/RESULTS.md, "Figures moved from code comments"). This module cuts both costs:

- Fewer kernels. The RMSNorm moves into the prologue of the projection that consumes it, the
  SiLU-and-mul into down_proj's, and the residual add into the epilogue of the projection that
  produces the addend (o_proj, down_proj): a layer is qkv, rotary, attention (+ split merge),
  o_proj, gate_up, down.
- Weights before the wait. A program owns BLOCK_N rows of W and loads them whole, [BLOCK_N, K]
  into registers (TILE_BYTES: 16 rows of K = 2048), before gdc_wait; with PDL
  (kernels/dependent_launch.py) that load streams while the previous kernel still runs. Only
  then does it read x: its one row whole, from L2, so the norm's statistics are computed right
  there (every program recomputes them: a few KB of L2 reads against its 16 KB of HBM), and the
  product is an elementwise multiply and a reduction over K in float32.

A first version walked K in tiles with x padded to 16 rows for a tensor-core dot: its x operand
went through the prologue's arithmetic, so the pipeliner did not prefetch it, and every K step
waited out an L2 round trip (slower than cuBLAS over a 1B step: bench/RESULTS.md). Holding whole
rows removes that loop. It serves batch 1 only (MAX_ROWS); larger batches take the batched GEMMs.

Rounding follows the unfused path: the projection output is rounded to the activation dtype
before the residual add, the sum is rounded, the normalised row is rounded before the weight
multiply, SiLU is rounded before the product, as HF does. Only summation orders differ.
Launch shapes depend on python ints only (N, K): capturable in CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

from strata.kernels.activation import silu_mul
from strata.kernels.dependent_launch import dependent_launch_supported, launch_options
from strata.kernels.one_shot_all_reduce import send_part, send_part_args
from strata.kernels.reference import fused_add_rms_norm_reference, rms_norm_reference, silu_and_mul_reference
from strata.kernels.rmsnorm import rms_norm_row

__all__ = [
    "DecodeLinearConfig",
    "choose_decode_linear_config",
    "linear_add_residual",
    "linear_add_residual_reference",
    "norm_linear",
    "norm_linear_reference",
    "plain_linear",
    "silu_mul_linear",
    "silu_mul_linear_reference",
    "use_decode_linear",
    "MAX_ROWS",
]

# One row: a second row of x was a second serial pass (L2 load, norm, product, reduction) over
# the program's W tile, and a few rows already ran slower than cuBLAS (bench/RESULTS.md).
MAX_ROWS = 1
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# W bytes a program loads before its wait (64 registers a thread at 8 warps). Every program also
# reads x's row and the norm weight from L2 (4 K bytes): at 16 KB, 2 rows of the 8B's K = 4096,
# that was half as much as W itself. Swept with bench.decode_chain --tile-kb: the 1B step is
# level from 16 to 64 KB, the 8B step fastest at 64 KB (bench/RESULTS.md).
TILE_BYTES = 64 * 1024

# What the prologue makes of x before the product.
_PLAIN, _NORM, _SILU_MUL = 0, 1, 2


@dataclass(frozen=True)
class DecodeLinearConfig:
    block_n: int  # rows of W per program, each loaded whole ([block_n, K] in registers)
    num_warps: int = 4


def choose_decode_linear_config(*, n: int, k: int, element_size: int = 2) -> DecodeLinearConfig:
    """As many W rows as fit TILE_BYTES of a padded row (at least one, at most 16): 16 rows of
    K = 2048 in bf16, 4 of 8192, 2 of 14336; 8 warps, 4 for tiles of 8 KB or less."""
    row_bytes = triton.next_power_of_2(k) * element_size
    block_n = max(1, min(16, TILE_BYTES // row_bytes))
    return DecodeLinearConfig(block_n=block_n, num_warps=8 if block_n * row_bytes > 8192 else 4)


@triton.jit
def _row_operand(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    res_out_ptr,
    pid,
    ks,
    k_mask,
    eps,
    K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    """x's row, whole ([K_PADDED] in registers, from L2), the prologue applied."""
    x = tl.load(x_ptr + ks, mask=k_mask, other=0.0)
    if PROLOGUE == 2:  # silu(gate) * up over a [gate | up] row of 2K
        up = tl.load(x_ptr + K + ks, mask=k_mask, other=0.0)
        x = silu_mul(x, up).to(x.dtype)
    elif PROLOGUE == 1:  # rms_norm(x (+ residual)): the whole row is here, so are its statistics
        if ADD_RESIDUAL:
            r = tl.load(res_ptr + ks, mask=k_mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
            tl.store(res_out_ptr + ks, x, mask=k_mask & (pid == 0))
        w = tl.load(norm_w_ptr + ks, mask=k_mask, other=0.0)
        x = rms_norm_row(x, w, K, eps).to(x.dtype)
    return x


@triton.jit
def _decode_linear_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    res_out_ptr,
    N,
    eps,
    # With SEND, the one-shot all-reduce that sums out over the ranks next (its exchange's
    # sequence numbers and every rank's buffer): each program sends its part of out as it ends.
    seq_ptr,
    capacity,
    buf0,
    buf1,
    buf2,
    buf3,
    buf4,
    buf5,
    buf6,
    buf7,
    K: tl.constexpr,
    K_PADDED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PROLOGUE: tl.constexpr,  # 0 x, 1 rms_norm(x (+ res)), 2 silu_mul(x)
    ADD_RESIDUAL: tl.constexpr,  # prologue 1: x + res, which program 0 stores to res_out
    EPILOGUE_RESIDUAL: tl.constexpr,  # out = round(y) + res
    HAS_BIAS: tl.constexpr,
    SEND: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    AR_BLOCK: tl.constexpr,  # the one-shot's elements a program (a multiple of BLOCK_N)
    BITS: tl.constexpr,
    EMPTY: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # rows past N re-read the last one, never stored
    ks = tl.arange(0, K_PADDED)
    k_mask = ks < K
    # The program's whole W tile, constant data: loaded before the wait, so it streams while the
    # previous kernel of the chain still runs.
    w = tl.load(w_ptr + rows[:, None] * K + ks[None, :], mask=k_mask[None, :], other=0.0)
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    x = _row_operand(x_ptr, res_ptr, norm_w_ptr, res_out_ptr, pid, ks, k_mask, eps, K, PROLOGUE, ADD_RESIDUAL)
    y = (tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1) + bias).to(out_ptr.dtype.element_ty)
    if EPILOGUE_RESIDUAL:
        r = tl.load(res_ptr + offs_n, mask=n_mask, other=0.0)
        y = (y.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_n, y, mask=n_mask)
    if SEND:  # kernels/one_shot_all_reduce.py, "Sent early": the NVLink trip overlaps this grid's tail
        send_part(
            y, offs_n, n_mask, pid * BLOCK_N, seq_ptr, capacity,
            buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
            RANK, WORLD, AR_BLOCK, BITS, EMPTY,
        )  # fmt: skip


# Decided when the kernel is defined, as triton.jit decides (TRITON_INTERPRET read at decoration).
_INTERPRETED = isinstance(_decode_linear_kernel, InterpretedFunction)


def use_decode_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the chain can serve F.linear(x, weight): one contiguous row of a supported dtype
    shared with a contiguous 2-D weight (CUDA tensors, or any under the interpreter)."""
    if not (x.dtype in SUPPORTED_DTYPES and weight.dtype == x.dtype and (x.is_cuda or _INTERPRETED)):
        return False
    if weight.dim() != 2 or not weight.is_contiguous() or x.dim() != 2 or not x.is_contiguous():
        return False
    return x.shape[0] == MAX_ROWS


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    k: int,
    prologue: int,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    add_residual_after: bool = False,
    config: DecodeLinearConfig | None = None,
    send_to=None,
):
    n = weight.shape[0]
    m = x.shape[0]
    assert weight.shape == (n, k) and weight.is_contiguous() and weight.dtype == x.dtype, (weight.shape, k)
    assert x.dim() == 2 and x.is_contiguous() and m == MAX_ROWS, (x.shape, x.stride())
    assert bias is None or (bias.shape == (n,) and bias.stride(0) == 1)
    if residual is not None:
        assert residual.dtype == x.dtype and residual.is_contiguous()
        assert residual.shape == ((m, n) if add_residual_after else (m, k)), (residual.shape, m, n, k)
    config = config or choose_decode_linear_config(n=n, k=k, element_size=x.element_size())
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res_out = None
    if prologue == _NORM and residual is not None:
        res_out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    send_args, send_constexprs = send_part_args(send_to, x.dtype, out)
    if send_to is not None:  # every program's rows in one block of the one-shot's (send_part)
        assert send_to.takes_early_sends(m * n, x.dtype) and send_constexprs["AR_BLOCK"] % config.block_n == 0
    pdl = dependent_launch_supported(x.device)
    _decode_linear_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else weight,
        weight,
        bias if bias is not None else weight,
        out,
        res_out if res_out is not None else out,
        n,
        eps,
        *send_args,
        K=k,
        K_PADDED=triton.next_power_of_2(k),
        BLOCK_N=config.block_n,
        PROLOGUE=prologue,
        ADD_RESIDUAL=res_out is not None,
        EPILOGUE_RESIDUAL=add_residual_after,
        HAS_BIAS=bias is not None,
        **send_constexprs,
        PDL=pdl,
        num_warps=config.num_warps,
        **launch_options(pdl),
    )
    return out, res_out


def plain_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: DecodeLinearConfig | None = None,
    send_to=None,
) -> torch.Tensor:
    """F.linear(x, weight, bias). send_to: the one-shot exchange (kernels/one_shot_all_reduce.py)
    whose sum of the output follows, sent to the peers as each program ends."""
    return _launch(x, weight, bias, k=x.shape[1], prologue=_PLAIN, config=config, send_to=send_to)[0]


def norm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    config: DecodeLinearConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(F.linear(rms_norm(x + residual), weight, bias), x + residual): a norm fused into the
    projection after it; x itself stands for the sum when residual is None."""
    out, res_out = _launch(
        x,
        weight,
        bias,
        k=x.shape[1],
        prologue=_NORM,
        residual=residual,
        norm_weight=norm_weight,
        eps=eps,
        config=config,
    )
    return out, (x if res_out is None else res_out)


def silu_mul_linear(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: DecodeLinearConfig | None = None,
    send_to=None,
) -> torch.Tensor:
    """F.linear(silu(gate) * up, weight, bias) for gate_up = [gate | up] rows [M, 2K]; send_to as
    plain_linear's."""
    k = gate_up.shape[1] // 2
    return _launch(gate_up, weight, bias, k=k, prologue=_SILU_MUL, config=config, send_to=send_to)[0]


def linear_add_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    *,
    silu_mul: bool = False,
    config: DecodeLinearConfig | None = None,
    send_to=None,
) -> torch.Tensor:
    """F.linear(x, weight, bias), rounded, + residual, rounded: the residual add in the
    projection's epilogue. silu_mul: x is [gate | up]; send_to as plain_linear's."""
    k = x.shape[1] // 2 if silu_mul else x.shape[1]
    return _launch(
        x,
        weight,
        bias,
        k=k,
        prologue=_SILU_MUL if silu_mul else _PLAIN,
        residual=residual,
        add_residual_after=True,
        config=config,
        send_to=send_to,
    )[0]


# ---- torch references (the tests' oracle) ---------------------------------------------------


def norm_linear_reference(x, weight, bias, norm_weight, eps, *, residual=None):
    if residual is None:
        return F.linear(rms_norm_reference(x, norm_weight, eps), weight, bias), x
    normed, summed = fused_add_rms_norm_reference(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), summed


def silu_mul_linear_reference(gate_up, weight, bias=None):
    return F.linear(silu_and_mul_reference(gate_up), weight, bias)


def linear_add_residual_reference(x, weight, bias, residual, *, silu_mul=False):
    return F.linear(silu_and_mul_reference(x) if silu_mul else x, weight, bias) + residual
