"""A layer of experts at batch 1 as GEMVs: the decode chain's MoE layer
(services/worker/model/decode_chain.py), for Qwen3-MoE and Mixtral.

    logits, _  = norm_linear(h, gate, norm)           the router, its RMSNorm in the prologue
                                                      (kernels/decode_linear.py)
    weights, ids = select_experts(logits)             kernels/moe_routing.py, one one-warp program
    inter      = expert_gate_up(h, ids)               a program per (slot s, BLOCK_N rows of I)
    out        = expert_down(inter, ids, weights)     a program per BLOCK_N columns of H, all k slots

Why: at one token the batched path (kernels/fused_moe.py) is eight launches around its two GEMMs
(norm, router GEMM, select_experts, align, gate/up, down, k-sum) and each boundary drains the GPU;
its 16-row tensor-core tiles also stream one token's experts well short of the copy floor
(bench/RESULTS.md, issue 53). One token needs no grouping by expert: slot s *is* one expert.

- gate/up: x = rms_norm(h) in the prologue (decode_linear's rule, the row is whole here), the
  slot's expert's BLOCK_N gate rows and BLOCK_N up rows whole in registers, silu(gate) * up
  stored to inter[s] as fused_moe rounds it.
- down: a [k * BLOCK_N, I] tile, the rows of each slot's expert for the program's columns, loaded
  *before* the dependent-launch wait: gate/up signals its dependents only after its own wait, so
  when down starts the routing has completed and its ids can be read early (from L2: `.cg`, as no
  L1 line may predate them). Then each row's product is rounded, weighted, rounded (fused_moe's
  rounding) and the k slots of a column summed in float32: one store per column, no k-sum
  kernel, the same order on every run.
(Routing inside every program's prologue instead of select_experts' launch was measured: k rounds
of argmax ahead of each program's weight loads made both GEMVs several times slower; bench/RESULTS.md.)

Expert parallelism: `expert_map` sends a slot whose expert another rank holds to nothing here.
Tensor parallelism shards I; the caller all-reduces the output. Batch 1 only, and only where a
down tile of k rows fits the register budget (decode_moe_serves).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from strata.kernels import decode_linear
from strata.kernels.activation import silu_mul
from strata.kernels.decode_linear import DecodeLinearConfig, norm_linear, use_decode_linear
from strata.kernels.dependent_launch import dependent_launch_supported, launch_options
from strata.kernels.moe_routing import select_experts
from strata.kernels.rmsnorm import rms_norm_row

__all__ = ["decode_moe", "decode_moe_serves", "launch_plans", "tile_rows"]


@triton.jit
def _local_expert(ids_ptr, expert_map_ptr, slots, mask, HAS_MAP: tl.constexpr, EARLY: tl.constexpr):
    """The local expert of each slot, -1 where masked or held by another rank. EARLY: read before
    the wait, past L1."""
    if EARLY:
        ids = tl.load(ids_ptr + slots, mask=mask, other=-1, cache_modifier=".cg")
    else:
        ids = tl.load(ids_ptr + slots, mask=mask, other=-1)
    if HAS_MAP:
        ids = tl.load(expert_map_ptr + ids, mask=ids >= 0, other=-1)
    return ids


@triton.jit
def _expert_gate_up_kernel(
    h_ptr,
    norm_w_ptr,
    ids_ptr,
    expert_map_ptr,
    w13_ptr,
    inter_ptr,
    eps,
    HIDDEN: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """inter[s, n] = silu(x . w13[e_s, n]) * (x . w13[e_s, I + n]), x = rms_norm(h), for BLOCK_N rows n."""
    slot = tl.program_id(0)
    ks = tl.arange(0, HIDDEN_PAD)
    k_ok = ks < HIDDEN
    norm_w = tl.load(norm_w_ptr + ks, mask=k_ok, other=0.0)
    if PDL:
        gdc_wait()  # the ids come from select_experts just before
        # Only now: down reads the ids before its own wait (see the module docstring).
        gdc_launch_dependents()
    expert = tl.sum(_local_expert(ids_ptr, expert_map_ptr, slot + tl.arange(0, 1), True, HAS_MAP, False))
    if expert < 0:
        return  # another rank's expert: down skips the slot
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_ptrs = (
        w13_ptr
        + expert.to(tl.int64) * (2 * INTERMEDIATE * HIDDEN)
        + tl.minimum(rows, INTERMEDIATE - 1)[:, None] * HIDDEN
        + ks[None, :]
    )
    gate_w = tl.load(gate_ptrs, mask=k_ok[None, :], other=0.0)
    up_w = tl.load(gate_ptrs + INTERMEDIATE * HIDDEN, mask=k_ok[None, :], other=0.0)
    h = tl.load(h_ptr + ks, mask=k_ok, other=0.0)
    x = rms_norm_row(h, norm_w, HIDDEN, eps).to(h.dtype).to(tl.float32)
    dtype = inter_ptr.dtype.element_ty
    gate = tl.sum(gate_w.to(tl.float32) * x[None, :], axis=1).to(dtype)
    up = tl.sum(up_w.to(tl.float32) * x[None, :], axis=1).to(dtype)
    tl.store(inter_ptr + slot * INTERMEDIATE + rows, silu_mul(gate, up).to(dtype), mask=rows < INTERMEDIATE)


@triton.jit
def _expert_down_kernel(
    inter_ptr,
    ids_ptr,
    topk_weights_ptr,
    expert_map_ptr,
    w2_ptr,
    out_ptr,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    INTERMEDIATE_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[n] = sum over slots s of weight_s * (inter[s] . w2[e_s, n]) for BLOCK_N columns n."""
    if PDL:
        gdc_launch_dependents()
    # Row r of the tile: slot r // BLOCK_N, column r % BLOCK_N.
    tile_rows = tl.arange(0, TOP_K_PAD * BLOCK_N)
    row_slot = tile_rows // BLOCK_N
    col = tl.minimum(tl.program_id(0) * BLOCK_N + tile_rows % BLOCK_N, HIDDEN - 1)
    # Before the wait: the routing finished before gate/up let this kernel start (EARLY loads).
    expert = _local_expert(ids_ptr, expert_map_ptr, row_slot, row_slot < TOP_K, HAS_MAP, PDL)
    used = expert >= 0
    ks = tl.arange(0, INTERMEDIATE_PAD)
    k_ok = ks < INTERMEDIATE
    w_ptrs = (
        w2_ptr + tl.maximum(expert, 0).to(tl.int64)[:, None] * (HIDDEN * INTERMEDIATE) + col[:, None] * INTERMEDIATE
    )
    w = tl.load(w_ptrs + ks[None, :], mask=used[:, None] & k_ok[None, :], other=0.0)
    if PDL:
        weight = tl.load(topk_weights_ptr + row_slot, mask=used, other=0.0, cache_modifier=".cg")
        gdc_wait()  # inter comes from gate/up
    else:
        weight = tl.load(topk_weights_ptr + row_slot, mask=used, other=0.0)
    inter = tl.load(
        inter_ptr + row_slot[:, None] * INTERMEDIATE + ks[None, :], mask=used[:, None] & k_ok[None, :], other=0.0
    )
    dtype = out_ptr.dtype.element_ty
    # fused_moe's rounding: the product rounded, times the weight in float32, rounded; k summed in float32.
    y = tl.sum(w.to(tl.float32) * inter.to(tl.float32), axis=1).to(dtype)
    weighted = tl.where(used, (y.to(tl.float32) * weight).to(dtype).to(tl.float32), 0.0)
    total = tl.sum(tl.reshape(weighted, (TOP_K_PAD, BLOCK_N)), axis=0)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + cols, total.to(dtype), mask=cols < HIDDEN)


def tile_rows(row_elements: int, rows_per_unit: int, element_size: int) -> int:
    """Rows of W a program holds: as many units of `rows_per_unit` padded rows as fit TILE_BYTES
    (decode_linear's register budget), a power of two, at least 1 (at most 16), 0 if one unit does not fit."""
    tile_bytes = decode_linear.TILE_BYTES  # read at each launch: bench.decode_chain --tile-kb sweeps it
    unit_bytes = rows_per_unit * triton.next_power_of_2(row_elements) * element_size
    if unit_bytes > tile_bytes:
        return 0
    return min(16, 1 << (tile_bytes // unit_bytes).bit_length() - 1)


def decode_moe_serves(h: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int) -> bool:
    """Whether these kernels serve this layer and step: one token the chain takes, and a down
    tile of the k slots' rows (and a gate/up pair of rows) within the register budget."""
    hidden = w13.shape[2]
    if not use_decode_linear(h, w13[0]) or not (w2.is_contiguous() and w2.dtype == h.dtype):
        return False
    intermediate = w2.shape[2]
    top_k_pad = triton.next_power_of_2(top_k)
    return tile_rows(hidden, 2, h.element_size()) > 0 and tile_rows(intermediate, top_k_pad, h.element_size()) > 0


def decode_moe(
    h: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    gate_weight: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    top_k: int,
    renormalize: bool,
    weight_dtype: torch.dtype | None = None,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' output [1, H] for one token's residual stream h [1, H]: SparseMoE(rms_norm(h))
    with fused_moe's rounding. gate_weight [E, H]; w13 [E_local, 2I, H]; w2 [E_local, H, I];
    weight_dtype and expert_map as select_experts and fused_moe take them."""
    num_local, two_i, hidden = w13.shape
    intermediate = two_i // 2
    num_experts = gate_weight.shape[0]
    assert decode_moe_serves(h, w13, w2, top_k), (tuple(h.shape), tuple(w13.shape), tuple(w2.shape), top_k)
    assert w13.is_contiguous() and tuple(w2.shape) == (num_local, hidden, intermediate)
    assert expert_map is None or (expert_map.dtype == torch.int32 and expert_map.shape == (num_experts,))
    # A few rows a program: the router's E rows would be a handful of programs at the chain's tile.
    router = DecodeLinearConfig(block_n=max(1, min(16, triton.next_power_of_2(num_experts) // 64)))
    logits, _ = norm_linear(h, gate_weight, None, norm_weight, eps, config=router)
    weights, ids = select_experts(logits, top_k, renormalize, weight_dtype=weight_dtype)
    pdl = dependent_launch_supported(h.device)
    gate_up, down = launch_plans(
        hidden=hidden,
        intermediate=intermediate,
        top_k=top_k,
        element_size=h.element_size(),
        has_map=expert_map is not None,
        pdl=pdl,
    )
    map_arg = expert_map if expert_map is not None else ids  # never read without HAS_MAP
    inter = torch.empty(top_k, intermediate, dtype=h.dtype, device=h.device)
    out = torch.empty_like(h)
    grid, constexprs, num_warps = gate_up
    _expert_gate_up_kernel[grid](
        h, norm_weight, ids, map_arg, w13, inter, eps, **constexprs, num_warps=num_warps, **launch_options(pdl)
    )
    grid, constexprs, num_warps = down
    _expert_down_kernel[grid](
        inter, ids, weights, map_arg, w2, out, **constexprs, num_warps=num_warps, **launch_options(pdl)
    )
    return out


def launch_plans(
    *, hidden: int, intermediate: int, top_k: int, element_size: int, has_map: bool, pdl: bool
) -> tuple[tuple, tuple]:
    """(grid, constexprs, warps) of the gate/up and the down launch (also the sm_90 compile test's)."""
    rows = tile_rows(hidden, 2, element_size)
    gate_up = (
        (top_k, triton.cdiv(intermediate, rows)),
        dict(
            HIDDEN=hidden,
            HIDDEN_PAD=triton.next_power_of_2(hidden),
            INTERMEDIATE=intermediate,
            HAS_MAP=has_map,
            BLOCK_N=rows,
            PDL=pdl,
        ),
        _warps(2 * rows, hidden, element_size),
    )
    top_k_pad = triton.next_power_of_2(top_k)
    cols = tile_rows(intermediate, top_k_pad, element_size)
    down = (
        (triton.cdiv(hidden, cols),),
        dict(
            HIDDEN=hidden,
            INTERMEDIATE=intermediate,
            INTERMEDIATE_PAD=triton.next_power_of_2(intermediate),
            TOP_K=top_k,
            TOP_K_PAD=top_k_pad,
            HAS_MAP=has_map,
            BLOCK_N=cols,
            PDL=pdl,
        ),
        _warps(top_k_pad * cols, intermediate, element_size),
    )
    return gate_up, down


def _warps(rows: int, row_elements: int, element_size: int) -> int:
    """decode_linear's rule: 8 warps for a tile over 8 KB, else 4."""
    return 8 if rows * triton.next_power_of_2(row_elements) * element_size > 8192 else 4
