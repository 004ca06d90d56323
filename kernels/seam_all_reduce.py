"""The all-reduce of a batch-1 decode chain's row-parallel GEMV split across its seam: the GEMV's
epilogue sends this rank's part, the next GEMV's prologue sums every rank's (tensor parallelism).

kernels/one_shot_all_reduce.py's one-shot is a launch of its own between o_proj (or down) and the
next GEMV. On two H200s each one added 1.90 us to a chain of 8 KB messages (bench/RESULTS.md,
"Issues 50 and 51 on two H200s at last"), 64 of them a step of the 8B: the batch-1 TPOT target of
issue 51 (0.6x one GPU) was missed by 0.006x. Most of that is the launch between: the one-shot waits
for the GEMV to end before it sends, and the GEMV after it waits for the one-shot to end before it
reads. Here each GEMV program sends its own rows as soon as it has them, and the next GEMV's
programs read the peers' rows from their own memory once the previous GEMV has ended (the chain's
gdc_wait), usually already landed.

The message travels as 64-bit words, each 32 bits of payload (two bf16 or fp16 elements, or one
fp32) and a 32-bit flag: the call's sequence number, as NCCL's LL protocol does. An 8-byte store
lands whole, so a word whose flag is this call's holds this call's payload; no fence, no empty
mark to restore. Each site of the chain (layer i's o_proj is site 2i, its down 2i + 1) owns its
own words in every slot, two sets of them alternating by the parity of the call's number.

Sequence numbers: each sending program counts its own calls (a word of its own: no other program
touches it), and the receiving GEMV's programs read program 0's count, which the send wrote before
its kernel ended. Every program of a site's GEMV runs every call, on every rank alike (the same
shapes), so the counts agree.

Why a peer cannot overwrite what this rank still reads: a peer's call k + 2 at a site reuses call
k's words, but the peer sends it only after its own receiving GEMV of call k + 1 has its parts,
which include this rank's call k + 1, sent by this rank's sending GEMV after its gdc_wait: after
every kernel before it ended, this rank's receiving GEMV of call k included (the chain's ordering,
kernels/dependent_launch.py).

A wait gives up when the host sets the abort word, as the one-shot's waits do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from strata.kernels.one_shot_all_reduce import Exchange, _nth

WORD_BYTES = 8
PAYLOAD_BYTES = 4


@dataclass(frozen=True)
class Seam:
    """One site of the chain on this rank: the exchange of 64-bit words every rank has mapped
    (tensor_parallel/ipc_all_reduce.py's "seams"), and where this site's words start in each slot
    (its sequence numbers start at the same index)."""

    exchange: Exchange
    offset: int


def words_for(numel: int, dtype: torch.dtype) -> int:
    """Words a message of numel elements takes."""
    return triton.cdiv(numel * dtype.itemsize, PAYLOAD_BYTES)


def sendable(block_n: int, dtype: torch.dtype) -> bool:
    """Whether a program of block_n rows fills whole words (two bf16, or one fp32)."""
    return dtype.itemsize in (2, 4) and (block_n * dtype.itemsize) % PAYLOAD_BYTES == 0


def seam_args(seam: Seam | None, dummy: torch.Tensor) -> list:
    """The GEMV kernel's seam arguments, from buf0 to seam_capacity (placeholders without one)."""
    if seam is None:
        return [dummy] * 8 + [dummy, 0, 0, 0]
    buffers_to_abort = seam.exchange.kernel_args()
    return [*buffers_to_abort, seam.offset, seam.exchange.capacity]


def seam_constexprs(seam: Seam | None) -> dict:
    if seam is None:
        return {"RANK": 0, "WORLD": 1}
    return {"RANK": seam.exchange.rank, "WORLD": len(seam.exchange.buffers)}


@triton.jit
def _pack(y, N: tl.constexpr, ELEMENT_BITS: tl.constexpr):
    """y [N] of 16- or 32-bit floats as payloads [N * ELEMENT_BITS / 32] in the low half of int64s."""
    if ELEMENT_BITS == 16:
        bits = y.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        pairs = tl.reshape(bits, (N // 2, 2))
        shift = tl.arange(0, 2) * 16
        payload = tl.sum(pairs << shift[None, :], axis=1)  # disjoint halves: the sum is their or
    else:
        payload = y.to(tl.int32, bitcast=True)
    return payload.to(tl.int64) & 0xFFFFFFFF


@triton.jit
def _unpack(words, WORDS: tl.constexpr, ELEMENT_BITS: tl.constexpr, like):
    """The elements words [WORDS] carry, of like's dtype ([WORDS * 32 / ELEMENT_BITS])."""
    payload = (words & 0xFFFFFFFF).to(tl.int32)
    if ELEMENT_BITS == 16:
        shift = tl.arange(0, 2) * 16
        halves = (payload[:, None] >> shift[None, :]) & 0xFFFF
        x = tl.reshape(halves.to(tl.int16), (WORDS * 2,)).to(like.dtype, bitcast=True)
    else:
        x = payload.to(like.dtype, bitcast=True)
    return x


@triton.jit
def seam_send(
    y, pid, N, seq_ptr, offset, capacity,
    buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
    BLOCK_N: tl.constexpr, ELEMENT_BITS: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
):  # fmt: skip
    """A sending program's rows y [BLOCK_N] (rows pid * BLOCK_N on) into slot RANK of every peer's
    words, flagged with this program's count of calls."""
    seq = tl.load(seq_ptr + offset + pid, volatile=True) + 1  # (from L2, as seam_sum reads it)
    tl.store(seq_ptr + offset + pid, seq)
    PER_WORD: tl.constexpr = 32 // ELEMENT_BITS
    WORDS: tl.constexpr = BLOCK_N // PER_WORD
    words = _pack(y, BLOCK_N, ELEMENT_BITS) | (seq.to(tl.int64) << 32)
    at = pid * WORDS + tl.arange(0, WORDS)
    mask = at * PER_WORD < N
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer = _nth(r, buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7)
            tl.store(peer + ((seq % 2) * WORLD + RANK) * capacity + offset + at, words, mask=mask)


@triton.jit
def seam_sum(
    x, K, seq_ptr, offset, capacity, abort_address,
    buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
    K_PADDED: tl.constexpr, ELEMENT_BITS: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
):  # fmt: skip
    """Every rank's row summed in rank order in float32 and rounded to x's dtype (the one-shot's
    arithmetic, so the same bits on every rank): x [K_PADDED] is this rank's, the peers' are read
    from this rank's words once their flags are this call's. After the sending GEMV ended."""
    # The sending GEMV's program 0's count, this call's. Volatile (from L2): this SM's L1 may hold
    # the line from before program 0's store (a sending program here loaded its own count, a word
    # of the same line), and with the previous call's count the previous call's words would match.
    seq = tl.load(seq_ptr + offset, volatile=True)
    PER_WORD: tl.constexpr = 32 // ELEMENT_BITS
    WORDS: tl.constexpr = K_PADDED // PER_WORD
    at = tl.arange(0, WORDS)
    mask = at * PER_WORD < K
    own = _nth(RANK, buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7)
    abort_ptr = abort_address.to(tl.pointer_type(tl.int32))
    total = tl.zeros([K_PADDED], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            part = x
        else:
            slot = own + ((seq % 2) * WORLD + r) * capacity + offset + at
            words = tl.load(slot, mask=mask, other=0, volatile=True)
            missing = tl.sum(((words >> 32).to(tl.int32) != seq).to(tl.int32) * mask.to(tl.int32))
            spins = 0
            while missing > 0:
                words = tl.load(slot, mask=mask, other=0, volatile=True)
                missing = tl.sum(((words >> 32).to(tl.int32) != seq).to(tl.int32) * mask.to(tl.int32))
                spins += 1
                if missing > 0 and spins % 1024 == 0:
                    if tl.load(abort_ptr, volatile=True) != 0:
                        missing = 0
            part = _unpack(words, WORDS, ELEMENT_BITS, x)
        total = total + part.to(tl.float32)
    return total.to(x.dtype)
