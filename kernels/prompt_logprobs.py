"""The row statistics of prompt logprobs in one read of the logits: per row of logits [R, V] (any
float dtype) and a token per row, the row's logsumexp, the number of entries at least as large as
the token's (its rank), the token's logit, and the k largest entries with their ids.

One program per (row, span of TILES x BLOCK entries) walks its span DEPTH tiles at a time and
keeps per-lane running values in registers: the lane's maximum, its sum of exp below that maximum, and
its count. Block-wide reductions are what cost (each is a round trip through shared memory), so
they happen once per span, not once per tile.

The top k needs no pass over the span: lane j sees the entries j, j + BLOCK, j + 2 BLOCK, ... of
the span, and the span's k largest entries all lie in the k lanes with the largest maxima (a lane
outside those has k lanes above it, so k larger entries). The program picks those k lanes, loads
their TILES entries each back (from cache) and takes the k largest of those k x TILES.

LogprobRows holds the spans' partials for every row of a step, filled a chunk of rows at a time
as the chunks' logits are made, and merges them once, a program per row. The torch
reference (kernels/reference.py) upcasts a float32 copy of the logits and reads them about five
times, more than the lm_head that made them once the vocabulary is large.
"""

from __future__ import annotations

import torch

from strata.kernels.reference import logprob_rows_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = ["LogprobRows", "logprob_rows", "logprob_rows_reference"]

BLOCK = 1024
MAX_TILES = 32  # tiles a span walks at most: enough spans per row to fill the GPU with few rows
DEPTH = 2  # tiles each load takes
NUM_WARPS = 4  # with the three above: the best of an H200 sweep (bench/RESULTS.md)
NUM_STAGES = 3
# Top counts the kernel is compiled for: a row's k is served by the next one up (fewer variants).
K_VARIANTS = (0, 1, 5, 20)

if triton is not None:

    @triton.jit
    def _take_tiles(x, hits, lane_max, lane_sum, lane_count):
        # A load of DEPTH tiles, x [DEPTH, BLOCK], into each lane's running maximum, sum of exp
        # below it, and count of entries at least the token's (hits).
        new_max = tl.maximum(lane_max, tl.max(x, axis=0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # lanes of -inf only: sum 0
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.sum(tl.exp(x - shift[None, :]), axis=0)
        return new_max, lane_sum, lane_count + tl.sum(hits.to(tl.int32), axis=0)

    @triton.jit(do_not_specialize=["first_row"])
    def _logprob_rows_kernel(
        logits_ptr,
        stride,
        targets_ptr,
        first_row,
        target_values_ptr,
        max_ptr,
        sum_ptr,
        count_ptr,
        top_values_ptr,
        top_ids_ptr,
        vocab,
        num_spans,
        BLOCK: tl.constexpr,
        TILES: tl.constexpr,
        DEPTH: tl.constexpr,
        K: tl.constexpr,
        K_PAD: tl.constexpr,
    ):
        # Row `row` of this chunk's logits and targets is row first_row + row of the partials.
        row = tl.program_id(0).to(tl.int64)
        span = tl.program_id(1)
        lanes = tl.arange(0, BLOCK)
        first = span * (TILES * BLOCK)
        base = logits_ptr + row * stride
        target = tl.load(base + tl.load(targets_ptr + row)).to(tl.float32)
        row += first_row
        if span == 0:
            tl.store(target_values_ptr + row, target)
        lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
        lane_sum = tl.zeros((BLOCK,), tl.float32)
        lane_count = tl.zeros((BLOCK,), tl.int32)
        # DEPTH tiles per load: several loads in flight per thread (one tile at a time waits on
        # each load's latency); their reduction along DEPTH stays within a thread's registers.
        # Only a row's last span reaches past the vocabulary: the others load unmasked.
        tiles = (tl.arange(0, DEPTH) * BLOCK)[:, None] + lanes[None, :]
        if first + TILES * BLOCK <= vocab:
            for t in range(0, TILES, DEPTH):
                x = tl.load(base + first + t * BLOCK + tiles).to(tl.float32)
                lane_max, lane_sum, lane_count = _take_tiles(x, x >= target, lane_max, lane_sum, lane_count)
        else:
            for t in range(0, TILES, DEPTH):
                cols = first + t * BLOCK + tiles
                valid = cols < vocab
                x = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32)
                lane_max, lane_sum, lane_count = _take_tiles(x, valid & (x >= target), lane_max, lane_sum, lane_count)
        out = row * num_spans + span
        m = tl.max(lane_max, axis=0)
        shift = tl.where(m == float("-inf"), 0.0, m)
        tl.store(max_ptr + out, m)
        tl.store(sum_ptr + out, tl.sum(lane_sum * tl.exp(lane_max - shift), axis=0))
        tl.store(count_ptr + out, tl.sum(lane_count, axis=0))
        if K > 0:
            # The K lanes of the largest maxima, then the K largest of their entries.
            slots = tl.arange(0, K_PAD)
            picked = tl.zeros((K_PAD,), tl.int32)
            for j in tl.static_range(K):
                _, lane = tl.max(lane_max, axis=0, return_indices=True, return_indices_tie_break_left=True)
                picked = tl.where(slots == j, lane, picked)
                lane_max = tl.where(lanes == lane, float("-inf"), lane_max)
            cols = first + tl.arange(0, TILES)[None, :] * BLOCK + picked[:, None]
            keep = (slots[:, None] < K) & (cols < vocab)
            values = tl.load(base + cols, mask=keep, other=float("-inf")).to(tl.float32)
            values = tl.reshape(values, (K_PAD * TILES,))
            cols = tl.reshape(cols, (K_PAD * TILES,))
            at = tl.arange(0, K_PAD * TILES)
            for j in tl.static_range(K):
                value, index = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
                tl.store(top_values_ptr + out * K + j, value)
                tl.store(top_ids_ptr + out * K + j, tl.sum(tl.where(at == index, cols, 0), axis=0))
                values = tl.where(at == index, float("-inf"), values)

    @triton.jit(do_not_specialize=["k"])
    def _merge_rows_kernel(
        max_ptr,
        sum_ptr,
        count_ptr,
        top_values_ptr,
        top_ids_ptr,
        log_norm_ptr,
        rank_ptr,
        out_values_ptr,
        out_ids_ptr,
        num_spans,
        k,
        SPANS: tl.constexpr,
        K: tl.constexpr,
        CANDIDATES: tl.constexpr,
    ):
        # One program per row: its spans' partials into the row's logsumexp, rank and top k.
        row = tl.program_id(0).to(tl.int64)
        spans = tl.arange(0, SPANS)
        real = spans < num_spans
        at = row * num_spans + spans
        maxima = tl.load(max_ptr + at, mask=real, other=float("-inf"))
        top = tl.max(maxima, axis=0)
        shift = tl.where(top == float("-inf"), 0.0, top)
        sums = tl.load(sum_ptr + at, mask=real, other=0.0)
        tl.store(log_norm_ptr + row, shift + tl.log(tl.sum(sums * tl.exp(maxima - shift), axis=0)))
        tl.store(rank_ptr + row, tl.sum(tl.load(count_ptr + at, mask=real, other=0).to(tl.int64), axis=0))
        if K > 0:
            cands = tl.arange(0, CANDIDATES)
            real = cands < num_spans * K
            values = tl.load(top_values_ptr + row * num_spans * K + cands, mask=real, other=float("-inf"))
            ids = tl.load(top_ids_ptr + row * num_spans * K + cands, mask=real, other=0)
            for j in tl.static_range(K):  # the variant's count; the row's own k are stored
                value, index = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
                tl.store(out_values_ptr + row * k + j, value, mask=j < k)
                picked = tl.sum(tl.where(cands == index, ids, 0), axis=0).to(tl.int64)
                tl.store(out_ids_ptr + row * k + j, picked, mask=j < k)
                values = tl.where(cands == index, float("-inf"), values)


class LogprobRows:
    """The partial statistics of `rows` rows of a `vocab`-wide vocabulary, top k (at most 20)."""

    def __init__(self, rows: int, vocab: int, k: int, device: torch.device):
        self.k, self.vocab = k, vocab
        self.variant = next(v for v in K_VARIANTS if v >= k)
        self.tiles_per_span = min(MAX_TILES, triton.next_power_of_2(triton.cdiv(vocab, BLOCK)))
        self.spans = triton.cdiv(vocab, self.tiles_per_span * BLOCK)
        f32, i32 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int32, device=device)
        self.target_values = torch.empty(rows, **f32)
        self.maxima = torch.empty((rows, self.spans), **f32)
        self.sums = torch.empty((rows, self.spans), **f32)
        self.counts = torch.empty((rows, self.spans), **i32)
        self.top_values = torch.empty((rows, self.spans * self.variant), **f32)
        self.top_ids = torch.empty((rows, self.spans * self.variant), **i32)

    def fill(self, logits: torch.Tensor, targets: torch.Tensor, start: int) -> None:
        """Rows start, start + 1, ... from logits [r, vocab] and their tokens."""
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        rows, vocab = logits.shape
        if vocab != self.vocab or start + rows > len(self.maxima):
            raise ValueError(f"logits {tuple(logits.shape)} from row {start} do not fit {tuple(self.maxima.shape)}")
        if not rows:
            return
        # The partials whole and the row offset apart: slices of them would start at addresses
        # of varying alignment, each a kernel variant of its own (Triton specialises pointers).
        _logprob_rows_kernel[(rows, self.spans)](
            logits,
            logits.stride(0),
            targets,
            start,
            self.target_values,
            self.maxima,
            self.sums,
            self.counts,
            self.top_values,
            self.top_ids,
            vocab,
            self.spans,
            BLOCK=BLOCK,
            TILES=self.tiles_per_span,
            DEPTH=min(DEPTH, self.tiles_per_span),
            K=self.variant,
            K_PAD=triton.next_power_of_2(max(self.variant, 1)),
            num_warps=NUM_WARPS,
            num_stages=NUM_STAGES,
        )

    def merge(self) -> tuple[torch.Tensor, ...]:
        """logprob_rows_reference's results (logsumexp, rank, the token's logit, top values,
        top ids) for every row, from one launch (a dozen small torch ops cost more host time than
        the row kernel takes on the device)."""
        rows, device = len(self.maxima), self.maxima.device
        log_norm = torch.empty(rows, dtype=torch.float32, device=device)
        ranks = torch.empty(rows, dtype=torch.int64, device=device)
        values = torch.empty((rows, self.k), dtype=torch.float32, device=device)
        ids = torch.empty((rows, self.k), dtype=torch.int64, device=device)
        if rows:
            _merge_rows_kernel[(rows,)](
                self.maxima,
                self.sums,
                self.counts,
                self.top_values,
                self.top_ids,
                log_norm,
                ranks,
                values,
                ids,
                self.spans,
                self.k,
                SPANS=triton.next_power_of_2(self.spans),
                K=self.variant,
                CANDIDATES=triton.next_power_of_2(max(self.spans * self.variant, 1)),
            )
        return log_norm, ranks, self.target_values, values, ids


def logprob_rows(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """logprob_rows_reference's results from one read of the logits."""
    stats = LogprobRows(logits.shape[0], logits.shape[1], k, logits.device)
    stats.fill(logits, targets, 0)
    return stats.merge()
