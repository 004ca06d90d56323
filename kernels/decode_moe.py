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
from triton.runtime.interpreter import InterpretedFunction

from strata.kernels import decode_linear
from strata.kernels.activation import silu_mul
from strata.kernels.arrival_counters import arrival_counters
from strata.kernels.decode_linear import DecodeLinearConfig, norm_linear, use_decode_linear
from strata.kernels.dependent_launch import dependent_launch_supported, launch_options
from strata.kernels.moe_routing import round_code, route_one_token, select_experts
from strata.kernels.rmsnorm import rms_norm_row

__all__ = ["decode_moe", "decode_moe_serves", "launch_plans", "layer_plan", "tile_rows"]

# Which batch-1 design decode_moe launches (an A/B under way: bench/RESULTS.md).
DESIGNS = ("one launch", "two GEMVs")
DESIGN = DESIGNS[0]
# Programs of the one launch a multiprocessor; 0: as many as fit (an A/B knob).
PROGRAMS_PER_SM = 0
# (GATE_ROWS, DOWN_COLS, warps) of the one launch, when set (an A/B knob).
PLAN = None


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


@triton.jit
def _wait_until_at_least(counter_ptr, target, INTERPRETED: tl.constexpr):
    """Spin until *counter_ptr >= target, every thread with acquire loads: what the releases before
    that count stored is then visible to each thread's later loads. (The interpreter runs one
    program at a time, so there the count is already there.)"""
    if INTERPRETED:
        tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    else:
        tl.inline_asm_elementwise(
            """{
            .reg .pred waiting;
            .reg .b32 seen;
            SPIN:
            ld.acquire.gpu.global.b32 seen, [$1];
            setp.lt.s32 waiting, seen, $2;
            @waiting bra SPIN;
            mov.b32 $0, seen;
            }""",
            "=r,l,r",
            [counter_ptr, target],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def _pinned_here(x, INTERPRETED: tl.constexpr):
    """x, used no earlier than here: else the compiler widens a loaded weight tile to float32 ahead
    of the atomics and the spin before this point, and the tile holds twice its registers while
    they last (200 registers a thread instead of 128 for the one launch, at 4 warps: half as many
    programs an SM)."""
    if INTERPRETED:
        return x
    else:
        pack: tl.constexpr = 32 // x.dtype.primitive_bitwidth
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=pack)


# The one launch's counters, after its ticket: programs gone, gate/up items done of each slot, then
# down's slots arrived at each block of columns.
_TICKET, _EXITS, _GATE_DONE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _expert_layer_kernel(
    h_ptr,
    norm_w_ptr,
    logits_ptr,
    expert_map_ptr,
    w13_ptr,
    w2_ptr,
    inter_ptr,
    partial_ptr,
    out_ptr,
    counters_ptr,
    eps,
    HIDDEN: tl.constexpr,
    HIDDEN_PAD: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    INTERMEDIATE_PAD: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND_WEIGHTS: tl.constexpr,
    HAS_MAP: tl.constexpr,
    GATE_ROWS: tl.constexpr,
    GATE_BLOCKS: tl.constexpr,
    DOWN_COLS: tl.constexpr,
    DOWN_BLOCKS: tl.constexpr,
    PDL: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """The whole layer of experts in one launch. Items, handed out in order by a ticket counter:
    TOP_K * GATE_BLOCKS gate/up items (slot, GATE_ROWS rows of I), then TOP_K * DOWN_BLOCKS down
    items (slot, DOWN_COLS columns of H). A down item loads its weights, then waits until its
    slot's gate/up items have stored inter[slot]; the last of a block's TOP_K down items to arrive
    sums their partials in slot order. Every gate/up ticket went out before the first down ticket,
    to a program that is running, so the wait always ends, whatever the grid and however many
    programs the GPU holds at once."""
    if PDL:
        gdc_wait()  # the router's logits just before
        gdc_launch_dependents()
    slots = tl.arange(0, TOP_K_PAD)
    ids, weights = route_one_token(logits_ptr, NUM_EXPERTS, EXPERTS_PAD, TOP_K, TOP_K_PAD, RENORMALIZE, ROUND_WEIGHTS)
    if HAS_MAP:
        ids = tl.load(expert_map_ptr + ids, mask=ids >= 0, other=-1)
    ks = tl.arange(0, HIDDEN_PAD)
    hidden_ok = ks < HIDDEN
    h = tl.load(h_ptr + ks, mask=hidden_ok, other=0.0)
    x = rms_norm_row(h, tl.load(norm_w_ptr + ks, mask=hidden_ok, other=0.0), HIDDEN, eps)
    x = x.to(h.dtype).to(tl.float32)
    js = tl.arange(0, INTERMEDIATE_PAD)
    j_ok = js < INTERMEDIATE
    dtype = out_ptr.dtype.element_ty
    num_gate: tl.constexpr = TOP_K * GATE_BLOCKS
    column_counters = counters_ptr + _GATE_DONE + TOP_K_PAD
    ticket = tl.atomic_add(counters_ptr + _TICKET, 1, sem="relaxed", scope="gpu")
    while ticket < num_gate + TOP_K * DOWN_BLOCKS:
        if ticket < num_gate:
            slot = ticket // GATE_BLOCKS
            expert = tl.sum(tl.where(slots == slot, ids, 0))
            rows = (ticket % GATE_BLOCKS) * GATE_ROWS + tl.arange(0, GATE_ROWS)
            gate_ptrs = (
                w13_ptr
                + tl.maximum(expert, 0).to(tl.int64) * (2 * INTERMEDIATE * HIDDEN)
                + tl.minimum(rows, INTERMEDIATE - 1)[:, None] * HIDDEN
                + ks[None, :]
            )
            mask = (expert >= 0) & hidden_ok[None, :]  # another rank's expert: nothing to load
            gate_w = tl.load(gate_ptrs, mask=mask, other=0.0)
            up_w = tl.load(gate_ptrs + INTERMEDIATE * HIDDEN, mask=mask, other=0.0)
            # The next ticket's round trip overlaps these loads.
            next_ticket = tl.atomic_add(counters_ptr + _TICKET, 1, sem="relaxed", scope="gpu")
            gate_w = _pinned_here(gate_w, INTERPRETED)
            up_w = _pinned_here(up_w, INTERPRETED)
            gate = tl.sum(gate_w.to(tl.float32) * x[None, :], axis=1).to(dtype)
            up = tl.sum(up_w.to(tl.float32) * x[None, :], axis=1).to(dtype)
            tl.store(inter_ptr + slot * INTERMEDIATE + rows, silu_mul(gate, up).to(dtype), mask=rows < INTERMEDIATE)
            tl.debug_barrier()  # every thread's rows are stored before the release below
            tl.atomic_add(counters_ptr + _GATE_DONE + slot, 1, sem="release", scope="gpu")
        else:
            slot = (ticket - num_gate) // DOWN_BLOCKS
            block = (ticket - num_gate) % DOWN_BLOCKS
            expert = tl.sum(tl.where(slots == slot, ids, 0))
            weight = tl.sum(tl.where(slots == slot, weights, 0.0))
            cols = block * DOWN_COLS + tl.arange(0, DOWN_COLS)
            w_ptrs = (
                w2_ptr
                + tl.maximum(expert, 0).to(tl.int64) * (HIDDEN * INTERMEDIATE)
                + tl.minimum(cols, HIDDEN - 1)[:, None] * INTERMEDIATE
                + js[None, :]
            )
            w = tl.load(w_ptrs, mask=(expert >= 0) & j_ok[None, :], other=0.0)
            next_ticket = tl.atomic_add(counters_ptr + _TICKET, 1, sem="relaxed", scope="gpu")
            _wait_until_at_least(counters_ptr + _GATE_DONE + slot, GATE_BLOCKS, INTERPRETED)
            w = _pinned_here(w, INTERPRETED)
            # Stored by other programs: from L2, as no L1 line may predate it.
            inter = tl.load(inter_ptr + slot * INTERMEDIATE + js, mask=j_ok, other=0.0, cache_modifier=".cg")
            # fused_moe's rounding: the product rounded, times the weight in float32, rounded.
            y = tl.sum(w.to(tl.float32) * inter.to(tl.float32)[None, :], axis=1).to(dtype)
            weighted = tl.where(expert >= 0, (y.to(tl.float32) * weight).to(dtype).to(tl.float32), 0.0)
            tl.store(partial_ptr + slot * HIDDEN + cols, weighted, mask=cols < HIDDEN)
            tl.debug_barrier()  # every thread's partials are stored before the release below
            if tl.atomic_add(column_counters + block, 1, sem="acq_rel", scope="gpu") == TOP_K - 1:
                # The block's last slot: the k partials summed in float32, in slot order.
                partials = tl.load(
                    partial_ptr + slots[:, None] * HIDDEN + cols[None, :],
                    mask=(slots[:, None] < TOP_K) & (cols[None, :] < HIDDEN),
                    other=0.0,
                    cache_modifier=".cg",
                )
                tl.store(out_ptr + cols, tl.sum(partials, axis=0).to(dtype), mask=cols < HIDDEN)
                tl.store(column_counters + block, 0)  # ready for the next launch
        ticket = next_ticket
    # The last program out zeroes the rest for the next launch: no other program reads them now.
    if tl.atomic_add(counters_ptr + _EXITS, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        tl.store(counters_ptr + _TICKET, 0)
        tl.store(counters_ptr + _EXITS, 0)
        tl.store(counters_ptr + _GATE_DONE + slots, 0)


_INTERPRETED = isinstance(_expert_layer_kernel, InterpretedFunction)


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
    pdl = dependent_launch_supported(h.device)
    inter = torch.empty(top_k, intermediate, dtype=h.dtype, device=h.device)
    out = torch.empty_like(h)
    if DESIGN == "two GEMVs":
        weights, ids = select_experts(logits, top_k, renormalize, weight_dtype=weight_dtype)
        gate_up, down = launch_plans(
            hidden=hidden,
            intermediate=intermediate,
            top_k=top_k,
            element_size=h.element_size(),
            has_map=expert_map is not None,
            pdl=pdl,
        )
        map_arg = expert_map if expert_map is not None else ids  # never read without HAS_MAP
        grid, constexprs, num_warps = gate_up
        _expert_gate_up_kernel[grid](
            h, norm_weight, ids, map_arg, w13, inter, eps, **constexprs, num_warps=num_warps, **launch_options(pdl)
        )
        grid, constexprs, num_warps = down
        _expert_down_kernel[grid](
            inter, ids, weights, map_arg, w2, out, **constexprs, num_warps=num_warps, **launch_options(pdl)
        )
        return out
    constexprs, num_warps = layer_plan(
        hidden=hidden,
        intermediate=intermediate,
        num_experts=num_experts,
        top_k=top_k,
        renormalize=renormalize,
        weight_dtype=weight_dtype,
        element_size=h.element_size(),
        has_map=expert_map is not None,
        pdl=pdl,
    )
    map_arg = expert_map if expert_map is not None else logits  # never read without HAS_MAP
    partials = torch.empty(top_k, hidden, dtype=torch.float32, device=h.device)
    counters = arrival_counters(
        h.device, _GATE_DONE + constexprs["TOP_K_PAD"] + constexprs["DOWN_BLOCKS"], "decode_moe"
    )
    args = (h, norm_weight, logits, map_arg, w13, w2, inter, partials, out, counters, eps)
    _expert_layer_kernel[(_programs(h.device, args, constexprs, num_warps),)](
        *args, **constexprs, num_warps=num_warps, **launch_options(pdl)
    )
    return out


def _programs(device: torch.device, args: tuple, constexprs: dict, num_warps: int) -> int:
    """The one launch's grid: as many programs as the GPU holds at once (registers, shared memory
    and threads of the compiled kernel), so that every one streams from the start. More would only
    find the tickets gone; fewer would leave HBM idle. 2 under the interpreter."""
    if _INTERPRETED:
        return 2
    key = (device.index, tuple(sorted(constexprs.items())), num_warps)
    if key not in _GRIDS:
        compiled = _expert_layer_kernel.warmup(*args, **constexprs, num_warps=num_warps, grid=(1,))
        compiled._init_handles()
        props = torch.cuda.get_device_properties(device)
        threads = 32 * num_warps
        per_sm = min(
            getattr(props, "regs_per_multiprocessor", 65536) // (compiled.n_regs * threads),
            props.max_threads_per_multi_processor // threads,
            props.shared_memory_per_multiprocessor // max(1, compiled.metadata.shared),
        )
        _GRIDS[key] = max(1, PROGRAMS_PER_SM or per_sm) * props.multi_processor_count
    return _GRIDS[key]


_GRIDS: dict[tuple, int] = {}


def layer_plan(
    *,
    hidden: int,
    intermediate: int,
    num_experts: int,
    top_k: int,
    renormalize: bool,
    weight_dtype,
    element_size: int,
    has_map: bool,
    pdl: bool,
) -> tuple[dict, int]:
    """(constexprs, warps) of the one launch (also the sm_90 compile test's)."""
    # Half the chain's tile a program: a few programs an SM, each streaming item after item.
    gate_rows, down_cols, warps = PLAN or (
        tile_rows(hidden, 4, element_size),
        tile_rows(intermediate, 2, element_size),
        4,
    )
    constexprs = dict(
        HIDDEN=hidden,
        HIDDEN_PAD=triton.next_power_of_2(hidden),
        INTERMEDIATE=intermediate,
        INTERMEDIATE_PAD=triton.next_power_of_2(intermediate),
        NUM_EXPERTS=num_experts,
        EXPERTS_PAD=triton.next_power_of_2(num_experts),
        TOP_K=top_k,
        TOP_K_PAD=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize,
        ROUND_WEIGHTS=round_code(weight_dtype),
        HAS_MAP=has_map,
        GATE_ROWS=gate_rows,
        GATE_BLOCKS=triton.cdiv(intermediate, gate_rows),
        DOWN_COLS=down_cols,
        DOWN_BLOCKS=triton.cdiv(hidden, down_cols),
        PDL=pdl,
        INTERPRETED=_INTERPRETED,
    )
    return constexprs, warps


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
