"""Counter-based Gumbel noise and the fused Gumbel-max draw of the sampler.

Randomness is a keyed integer hash of (seed, position, salt, vocab index), never a generator's
state, so a seeded row draws the same token whatever shares its batch, on CPU or CUDA. The torch
functions here are the reference; `gumbel_argmax` is the Triton kernel that fuses hash, noise,
filter threshold and argmax on the GPU, reading the logits once. services/worker/sampling/sampler.py
builds the per-row settings and filters on top of both.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

try:  # Triton is optional: CPU-only installs sample with the torch reference.
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from strata.kernels.arrival_counters import arrival_counters
    from strata.kernels.kernel_launch import device_sm_count
except ImportError:  # pragma: no cover - depends on the install
    triton = None

HAVE_TRITON = triton is not None

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


def gumbel_row_keys(seeds: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """The sampler's per-row keys (salt 0, Gumbel domain), as the kernel derives them."""
    return _row_keys(seeds, positions, 0, _DOMAIN_GUMBEL)


def gumbel_from_keys(key_a: Tensor, key_b: Tensor, vocab_size: int, offset: int = 0) -> Tensor:
    """Noise [..., vocab_size] of the vocabulary indices offset .. offset + vocab_size - 1."""
    if offset:
        index = torch.arange(offset, offset + vocab_size, device=key_a.device, dtype=torch.int64)
        u = _uniform_from_hash(_element_hash(key_a.unsqueeze(-1), key_b.unsqueeze(-1), index))
        return -torch.log(-torch.log(u))
    return _gumbel_from_keys(key_a, key_b, vocab_size)


# ---------------------------------------------------------------------------------------------
# A draw over several slices of the vocabulary (tensor parallelism): each slice's best (value,
# global index) packed into one int64, so that one all-reduce (max) over the slices gives the
# whole row's draw, with torch.argmax's rule: the largest value, the smallest index among equal
# values. The Triton kernel packs in the same way (_pack_key_tl).
# ---------------------------------------------------------------------------------------------

_LOW32 = 0xFFFFFFFF


def pack_draw_keys(values: Tensor, tokens: Tensor) -> Tensor:
    """int64 keys, ordered as (value, then -token): float32 values as order-preserving int32
    (-0.0 as +0.0, NaN above +inf, as argmax takes them) in the high word, 2**32 - 1 - token
    in the low one."""
    values = values.float() + 0.0
    bits = values.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    ordered = torch.where(torch.isnan(values), torch.full_like(ordered, 0x7FFFFFFF), ordered)
    return (ordered.to(torch.int64) << 32) | (_LOW32 - tokens.to(torch.int64))


def unpack_draw_tokens(keys: Tensor) -> Tensor:
    """The tokens of pack_draw_keys' keys."""
    return _LOW32 - (keys & _LOW32)


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
    def _log2_approx(x, INTERPRETED: tl.constexpr):
        """log2 with the GPU's special-function unit (lg2.approx, ~2**-22 relative error):
        libdevice's accurate logf costs ~20 instructions, and the draw takes two logs per
        vocabulary entry. The interpreter has no PTX, so it uses numpy's log2."""
        if INTERPRETED:
            return tl.log2(x)
        else:
            # .ftz: its arguments (u >= 2**-24, -ln u >= 2**-24) are never denormal, and without it
            # ptxas wraps every log in a denormal test and rescale (3 more instructions each).
            return tl.inline_asm_elementwise(
                "lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
            )

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
    def _perturbed_tl(x, cols, key_a, key_b, inv_t, INTERPRETED: tl.constexpr):
        """x * inv_t + Gumbel noise of (row key, cols), as float32: the sampled rows' draw value.
        Every kernel that draws calls this one function, so their values agree bit for bit."""
        h = _mix32_tl(cols.to(tl.uint32) * 0x61C88647 + key_a)
        h = _mix32_tl(h ^ key_b)
        u = tl.maximum((h >> 8).to(tl.float32), 1.0) * 5.9604644775390625e-08  # 2**-24
        # Gumbel noise -ln(-ln u), as ln y = ln2 * log2 y.
        exponential = -0.6931471805599453 * _log2_approx(u, INTERPRETED)
        return x * inv_t - 0.6931471805599453 * _log2_approx(exponential, INTERPRETED)

    @triton.jit
    def _gumbel_argmax_kernel(
        logits_ptr,
        row_stride,
        seeds_ptr,
        positions_ptr,
        inv_temp_ptr,
        greedy_ptr,
        threshold_ptr,
        best_val_ptr,
        best_idx_ptr,
        max_ptr,
        sum_exp_ptr,
        arrivals_ptr,
        token_ptr,
        log_norm_ptr,
        store_rows_ptr,
        store_ptr,
        skip_ptr,
        key_ptr,
        vocab_size,
        num_splits,
        col_offset,
        CHUNK: tl.constexpr,
        BLOCK: tl.constexpr,
        SPLITS_PADDED: tl.constexpr,
        HAS_THRESHOLD: tl.constexpr,
        LOG_NORM: tl.constexpr,
        STORE: tl.constexpr,
        INTERPRETED: tl.constexpr,
        PREFETCH: tl.constexpr,
        SKIP: tl.constexpr = False,
        KEY: tl.constexpr = False,
    ):
        # Program (row, split) scans logits[row, split*CHUNK : (split+1)*CHUNK] once and stores
        # its best perturbed value and index (plus max and sum of exp of the raw logits when
        # LOG_NORM); the row's last split to arrive merges them (kernels/arrival_counters.py).
        # SKIP: rows whose skip flag is set are left alone (another kernel draws them).
        # col_offset: the global vocabulary index of column 0 (a tensor-parallel rank's slice of
        # the logits): the noise is that of the global index, and tokens are global. KEY: the
        # row's best also goes to key_ptr as a packed int64 (pack_draw_keys), which an
        # all-reduce (max) over the ranks' slices turns into the whole row's draw.
        row = tl.program_id(0)
        split = tl.program_id(1)
        if SKIP:
            if tl.load(skip_ptr + row) != 0:
                return
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
        if PREFETCH:  # always, but for the sweep's comparison with the plain loop
            x_next = tl.load(
                row_ptr + start + tl.arange(0, BLOCK),
                mask=start + tl.arange(0, BLOCK) < vocab_size,
                other=float("-inf"),
            )
        for offset in range(0, CHUNK, BLOCK):
            cols = start + offset + tl.arange(0, BLOCK)
            in_vocab = cols < vocab_size
            if PREFETCH:
                # The next block's load is issued before this block's hashing, so it is in flight
                # while the ALUs work (plain loads outside a dot are not software-pipelined).
                x = x_next.to(tl.float32)
                next_cols = cols + BLOCK
                x_next = tl.load(
                    row_ptr + next_cols, mask=(next_cols < vocab_size) & (offset + BLOCK < CHUNK), other=float("-inf")
                )
            else:
                x = tl.load(row_ptr + cols, mask=in_vocab, other=float("-inf")).to(tl.float32)
            val = x
            if greedy == 0:
                val = _perturbed_tl(x, cols + col_offset, key_a, key_b, inv_t, INTERPRETED)
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
        part = row * num_splits + split
        tl.store(best_val_ptr + part, best)
        tl.store(best_idx_ptr + part, best_col)
        if LOG_NORM:
            tl.store(max_ptr + part, run_max)
            tl.store(sum_exp_ptr + part, run_sum)
        tl.debug_barrier()  # every thread's stores are done before the release below
        arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            token = _merge_splits(
                best_val_ptr,
                best_idx_ptr,
                max_ptr,
                sum_exp_ptr,
                token_ptr,
                log_norm_ptr,
                row,
                num_splits,
                SPLITS_PADDED,
                LOG_NORM,
            )
            token += col_offset
            if col_offset != 0:
                tl.store(token_ptr + row, token)
            if STORE:  # a copy where the caller keeps it (the worker's last_sampled, by state row)
                tl.store(store_ptr + tl.load(store_rows_ptr + row), token)
            if KEY:
                splits = tl.arange(0, SPLITS_PADDED)
                vals = tl.load(
                    best_val_ptr + row * num_splits + splits,
                    mask=splits < num_splits,
                    other=float("-inf"),
                    cache_modifier=".cg",
                )
                tl.store(key_ptr + row, _pack_key_tl(tl.max(vals, axis=0), token))
            tl.store(arrivals_ptr + row, 0)  # ready for the next launch

    @triton.jit
    def _pack_key_tl(value, token):
        """pack_draw_keys for one row: a float32 value and an int64 token."""
        value = value + 0.0  # -0.0 -> +0.0: torch.argmax takes them as equal
        bits = value.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        ordered = tl.where(value != value, 0x7FFFFFFF, ordered)  # NaN above everything, as argmax
        low = tl.full((), 0xFFFFFFFF, tl.int64)
        return (ordered.to(tl.int64) << 32) | (low - token.to(tl.int64))

    @triton.jit
    def _merge_splits(
        best_val_ptr,
        best_idx_ptr,
        max_ptr,
        sum_exp_ptr,
        token_ptr,
        log_norm_ptr,
        row,
        num_splits,
        SPLITS_PADDED: tl.constexpr,
        LOG_NORM: tl.constexpr,
    ):
        """The row's token (the first split wins ties, like torch.argmax over splits) and, when
        LOG_NORM, its logsumexp from the splits' (max, sum of exp). .cg loads read L2, where the
        other programs stored, never a stale L1 line."""
        splits = tl.arange(0, SPLITS_PADDED)
        valid = splits < num_splits
        first = row * num_splits
        vals = tl.load(best_val_ptr + first + splits, mask=valid, other=float("-inf"), cache_modifier=".cg")
        cols = tl.load(best_idx_ptr + first + splits, mask=valid, other=0, cache_modifier=".cg")
        best = tl.max(vals, axis=0)
        winner = tl.min(tl.where(valid & (vals == best), splits, SPLITS_PADDED), axis=0)
        token = tl.sum(tl.where(splits == winner, cols, 0), axis=0).to(tl.int64)
        tl.store(token_ptr + row, token)
        if LOG_NORM:
            maxes = tl.load(max_ptr + first + splits, mask=valid, other=float("-inf"), cache_modifier=".cg")
            sums = tl.load(sum_exp_ptr + first + splits, mask=valid, other=0.0, cache_modifier=".cg")
            row_max = tl.max(maxes, axis=0)
            shift = tl.where(row_max == float("-inf"), 0.0, row_max)  # all -inf: log(0) = -inf
            total = tl.sum(tl.where(valid, sums * tl.exp(maxes - shift), 0.0), axis=0)
            tl.store(log_norm_ptr + row, shift + tl.log(total))
        return token

    # Decided at definition time, like triton.jit itself (TRITON_INTERPRET read when decorating).
    _INTERPRETED = isinstance(_gumbel_argmax_kernel, InterpretedFunction)


_TRITON_BLOCK = 1024


def _launch_shape(num_rows: int, vocab: int, sm_count: int) -> tuple[int, int, int, bool]:
    """(chunk, block, num_warps, prefetch), from a sweep (bench/bench_sampling.py; bench/RESULTS.md).
    Small batches cut each row into 4096-entry splits of 8 warps (latency-bound: more programs in
    flight); once those would fill the GPU several times over, 16384-entry splits of 4 warps,
    fewer programs and fewer partials to merge."""
    small = num_rows * triton.cdiv(vocab, 4096) <= 4 * sm_count
    chunk = min(4096 if small else 16384, triton.cdiv(vocab, _TRITON_BLOCK) * _TRITON_BLOCK)
    return chunk, _TRITON_BLOCK, 8 if small else 4, True


def batches_per_launch_shape(vocab: int, device: torch.device) -> list[int]:
    """One batch size per launch shape of the draw (each a compiled variant the worker's warm-up
    compiles): the smallest batch, and the first power of two past the small-batch shape."""
    sm_count, rows = device_sm_count(device), 2
    while _launch_shape(rows, vocab, sm_count) == _launch_shape(1, vocab, sm_count):
        rows *= 2
    return [2, rows]


def gumbel_argmax(
    logits: Tensor,
    seeds: Tensor,
    positions: Tensor,
    inv_temperature: Tensor,
    greedy: Tensor,
    threshold: Tensor | None,
    want_log_norm: bool,
    store: tuple[Tensor, Tensor] | None = None,
    launch: tuple[int, int, int, bool] | None = None,
    skip: Tensor | None = None,
    out: Tensor | None = None,
    vocab_offset: int = 0,
    keys: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Per row: argmax of logits * inv_temperature + Gumbel noise over logits >= threshold
    (plain argmax where greedy), reading the logits once; also logsumexp of the raw logits when
    want_log_norm. One launch, no host sync. Torch reference: draw_reference below.
    store (out, rows): also out[rows[i]] = token i (int64 out). launch: (chunk, block, num_warps,
    prefetch) instead of _launch_shape's, for sweeps. skip: uint8 [rows], nonzero where the row
    is left alone (no token, no store: the controlled draw of kernels/controlled_sampling.py
    draws it). out: the int64 token tensor to write (default: a new one).
    vocab_offset: the logits are columns [vocab_offset, vocab_offset + V) of the vocabulary (a
    tensor-parallel rank's slice): noise and tokens are the global index's. keys: an int64 [rows]
    tensor that also gets each row's pack_draw_keys(best value, token)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab = logits.shape
    device = logits.device
    if launch is None:
        launch = _launch_shape(num_rows, vocab, device_sm_count(device))
    chunk, block, num_warps, prefetch = launch
    num_splits = triton.cdiv(vocab, chunk)
    # Each partial plane starts 16-byte aligned whatever rows x splits is: Triton specialises on
    # pointer alignment, and a plane offset of 2 rows x 13 splits x 4 bytes (a 50,000 vocabulary)
    # made the warm-up compile another variant than the one serving 8 rows needs.
    plane = triton.cdiv(num_rows * num_splits, 4) * 4
    planes = torch.empty((4 if want_log_norm else 2, plane), device=device, dtype=torch.float32)
    partial = planes[:, : num_rows * num_splits]
    best_idx = torch.empty((num_rows, num_splits), device=device, dtype=torch.int32)
    token_ids = out if out is not None else torch.empty(num_rows, device=device, dtype=torch.int64)
    log_norm = torch.empty(num_rows, device=device, dtype=torch.float32) if want_log_norm else None
    _gumbel_argmax_kernel[(num_rows, num_splits)](
        logits,
        logits.stride(0),
        seeds,
        positions,
        inv_temperature,
        greedy.view(torch.uint8),
        threshold if threshold is not None else inv_temperature,
        partial[0],
        best_idx,
        partial[-2],
        partial[-1],
        arrival_counters(device, num_rows, "gumbel_argmax"),
        token_ids,
        log_norm if want_log_norm else partial[0],
        *(reversed(store) if store else (token_ids, token_ids)),
        skip.view(torch.uint8) if skip is not None else greedy.view(torch.uint8),
        keys if keys is not None else token_ids,
        vocab,
        num_splits,
        vocab_offset,
        CHUNK=chunk,
        BLOCK=block,
        SPLITS_PADDED=triton.next_power_of_2(num_splits),
        HAS_THRESHOLD=threshold is not None,
        LOG_NORM=want_log_norm,
        STORE=store is not None,
        INTERPRETED=_INTERPRETED,
        PREFETCH=prefetch,
        SKIP=skip is not None,
        KEY=keys is not None,
        num_warps=num_warps,
    )
    return token_ids, log_norm
