"""Fused mixture-of-experts layer for Qwen3-MoE and Mixtral: routing, tokens grouped by expert,
then per expert tile the gate/up GEMM with SiLU-and-mul, and the down GEMM with the routing weight.

    weights, ids = select_experts(router_logits, top_k, renormalize)     # [T, k] float32, int32
    out = fused_moe(hidden, w13, w2, weights, ids)                        # [T, H]

Launches, all with grids and shapes fixed by T (and the weights' shapes), no host synchronisation,
so the whole layer is capturable in a CUDA graph:
1. select_experts: one program per BLOCK_T tokens: softmax in float32, top-k, renormalise.
2. align (moe_align_block_size): the (token, slot) pairs sorted by local expert id, each expert's
   segment padded to BLOCK_M, into static buffers sized for the worst case,
   T*k + min(E, T*k) * (BLOCK_M - 1). Per chunk of pairs: a histogram of experts and a sort of
   (expert, pair) keys. One program when the pairs fit one chunk (a decode step up to 256 tokens
   at k = 8); else count per chunk, offsets (one program), scatter per chunk. Integer counts and
   keys that include the pair id: the layout is the same on every run.
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
from triton.runtime.interpreter import InterpretedFunction

from strata.kernels.activation import silu_mul
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

# Pairs an align program sorts at once, smallest first: one program takes all the pairs when they
# fit one of these (a decode step of up to 256 tokens at k = 8), sorting only as many keys as the
# smallest that fits, since a sort's time grows with its width; more pairs go in chunks of the
# largest. The interpreter sorts slowly: there only 64, which also brings the several-chunk path
# within reach of small tests.
ALIGN_CHUNKS = (64, 256, 2048)
_INTERPRETED_ALIGN_CHUNKS = (64,)
# Elements of the align kernels' [rows, E] tiles (block experts, chunk offsets).
_ALIGN_TILE = 4096
_ALIGN_WARPS = 8
# Rounding codes for select_experts' weights (a constexpr, not a dtype, so every Triton build takes it).
_ROUND_CODES = {None: 0, torch.bfloat16: 1, torch.float16: 2, torch.float32: 0}


# --- 1. routing ---------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_tokens"])
def _select_experts_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    stride_logits,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND_WEIGHTS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < num_tokens
    experts = tl.arange(0, EXPERTS_PAD)
    expert_ok = experts < NUM_EXPERTS
    logits = tl.load(
        logits_ptr + rows.to(tl.int64)[:, None] * stride_logits + experts[None, :],
        mask=row_ok[:, None] & expert_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    logits = tl.where(expert_ok[None, :], logits, -float("inf"))  # rows past T stay finite: no NaN
    # HF's softmax in float32: exp(x - max) / sum, then probabilities compared and summed.
    shifted = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    shifted = tl.where(expert_ok[None, :], shifted, 0.0)
    probs = shifted / tl.sum(shifted, axis=1)[:, None]
    # Top-k by the logits (the same order as the probabilities, free of exp's rounding), k rounds of
    # argmax; ties go to the lower expert id. Slot s holds the s-th largest, as torch.topk sorts.
    slots = tl.arange(0, TOP_K_PAD)
    chosen_ids = tl.zeros((BLOCK_T, TOP_K_PAD), dtype=tl.int32)
    chosen = tl.zeros((BLOCK_T, TOP_K_PAD), dtype=tl.float32)
    remaining = logits
    for s in tl.static_range(TOP_K):
        best = tl.argmax(remaining, axis=1, tie_break_left=True).to(tl.int32)
        hit = experts[None, :] == best[:, None]
        best_prob = tl.sum(tl.where(hit, probs, 0.0), axis=1)
        chosen_ids = tl.where(slots[None, :] == s, best[:, None], chosen_ids)
        chosen = tl.where(slots[None, :] == s, best_prob[:, None], chosen)
        remaining = tl.where(hit, -float("inf"), remaining)
    if RENORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=1)[:, None]
    if ROUND_WEIGHTS == 1:
        chosen = chosen.to(tl.bfloat16).to(tl.float32)
    elif ROUND_WEIGHTS == 2:
        chosen = chosen.to(tl.float16).to(tl.float32)
    out_offsets = rows[:, None] * TOP_K + slots[None, :]
    out_mask = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out_offsets, chosen, mask=out_mask)
    tl.store(ids_ptr + out_offsets, chosen_ids, mask=out_mask)


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, *, weight_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's router on [T, E] logits in one launch -> (weights float32 [T, k], ids int32 [T, k]).

    Softmax in float32, the k largest (sorted, ties to the lower id), divided by their sum when
    `renormalize` (Qwen3-MoE's norm_topk_prob; Mixtral always, which equals its softmax over the
    top-k logits). weight_dtype: round the weights to it as Qwen3MoeTopKRouter does (pass the
    logits' dtype); None keeps them float32 as MixtralTopKRouter (transformers 5) does."""
    assert router_logits.dim() == 2 and router_logits.stride(-1) == 1, tuple(router_logits.shape)
    num_tokens, num_experts = router_logits.shape
    assert 1 <= top_k <= num_experts, (top_k, num_experts)
    assert weight_dtype in _ROUND_CODES, weight_dtype
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    launch = _routing_launch(num_experts, top_k, renormalize, weight_dtype)
    launch(
        (triton.cdiv(num_tokens, launch.constexprs["BLOCK_T"]),),
        router_logits,
        weights,
        ids,
        num_tokens,
        router_logits.stride(0),
    )
    return weights, ids


@dataclass(frozen=True)
class KernelLaunch:
    """The compile-time half of a launch (constexprs, warps, stages), shared by the launch itself
    and by the list of variants that compile_check and warm-up compile."""

    name: str
    kernel: object
    constexprs: dict
    num_warps: int
    num_stages: int = 1

    def __call__(self, grid, *args) -> None:
        self.kernel[grid](*args, **self.constexprs, num_warps=self.num_warps, num_stages=self.num_stages)


@cache
def _routing_launch(num_experts: int, top_k: int, renormalize: bool, weight_dtype) -> KernelLaunch:
    experts_pad = triton.next_power_of_2(num_experts)
    constexprs = dict(
        NUM_EXPERTS=num_experts,
        EXPERTS_PAD=experts_pad,
        TOP_K=top_k,
        TOP_K_PAD=triton.next_power_of_2(top_k),
        BLOCK_T=max(1, min(64, 2048 // experts_pad)),
        RENORMALIZE=renormalize,
        ROUND_WEIGHTS=_ROUND_CODES[weight_dtype],
    )
    return KernelLaunch(f"select_experts E={num_experts} k={top_k}", _select_experts_kernel, constexprs, num_warps=4)


def expert_map_for_range(num_experts: int, start: int, end: int, device=None) -> torch.Tensor:
    """expert_map of a rank holding global experts [start, end) as its local 0 .. end - start - 1."""
    assert 0 <= start < end <= num_experts, (start, end, num_experts)
    expert_map = torch.full((num_experts,), -1, dtype=torch.int32, device=device)
    expert_map[start:end] = torch.arange(end - start, dtype=torch.int32, device=device)
    return expert_map


# --- 2. grouping the (token, slot) pairs by expert ------------------------------------------------


@dataclass
class MoEAlignment:
    """The pairs (pair = token * k + slot) grouped by local expert, each group padded to block_m.

    sorted_pairs [max_blocks * block_m] int32: pair ids, expert by expert, ascending within an
        expert; padding holds num_pairs. Past the padded total the contents are undefined.
    block_experts [max_blocks] int32: the local expert of each block of block_m rows, -1 past the total.
    padded_total [1] int32: rows in use (a multiple of block_m), on the device.
    """

    sorted_pairs: torch.Tensor
    block_experts: torch.Tensor
    padded_total: torch.Tensor
    num_pairs: int
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_experts.shape[0]


@triton.jit
def _chunk_local_ids(topk_ids_ptr, expert_map_ptr, pairs, num_pairs, HAS_MAP: tl.constexpr):
    """Local expert id of each pair, -1 past num_pairs or for an expert another rank holds."""
    valid = pairs < num_pairs
    ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=-1)
    if HAS_MAP:
        ids = tl.load(expert_map_ptr + ids, mask=valid & (ids >= 0), other=-1)
    return ids


@triton.jit
def _expert_counts(ids, EXPERTS_PAD: tl.constexpr):
    return tl.histogram(ids, EXPERTS_PAD, mask=ids >= 0)


@triton.jit
def _scatter_chunk(sorted_pairs_ptr, ids, counts, base, first_pair, CHUNK: tl.constexpr, EXPERTS_PAD: tl.constexpr):
    """The chunk's pairs to their rows: sorted by (expert, pair), the i-th goes to
    base[e] + i - (pairs of lower experts in the chunk). Pairs without a local expert sort last
    and are dropped. No [CHUNK, E] tile: a sort of CHUNK keys and a gather of E offsets."""
    local = tl.arange(0, CHUNK)
    keys = tl.sort(tl.where(ids >= 0, ids, EXPERTS_PAD) * CHUNK + local)
    experts = keys // CHUNK
    shift = base - (tl.cumsum(counts, axis=0) - counts)
    dest = local + tl.gather(shift, tl.minimum(experts, EXPERTS_PAD - 1), 0)
    tl.store(sorted_pairs_ptr + dest, first_pair + keys % CHUNK, mask=experts < EXPERTS_PAD)


@triton.jit
def _finish_layout(
    sorted_pairs_ptr,
    block_experts_ptr,
    padded_total_ptr,
    totals,
    num_pairs,
    max_blocks,
    BLOCK_M: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    BLOCKS_PER_STEP: tl.constexpr,
):
    """From the per-expert pair counts: each expert's padded start, the padding rows filled with
    the num_pairs sentinel, the expert of every block (-1 past the total), and the total.
    Returns the starts."""
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(padded_total_ptr, total)
    # Padding: at most BLOCK_M - 1 rows after each expert's pairs.
    fill = tl.arange(0, BLOCK_M)
    tl.store(
        sorted_pairs_ptr + (starts + totals)[:, None] + fill[None, :],
        tl.zeros((EXPERTS_PAD, BLOCK_M), tl.int32) + num_pairs,
        mask=fill[None, :] < (padded - totals)[:, None],
    )
    # A block's expert is the number of segments ending at or before its first row. (While loops
    # over runtime bounds here: the interpreter, with numpy 2, cannot take them in range().)
    first = 0
    while first < max_blocks:
        blocks = first + tl.arange(0, BLOCKS_PER_STEP)
        rows = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= rows[:, None]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + blocks, tl.where(rows < total, expert, -1), mask=blocks < max_blocks)
        first += BLOCKS_PER_STEP
    return starts


@triton.jit(do_not_specialize=["num_pairs", "max_blocks"])
def _align_one_chunk_kernel(
    topk_ids_ptr,
    expert_map_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    padded_total_ptr,
    num_pairs,
    max_blocks,
    HAS_MAP: tl.constexpr,
    CHUNK: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCKS_PER_STEP: tl.constexpr,
):
    """All pairs in one program (decode): count, lay out and scatter in one launch."""
    ids = _chunk_local_ids(topk_ids_ptr, expert_map_ptr, tl.arange(0, CHUNK), num_pairs, HAS_MAP)
    counts = _expert_counts(ids, EXPERTS_PAD)
    starts = _finish_layout(
        sorted_pairs_ptr,
        block_experts_ptr,
        padded_total_ptr,
        counts,
        num_pairs,
        max_blocks,
        BLOCK_M,
        EXPERTS_PAD,
        BLOCKS_PER_STEP,
    )
    _scatter_chunk(sorted_pairs_ptr, ids, counts, starts, 0, CHUNK, EXPERTS_PAD)


@triton.jit(do_not_specialize=["num_pairs"])
def _align_count_kernel(
    topk_ids_ptr,
    expert_map_ptr,
    chunk_counts_ptr,
    num_pairs,
    HAS_MAP: tl.constexpr,
    CHUNK: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
):
    """Pairs of each expert in this program's chunk -> chunk_counts[chunk, expert]."""
    chunk = tl.program_id(0)
    ids = _chunk_local_ids(topk_ids_ptr, expert_map_ptr, chunk * CHUNK + tl.arange(0, CHUNK), num_pairs, HAS_MAP)
    tl.store(chunk_counts_ptr + chunk * EXPERTS_PAD + tl.arange(0, EXPERTS_PAD), _expert_counts(ids, EXPERTS_PAD))


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks"])
def _align_offsets_kernel(
    chunk_counts_ptr,
    sorted_pairs_ptr,
    block_experts_ptr,
    padded_total_ptr,
    num_pairs,
    num_chunks,
    max_blocks,
    EXPERTS_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNKS_PER_STEP: tl.constexpr,
    BLOCKS_PER_STEP: tl.constexpr,
):
    """One program: totals over the chunks, the layout, then each chunk's first row per expert
    (its expert's start + the pairs earlier chunks put there), in place of its counts."""
    experts = tl.arange(0, EXPERTS_PAD)
    totals = tl.zeros((EXPERTS_PAD,), dtype=tl.int32)
    first = 0
    while first < num_chunks:
        chunks = first + tl.arange(0, CHUNKS_PER_STEP)
        offsets = chunks[:, None] * EXPERTS_PAD + experts[None, :]
        counts = tl.load(chunk_counts_ptr + offsets, mask=(chunks < num_chunks)[:, None], other=0)
        totals += tl.sum(counts, axis=0)
        first += CHUNKS_PER_STEP
    base = _finish_layout(
        sorted_pairs_ptr,
        block_experts_ptr,
        padded_total_ptr,
        totals,
        num_pairs,
        max_blocks,
        BLOCK_M,
        EXPERTS_PAD,
        BLOCKS_PER_STEP,
    )
    first = 0
    while first < num_chunks:
        chunks = first + tl.arange(0, CHUNKS_PER_STEP)
        offsets = chunks[:, None] * EXPERTS_PAD + experts[None, :]
        in_range = (chunks < num_chunks)[:, None]
        counts = tl.load(chunk_counts_ptr + offsets, mask=in_range, other=0)
        tl.store(chunk_counts_ptr + offsets, base[None, :] + tl.cumsum(counts, axis=0) - counts, mask=in_range)
        base += tl.sum(counts, axis=0)
        first += CHUNKS_PER_STEP


@triton.jit(do_not_specialize=["num_pairs"])
def _align_scatter_kernel(
    topk_ids_ptr,
    expert_map_ptr,
    chunk_counts_ptr,
    sorted_pairs_ptr,
    num_pairs,
    HAS_MAP: tl.constexpr,
    CHUNK: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
):
    """Each chunk's pairs to their rows, from the chunk's first row per expert."""
    chunk = tl.program_id(0)
    ids = _chunk_local_ids(topk_ids_ptr, expert_map_ptr, chunk * CHUNK + tl.arange(0, CHUNK), num_pairs, HAS_MAP)
    base = tl.load(chunk_counts_ptr + chunk * EXPERTS_PAD + tl.arange(0, EXPERTS_PAD))
    _scatter_chunk(sorted_pairs_ptr, ids, _expert_counts(ids, EXPERTS_PAD), base, chunk * CHUNK, CHUNK, EXPERTS_PAD)


def max_padded_blocks(num_pairs: int, num_local_experts: int, block_m: int) -> int:
    """Blocks of the worst-case layout: every expert that gets a pair wastes up to block_m - 1 rows."""
    return triton.cdiv(num_pairs + min(num_local_experts, num_pairs) * (block_m - 1), block_m)


def align_chunk(num_pairs: int) -> tuple[int, bool]:
    """(pairs per align program, whether one program takes all num_pairs)."""
    interpreted = isinstance(_align_one_chunk_kernel, InterpretedFunction)
    sizes = _INTERPRETED_ALIGN_CHUNKS if interpreted else ALIGN_CHUNKS
    fits = [size for size in sizes if num_pairs <= size]
    return (fits[0], True) if fits else (sizes[-1], False)


def align_pairs_by_expert(
    topk_ids: torch.Tensor,
    num_local_experts: int,
    block_m: int,
    expert_map: torch.Tensor | None = None,
    *,
    chunk: int | None = None,
) -> MoEAlignment:
    """Group the (token, slot) pairs of topk_ids [T, k] by local expert (vLLM's
    moe_align_block_size), on the device, into buffers whose sizes depend on T, k, E only.
    chunk: pairs per align program, a power of two (default: align_chunk's)."""
    assert topk_ids.dtype == torch.int32 and topk_ids.is_contiguous(), (topk_ids.dtype, topk_ids.stride())
    if expert_map is not None:
        assert expert_map.dtype == torch.int32 and expert_map.is_contiguous()
    num_pairs = topk_ids.numel()
    device = topk_ids.device
    max_blocks = max_padded_blocks(num_pairs, num_local_experts, block_m)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=device)
    padded_total = torch.empty(1, dtype=torch.int32, device=device)
    chunk, one_program = (chunk, num_pairs <= chunk) if chunk else align_chunk(num_pairs)
    launches = _align_launches(num_local_experts, block_m, expert_map is not None, chunk)
    map_arg = expert_map if expert_map is not None else topk_ids  # never read without HAS_MAP
    layout = (sorted_pairs, block_experts, padded_total)
    if one_program:
        launches["one_chunk"]((1,), topk_ids, map_arg, *layout, num_pairs, max_blocks)
    else:
        num_chunks = triton.cdiv(num_pairs, chunk)
        chunk_counts = torch.empty(
            num_chunks, triton.next_power_of_2(num_local_experts), dtype=torch.int32, device=device
        )
        launches["count"]((num_chunks,), topk_ids, map_arg, chunk_counts, num_pairs)
        launches["offsets"]((1,), chunk_counts, *layout, num_pairs, num_chunks, max_blocks)
        launches["scatter"]((num_chunks,), topk_ids, map_arg, chunk_counts, sorted_pairs, num_pairs)
    return MoEAlignment(sorted_pairs, block_experts, padded_total, num_pairs, block_m)


@cache
def _align_launches(num_local_experts: int, block_m: int, has_map: bool, chunk: int) -> dict:
    experts_pad = triton.next_power_of_2(num_local_experts)
    pairs = dict(HAS_MAP=has_map, CHUNK=chunk, EXPERTS_PAD=experts_pad)
    layout = dict(EXPERTS_PAD=experts_pad, BLOCK_M=block_m, BLOCKS_PER_STEP=max(16, _ALIGN_TILE // experts_pad))
    shape = f"E={num_local_experts}{' mapped' if has_map else ''}"
    return dict(
        one_chunk=KernelLaunch(
            f"moe_align one chunk {shape} BM={block_m} chunk={chunk}",
            _align_one_chunk_kernel,
            {**pairs, **layout},
            _ALIGN_WARPS,
        ),
        count=KernelLaunch(f"moe_align count {shape} chunk={chunk}", _align_count_kernel, pairs, _ALIGN_WARPS),
        offsets=KernelLaunch(
            f"moe_align offsets E={num_local_experts} BM={block_m}",
            _align_offsets_kernel,
            {**layout, "CHUNKS_PER_STEP": max(1, _ALIGN_TILE // experts_pad)},
            _ALIGN_WARPS,
        ),
        scatter=KernelLaunch(f"moe_align scatter {shape} chunk={chunk}", _align_scatter_kernel, pairs, _ALIGN_WARPS),
    )


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
    variants = [_routing_launch(num_experts, top_k, renormalize, weight_dtype), _sum_launch(hidden_size, top_k, False)]
    for tokens in warm_up_token_counts(num_experts, top_k):
        config, chunk, one_program = _variant_key(tokens, num_experts, top_k)
        aligns = _align_launches(num_experts, config.block_m, False, chunk)
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
