"""A one-shot all-reduce of a message of up to a few MiB over buffers that every rank has mapped (CUDA IPC),
in one Triton launch that chains with the kernels around it (programmatic dependent launch).

A decode step of a T-way stage runs two all-reduces a layer, each of a few KB to a few MB.
NCCL's kernel is not a programmatic dependent: the next layer's GEMV cannot stream its weights
until NCCL's kernel has ended, so every all-reduce adds its whole latency to the step. This kernel
calls gdc_launch_dependents as it starts, so the GEMV after it launches and loads its weights while
the ranks meet (kernels/dependent_launch.py).

Each program owns a 2 KB block of the message (BLOCK elements); past MAX_PROGRAMS blocks, block b
is program b % MAX_PROGRAMS's, and a program does step 2 for all of its blocks before step 3. It:
1. waits for the kernel before it (gdc_wait), reads its elements of x;
2. writes them into slot RANK of every peer's buffer (remote stores over NVLink, posted, not read
   round trips);
3. reads the peers' slots of its own buffer until none holds the empty mark, sums every rank's
   part in rank order in float32 (its own from registers) and stores the sum over x: every rank
   the same bits (or takes their maximum: the sampler's draw over vocabulary slices, one int64 key
   a row);
4. marks the slots it read empty again.

The data is its own signal (as TensorRT-LLM's "Lamport" one-shot does it): an empty slot holds a
mark no message can hold, -0.0 (a float's -0.0 is sent as +0.0, which sums alike). The draw's
keys take -1, the key of a -0.0 value for token 0, which pack_draw_keys already makes +0.0's
(kernels/gumbel_sampling.py); a -1 that came anyway is sent as that key. There is
no flag to raise behind a system-scope fence, which waits for the NVLink stores to be
acknowledged: a rank's part is ready the moment it lands, one one-way trip. Each element is
checked, so a 16-byte store that lands in parts is waited for.

Sent early (the decode chain's o_proj and down: kernels/decode_linear.py): the kernel that
computes x does step 2 in its epilogue, each of its programs as it ends (send_part), and the
one-shot launched after it (sent=True) skips it. The NVLink trip then overlaps the tail of that
kernel instead of following its end. send_part reads the sequence number of the one-shot's program
that owns its elements and sends with the parity that program's next call will have; the
ordering argument below holds unchanged, since the sends of call k + 1 still come only after this
rank's call k ended (the sending kernel waits for its predecessors, transitively the one-shot of
call k, before it computes anything it sends).

The norm variant (one_shot_all_reduce_add_rms_norm) gives each program a whole row of a
row-parallel output and, after step 3, adds the residual and normalises the row as rmsnorm.py
does: the launch after o_proj or down, and the norm's own launch, become one.

Two sets of slots, alternating by the parity of a per-program count of calls kept in this rank's
memory (programs past a call's grid miss that call on every rank alike, since every rank runs the
same message sizes). A peer can be at most one call ahead: it cannot finish call k + 1 before this
rank's part of it landed, which this rank sends only in its next launch, after this one, with its
step 4, has ended (every kernel between them waits for its predecessor before it ends:
kernels/dependent_launch.py). So the peer's call k + 2, which reuses call k's slots, lands after they were
marked empty, and its call k + 1 never lands on what this rank still reads. That holds per
program because a program always owns the same part of the buffers: so one set of buffers serves
one kind of call (the sum, the maximum, or rows of one width for the norm).

A wait also gives up when the host sets the abort word (pinned host memory; read every 1,024
spins): a rank whose peer died must not leave a kernel spinning forever on its GPU. The sum is
then garbage, and the step that ran it fails (TensorParallelGroup.abort).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from strata.kernels.dependent_launch import dependent_launch_supported, launch_options
from strata.kernels.rmsnorm import rms_norm_row, row_warps

MAX_RANKS = 8  # the kernel takes each rank's buffer as an argument of its own
BLOCK_BYTES = 2048  # a block of the message: 16 bytes a thread at 4 warps (one vector; more spilled int64)
WARPS = 4
# Programs a launch runs at most (512 KiB of bf16 in blocks, or 256 rows): few enough that all of
# them are on the GPU at once, since each waits for the same program of every peer; a larger
# message loops, block b (or row b) always program b % MAX_PROGRAMS's.
MAX_PROGRAMS = 256
# Rows a looping program of the norm variant sends at once (all 4 of an 8B's 1,024-row message; a
# row at a time waited out a load's round trip per row: 20.7 against 18.4 us at 528 rows on two
# H200s). Its gathers stay a row at a time. The plain sum gained nothing from sending by chunks,
# and gathering by chunks as well (94 registers a thread) hung two ranks sharing one GPU
# (bench/RESULTS.md, session 17: "the norm one-shot's sends by chunks").
MAX_CHUNK_ROWS = 4


@triton.jit
def _nth(r: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
    """The r-th of eight pointers (r known when compiling)."""
    if r == 0:
        p = p0
    elif r == 1:
        p = p1
    elif r == 2:
        p = p2
    elif r == 3:
        p = p3
    elif r == 4:
        p = p4
    elif r == 5:
        p = p5
    elif r == 6:
        p = p6
    else:
        p = p7
    return p


@triton.jit
def _sendable(x, MAX: tl.constexpr, BITS: tl.constexpr, EMPTY: tl.constexpr):
    """x as it may travel: never the empty mark."""
    if MAX:  # a key of -1 (the empty mark) has a -0.0 value: it goes as +0.0's, as argmax takes it
        x = tl.where(x == EMPTY, 0xFFFFFFFF, x)
    else:  # -0.0 is the empty mark: sent as +0.0
        x = tl.where(x.to(BITS, bitcast=True) == EMPTY, tl.zeros_like(x), x)
    return x


@triton.jit
def _send(
    x, offs, mask, parity, capacity,
    buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
    RANK: tl.constexpr, WORLD: tl.constexpr,
):  # fmt: skip
    """Step 2: this rank's elements x (sendable) into slot RANK of every peer's buffer."""
    for r in tl.static_range(WORLD):
        if r != RANK:
            buffer = _nth(r, buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7)
            tl.store(buffer + (parity * WORLD + RANK) * capacity + offs, x, mask=mask)


@triton.jit
def send_part(
    x, offs, mask, first, seq_ptr, capacity,
    buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr, EMPTY: tl.constexpr,
):  # fmt: skip
    """Step 2 ahead of a sum's launch (one_shot_all_reduce(sent=True)), from the kernel that
    computes the message: its elements x at offs, all in the block of element `first`, into the
    slots of the call that block's program makes next. Its count is read from L2 (volatile): this
    SM's L1 may hold the line from before the previous call stored it."""
    seq = tl.load(seq_ptr + first // BLOCK, volatile=True) + 1
    x = _sendable(x, False, BITS, EMPTY)
    _send(x, offs, mask, seq % 2, capacity, buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7, RANK, WORLD)


@triton.jit
def _gather(
    x, offs, mask, parity, abort_address, capacity,
    buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
    RANK: tl.constexpr, WORLD: tl.constexpr, MAX: tl.constexpr, BITS: tl.constexpr, EMPTY: tl.constexpr,
):  # fmt: skip
    """Steps 3-4 for elements at offs whose own part is x (sendable): every rank's, summed in
    float32 in rank order (or their maximum, in x's dtype), once none is empty; the slots read are
    marked empty again."""
    own = _nth(RANK, buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7)
    abort_ptr = abort_address.to(tl.pointer_type(tl.int32))
    if MAX:
        total = x
    else:
        total = x.to(tl.float32)
    missing = 1
    spins = 0
    while missing > 0:
        empty = tl.zeros_like(offs)
        for r in tl.static_range(WORLD):
            if r == RANK:
                part = x
            else:
                slot = own + (parity * WORLD + r) * capacity + offs
                part = tl.load(slot, mask=mask, other=0, volatile=True)
                empty += (part.to(BITS, bitcast=True) == EMPTY).to(offs.dtype)
            if MAX:
                total = part if r == 0 else tl.maximum(total, part)
            else:
                total = part.to(tl.float32) if r == 0 else total + part.to(tl.float32)
        missing = tl.sum(empty)
        spins += 1
        if missing > 0 and spins % 1024 == 0:
            if tl.load(abort_ptr, volatile=True) != 0:
                missing = 0
    own_bits = own.to(tl.pointer_type(BITS))
    for r in tl.static_range(WORLD):
        if r != RANK:
            slot = own_bits + (parity * WORLD + r) * capacity + offs
            tl.store(slot, tl.full(offs.shape, EMPTY, BITS), mask=mask)
    return total


@triton.jit
def _one_shot_all_reduce_kernel(
    x_ptr,
    # Each rank's buffer ([2, WORLD, capacity] of x's dtype) as mapped here; ranks past WORLD
    # repeat this rank's. Pointers, not addresses in an array: Triton then knows their alignment
    # and moves 16 bytes a thread at a time.
    buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
    seq_ptr,  # int32 [max programs]: this rank's calls so far, per program
    abort_address,  # of an int32 in pinned host memory (the same address on the device: UVA)
    n,
    capacity,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    MAX: tl.constexpr,  # the elementwise maximum (the sampler's packed draw keys) instead of the sum
    BITS: tl.constexpr,
    EMPTY: tl.constexpr,
    LOOP: tl.constexpr,  # more blocks than programs: each program sends all of its blocks, then gathers them
    SENT: tl.constexpr,  # the kernel before it sent this rank's part (send_part): steps 1, 3 and 4 only
    PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    if PDL:
        # Before the sequence number too: the previous call may still be running until then (it
        # let its successor launch early, and that one let this one).
        gdc_wait()
    seq = tl.load(seq_ptr + pid) + 1  # this program's alone: no other program touches it
    parity = seq % 2
    if LOOP:
        # Block b is always program b % programs's (the grid is MAX_PROGRAMS whenever it loops), so
        # the parity argument above holds per program for every block it owns.
        programs = tl.num_programs(0)
        b = pid  # (while loops: the interpreter's range() takes no program id)
        while b * BLOCK < n:
            offs = b * BLOCK + tl.arange(0, BLOCK)
            x = _sendable(tl.load(x_ptr + offs, mask=offs < n), MAX, BITS, EMPTY)
            _send(x, offs, offs < n, parity, capacity, buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7, RANK, WORLD)
            b += programs
        b = pid
        while b * BLOCK < n:
            offs = b * BLOCK + tl.arange(0, BLOCK)
            x = _sendable(tl.load(x_ptr + offs, mask=offs < n), MAX, BITS, EMPTY)
            total = _gather(
                x, offs, offs < n, parity, abort_address, capacity,
                buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
                RANK, WORLD, MAX, BITS, EMPTY,
            )  # fmt: skip
            tl.store(x_ptr + offs, total.to(x_ptr.dtype.element_ty), mask=offs < n)
            b += programs
    else:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = _sendable(tl.load(x_ptr + offs, mask=mask), MAX, BITS, EMPTY)
        if not SENT:
            _send(x, offs, mask, parity, capacity, buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7, RANK, WORLD)
        total = _gather(
            x, offs, mask, parity, abort_address, capacity,
            buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
            RANK, WORLD, MAX, BITS, EMPTY,
        )  # fmt: skip
        tl.store(x_ptr + offs, total.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(seq_ptr + pid, seq)


@triton.jit
def _residual(residual_ptr, offs, mask, x, ADD_RESIDUAL: tl.constexpr):
    """The row's residual, loaded before the wait: it streams while the ranks meet."""
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + offs, mask=mask, other=0.0)
    else:
        residual = x  # (unused)
    return residual


@triton.jit
def _gather_norm_row(
    x, residual, weight, out_ptr, residual_out_ptr, offs, mask, parity, abort_address, capacity, eps,
    buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
    HIDDEN: tl.constexpr, ADD_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    RANK: tl.constexpr, WORLD: tl.constexpr, BITS: tl.constexpr, EMPTY: tl.constexpr,
):  # fmt: skip
    """Steps 3-4 for a row, then its sum rounded as NCCL returns it, plus the residual, stored as
    the residual stream and normalised."""
    total = _gather(
        x, offs, mask, parity, abort_address, capacity,
        buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
        RANK, WORLD, False, BITS, EMPTY,
    )  # fmt: skip
    h = total.to(x.dtype)
    if ADD_RESIDUAL:
        h = (h.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
    tl.store(residual_out_ptr + offs, h, mask=mask)  # the residual stream after this layer's add
    out = rms_norm_row(h, weight, HIDDEN, eps, UNIT_OFFSET)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _one_shot_all_reduce_norm_kernel(
    x_ptr,  # [rows, HIDDEN]: this rank's partial row-parallel output
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
    seq_ptr,
    abort_address,
    rows,
    capacity,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BITS: tl.constexpr,
    EMPTY: tl.constexpr,
    LOOP: tl.constexpr,  # more rows than programs: each program sends all of its rows, then gathers them
    CHUNK: tl.constexpr,  # with LOOP: rows a program sends at once
    PDL: tl.constexpr,
):  # fmt: skip
    """One row a program (or, with LOOP, rows pid, pid + programs, ...): its all-reduce, then
    kernels/rmsnorm.py's add and norm, rounded at the same points (the sum in the activation dtype,
    as NCCL returns it; the residual sum; the normalised row): the same bits as the one-shot
    followed by fused_add_rms_norm."""
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # constant: before the wait
    if PDL:
        gdc_wait()
    seq = tl.load(seq_ptr + pid) + 1
    parity = seq % 2
    if LOOP:
        programs = tl.num_programs(0)
        # The sends CHUNK rows at a time (MAX_CHUNK_ROWS); the gathers a row at a time, each row
        # normed as rmsnorm.py does.
        chunk_rows = tl.arange(0, CHUNK)[:, None] * programs
        row = pid
        while row < rows:
            offs = (row + chunk_rows) * HIDDEN + cols[None, :]
            both = (row + chunk_rows < rows) & mask[None, :]
            x = _sendable(tl.load(x_ptr + offs, mask=both, other=0.0), False, BITS, EMPTY)
            _send(x, offs, both, parity, capacity, buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7, RANK, WORLD)
            row += CHUNK * programs
        row = pid
        while row < rows:
            offs = row * HIDDEN + cols
            x = _sendable(tl.load(x_ptr + offs, mask=mask, other=0.0), False, BITS, EMPTY)
            residual = _residual(residual_ptr, offs, mask, x, ADD_RESIDUAL)
            _gather_norm_row(
                x, residual, weight, out_ptr, residual_out_ptr, offs, mask, parity, abort_address, capacity, eps,
                buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
                HIDDEN, ADD_RESIDUAL, UNIT_OFFSET, RANK, WORLD, BITS, EMPTY,
            )  # fmt: skip
            row += programs
    else:
        offs = pid * HIDDEN + cols
        x = _sendable(tl.load(x_ptr + offs, mask=mask, other=0.0), False, BITS, EMPTY)
        residual = _residual(residual_ptr, offs, mask, x, ADD_RESIDUAL)
        _send(x, offs, mask, parity, capacity, buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7, RANK, WORLD)
        _gather_norm_row(
            x, residual, weight, out_ptr, residual_out_ptr, offs, mask, parity, abort_address, capacity, eps,
            buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
            HIDDEN, ADD_RESIDUAL, UNIT_OFFSET, RANK, WORLD, BITS, EMPTY,
        )  # fmt: skip
    tl.store(seq_ptr + pid, seq)


@dataclass(frozen=True)
class Exchange:
    """What a rank's launches share (tensor_parallel/ipc_all_reduce.py builds it): every rank's
    buffer as mapped in this process, this rank's sequence numbers, the abort word."""

    buffers: list[torch.Tensor]  # rank r's [2, ranks, capacity], empty (mark_empty) when shared
    sequences: torch.Tensor  # int32 [programs]
    abort_word: torch.Tensor  # int32 [1], pinned host memory
    capacity: int
    rank: int

    def kernel_args(self) -> list:
        """The kernels' arguments from buf0 to abort_address: every rank's buffer (the slots past
        the group's size repeat this rank's), then the rest."""
        return [*self.padded_buffers(), self.sequences, self.abort_word.data_ptr()]

    def padded_buffers(self) -> list[torch.Tensor]:
        return [*self.buffers, *[self.buffers[self.rank]] * (MAX_RANKS - len(self.buffers))]

    def takes_early_sends(self, numel: int, dtype: torch.dtype) -> bool:
        """Whether a sum of numel `dtype` elements may be sent early (send_part): one launch that
        does not loop, over these buffers' dtype."""
        held = self.buffers[0].dtype
        return dtype == held and numel <= self.capacity and programs_for(numel, dtype) <= MAX_PROGRAMS


def send_part_args(exchange: Exchange | None, dtype: torch.dtype, dummy: torch.Tensor) -> tuple[list, dict]:
    """send_part's arguments in a sending kernel (seq_ptr, capacity, buf0..buf7) and its
    constexprs (SEND, RANK, WORLD, AR_BLOCK, BITS, EMPTY); with no exchange, SEND off and `dummy`
    for the pointers, which are then never read."""
    if exchange is None:
        return [dummy, 0, *[dummy] * MAX_RANKS], dict(SEND=False, RANK=0, WORLD=1, AR_BLOCK=1, **_mark_args(dtype))
    constexprs = dict(SEND=True, RANK=exchange.rank, WORLD=len(exchange.buffers), AR_BLOCK=block_for(dtype))
    return [exchange.sequences, exchange.capacity, *exchange.padded_buffers()], constexprs | _mark_args(dtype)


# The integer types of an element's width: the empty mark is compared and written in them.
_BITS = {2: (tl.int16, torch.int16), 4: (tl.int32, torch.int32), 8: (tl.int64, torch.int64)}


def empty_mark(dtype: torch.dtype) -> int:
    """What an empty slot holds, as an integer of dtype's width: -0.0's bits for floats, -1 for
    the draw's int64 keys (a key of -1 would carry a -0.0 value, which the keys hold as +0.0)."""
    return -(1 << (8 * dtype.itemsize - 1)) if dtype.is_floating_point else -1


def mark_empty(buffer: torch.Tensor) -> None:
    buffer.view(_BITS[buffer.dtype.itemsize][1]).fill_(empty_mark(buffer.dtype))


def _mark_args(dtype: torch.dtype) -> dict:
    return {"BITS": _BITS[dtype.itemsize][0], "EMPTY": empty_mark(dtype)}


def block_for(dtype: torch.dtype) -> int:
    """Elements a program owns: 1,024 of bf16, 256 int64 keys."""
    return BLOCK_BYTES // dtype.itemsize


def programs_for(numel: int, dtype: torch.dtype) -> int:
    """Blocks of a message of numel elements (a program each, up to MAX_PROGRAMS)."""
    return triton.cdiv(numel, block_for(dtype))


def sequence_words(capacity: int, dtype: torch.dtype) -> int:
    """The sequence numbers an exchange of `capacity` elements keeps: one a program."""
    return min(programs_for(capacity, dtype), MAX_PROGRAMS)


def one_shot_all_reduce(x: torch.Tensor, exchange: Exchange, maximum: bool = False, sent: bool = False) -> None:
    """x (contiguous, at most exchange.capacity elements) summed over the ranks in place (or its
    elementwise maximum). Every rank calls it with the same numel, in the same order. sent: the
    kernel that wrote x sent it already (send_part; exchange.takes_early_sends). Launch shapes
    depend on python ints only: capturable in CUDA graphs."""
    assert x.numel() <= exchange.capacity, (x.numel(), exchange.capacity)
    assert not sent or (exchange.takes_early_sends(x.numel(), x.dtype) and not maximum), (x.shape, x.dtype)
    pdl = dependent_launch_supported(x.device)
    programs = programs_for(x.numel(), x.dtype)
    _one_shot_all_reduce_kernel[(min(programs, MAX_PROGRAMS),)](
        x,
        *exchange.kernel_args(),
        x.numel(),
        exchange.capacity,
        RANK=exchange.rank,
        WORLD=len(exchange.buffers),
        BLOCK=block_for(x.dtype),
        MAX=maximum,
        **_mark_args(x.dtype),
        LOOP=programs > MAX_PROGRAMS,
        SENT=sent,
        PDL=pdl,
        num_warps=WARPS,
        **launch_options(pdl),
    )


def one_shot_all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    exchange: Exchange,
) -> None:
    """out = rms_norm(x summed over the ranks (+ residual)), residual_out = that sum (+ residual),
    for contiguous x, residual, out and residual_out of [rows, hidden]; rows * hidden at most
    exchange.capacity. residual_out may be x or residual (a program reads its row before it writes
    it). As one_shot_all_reduce: the same calls on every rank."""
    rows, hidden = x.shape
    assert rows * hidden <= exchange.capacity, (x.shape, exchange.capacity)
    pdl = dependent_launch_supported(x.device)
    block = triton.next_power_of_2(hidden)
    add = residual is not None
    _one_shot_all_reduce_norm_kernel[(min(rows, MAX_PROGRAMS),)](
        x,
        residual if add else x,
        weight,
        out,
        residual_out,
        *exchange.kernel_args(),
        rows,
        exchange.capacity,
        eps,
        HIDDEN=hidden,
        BLOCK=block,
        ADD_RESIDUAL=add,
        UNIT_OFFSET=unit_offset,
        RANK=exchange.rank,
        WORLD=len(exchange.buffers),
        **_mark_args(x.dtype),
        LOOP=rows > MAX_PROGRAMS,
        CHUNK=min(triton.next_power_of_2(triton.cdiv(rows, MAX_PROGRAMS)), MAX_CHUNK_ROWS),
        PDL=pdl,
        num_warps=row_warps(block),  # rmsnorm.py's: the same order of the sum of squares, the same bits
        **launch_options(pdl),
    )
