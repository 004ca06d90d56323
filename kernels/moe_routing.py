"""Routing for the fused mixture-of-experts layer (kernels/fused_moe.py has the whole layer):

1. select_experts: one program per BLOCK_T tokens: softmax in float32, top-k, renormalise. One
   token takes a one-warp program: its reductions then never cross warps. route_one_token makes
   the same choice inside another kernel (the decode chain's MoE launch, kernels/decode_moe.py),
   by ranks: two reductions instead of k dependent argmax rounds.
2. align_pairs_by_expert (vLLM's moe_align_block_size): the (token, slot) pairs sorted by local
   expert id, each expert's segment padded to BLOCK_M, into static buffers sized for the worst
   case, T*k + min(E, T*k) * (BLOCK_M - 1). Per chunk of pairs: a histogram of experts and a sort
   of (expert, pair) keys. One program when the pairs fit one chunk (a decode step up to 256
   tokens at k = 8); else count per chunk, offsets (one program), scatter per chunk. Integer
   counts and keys that include the pair id: the layout is the same on every run.

Grids and buffer shapes depend on T, k and E only: capturable in a CUDA graph. `expert_map`
[E_global] int32 maps global ids to this rank's experts (-1 for experts held elsewhere: their
pairs are dropped at alignment).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

from strata.kernels.dependent_launch import dependent_launch_supported, launch_options
from strata.kernels.kernel_launch import KernelLaunch

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
    PDL: tl.constexpr = False,
):
    if PDL:  # the logits come from the router just before
        gdc_launch_dependents()
        gdc_wait()
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


@triton.jit
def route_one_token(
    logits_ptr,
    NUM_EXPERTS: tl.constexpr,
    EXPERTS_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND_WEIGHTS: tl.constexpr,
):
    """select_experts of one token inside another kernel (kernels/decode_moe.py) -> (ids [TOP_K_PAD]
    int32, -1 past TOP_K; weights [TOP_K_PAD] float32). The same choice, by ranks instead of k
    dependent argmax rounds: an expert's rank is the number of experts ahead of it (a larger logit,
    or an equal one with a lower id), and slot s holds the expert ranked s. The logits are read
    from L2 (`.cg`): the caller reads them right after its dependent-launch wait."""
    experts = tl.arange(0, EXPERTS_PAD)
    expert_ok = experts < NUM_EXPERTS
    logits = tl.load(logits_ptr + experts, mask=expert_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    logits = tl.where(expert_ok, logits, -float("inf"))
    shifted = tl.where(expert_ok, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
    probs = shifted / tl.sum(shifted, axis=0)
    # ahead[j, e]: expert j comes before expert e. Padding (-inf, higher ids) ranks past every real one.
    ahead = (logits[:, None] > logits[None, :]) | (
        (logits[:, None] == logits[None, :]) & (experts[:, None] < experts[None, :])
    )
    rank = tl.sum(ahead.to(tl.int32), axis=0)
    slots = tl.arange(0, TOP_K_PAD)
    hit = (rank[None, :] == slots[:, None]) & (slots[:, None] < TOP_K)
    ids = tl.where(slots < TOP_K, tl.sum(tl.where(hit, experts[None, :], 0), axis=1), -1)
    chosen = tl.sum(tl.where(hit, probs[None, :], 0.0), axis=1)
    if RENORMALIZE:
        chosen = chosen / tl.sum(chosen, axis=0)
    if ROUND_WEIGHTS == 1:
        chosen = chosen.to(tl.bfloat16).to(tl.float32)
    elif ROUND_WEIGHTS == 2:
        chosen = chosen.to(tl.float16).to(tl.float32)
    return ids, chosen


def round_code(weight_dtype) -> int:
    """The ROUND_WEIGHTS constexpr of select_experts' weight_dtype."""
    assert weight_dtype in _ROUND_CODES, weight_dtype
    return _ROUND_CODES[weight_dtype]


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
    pdl = dependent_launch_supported(router_logits.device)
    launch = routing_launch(num_experts, top_k, renormalize, weight_dtype, num_tokens == 1, pdl)
    launch(
        (triton.cdiv(num_tokens, launch.constexprs["BLOCK_T"]),),
        router_logits,
        weights,
        ids,
        num_tokens,
        router_logits.stride(0),
        **launch_options(pdl),
    )
    return weights, ids


@cache
def routing_launch(
    num_experts: int, top_k: int, renormalize: bool, weight_dtype, one_token: bool = False, pdl: bool = False
) -> KernelLaunch:
    experts_pad = triton.next_power_of_2(num_experts)
    constexprs = dict(
        NUM_EXPERTS=num_experts,
        EXPERTS_PAD=experts_pad,
        TOP_K=top_k,
        TOP_K_PAD=triton.next_power_of_2(top_k),
        BLOCK_T=1 if one_token else max(1, min(64, 2048 // experts_pad)),
        RENORMALIZE=renormalize,
        ROUND_WEIGHTS=round_code(weight_dtype),
        PDL=pdl,
    )
    name = f"select_experts E={num_experts} k={top_k}{' one token' if one_token else ''}"
    return KernelLaunch(name, _select_experts_kernel, constexprs, num_warps=1 if one_token else 4)


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
    launches = align_launches(num_local_experts, block_m, expert_map is not None, chunk)
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
def align_launches(num_local_experts: int, block_m: int, has_map: bool, chunk: int) -> dict:
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
