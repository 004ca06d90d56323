"""Fused mixture-of-experts layer for Qwen3-MoE and Mixtral: routing, tokens grouped by expert,
then per expert tile the gate/up GEMM with SiLU-and-mul, and the down GEMM with the routing weight.

    weights, ids = select_experts(router_logits, top_k, renormalize)     # [T, k] float32, int32
    out = fused_moe(hidden, w13, w2, weights, ids)                        # [T, H]

Launches, all with grids and shapes fixed by T (and the weights' shapes), no host synchronisation,
so the whole layer is capturable in a CUDA graph:
1-2. routing (kernels/moe_routing.py): select_experts picks each token's k experts and weights;
   align_pairs_by_expert sorts the (token, slot) pairs by expert, each expert's segment padded to
   BLOCK_M, into static buffers sized for the worst case.
3. gate/up: a program per (BLOCK_M pairs of one expert, BLOCK_N columns of I) computes both
   halves of w13 for its columns, then silu(gate) * up, into an intermediate [T*k, I] row per pair.
4. down: a program per (BLOCK_M pairs, BLOCK_N columns of H): intermediate @ w2[e]^T, times the
   routing weight, into [T*k, H] row per pair.
5. sum: each token's k rows added in slot order in float32. A fixed order instead of atomics, so
   the output is bit-for-bit reproducible.
Programs past the padded total (the static grid covers the worst case) exit at once.

Rounding follows HF's bf16 path: the gate/up and down GEMM outputs are rounded to the activation
dtype, silu is rounded before the product and the product after it; the routing weight multiplies
the rounded down output in float32, rounded again. Only the k-sum differs: float32 here, HF adds
into a bf16 output one expert at a time.

Expert parallelism: `expert_map` [E_global] int32 maps global ids to this rank's experts (-1 for
experts held elsewhere: their pairs are dropped at alignment and add nothing). Tensor parallelism
only shrinks I. Tile sizes come from a small table by tokens per expert (choose_moe_config), never
autotuned, so warm-up can compile every variant serving will use (warm_up_token_counts, launch_variants).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from strata.kernels.activation import silu_mul
from strata.kernels.kernel_launch import KernelLaunch
from strata.kernels.moe_routing import (
    ALIGN_CHUNKS,
    MoEAlignment,
    align_chunk,
    align_launches,
    align_pairs_by_expert,
    expert_map_for_range,
    routing_launch,
    select_experts,
)
from strata.kernels.reference import fused_moe_reference, select_experts_reference

__all__ = [
    "GemmTile",
    "KernelLaunch",
    "MoEAlignment",
    "MoELaunchConfig",
    "align_pairs_by_expert",
    "choose_moe_config",
    "expert_map_for_range",
    "fused_moe",
    "fused_moe_reference",
    "launch_variants",
    "warm_up_token_counts",
    "select_experts",
    "select_experts_reference",
]


# --- 3./4. the expert GEMMs ---------------------------------------------------------------------


@dataclass(frozen=True)
class GemmTile:
    block_n: int  # output columns per program (for gate/up: of each half, gate and up)
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int = 1  # consecutive programs walk this many row blocks of one column block (L2 reuse)


@dataclass(frozen=True)
class MoELaunchConfig:
    block_m: int  # pairs per program, both GEMMs (the alignment pads to it)
    gate_up: GemmTile
    down: GemmTile


# By expected pairs per expert (T * k / E): at most that many -> config. Decode rows stream the
# weights once with small tiles (16-row MMAs, narrow N for enough programs); prefill rows reuse each
# weight tile over 64-128 rows. Table, not autotune: every variant is known at warm-up.
_CONFIG_TABLE: tuple[tuple[float, MoELaunchConfig], ...] = (
    (12, MoELaunchConfig(16, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4))),
    (24, MoELaunchConfig(32, GemmTile(64, 128, 4, 3), GemmTile(64, 128, 4, 3))),
    (96, MoELaunchConfig(64, GemmTile(64, 64, 4, 3, group_m=8), GemmTile(128, 64, 4, 3, group_m=8))),
    (float("inf"), MoELaunchConfig(128, GemmTile(128, 64, 8, 4, group_m=16), GemmTile(256, 64, 8, 3, group_m=8))),
)


def choose_moe_config(num_tokens: int, top_k: int, num_experts: int) -> MoELaunchConfig:
    """The table's row for num_tokens * top_k / num_experts pairs per expert (num_experts: all of
    the model's, so every expert-parallel rank picks the same tiles)."""
    per_expert = num_tokens * top_k / num_experts
    return next(config for limit, config in _CONFIG_TABLE if per_expert <= limit)


@triton.jit
def _tile_of(pid, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """(row block, column block) of a program: GROUP_M row blocks per column block before the next,
    so consecutive programs share the weight tile of one expert in L2."""
    in_group = GROUP_M * num_n_blocks
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    return first_m + (pid % in_group) % group_rows, (pid % in_group) // group_rows


@triton.jit
def _block_rows(sorted_pairs_ptr, block_experts_ptr, padded_total_ptr, m_block, num_pairs, BLOCK_M: tl.constexpr):
    """The block's expert (-1: nothing to do) and its pair ids (num_pairs for padding rows)."""
    expert = tl.load(block_experts_ptr + m_block)
    expert = tl.where(m_block * BLOCK_M < tl.load(padded_total_ptr), expert, -1)
    pairs = tl.load(sorted_pairs_ptr + m_block * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs


@triton.jit
def _dot(a, b, acc, IEEE_DOT: tl.constexpr):
    if IEEE_DOT:  # float32 weights: exact products, not tf32
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _moe_gate_up_kernel(
    hidden_ptr,
    w13_ptr,
    inter_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    padded_total_ptr,
    num_pairs,
    num_m_blocks,
    stride_hidden,
    stride_w13_expert,
    stride_w13_row,
    stride_inter,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    """inter[pair, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, I + n]) for a block of
    BLOCK_M pairs of expert e and BLOCK_N columns n."""
    m_block, n_block = _tile_of(tl.program_id(0), num_m_blocks, tl.cdiv(INTERMEDIATE, BLOCK_N), GROUP_M)
    expert, pairs = _block_rows(sorted_pairs_ptr, block_experts_ptr, padded_total_ptr, m_block, num_pairs, BLOCK_M)
    if expert < 0:
        return
    row_ok = pairs < num_pairs
    # Padding rows and tail columns read row 0 / a wrapped column (always in bounds) and are
    # never stored: no masks in the K loop unless K itself has a tail.
    tokens = tl.where(row_ok, pairs // TOP_K, 0).to(tl.int64)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = hidden_ptr + tokens[:, None] * stride_hidden + ks[None, :]
    gate_ptrs = (
        w13_ptr
        + expert.to(tl.int64) * stride_w13_expert
        + (cols % INTERMEDIATE)[None, :].to(tl.int64) * stride_w13_row
        + ks[:, None]
    )
    up_ptrs = gate_ptrs + INTERMEDIATE * stride_w13_row
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, HIDDEN, BLOCK_K):
        if HIDDEN % BLOCK_K == 0:
            a = tl.load(a_ptrs)
            gate_w = tl.load(gate_ptrs)
            up_w = tl.load(up_ptrs)
        else:
            k_ok = ks < HIDDEN - k
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            gate_w = tl.load(gate_ptrs, mask=k_ok[:, None], other=0.0)
            up_w = tl.load(up_ptrs, mask=k_ok[:, None], other=0.0)
        acc_gate = _dot(a, gate_w, acc_gate, IEEE_DOT)
        acc_up = _dot(a, up_w, acc_up, IEEE_DOT)
        a_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    dtype = inter_ptr.dtype.element_ty
    activated = silu_mul(acc_gate.to(dtype), acc_up.to(dtype)).to(dtype)
    out_ptrs = inter_ptr + pairs.to(tl.int64)[:, None] * stride_inter + cols[None, :]
    tl.store(out_ptrs, activated, mask=row_ok[:, None] & (cols < INTERMEDIATE)[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _moe_down_kernel(
    inter_ptr,
    w2_ptr,
    topk_weights_ptr,
    contrib_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    padded_total_ptr,
    num_pairs,
    num_m_blocks,
    stride_inter,
    stride_w2_expert,
    stride_w2_row,
    stride_contrib,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE_DOT: tl.constexpr,
):
    """contrib[pair, n] = weight[pair] * (inter[pair] . w2[e, n]) for a block of BLOCK_M pairs of
    expert e and BLOCK_N hidden columns n."""
    m_block, n_block = _tile_of(tl.program_id(0), num_m_blocks, tl.cdiv(HIDDEN, BLOCK_N), GROUP_M)
    expert, pairs = _block_rows(sorted_pairs_ptr, block_experts_ptr, padded_total_ptr, m_block, num_pairs, BLOCK_M)
    if expert < 0:
        return
    row_ok = pairs < num_pairs
    safe_pairs = tl.where(row_ok, pairs, 0).to(tl.int64)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + safe_pairs[:, None] * stride_inter + ks[None, :]
    b_ptrs = (
        w2_ptr
        + expert.to(tl.int64) * stride_w2_expert
        + (cols % HIDDEN)[None, :].to(tl.int64) * stride_w2_row
        + ks[:, None]
    )
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, INTERMEDIATE, BLOCK_K):
        if INTERMEDIATE % BLOCK_K == 0:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:  # tensor-parallel shards of I need not be multiples of BLOCK_K
            k_ok = ks < INTERMEDIATE - k
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = _dot(a, b, acc, IEEE_DOT)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    dtype = contrib_ptr.dtype.element_ty
    weight = tl.load(topk_weights_ptr + safe_pairs)
    # HF rounds the down projection, then multiplies by the weight and rounds again.
    weighted = (acc.to(dtype).to(tl.float32) * weight[:, None]).to(dtype)
    out_ptrs = contrib_ptr + pairs.to(tl.int64)[:, None] * stride_contrib + cols[None, :]
    tl.store(out_ptrs, weighted, mask=row_ok[:, None] & (cols < HIDDEN)[None, :])


# --- 5. the k contributions of each token --------------------------------------------------------


@triton.jit
def _sum_topk_kernel(
    contrib_ptr,
    topk_ids_ptr,
    expert_map_ptr,
    out_ptr,
    stride_contrib,
    stride_out,
    HIDDEN: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_MAP: tl.constexpr,
):
    """out[t] = sum over slots s in order of contrib[t * k + s], skipping experts held elsewhere."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < HIDDEN
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):
        pair = token * TOP_K + slot
        keep = col_ok
        if HAS_MAP:
            expert = tl.load(topk_ids_ptr + pair)
            keep = keep & (tl.load(expert_map_ptr + expert) >= 0)
        acc += tl.load(contrib_ptr + pair * stride_contrib + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


# --- entry point ----------------------------------------------------------------------------------


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: MoELaunchConfig | None = None,
) -> torch.Tensor:
    """sum over the k routed experts e of token t: topk_weights[t, s] * down_e(silu(gate_e(x)) * up_e(x)).

    hidden [T, H]; w13 [E_local, 2I, H] (gate rows, then up rows); w2 [E_local, H, I], all one
    dtype (bf16 serving; float32/float16 for tests). topk_weights float32 [T, k], topk_ids int32
    [T, k] (from select_experts). expert_map [E_global] int32: global id -> local expert, -1 for
    experts on other ranks (they contribute nothing); None: the ids are local. config: tiles
    (default choose_moe_config for T). Returns [T, H] in hidden's dtype (into `out` if given)."""
    num_tokens, hidden_size = hidden.shape
    num_local, two_i, _ = w13.shape
    intermediate = two_i // 2
    top_k = topk_ids.shape[1]
    _check_moe_args(hidden, w13, w2, topk_weights, topk_ids, expert_map, out)
    if out is None:
        out = torch.empty_like(hidden)
    if num_tokens == 0:
        return out
    num_experts = num_local if expert_map is None else expert_map.shape[0]
    config = config or choose_moe_config(num_tokens, top_k, num_experts)
    layout = align_pairs_by_expert(topk_ids, num_local, config.block_m, expert_map)
    gate_up, down = _gemm_launches(hidden_size, intermediate, top_k, config, hidden.dtype == torch.float32)
    rows = (layout.sorted_pairs, layout.block_experts, layout.padded_total, layout.num_pairs, layout.max_blocks)
    inter = torch.empty(layout.num_pairs, intermediate, dtype=hidden.dtype, device=hidden.device)
    gate_up(
        (layout.max_blocks * triton.cdiv(intermediate, config.gate_up.block_n),),
        hidden,
        w13,
        inter,
        *rows,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        inter.stride(0),
    )
    contrib = torch.empty(layout.num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    down(
        (layout.max_blocks * triton.cdiv(hidden_size, config.down.block_n),),
        inter,
        w2,
        topk_weights,
        contrib,
        *rows,
        inter.stride(0),
        w2.stride(0),
        w2.stride(1),
        contrib.stride(0),
    )
    total = _sum_launch(hidden_size, top_k, expert_map is not None)
    total(
        (num_tokens, triton.cdiv(hidden_size, total.constexprs["BLOCK_H"])),
        contrib,
        topk_ids,
        expert_map if expert_map is not None else topk_ids,
        out,
        contrib.stride(0),
        out.stride(0),
    )
    return out


@cache
def _gemm_launches(
    hidden_size: int, intermediate: int, top_k: int, config: MoELaunchConfig, ieee_dot: bool
) -> tuple[KernelLaunch, KernelLaunch]:
    shape = f"H={hidden_size} I={intermediate} BM={config.block_m}"
    launches = []
    for name, kernel, tile, extra in (
        ("gate_up", _moe_gate_up_kernel, config.gate_up, dict(TOP_K=top_k)),
        ("down", _moe_down_kernel, config.down, {}),
    ):
        constexprs = dict(
            HIDDEN=hidden_size,
            INTERMEDIATE=intermediate,
            BLOCK_M=config.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            GROUP_M=tile.group_m,
            IEEE_DOT=ieee_dot,
            **extra,
        )
        label = f"fused_moe gemm {name} {shape} BN={tile.block_n} BK={tile.block_k}"
        launches.append(KernelLaunch(label, kernel, constexprs, tile.num_warps, tile.num_stages))
    return launches[0], launches[1]


@cache
def _sum_launch(hidden_size: int, top_k: int, has_map: bool) -> KernelLaunch:
    constexprs = dict(
        HIDDEN=hidden_size, TOP_K=top_k, BLOCK_H=min(1024, triton.next_power_of_2(hidden_size)), HAS_MAP=has_map
    )
    name = f"moe_sum_topk H={hidden_size} k={top_k}{' mapped' if has_map else ''}"
    return KernelLaunch(name, _sum_topk_kernel, constexprs, num_warps=4)


def warm_up_token_counts(num_experts: int, top_k: int) -> list[int]:
    """The fewest token counts whose fused_moe calls launch every variant serving can launch
    (each block_m of the table, each way of aligning): a warm-up that runs select_experts and
    fused_moe at each compiles them all before traffic."""
    counts = list(range(1, max(ALIGN_CHUNKS) // top_k + 2)) + [1 << p for p in range(18)]
    first_of = {}
    for tokens in sorted(set(counts)):
        first_of.setdefault(_variant_key(tokens, num_experts, top_k), tokens)
    return sorted(first_of.values())


def _variant_key(tokens: int, num_experts: int, top_k: int) -> tuple:
    return (choose_moe_config(tokens, top_k, num_experts), *align_chunk(tokens * top_k))


def launch_variants(
    *,
    hidden_size: int,
    intermediate: int,
    num_experts: int,
    top_k: int,
    renormalize: bool = True,
    weight_dtype: torch.dtype | None = None,
    ieee_dot: bool = False,
) -> list[KernelLaunch]:
    """Every kernel variant a model of this shape launches while serving (those of each of
    warm_up_token_counts, routing with the model's options): for compile_check."""
    routing = [routing_launch(num_experts, top_k, renormalize, weight_dtype, one, True) for one in (False, True)]
    variants = [*routing, _sum_launch(hidden_size, top_k, False)]
    for tokens in warm_up_token_counts(num_experts, top_k):
        config, chunk, one_program = _variant_key(tokens, num_experts, top_k)
        aligns = align_launches(num_experts, config.block_m, False, chunk)
        variants += [aligns["one_chunk"]] if one_program else [aligns[key] for key in ("count", "offsets", "scatter")]
        variants += _gemm_launches(hidden_size, intermediate, top_k, config, ieee_dot)
    return list({launch.name: launch for launch in variants}.values())


def _check_moe_args(hidden, w13, w2, topk_weights, topk_ids, expert_map, out) -> None:
    num_tokens, hidden_size = hidden.shape
    num_local, two_i, w13_hidden = w13.shape
    assert two_i % 2 == 0 and w13_hidden == hidden_size, (tuple(w13.shape), hidden_size)
    assert tuple(w2.shape) == (num_local, hidden_size, two_i // 2), (tuple(w2.shape), tuple(w13.shape))
    assert hidden.dtype == w13.dtype == w2.dtype, (hidden.dtype, w13.dtype, w2.dtype)
    # Rows may be strided (a view of a larger buffer); the K dimension must be contiguous.
    assert hidden.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1, "last dimensions must be contiguous"
    assert topk_ids.dtype == torch.int32 and topk_ids.is_contiguous(), (topk_ids.dtype, topk_ids.stride())
    assert topk_weights.dtype == torch.float32 and topk_weights.is_contiguous(), topk_weights.dtype
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens, (
        tuple(topk_ids.shape),
        tuple(topk_weights.shape),
        num_tokens,
    )
    if expert_map is not None:
        assert expert_map.dtype == torch.int32 and expert_map.dim() == 1, expert_map.dtype
    if out is not None:
        assert out.shape == hidden.shape and out.dtype == hidden.dtype and out.stride(1) == 1, (out.shape, out.dtype)
