"""Sampling on a tensor-parallel rank's slice of the logits, exact: every rank draws the token the
unsharded Sampler draws from the whole row (sampler.py), bit for bit on the same logits.

The noise of a draw is a function of (seed, position, global vocabulary index), so a rank
computes exactly the perturbed values the whole row has at its columns. Each rank reduces its
slice to one int64 per row, its best (value, global index) packed so that integer order is
torch.argmax's order (the larger value, then the smaller index: kernels/gumbel_sampling.py's
pack_draw_keys), and one all-reduce (max) of those keys gives every rank the row's token.

What each mode needs beyond that, the cheapest exact way (a rank's work is always on its slice):

| mode                              | extra collectives                     | why exact                     |
| greedy, temperature               | none                                  | max and first index           |
| min-p (without top-k/top-p)       | all-reduce (max) of the slice maxima  | the row's max logit, exact    |
| top-k, top-k with top-p           | all-gather of each slice's top w keys | the merged top w are the row's|
|                                   |                                       | top w values, in order: the   |
|                                   |                                       | same tensor keep_threshold    |
|                                   |                                       | ranks at T = 1                |
| logprobs (sampled and top n)      | all-gather of (max, sum of exp), an   | tokens exact; values within   |
|                                   | all-reduce (max) of the token's logit | float32 rounding of T = 1's   |
| top-p without top-k, a top-k past | all-gather of the whole rows, then    | the same rows as T = 1's      |
| a slice's width, penalties,       | the unsharded Sampler (and controls)  |                               |
| grammars                          |                                       |                               |

Which path a step takes is decided from host flags (SamplingTensors, the sequence table), the
same on every rank, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from strata.kernels.gumbel_sampling import (
    HAVE_TRITON,
    gumbel_argmax,
    gumbel_from_keys,
    gumbel_row_keys,
    pack_draw_keys,
    unpack_draw_tokens,
)
from strata.services.worker.sampling.sampler import Sampler, SamplerOutput, SamplingTensors, keep_threshold
from strata.services.worker.tensor_parallel.vocab import VocabShard

_NEG_INF = float("-inf")
_LOWEST_KEY = torch.iinfo(torch.int64).min  # a slice with no column: loses to every key


def unpack_draw_values(keys: Tensor) -> Tensor:
    """The float32 values of pack_draw_keys' keys (NaN comes back as NaN)."""
    ordered = (keys >> 32).to(torch.int32)
    bits = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return bits.view(torch.float32)


def draw_keys_reference(
    logits: Tensor, st: SamplingTensors, threshold: Tensor | None, vocab_offset: int, rows: Tensor | None = None
) -> Tensor:
    """Torch reference of a slice's draw: per row the packed key of the best value (greedy rows:
    the raw logit; others: logit / T + Gumbel noise of the global index, over logits at or above
    the threshold), as Sampler's torch draw computes it on the whole row. rows: the rows of the
    settings the logits' rows are (default: all)."""
    n, width = logits.shape
    if width == 0:
        return torch.full((n,), _LOWEST_KEY, dtype=torch.int64, device=logits.device)
    pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
    greedy = pick(st.greedy)
    key_a, key_b = gumbel_row_keys(pick(st.seeds), pick(st.positions))
    perturbed = logits * pick(st.inv_temperature).unsqueeze(1) + gumbel_from_keys(key_a, key_b, width, vocab_offset)
    if threshold is not None:
        perturbed = perturbed.masked_fill(logits < pick(threshold).unsqueeze(1), _NEG_INF)
    values = torch.where(greedy.unsqueeze(1), logits, perturbed)
    index = values.argmax(dim=-1)
    best = values.gather(1, index.unsqueeze(1)).squeeze(1)
    return pack_draw_keys(best, index + vocab_offset)


def draw_keys_triton(logits: Tensor, st: SamplingTensors, threshold: Tensor | None, vocab_offset: int) -> Tensor:
    keys = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[1] == 0:
        return keys.fill_(_LOWEST_KEY)
    gumbel_argmax(
        logits,
        st.seeds,
        st.positions,
        st.inv_temperature,
        st.greedy,
        threshold,
        False,
        vocab_offset=vocab_offset,
        keys=keys,
    )
    return keys


class ShardedSampler:
    """The Sampler over rank `vocab.rank`'s slice [N, vocab.local] of the logits (columns past
    vocab.valid are padding). group: the stage's TensorParallelGroup."""

    def __init__(self, group, vocab: VocabShard, backend: str = "auto"):
        self.group, self.vocab = group, vocab
        self.sampler = Sampler(backend)  # the whole rows' path, and the backend choice

    # ------------------------------------------------------------ routing

    def needs_whole_rows(self, st: SamplingTensors) -> bool:
        """Whether the step's draw needs every row's whole logits (all_gather_rows): top-p
        without top-k, or a top-k (or top-logprob count) wider than a slice."""
        if st.all_greedy and st.num_logprobs < 0:
            return False
        if not st.all_greedy and st.needs_full_sort:
            return True
        return self._width(st) > self.vocab.local  # (the same on every rank: never `valid`)

    def _width(self, st: SamplingTensors) -> int:
        """The ranked width the unsharded Sampler takes (its filter width or top logprobs)."""
        filter_width = st.max_top_k if not st.all_greedy and (st.any_top_k or st.any_top_p) else 0
        return min(max(filter_width, st.num_logprobs), self.vocab.vocab_size)

    def all_gather_rows(self, logits: Tensor) -> Tensor:
        """The whole rows [N, V]: every rank's slice, side by side, padding dropped."""
        n = logits.shape[0]
        slices = self.group.all_gather(logits.contiguous())  # [T, N, local]
        return slices.permute(1, 0, 2).reshape(n, -1)[:, : self.vocab.vocab_size]

    # ------------------------------------------------------------ the draw

    def __call__(self, logits: Tensor, st: SamplingTensors) -> SamplerOutput:
        """The tokens (and logprobs) the Sampler draws from the whole rows, from this rank's
        slice (or from the whole rows, gathered, where needs_whole_rows says so)."""
        if logits.dim() != 2 or logits.shape[0] != st.num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {st.num_rows} sampling rows")
        if self.needs_whole_rows(st):
            return self.sampler(self.all_gather_rows(logits), st)
        vocab = self.vocab
        x = logits[:, : vocab.valid]
        want_logprobs = st.num_logprobs >= 0
        use_triton = self.sampler._use_triton(logits) and logits.shape[0] > 0
        if not use_triton or want_logprobs or st.any_top_k or st.any_top_p or st.any_min_p:
            x = x.float()
        width = self._width(st)
        ranked = self._merged_top(x, width) if width > 0 and x.shape[0] > 0 else None
        threshold = None
        if not st.all_greedy and (st.any_top_k or st.any_top_p or st.any_min_p):
            if ranked is None:  # min-p alone: the row's max logit is all it needs
                top = x.amax(dim=-1) if x.shape[1] else x.new_full((x.shape[0],), _NEG_INF)
                ranked = (self.group.all_reduce_max_(top).unsqueeze(1), None)
            threshold = keep_threshold(None, st, ranked[0])
        draw = draw_keys_triton if use_triton else draw_keys_reference
        keys = self.group.all_reduce_max_(draw(x, st, threshold, vocab.offset))
        token_ids = unpack_draw_tokens(keys)
        if not want_logprobs:
            return SamplerOutput(token_ids, None, None, None)
        log_norm = self._log_norm(x)
        owned = (token_ids >= vocab.offset) & (token_ids < vocab.offset + vocab.valid)
        local = (token_ids - vocab.offset).clamp(0, max(vocab.valid - 1, 0)).unsqueeze(1)
        mine = x.gather(1, local).squeeze(1) if vocab.valid else x.new_full((x.shape[0],), _NEG_INF)
        chosen = self.group.all_reduce_max_(torch.where(owned, mine, _NEG_INF))
        k = max(st.num_logprobs, 0)
        if ranked is None or ranked[1] is None:
            top_values = x.new_empty((x.shape[0], k))
            top_ids = torch.empty((x.shape[0], k), device=x.device, dtype=torch.int64)
        else:
            top_values, top_ids = ranked[0][:, :k], ranked[1][:, :k]
        return SamplerOutput(token_ids, chosen - log_norm, top_ids, top_values - log_norm.unsqueeze(1))

    def _merged_top(self, x: Tensor, width: int) -> tuple[Tensor, Tensor]:
        """The rows' top `width` (values descending, ids; equal values by smaller id) from each
        slice's top `width`, merged after one all-gather of their packed keys: the same values,
        in the same order, as the whole row's topk."""
        n, valid = x.shape
        take = min(width, valid)
        if take:
            values, index = x.topk(take, dim=-1)
            keys = pack_draw_keys(values, index + self.vocab.offset)
        else:
            keys = torch.empty((n, 0), dtype=torch.int64, device=x.device)
        if take < width:  # a slice narrower than the width: its missing entries lose every merge
            keys = torch.cat([keys, keys.new_full((n, width - take), _LOWEST_KEY)], dim=1)
        merged = self.group.all_gather(keys).permute(1, 0, 2).reshape(n, -1).topk(width, dim=-1).values
        return unpack_draw_values(merged), unpack_draw_tokens(merged)

    def _log_norm(self, x: Tensor) -> Tensor:
        """logsumexp of the whole rows' raw logits, from each slice's (max, sum of exp)."""
        n = x.shape[0]
        if x.shape[1]:
            top = x.amax(dim=-1)
            shift = torch.where(torch.isinf(top) & (top < 0), 0.0, top)
            total = torch.exp(x - shift.unsqueeze(1)).sum(dim=-1)
        else:
            top = shift = x.new_full((n,), _NEG_INF)
            total = x.new_zeros(n)
        parts = self.group.all_gather(torch.stack([top, total], dim=1))  # [T, N, 2]
        maxes, sums = parts[..., 0], parts[..., 1]
        row_max = maxes.amax(dim=0)
        shift = torch.where(torch.isinf(row_max) & (row_max < 0), 0.0, row_max)
        scaled = torch.where(torch.isinf(maxes) & (maxes < 0), 0.0, sums * torch.exp(maxes - shift))
        return shift + torch.log(scaled.sum(dim=0))

    # ------------------------------------------------------------ prompt logprobs

    def logprob_rows(self, logits: Tensor, targets: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Prompt logprobs' statistics of whole rows from this rank's slice [R, local] of their
        raw logits: (logsumexp [R], rank [R]: tokens whose logit is at least the target's, the
        target's logit [R], the top k logits [R, k] and their ids), each rank's slice reduced
        and the slices combined: the logsumexps from each slice's (max, sum of exp), the target
        from the slice that holds it, the ranks summed, the top k merged from each slice's."""
        vocab = self.vocab
        x = logits[:, : vocab.valid].float()
        owned = (targets >= vocab.offset) & (targets < vocab.offset + vocab.valid)
        local = (targets - vocab.offset).clamp(0, max(vocab.valid - 1, 0)).unsqueeze(1)
        mine = x.gather(1, local).squeeze(1) if vocab.valid else x.new_full((x.shape[0],), _NEG_INF)
        target = self.group.all_reduce_max_(torch.where(owned, mine, _NEG_INF))
        ranks = self.group.all_reduce_((x >= target.unsqueeze(1)).sum(dim=1, dtype=torch.int64))
        log_norm = self._log_norm(x)
        if k > 0:
            top_values, top_ids = self._merged_top(x, min(k, vocab.vocab_size))
        else:
            top_values = x.new_empty((x.shape[0], 0))
            top_ids = torch.empty((x.shape[0], 0), dtype=torch.int64, device=x.device)
        return log_norm, ranks, target, top_values, top_ids

    # ------------------------------------------------------------ in a decode graph

    def draw_unfiltered(
        self,
        logits: Tensor,
        seeds: Tensor,
        positions: Tensor,
        inv_temperature: Tensor,
        greedy: Tensor,
        store: tuple[Tensor, Tensor] | None = None,
        skip: Tensor | None = None,
    ) -> Tensor:
        """sample_unfiltered (sampler.py) on this rank's slice: the packed draw, its all-reduce,
        then the store (every rank keeps the same tokens). Needs Triton on CUDA; capturable."""
        keys = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        if self.vocab.valid:
            gumbel_argmax(
                logits[:, : self.vocab.valid],
                seeds,
                positions,
                inv_temperature,
                greedy,
                None,
                False,
                vocab_offset=self.vocab.offset,
                keys=keys,
            )
        else:
            keys.fill_(_LOWEST_KEY)
        tokens = unpack_draw_tokens(self.group.all_reduce_max_(keys))
        if store is not None:
            out, rows = store
            kept = tokens if skip is None else torch.where(skip.bool(), out[rows], tokens)
            out[rows] = kept
        return tokens


__all__ = ["ShardedSampler", "draw_keys_reference", "draw_keys_triton", "unpack_draw_values", "HAVE_TRITON"]
