"""Token sampling for the last pipeline stage, vectorised over the batch.

Per row: temperature scaling, then top-k, top-p, min-p, then a draw; greedy rows (temperature 0)
take the argmax of the raw logits. Every filter keeps a prefix of the tokens ranked by logit, so
the three of them reduce to one number per row: the smallest raw logit still allowed
(`keep_threshold`). Sampling is then Gumbel-max over the kept tokens,

    token = argmax_v  logits[v] / T + g(seed, position, v)     over logits[v] >= threshold,

with g a Gumbel variate derived from a keyed integer hash (counter-based: no generator state), so a
seeded row draws the same token whatever else shares its batch, in any order, on any number of
stages, after a restart, on CPU or CUDA.

On CUDA one Triton kernel fuses hash, noise, filter and argmax, reading the logits once; elsewhere
(and as its oracle) the same arithmetic runs as torch ops. Nothing here synchronises with the
host: everything data-dependent that needs a Python value (which filters are on, the largest k)
is decided from the host-side lists in `SamplingTensors.build`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from strata.kernels.gumbel_sampling import HAVE_TRITON, gumbel_argmax, gumbel_from_keys, gumbel_row_keys
from strata.sampling_rules import check_min_p, check_temperature, check_top_p, greedy_and_inverse_temperature
from strata.services.worker.device.host_to_device import upload

__all__ = ["Sampler", "SamplerOutput", "SamplingTensors", "keep_threshold", "sample_unfiltered"]

# ---------------------------------------------------------------------------------------------
# Per-step sampling settings.
# ---------------------------------------------------------------------------------------------


def _seed_bits(seeds) -> np.ndarray:
    """Seeds as int64 bit patterns, from int64 bits or unsigned 64-bit values."""
    if isinstance(seeds, Tensor):
        seeds = seeds.cpu().numpy()
    if isinstance(seeds, np.ndarray):
        if seeds.dtype == np.uint64:
            return seeds.reshape(-1).view(np.int64)
        if seeds.dtype.kind in "iu":
            return seeds.reshape(-1).astype(np.int64)
        raise ValueError(f"seeds must be integers, got {seeds.dtype}")
    # Python ints: numpy would turn values >= 2**63 into float64, so convert each exactly.
    return np.fromiter((int(s) & 0xFFFFFFFFFFFFFFFF for s in seeds), dtype=np.uint64).view(np.int64)


@dataclass
class SamplingTensors:
    """One row per sequence that samples this step; build() it from host-side lists.

    top_k / top_p / min_p hold the *effective* settings: greedy rows have every filter off, and
    top_k < 0 means off (0). The flags and max_top_k are host values, so the sampler decides
    which work to do without reading anything back from the device.
    """

    temperature: Tensor  # float32 [N]; 0 = greedy
    top_k: Tensor  # int32 [N]; 0 = off
    top_p: Tensor  # float32 [N]; 1 = off
    min_p: Tensor  # float32 [N]; 0 = off
    seeds: Tensor  # int64 [N], a 64-bit seed's bits
    positions: Tensor  # int64 [N], absolute index of the token being sampled
    num_logprobs: int  # largest top-logprob count asked by any row; -1: no row wants logprobs
    # Derived by build():
    greedy: Tensor  # bool [N]
    inv_temperature: Tensor  # float32 [N]; 1 on greedy rows
    min_p_offset: Tensor  # float32 [N]: T * log(min_p), the min-p cut below the max logit; -inf = off
    sample_rows: Tensor  # int64 [number of non-greedy rows]: their indices
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_top_k: int  # largest top_k over rows (0 when none)
    needs_full_sort: bool  # some row uses top-p without top-k: its candidates are the whole vocab

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def build(cls, temperature, top_k, top_p, min_p, seeds, positions, num_logprobs: int, device) -> SamplingTensors:
        arrays, flags = cls.prepare(temperature, top_k, top_p, min_p, seeds, positions, num_logprobs)
        return cls(**upload(arrays, torch.device(device)), **flags)

    @staticmethod
    def prepare(temperature, top_k, top_p, min_p, seeds, positions, num_logprobs: int) -> tuple[dict, dict]:
        """The host half of build(): (numpy arrays for the tensor fields, the host-side flags).
        The worker uploads the arrays together with its other per-step inputs, in one copy."""
        temperature = np.asarray(temperature, dtype=np.float32).reshape(-1)
        top_k = np.asarray(top_k, dtype=np.int64).reshape(-1)
        top_p = np.asarray(top_p, dtype=np.float32).reshape(-1)
        min_p = np.asarray(min_p, dtype=np.float32).reshape(-1)
        seeds = _seed_bits(seeds)
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        n = temperature.shape[0]
        if not all(a.shape[0] == n for a in (top_k, top_p, min_p, seeds, positions)):
            raise ValueError("sampling settings must all have one entry per row")
        check_temperature(temperature)  # each a ValueError naming the setting
        check_top_p(top_p)
        check_min_p(min_p)

        greedy, inv_temperature = greedy_and_inverse_temperature(temperature)
        sampled = ~greedy
        # Filters only matter on sampled rows; turning them off elsewhere avoids needless sorts.
        top_k = np.where(sampled & (top_k > 0), top_k, 0)
        top_p = np.where(sampled, top_p, np.float32(1.0))
        min_p = np.where(sampled, min_p, np.float32(0.0))
        temperature = np.where(greedy, np.float32(0.0), temperature)
        with np.errstate(divide="ignore", invalid="ignore"):
            min_p_offset = np.where(min_p > 0, temperature * np.log(min_p), -np.inf).astype(np.float32)
        sampled_rows = np.nonzero(sampled)[0].astype(np.int64)
        num_sampled = sampled_rows.shape[0]
        uses_top_p = top_p < 1
        arrays = {
            "temperature": temperature,
            "top_p": top_p,
            "min_p": min_p,
            "inv_temperature": inv_temperature,
            "min_p_offset": min_p_offset,
            "top_k": top_k.astype(np.int32),
            "seeds": seeds,
            "positions": positions,
            "sample_rows": sampled_rows,
            "greedy": greedy,
        }
        flags = dict(
            num_logprobs=int(num_logprobs),
            all_greedy=num_sampled == 0,
            any_greedy=num_sampled < n,
            any_top_k=bool((top_k > 0).any()),
            any_top_p=bool(uses_top_p.any()),
            any_min_p=bool((min_p > 0).any()),
            max_top_k=int(top_k.max(initial=0)),
            needs_full_sort=bool((uses_top_p & (top_k == 0)).any()),
        )
        return arrays, flags


@dataclass
class SamplerOutput:
    token_ids: Tensor  # int64 [N]
    logprobs: Tensor | None  # float32 [N]: log_softmax(raw logits) at the sampled token
    top_ids: Tensor | None  # int64 [N, K], K = num_logprobs: top tokens of the raw distribution
    top_logprobs: Tensor | None  # float32 [N, K]


# ---------------------------------------------------------------------------------------------
# Filters.
# ---------------------------------------------------------------------------------------------

_NEG_INF = float("-inf")


def keep_threshold(logits: Tensor, st: SamplingTensors, ranked: Tensor | None = None) -> Tensor | None:
    """Smallest raw logit each row may sample (float32 [N], -inf = no filter); None if no filter.

    Top-k keeps the k largest logits, top-p (on the top-k-renormalised, temperature-scaled
    distribution) the smallest prefix whose probability reaches top_p, min-p the tokens with
    p >= min_p * p_max. Each keeps a prefix of the tokens sorted by logit, so the kept set is the
    tokens at or above the largest of the three cut values (ties at the cut are kept).
    Thresholds are actual logit values (or max logit + T log min_p), so comparing raw logits
    against them is exact for top-k and top-p.

    ranked: optionally the caller's logits.topk(w) values (descending, w >= st.max_top_k), reused
    when no row needs the full sort.
    """
    if not (st.any_top_k or st.any_top_p or st.any_min_p):
        return None
    threshold = None
    if st.any_top_k or st.any_top_p:  # per row, its candidate logits in descending order
        if st.needs_full_sort:
            ranked = logits.sort(dim=-1, descending=True).values
        elif ranked is None:  # every filtered row has a top-k: its candidates are within the largest k
            ranked = logits.topk(min(st.max_top_k, logits.shape[-1]), dim=-1).values
        width = ranked.shape[-1]
        if st.any_top_k:
            k = st.top_k.to(torch.int64)
            kth = ranked.gather(1, (k.clamp(1, width) - 1).unsqueeze(1)).squeeze(1)
            threshold = torch.where(k > 0, kth, _NEG_INF)
        if st.any_top_p:
            candidates = ranked if threshold is None else ranked.masked_fill(ranked < threshold.unsqueeze(1), _NEG_INF)
            probs = torch.softmax(candidates * st.inv_temperature.unsqueeze(1), dim=-1)
            cumulative = probs.cumsum(dim=-1)
            # Keep rank r while the mass strictly before it is < top_p (rank 0 always).
            num_kept = 1 + (cumulative[:, :-1] < st.top_p.unsqueeze(1)).sum(dim=-1)
            cut = ranked.gather(1, (num_kept - 1).unsqueeze(1)).squeeze(1)
            cut = torch.where(st.top_p < 1, cut, _NEG_INF)
            threshold = cut if threshold is None else torch.maximum(threshold, cut)
    if st.any_min_p:
        max_logit = ranked[:, 0] if ranked is not None else logits.amax(dim=-1)
        cut = max_logit + st.min_p_offset  # -inf where min-p is off
        threshold = cut if threshold is None else torch.maximum(threshold, cut)
    return threshold


# ---------------------------------------------------------------------------------------------
# Gumbel-max draw: torch reference and fused Triton kernel. Both return (token_ids, log_norm),
# log_norm = logsumexp of the raw logits per row when asked for (logprobs), else None.
# ---------------------------------------------------------------------------------------------


def _draw_torch(
    logits: Tensor, st: SamplingTensors, threshold: Tensor | None, want_log_norm: bool
) -> tuple[Tensor, Tensor | None]:
    log_norm = torch.logsumexp(logits, dim=-1) if want_log_norm else None
    if st.all_greedy:
        return logits.argmax(dim=-1), log_norm
    rows = st.sample_rows if st.any_greedy else None  # draw noise only for rows that sample
    sub_logits, inv_t = logits, st.inv_temperature
    seeds, positions = st.seeds, st.positions
    if rows is not None:
        sub_logits, inv_t = logits.index_select(0, rows), inv_t.index_select(0, rows)
        seeds, positions = seeds.index_select(0, rows), positions.index_select(0, rows)
        threshold = threshold.index_select(0, rows) if threshold is not None else None
    key_a, key_b = gumbel_row_keys(seeds, positions)
    perturbed = sub_logits * inv_t.unsqueeze(1) + gumbel_from_keys(key_a, key_b, logits.shape[-1])
    if threshold is not None:
        perturbed = perturbed.masked_fill(sub_logits < threshold.unsqueeze(1), _NEG_INF)
    drawn = perturbed.argmax(dim=-1)
    if rows is None:
        return drawn, log_norm
    return logits.argmax(dim=-1).index_copy(0, rows, drawn), log_norm


def _draw_triton(
    logits: Tensor, st: SamplingTensors, threshold: Tensor | None, want_log_norm: bool
) -> tuple[Tensor, Tensor | None]:
    return gumbel_argmax(logits, st.seeds, st.positions, st.inv_temperature, st.greedy, threshold, want_log_norm)


def sample_unfiltered(
    logits: Tensor,
    seeds: Tensor,
    positions: Tensor,
    inv_temperature: Tensor,
    greedy: Tensor,
    store: tuple[Tensor, Tensor] | None = None,
    skip: Tensor | None = None,
) -> Tensor:
    """The tokens Sampler draws for rows with no top-k/top-p/min-p filter and no logprobs, from
    device tensors alone (no host-side flags), so that a CUDA graph can capture the draw: greedy
    rows take the first argmax, as logits.argmax does, the others the seeded Gumbel-max draw.
    inv_temperature and greedy as SamplingTensors holds them; store (out, rows): also
    out[rows] = tokens, in the same launch; skip (uint8): rows left alone (no token, no store).
    Needs Triton on CUDA."""
    return gumbel_argmax(logits, seeds, positions, inv_temperature, greedy, None, False, store, skip=skip)[0]


# ---------------------------------------------------------------------------------------------
# The sampler.
# ---------------------------------------------------------------------------------------------


class Sampler:
    """Samples one token per row of logits [N, V], on the logits' device.

    backend: "auto" (Triton on CUDA when available, else torch), "torch" or "triton".
    """

    def __init__(self, backend: str = "auto"):
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"unknown sampler backend {backend!r}")
        if backend == "triton" and not HAVE_TRITON:
            raise ValueError("the triton sampler backend needs triton installed")
        self.backend = backend

    def _use_triton(self, logits: Tensor) -> bool:
        if self.backend == "auto":
            return HAVE_TRITON and logits.is_cuda
        return self.backend == "triton"

    @torch.inference_mode()
    def __call__(self, logits: Tensor, st: SamplingTensors) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != st.num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {st.num_rows} sampling rows")
        want_logprobs = st.num_logprobs >= 0
        if st.all_greedy and not want_logprobs:
            return SamplerOutput(logits.argmax(dim=-1), None, None, None)  # exact in any dtype
        use_triton = self._use_triton(logits) and logits.shape[0] > 0
        needs_torch_ops = want_logprobs or st.any_top_k or st.any_top_p or st.any_min_p
        if not use_triton or needs_torch_ops:
            logits = logits.float()  # the fused kernel upcasts as it reads; torch ops need float32
        # One torch.topk serves both the top-k/top-p cut and the top logprobs. (A per-chunk
        # tl.topk first stage measured slower than torch.topk.)
        filter_width = 0
        if not st.all_greedy and (st.any_top_k or st.any_top_p) and not st.needs_full_sort:
            filter_width = st.max_top_k
        width = min(max(filter_width, st.num_logprobs), logits.shape[-1])
        ranked = logits.topk(width, dim=-1) if width > 0 and logits.shape[0] > 0 else None
        threshold = None
        if not st.all_greedy:
            threshold = keep_threshold(logits, st, ranked[0] if ranked is not None else None)
        draw = _draw_triton if use_triton else _draw_torch
        token_ids, log_norm = draw(logits, st, threshold, want_logprobs)
        if not want_logprobs:
            return SamplerOutput(token_ids, None, None, None)
        # x - logsumexp(x) is log_softmax without materialising [N, V].
        logprobs = logits.gather(1, token_ids.unsqueeze(1)).squeeze(1) - log_norm
        k = max(st.num_logprobs, 0)
        if ranked is None:  # k == 0 or no rows
            top_values = logits.new_empty((logits.shape[0], k))
            top_ids = torch.empty((logits.shape[0], k), device=logits.device, dtype=torch.int64)
        else:
            top_values, top_ids = ranked[0][:, :k], ranked[1][:, :k]
        return SamplerOutput(token_ids, logprobs, top_ids, top_values - log_norm.unsqueeze(1))
