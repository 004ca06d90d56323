"""Gated MLP activation: act(gate) * up from the fused [gate | up] projection, one kernel, with
act SiLU (Llama, Qwen, Mistral) or GELU-tanh (Gemma's gelu_pytorch_tanh).

Replaces the split + activation + mul of the torch path (two kernels and a [T, I] intermediate).
The activation is rounded to the activation dtype before the product, as F.silu(gate) * up does.
The grid is (tokens, column blocks): no host synchronisation, capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice
from triton.runtime.interpreter import InterpretedFunction

from strata.kernels.reference import gelu_tanh_and_mul_reference, silu_and_mul_reference

__all__ = ["gelu_tanh_and_mul", "gelu_tanh_and_mul_reference", "silu_and_mul", "silu_and_mul_reference"]


_MAX_BLOCK = 1024


@triton.jit
def _act_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_gate_up,
    stride_out,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
    GELU_TANH: tl.constexpr = False,
    LIBDEVICE_TANH: tl.constexpr = True,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate_ptrs = gate_up_ptr + row * stride_gate_up + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(gate_ptrs + INTERMEDIATE, mask=mask, other=0.0)
    if GELU_TANH:
        activated = gelu_tanh_mul(gate, up, LIBDEVICE_TANH)
    else:
        activated = silu_mul(gate, up)
    tl.store(out_ptr + row * stride_out + cols, activated.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in float32, silu rounded to gate's dtype first as F.silu(gate) * up does
    (also decode_linear's prologue)."""
    gate32 = gate.to(tl.float32)
    activated = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    return activated.to(tl.float32) * up.to(tl.float32)


@triton.jit
def gelu_tanh_mul(gate, up, LIBDEVICE_TANH: tl.constexpr):
    """gelu_tanh(gate) * up in float32, the GELU rounded to gate's dtype first as
    F.gelu(gate, approximate="tanh") * up does, by torch's formula 0.5 x (1 + tanh(y)). On the GPU
    tanh is CUDA's tanhf (libdevice), the function torch's CUDA kernel calls, so the 1 + tanh
    near -1 cancels as torch's does; the interpreter has no libdevice: sign(y) (1 - e) / (1 + e)
    with e = exp(-2 |y|) there, a few ulps from it."""
    gate32 = gate.to(tl.float32)
    inner = 0.7978845608028654 * (gate32 + 0.044715 * gate32 * gate32 * gate32)  # sqrt(2 / pi) * (x + c x^3)
    if LIBDEVICE_TANH:
        tanh = libdevice.tanh(inner)
    else:
        e = tl.exp(-2.0 * tl.abs(inner))
        tanh = tl.where(inner < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e)
    activated = (0.5 * gate32 * (1.0 + tanh)).to(gate.dtype)
    return activated.to(tl.float32) * up.to(tl.float32)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:] as [T, I] (into `out` if given)."""
    return _launch(gate_up, out, gelu_tanh=False)


def gelu_tanh_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] -> gelu_tanh(gate_up[:, :I]) * gate_up[:, I:] as [T, I] (into `out` if given)."""
    return _launch(gate_up, out, gelu_tanh=True)


def _launch(gate_up: torch.Tensor, out: torch.Tensor | None, gelu_tanh: bool) -> torch.Tensor:
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, tuple(gate_up.shape)
    assert gate_up.stride(-1) == 1, "rows must be contiguous"
    num_tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (num_tokens, intermediate) and out.stride(-1) == 1, (out.shape, intermediate)
    if num_tokens == 0:
        return out
    block = min(_MAX_BLOCK, triton.next_power_of_2(intermediate))
    _act_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=block,
        GELU_TANH=gelu_tanh,
        LIBDEVICE_TANH=not isinstance(_act_and_mul_kernel, InterpretedFunction),
        num_warps=max(1, min(4, block // 256)),
    )
    return out
