"""The row statistics of prompt logprobs in one read of the logits: per row of logits [R, V] (any
float dtype) and a token per row, the row's logsumexp, the number of entries at least as large as
the token's (its rank), the token's logit, and the k largest entries with their ids.

One program per (row, tile of BLOCK entries) reads its tile once and writes the tile's maximum,
its sum of exp below that maximum, its count, and its own k largest (k rounds of max and mask
in registers). LogprobRows holds those partials for every row of a step, filled a chunk of rows
at a time as the chunks' logits are made, and merges them once with a handful of torch ops. The
torch reference (kernels/reference.py) upcasts a float32 copy of the logits and reads them about
five times, more than the lm_head that made them once the vocabulary is large.
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

BLOCK = 2048
# Top counts the kernel is compiled for: a row's k is served by the next one up (fewer variants).
_K_VARIANTS = (0, 1, 2, 5, 10, 20)

if triton is not None:

    @triton.jit
    def _logprob_rows_kernel(
        logits_ptr,
        stride,
        targets_ptr,
        target_values_ptr,
        max_ptr,
        sum_ptr,
        count_ptr,
        top_values_ptr,
        top_ids_ptr,
        vocab,
        num_tiles,
        BLOCK: tl.constexpr,
        K: tl.constexpr,
    ):
        # Row `row` of this chunk's logits is row `row` of the partials (offset by the caller).
        row = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        offsets = tl.arange(0, BLOCK)
        cols = tile * BLOCK + offsets
        valid = cols < vocab
        base = logits_ptr + row * stride
        x = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32)
        target = tl.load(base + tl.load(targets_ptr + row)).to(tl.float32)
        if tile == 0:
            tl.store(target_values_ptr + row, target)
        out = row * num_tiles + tile
        m = tl.max(x, axis=0)
        shift = tl.where(m == float("-inf"), 0.0, m)  # a tile of -inf only: its sum is 0
        tl.store(max_ptr + out, m)
        tl.store(sum_ptr + out, tl.sum(tl.exp(x - shift), axis=0))
        tl.store(count_ptr + out, tl.sum((valid & (x >= target)).to(tl.int32), axis=0))
        for j in tl.static_range(K):
            value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            tl.store(top_values_ptr + out * K + j, value)
            tl.store(top_ids_ptr + out * K + j, tile * BLOCK + index)
            x = tl.where(offsets == index, float("-inf"), x)


class LogprobRows:
    """The partial statistics of `rows` rows of a `vocab`-wide vocabulary, top k (at most 20)."""

    def __init__(self, rows: int, vocab: int, k: int, device: torch.device):
        self.k, self.vocab = k, vocab
        self.variant = next(v for v in _K_VARIANTS if v >= k)
        self.tiles = triton.cdiv(vocab, BLOCK)
        f32, i32 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int32, device=device)
        self.target_values = torch.empty(rows, **f32)
        self.maxima = torch.empty((rows, self.tiles), **f32)
        self.sums = torch.empty((rows, self.tiles), **f32)
        self.counts = torch.empty((rows, self.tiles), **i32)
        self.top_values = torch.empty((rows, self.tiles * self.variant), **f32)
        self.top_ids = torch.empty((rows, self.tiles * self.variant), **i32)

    def fill(self, logits: torch.Tensor, targets: torch.Tensor, start: int) -> None:
        """Rows start, start + 1, ... from logits [r, vocab] and their tokens."""
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        rows, vocab = logits.shape
        if vocab != self.vocab or start + rows > len(self.maxima):
            raise ValueError(f"logits {tuple(logits.shape)} from row {start} do not fit {tuple(self.maxima.shape)}")
        if not rows:
            return
        end = start + rows
        _logprob_rows_kernel[(rows, self.tiles)](
            logits,
            logits.stride(0),
            targets,
            self.target_values[start:end],
            self.maxima[start:end],
            self.sums[start:end],
            self.counts[start:end],
            self.top_values[start:end],
            self.top_ids[start:end],
            vocab,
            self.tiles,
            BLOCK=BLOCK,
            K=self.variant,
            num_warps=8,
        )

    def merge(self) -> tuple[torch.Tensor, ...]:
        """logprob_rows_reference's results (logsumexp, rank, the token's logit, top values,
        top ids) for every row."""
        top = self.maxima.amax(dim=1, keepdim=True)
        shift = torch.where(top == float("-inf"), 0.0, top)
        log_norm = (shift + (self.sums * torch.exp(self.maxima - shift)).sum(dim=1, keepdim=True).log()).squeeze(1)
        ranks = self.counts.sum(dim=1, dtype=torch.int64)
        if not self.k:
            return log_norm, ranks, self.target_values, self.top_values[:, :0], self.top_ids[:, :0].long()
        values, picked = self.top_values.topk(self.k, dim=1)
        return log_norm, ranks, self.target_values, values, self.top_ids.gather(1, picked).long()


def logprob_rows(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """logprob_rows_reference's results from one read of the logits."""
    stats = LogprobRows(logits.shape[0], logits.shape[1], k, logits.device)
    stats.fill(logits, targets, 0)
    return stats.merge()
