"""SiLU-gated MLP activation: silu(gate) * up from the fused [gate | up] projection, one kernel.

Replaces the split + silu + mul of the torch path (two kernels and a [T, I] intermediate).
silu is rounded to the activation dtype before the product, as F.silu(gate) * up does.
The grid is (tokens, column blocks): no host synchronisation, capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.reference import silu_and_mul_reference

__all__ = ["silu_and_mul", "silu_and_mul_reference"]

_MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,
    out_ptr,
    stride_gate_up,
    stride_out,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate_ptrs = gate_up_ptr + row * stride_gate_up + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0)
    up = tl.load(gate_ptrs + INTERMEDIATE, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, silu_mul(gate, up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in float32, silu rounded to gate's dtype first as F.silu(gate) * up does
    (also decode_linear's prologue)."""
    gate32 = gate.to(tl.float32)
    activated = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype)
    return activated.to(tl.float32) * up.to(tl.float32)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gate_up [T, 2I] -> silu(gate_up[:, :I]) * gate_up[:, I:] as [T, I] (into `out` if given)."""
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, tuple(gate_up.shape)
    assert gate_up.stride(-1) == 1, "rows must be contiguous"
    num_tokens, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == (num_tokens, intermediate) and out.stride(-1) == 1, (out.shape, intermediate)
    if num_tokens == 0:
        return out
    block = min(_MAX_BLOCK, triton.next_power_of_2(intermediate))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, block))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        INTERMEDIATE=intermediate,
        BLOCK=block,
        num_warps=max(1, min(4, block // 256)),
    )
    return out
