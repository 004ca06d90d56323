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

try:  # Triton is optional: CPU-only installs sample with torch ops.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

__all__ = [
    "GREEDY_EPSILON",
    "Sampler",
    "SamplerOutput",
    "SamplingTensors",
    "gumbel_noise",
    "keep_threshold",
    "sampling_logits",
    "uniform_noise",
]

# Temperatures below this are greedy (as in vLLM): dividing by them would overflow.
GREEDY_EPSILON = 1e-5

# ---------------------------------------------------------------------------------------------
# Counter-based noise.
#
# All integer work holds 32-bit values in int64 and masks after each multiply. The multipliers
# are below 2**31, so a product with a 32-bit value never leaves int64's range: no overflow
# anywhere, hence bit-identical results on every device. The Triton kernel does the same
# arithmetic in uint32, where wrapping is the definition.
# ---------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF
# A 32-bit finaliser found by Chris Wellons' hash-prospector (xorshift-multiply, low bias).
_MIX_MUL_1 = 0x21F0AAAD
_MIX_MUL_2 = 0x735A2D97
# 2**32 / golden ratio, reduced below 2**31: spreads consecutive vocab ids before mixing.
_VOCAB_STRIDE = 0x61C88647
# Two hash lanes from different initial states give each (seed, position, salt, domain) a
# 64-bit key. Every constant is below 2**31 so Triton reads it as a plain 32-bit literal.
_LANE_A_INIT = 0x243F6A88
_LANE_B_INIT = 0x13198A2E
# Domain words keep Gumbel noise and per-row uniforms independent even for equal salts.
_DOMAIN_GUMBEL = 0x47554D42
_DOMAIN_UNIFORM = 0x554E4946
_TWO_POW_M24 = 2.0**-24


def _mix32(x):
    """Bijective 32-bit avalanche mix of values in [0, 2**32) held in int64 tensors."""
    x = x ^ (x >> 16)  # a new array: the in-place steps below never touch the caller's
    x *= _MIX_MUL_1
    x &= _M32
    x ^= x >> 15
    x *= _MIX_MUL_2
    x &= _M32
    x ^= x >> 15
    return x


def _row_keys(seeds: Tensor, positions: Tensor, salt: Tensor | int, domain: int) -> tuple[Tensor, Tensor]:
    """(key_a, key_b): two 32-bit words keying a row's noise, from int64 seeds/positions/salt.

    The two lanes absorb the same six words from different initial states (the Triton kernel
    repeats this per row, _row_keys_tl).
    """
    seeds, positions = torch.broadcast_tensors(seeds, positions)
    words = ((positions >> 32) & _M32, salt & _M32, domain)
    state = torch.stack(((seeds & _M32) ^ _LANE_A_INIT, (seeds & _M32) ^ _LANE_B_INIT))
    state = _mix32(state)
    state = _mix32(state ^ ((seeds >> 32) & _M32))
    state = _mix32(state ^ (positions & _M32))
    for word in words:  # the remaining words, not a per-token loop
        state = _mix32(state ^ word)
    return state[0], state[1]


def _element_hash(key_a, key_b, index):
    """32 random bits for (row key, index); key_* and index broadcast (int64 values < 2**32)."""
    h = _mix32((index * _VOCAB_STRIDE + key_a) & _M32)
    return _mix32(h ^ key_b)


def _uniform_from_hash(h: Tensor) -> Tensor:
    """The top 24 bits as a float32 in (0, 1): m / 2**24, m = 0 folded onto 1 (never 0 or 1)."""
    return (h >> 8).clamp_min(1).to(torch.float32) * _TWO_POW_M24


def _gumbel_from_keys(key_a: Tensor, key_b: Tensor, vocab_size: int) -> Tensor:
    """Gumbel noise [..., V] for rows keyed by key_a/key_b of shape [...]."""
    index = torch.arange(vocab_size, device=key_a.device, dtype=torch.int64)
    u = _uniform_from_hash(_element_hash(key_a.unsqueeze(-1), key_b.unsqueeze(-1), index))
    return -torch.log(-torch.log(u))


def _as_int64_tensor(x, device=None) -> Tensor:
    if isinstance(x, Tensor):
        return x.to(device=device if device is not None else x.device, dtype=torch.int64)
    return torch.as_tensor(np.asarray(x, dtype=np.int64), device=device)


def gumbel_noise(seeds, positions, vocab_size: int, salt: int | Tensor = 0) -> Tensor:
    """Standard Gumbel noise float32 [..., vocab_size], a pure function of (seed, position, salt, index).

    seeds (int64 bits of a 64-bit seed), positions and salt broadcast to the row shape [...].
    The sampler uses salt 0; other consumers (e.g. speculative resampling) pick another salt to
    draw independent noise for the same position.
    """
    seeds = _as_int64_tensor(seeds)
    positions = _as_int64_tensor(positions, seeds.device)
    salt = _as_int64_tensor(salt, seeds.device)
    key_a, key_b = _row_keys(seeds, positions, salt, _DOMAIN_GUMBEL)
    return _gumbel_from_keys(key_a, key_b, vocab_size)


def uniform_noise(seeds, positions, salt: int | Tensor = 0) -> Tensor:
    """One float32 in (0, 1) per row (24 random bits), a pure function of (seed, position, salt).

    Independent of gumbel_noise for any salt. Meant for accept/reject tests.
    """
    seeds = _as_int64_tensor(seeds)
    positions = _as_int64_tensor(positions, seeds.device)
    salt = _as_int64_tensor(salt, seeds.device)
    key_a, key_b = _row_keys(seeds, positions, salt, _DOMAIN_UNIFORM)
    return _uniform_from_hash(_element_hash(key_a, key_b, 0))


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
    def build(cls, temperature, top_k, top_p, min_p, seeds, positions, num_logprobs: int,
              device) -> "SamplingTensors":
        temperature = np.asarray(temperature, dtype=np.float32).reshape(-1)
        top_k = np.asarray(top_k, dtype=np.int64).reshape(-1)
        top_p = np.asarray(top_p, dtype=np.float32).reshape(-1)
        min_p = np.asarray(min_p, dtype=np.float32).reshape(-1)
        seeds = _seed_bits(seeds)
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        n = temperature.shape[0]
        if not all(a.shape[0] == n for a in (top_k, top_p, min_p, seeds, positions)):
            raise ValueError("sampling settings must all have one entry per row")
        if not np.all(temperature >= 0):  # also rejects NaN
            raise ValueError("temperature must be >= 0")
        if not np.all((top_p > 0) & (top_p <= 1)):
            raise ValueError("top_p must be in (0, 1]")
        if not np.all((min_p >= 0) & (min_p <= 1)):
            raise ValueError("min_p must be in [0, 1]")

        greedy = temperature < GREEDY_EPSILON
        sampled = ~greedy
        # Filters only matter on sampled rows; turning them off elsewhere avoids needless sorts.
        top_k = np.where(sampled & (top_k > 0), top_k, 0)
        top_p = np.where(sampled, top_p, np.float32(1.0))
        min_p = np.where(sampled, min_p, np.float32(0.0))
        temperature = np.where(greedy, np.float32(0.0), temperature)
        inv_temperature = np.float32(1.0) / np.where(greedy, np.float32(1.0), temperature)
        with np.errstate(divide="ignore", invalid="ignore"):
            min_p_offset = np.where(min_p > 0, temperature * np.log(min_p), -np.inf)
        sample_rows = np.zeros(n, dtype=np.int64)  # padded to n so it rides in the same copy
        num_sampled = int(sampled.sum())
        sample_rows[:num_sampled] = np.nonzero(sampled)[0]

        # Two host-to-device copies for the whole struct.
        floats = torch.from_numpy(np.stack(
            [temperature, top_p, min_p, inv_temperature, min_p_offset]).astype(np.float32)).to(device)
        ints = torch.from_numpy(np.stack(
            [top_k, seeds, positions, greedy.astype(np.int64), sample_rows])).to(device)
        uses_top_p = top_p < 1
        return cls(
            temperature=floats[0], top_p=floats[1], min_p=floats[2], inv_temperature=floats[3],
            min_p_offset=floats[4],
            top_k=ints[0].to(torch.int32), seeds=ints[1], positions=ints[2], greedy=ints[3].bool(),
            sample_rows=ints[4, :num_sampled],
            num_logprobs=int(num_logprobs),
            all_greedy=num_sampled == 0,
            any_greedy=num_sampled < n,
            any_top_k=bool((top_k > 0).any()),
            any_top_p=bool(uses_top_p.any()),
            any_min_p=bool((min_p > 0).any()),
            max_top_k=int(top_k.max(initial=0)),
            needs_full_sort=bool((uses_top_p & (top_k == 0)).any()),
        )


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


def sampling_logits(logits: Tensor, st: SamplingTensors) -> Tensor:
    """The logits a sampled row draws from: logits / T, filtered tokens at -inf.

    softmax of a row is its sampling distribution. Greedy rows come back raw (they take the
    argmax). Materialises [N, V]: for consumers such as speculative verification, not the
    sampler's own path.
    """
    logits = logits.float()
    scaled = logits * st.inv_temperature.unsqueeze(1)
    threshold = keep_threshold(logits, st)
    if threshold is not None:
        scaled = scaled.masked_fill(logits < threshold.unsqueeze(1), _NEG_INF)
    return scaled


# ---------------------------------------------------------------------------------------------
# Gumbel-max draw: torch reference and fused Triton kernel. Both return (token_ids, log_norm),
# log_norm = logsumexp of the raw logits per row when asked for (logprobs), else None.
# ---------------------------------------------------------------------------------------------


def _draw_torch(logits: Tensor, st: SamplingTensors, threshold: Tensor | None,
                want_log_norm: bool) -> tuple[Tensor, Tensor | None]:
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
    key_a, key_b = _row_keys(seeds, positions, 0, _DOMAIN_GUMBEL)
    perturbed = sub_logits * inv_t.unsqueeze(1) + _gumbel_from_keys(key_a, key_b, logits.shape[-1])
    if threshold is not None:
        perturbed = perturbed.masked_fill(sub_logits < threshold.unsqueeze(1), _NEG_INF)
    drawn = perturbed.argmax(dim=-1)
    if rows is None:
        return drawn, log_norm
    return logits.argmax(dim=-1).index_copy(0, rows, drawn), log_norm


if triton is not None:

    @triton.jit
    def _mix32_tl(x):
        x ^= x >> 16
        x *= 0x21F0AAAD
        x ^= x >> 15
        x *= 0x735A2D97
        x ^= x >> 15
        return x

    @triton.jit
    def _row_keys_tl(seed, position):
        """_row_keys for one row (salt 0, Gumbel domain); seed and position are int64 scalars."""
        seed_lo = seed.to(tl.uint32)
        key_a = _mix32_tl(seed_lo ^ 0x243F6A88)
        key_b = _mix32_tl(seed_lo ^ 0x13198A2E)
        word = (seed >> 32).to(tl.uint32)
        key_a = _mix32_tl(key_a ^ word)
        key_b = _mix32_tl(key_b ^ word)
        word = position.to(tl.uint32)
        key_a = _mix32_tl(key_a ^ word)
        key_b = _mix32_tl(key_b ^ word)
        word = (position >> 32).to(tl.uint32)
        key_a = _mix32_tl(key_a ^ word)
        key_b = _mix32_tl(key_b ^ word)
        key_a = _mix32_tl(key_a)  # salt 0
        key_b = _mix32_tl(key_b)
        key_a = _mix32_tl(key_a ^ 0x47554D42)  # _DOMAIN_GUMBEL
        key_b = _mix32_tl(key_b ^ 0x47554D42)
        return key_a, key_b

    @triton.jit
    def _gumbel_argmax_kernel(
        logits_ptr, row_stride, seeds_ptr, positions_ptr, inv_temp_ptr, greedy_ptr, threshold_ptr,
        best_val_ptr, best_idx_ptr, max_ptr, sum_exp_ptr, vocab_size, num_splits,
        CHUNK: tl.constexpr, BLOCK: tl.constexpr, HAS_THRESHOLD: tl.constexpr, LOG_NORM: tl.constexpr,
    ):
        # Program (row, split) scans logits[row, split*CHUNK : (split+1)*CHUNK] once and writes
        # its best perturbed value and index (plus max and sum of exp of the raw logits when
        # LOG_NORM); a few torch ops on [N, splits] combine the splits without a host sync.
        row = tl.program_id(0)
        split = tl.program_id(1)
        key_a, key_b = _row_keys_tl(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))
        inv_t = tl.load(inv_temp_ptr + row)
        greedy = tl.load(greedy_ptr + row)
        threshold = float("-inf")
        if HAS_THRESHOLD:
            threshold = tl.load(threshold_ptr + row)
        row_ptr = logits_ptr + row.to(tl.int64) * row_stride
        start = split * CHUNK
        # Per lane running best: strict '>' keeps each lane's first maximum.
        best_vals = tl.full((BLOCK,), float("-inf"), tl.float32)
        best_cols = tl.full((BLOCK,), 2147483647, tl.int32)
        run_max = tl.full((), float("-inf"), tl.float32)
        run_sum = tl.full((), 0.0, tl.float32)
        for offset in range(0, CHUNK, BLOCK):
            cols = start + offset + tl.arange(0, BLOCK)
            in_vocab = cols < vocab_size
            x = tl.load(row_ptr + cols, mask=in_vocab, other=float("-inf")).to(tl.float32)
            val = x
            if greedy == 0:
                h = _mix32_tl(cols.to(tl.uint32) * 0x61C88647 + key_a)
                h = _mix32_tl(h ^ key_b)
                u = tl.maximum((h >> 8).to(tl.float32), 1.0) * 5.9604644775390625e-08  # 2**-24
                val = x * inv_t - tl.log(-tl.log(u))
                if HAS_THRESHOLD:
                    val = tl.where(x >= threshold, val, float("-inf"))
            val = tl.where(in_vocab, val, float("-inf"))
            better = val > best_vals
            best_vals = tl.where(better, val, best_vals)
            best_cols = tl.where(better, cols, best_cols)
            if LOG_NORM:
                new_max = tl.maximum(run_max, tl.max(x, axis=0))
                shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # all -inf so far
                run_sum = run_sum * tl.exp(run_max - shift) + tl.sum(tl.exp(x - shift), axis=0)
                run_max = new_max
        best = tl.max(best_vals, axis=0)
        # First maximum across lanes; a row (split) with nothing above -inf reports its start.
        best_col = tl.min(tl.where(best_vals == best, best_cols, 2147483647), axis=0)
        best_col = tl.where(best == float("-inf"), start, best_col)
        tl.store(best_val_ptr + row * num_splits + split, best)
        tl.store(best_idx_ptr + row * num_splits + split, best_col)
        if LOG_NORM:
            tl.store(max_ptr + row * num_splits + split, run_max)
            tl.store(sum_exp_ptr + row * num_splits + split, run_sum)


_TRITON_BLOCK = 1024
_TRITON_CHUNK = 8192
_TRITON_NUM_WARPS = 4


def _draw_triton(logits: Tensor, st: SamplingTensors, threshold: Tensor | None,
                 want_log_norm: bool) -> tuple[Tensor, Tensor | None]:
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab = logits.shape
    chunk = min(_TRITON_CHUNK, triton.cdiv(vocab, _TRITON_BLOCK) * _TRITON_BLOCK)
    num_splits = triton.cdiv(vocab, chunk)
    partial = torch.empty((4 if want_log_norm else 2, num_rows, num_splits), device=logits.device,
                          dtype=torch.float32)
    best_idx = torch.empty((num_rows, num_splits), device=logits.device, dtype=torch.int32)
    _gumbel_argmax_kernel[(num_rows, num_splits)](
        logits, logits.stride(0), st.seeds, st.positions, st.inv_temperature,
        st.greedy.view(torch.uint8), threshold if threshold is not None else st.inv_temperature,
        partial[0], best_idx, partial[-2], partial[-1], vocab, num_splits,
        CHUNK=chunk, BLOCK=_TRITON_BLOCK, HAS_THRESHOLD=threshold is not None,
        LOG_NORM=want_log_norm, num_warps=_TRITON_NUM_WARPS,
    )
    winner = partial[0].argmax(dim=1, keepdim=True)  # first split wins ties, like torch.argmax
    token_ids = best_idx.gather(1, winner).squeeze(1).to(torch.int64)
    if not want_log_norm:
        return token_ids, None
    split_max, split_sum = partial[2], partial[3]
    row_max = split_max.amax(dim=1, keepdim=True)
    shift = torch.where(row_max == _NEG_INF, 0.0, row_max)
    log_norm = (shift + (split_sum * torch.exp(split_max - shift)).sum(dim=1, keepdim=True).log()).squeeze(1)
    return token_ids, log_norm


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
        if backend == "triton" and triton is None:
            raise ValueError("the triton sampler backend needs triton installed")
        self.backend = backend

    def _use_triton(self, logits: Tensor) -> bool:
        if self.backend == "auto":
            return triton is not None and logits.is_cuda
        return self.backend == "triton"

    @torch.inference_mode()
    def __call__(self, logits: Tensor, st: SamplingTensors) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != st.num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {st.num_rows} sampling rows")
        logits = logits.float()
        want_logprobs = st.num_logprobs >= 0
        if st.all_greedy and not want_logprobs:
            return SamplerOutput(logits.argmax(dim=-1), None, None, None)
        # One torch.topk serves both the top-k/top-p cut and the top logprobs. (A per-chunk
        # tl.topk first stage measured slower than torch.topk on an H200.)
        filter_width = 0
        if not st.all_greedy and (st.any_top_k or st.any_top_p) and not st.needs_full_sort:
            filter_width = st.max_top_k
        width = min(max(filter_width, st.num_logprobs), logits.shape[-1])
        ranked = logits.topk(width, dim=-1) if width > 0 and logits.shape[0] > 0 else None
        threshold = None
        if not st.all_greedy:
            threshold = keep_threshold(logits, st, ranked[0] if ranked is not None else None)
        draw = _draw_triton if self._use_triton(logits) and logits.shape[0] > 0 else _draw_torch
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
