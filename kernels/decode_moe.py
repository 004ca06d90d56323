"""A layer of experts at batch 1 in two launches: the decode chain's MoE layer
(services/worker/model/decode_chain.py), for Qwen3-MoE and Mixtral.

    logits, _ = norm_linear(h, gate, norm)   the router, its RMSNorm in its prologue (decode_linear.py)
    out       = expert_layer(h, logits)      everything else, in one persistent launch

Why: at one token the batched path (kernels/fused_moe.py) is eight launches around its two GEMMs,
and each boundary drains the GPU. One token needs no grouping by expert: slot s *is* one expert.
Two GEMV launches (gate/up, then down) after select_experts were 1.60x the step's floor: down
could load only the weights of its first wave before gate/up ended, and then streamed 25 MB in
two waves with HBM idle between them (bench/RESULTS.md, issue 53). In one launch, HBM streams
the whole layer without a gap:

- Each program routes (moe_routing.route_one_token: softmax, top-k by ranks, renormalise) and
  computes x = rms_norm(h) once, then takes items by ticket until none is left:
  - gate/up (slot s, GATE_ROWS rows of I): silu(x . gate) * (x . up), rounded as fused_moe does,
    into inter[s]; then it bumps slot s's done count;
  - down (slot s, DOWN_COLS columns of H): loads the slot's expert's rows, *then* waits until
    slot s's gate/up items are done (by the time down tickets go out, the early slots' are long
    done), and stores y * weight, rounded as fused_moe does, as a float32 partial. The last of the k
    slots to arrive at a block of columns sums the partials in slot order (arrival counters, as
    decode attention merges its splits): the same order on every run, no k-sum kernel.
- Tickets go out in order, gate/up before down, so every item a down item waits for belongs to a
  program that is already running: the wait always ends, whatever the grid and whatever else
  holds SMs (no program ever waits for one that has not started).
- The grid is as many programs as the GPU holds at once (4 an SM at 128 registers): more would
  only find the tickets gone.

Expert parallelism: `expert_map` sends a slot whose expert another rank holds to nothing here.
Tensor parallelism shards I; the caller all-reduces the output. Batch 1 only, up to 128 experts
(the ranks compare every pair), and where a tile of 2 rows fits (decode_moe_serves).
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
from strata.kernels.moe_routing import round_code, route_one_token
from strata.kernels.rmsnorm import rms_norm_row

__all__ = ["decode_moe", "decode_moe_serves", "layer_plan", "tile_rows", "MAX_EXPERTS", "WARPS"]

# Routing compares every pair of experts: 128 (Qwen3-MoE's) is 128 values a thread; more take the
# batched layer.
MAX_EXPERTS = 128
# At half the chain's tile (32 KB of weights a program), 4 warps take 128 registers a thread: 4
# programs an SM. 8 warps at the same or twice the tile ran 1.7x slower (bench/RESULTS.md).
WARPS = 4


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
    x = x.to(h.dtype)  # rounded as the unfused norm rounds it; kept so: half the registers of float32
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
            x32 = x.to(tl.float32)[None, :]
            gate = tl.sum(gate_w.to(tl.float32) * x32, axis=1).to(dtype)
            up = tl.sum(up_w.to(tl.float32) * x32, axis=1).to(dtype)
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


def decode_moe_serves(h: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, num_experts: int) -> bool:
    """Whether the one launch serves this layer and step: one token the chain takes, up to
    MAX_EXPERTS experts, and tiles of at least one row (H and I within the register budget)."""
    if not use_decode_linear(h, w13[0]) or not (w2.is_contiguous() and w2.dtype == h.dtype):
        return False
    return num_experts <= MAX_EXPERTS and min(_tiles(w13.shape[2], w2.shape[2], h.element_size())) > 0


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
    assert decode_moe_serves(h, w13, w2, top_k, num_experts), (tuple(h.shape), tuple(w13.shape), tuple(w2.shape))
    assert w13.is_contiguous() and tuple(w2.shape) == (num_local, hidden, intermediate)
    assert expert_map is None or (expert_map.dtype == torch.int32 and expert_map.shape == (num_experts,))
    # A few rows a program: the router's E rows would be a handful of programs at the chain's tile.
    router = DecodeLinearConfig(block_n=max(1, min(16, triton.next_power_of_2(num_experts) // 64)))
    logits, _ = norm_linear(h, gate_weight, None, norm_weight, eps, config=router)
    pdl = dependent_launch_supported(h.device)
    inter = torch.empty(top_k, intermediate, dtype=h.dtype, device=h.device)
    out = torch.empty_like(h)
    constexprs = layer_plan(
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
    grid = (_programs(h.device, args, constexprs),)
    _expert_layer_kernel[grid](*args, **constexprs, num_warps=WARPS, **launch_options(pdl))
    return out


def _programs(device: torch.device, args: tuple, constexprs: dict) -> int:
    """The grid: as many programs as the GPU holds at once (by the compiled kernel's registers,
    shared memory and threads), all streaming from the start; more would only find the tickets
    gone. 2 under the interpreter, which runs one program after the other."""
    if _INTERPRETED:
        return 2
    key = (device.index, args[0].dtype, tuple(sorted(constexprs.items())))
    if key not in _GRIDS:
        compiled = _expert_layer_kernel.warmup(*args, **constexprs, num_warps=WARPS, grid=(1,))
        compiled._init_handles()  # loads it: n_regs is known from here
        props = torch.cuda.get_device_properties(device)
        threads = 32 * WARPS
        per_sm = min(
            getattr(props, "regs_per_multiprocessor", 65536) // (compiled.n_regs * threads),
            props.max_threads_per_multi_processor // threads,
            props.shared_memory_per_multiprocessor // max(1, compiled.metadata.shared),
        )
        _GRIDS[key] = max(1, per_sm) * props.multi_processor_count
    return _GRIDS[key]


_GRIDS: dict[tuple, int] = {}


def _tiles(hidden: int, intermediate: int, element_size: int) -> tuple[int, int]:
    """(GATE_ROWS, DOWN_COLS): half the chain's tile a program, GATE_ROWS gate rows and as many up
    rows of H, DOWN_COLS rows of I; 0 where one row does not fit."""
    return tile_rows(hidden, 4, element_size), tile_rows(intermediate, 2, element_size)


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
) -> dict:
    """The one launch's constexprs (also the sm_90 compile test's); it runs at WARPS warps."""
    gate_rows, down_cols = _tiles(hidden, intermediate, element_size)
    return dict(
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
