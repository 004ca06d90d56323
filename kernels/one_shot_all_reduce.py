"""A one-shot all-reduce of a small message over buffers that every rank has mapped (CUDA IPC),
in one Triton launch that chains with the kernels around it (programmatic dependent launch).

A decode step of a T-way stage runs two all-reduces a layer, each of a few KB to a few hundred KB.
NCCL's kernel is not a programmatic dependent: the next layer's GEMV cannot stream its weights
until NCCL's kernel has ended, so every all-reduce adds its whole latency to the step. This kernel
calls gdc_launch_dependents as it starts, so the GEMV after it launches and loads its weights while
the ranks meet (kernels/dependent_launch.py).

Each program owns 2 KB of the message (BLOCK elements). It:
1. waits for the kernel before it (gdc_wait), reads its elements of x;
2. writes them into slot RANK of every rank's buffer (its own included: remote stores over
   NVLink, posted, not read round trips);
3. signals each rank: flag[RANK][program] = this call's sequence number, a system-scope release
   after a CTA barrier, so every thread's stores are visible before the flag is;
4. waits until every rank's flag for this program holds the sequence number (acquire loads), then
   sums the T slots in rank order in float32 and stores the sum over x: every rank the same bits
   (or takes their maximum: the sampler's draw over vocabulary slices, one int64 key a row).

The norm variant (one_shot_all_reduce_add_rms_norm) gives each program a whole row of a
row-parallel output and, after step 4, adds the residual and normalises the row as rmsnorm.py
does: the launch after o_proj or down, and the norm's own launch, become one.

Sequence numbers, not flags reset to zero: each program keeps its own count of calls in this
rank's memory (programs past a call's grid miss that call on every rank alike, since every rank
runs the same message sizes), so nothing is cleared between calls. Buffers alternate by the
parity of the sequence number: a rank can be at most one call ahead of a slower peer (it cannot
finish call k + 1 before the peer signalled it, which the peer does only after finishing call k),
so call k + 2, which reuses call k's buffer, never overwrites what the peer still reads. That
holds per program because a program always owns the same part of the buffers: so one set of
buffers serves one kind of call (the sum, the maximum, or rows of one width for the norm).

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
BLOCK_BYTES = 2048  # what a program owns: 16 bytes a thread at 4 warps (one vector; more spilled int64)
WARPS = 4


@triton.jit
def _wait_for_sequence(flag_ptr, seq, abort_ptr):
    """Spin until *flag_ptr == seq (acquire, system scope: the signalling rank's stores before its
    release are visible to this thread's later loads) or the abort word is set. Every thread spins
    itself, so every thread's later loads are ordered after its own acquire."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred waiting;
        .reg .b32 seen, spins, low, stop;
        mov.b32 spins, 0;
        SPIN:
        ld.acquire.sys.global.b32 seen, [$1];
        setp.ne.s32 waiting, seen, $2;
        @!waiting bra DONE;
        add.s32 spins, spins, 1;
        and.b32 low, spins, 1023;
        setp.ne.s32 waiting, low, 0;
        @waiting bra SPIN;
        ld.volatile.global.b32 stop, [$3];
        setp.eq.s32 waiting, stop, 0;
        @waiting bra SPIN;
        DONE:
        mov.b32 $0, seen;
        }""",
        "=r,l,r,l",
        [flag_ptr, seq, abort_ptr],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


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
def _exchange(
    x, offs, mask, pid, seq_ptr, abort_address, capacity, max_programs,
    buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
    flag0, flag1, flag2, flag3, flag4, flag5, flag6, flag7,
    RANK: tl.constexpr, WORLD: tl.constexpr, MAX: tl.constexpr,
):  # fmt: skip
    """Steps 2-4 for this program's elements x (at offs): every rank's, summed in float32 in rank
    order (or their maximum, in x's dtype). After gdc_wait: the sequence number is read here."""
    seq = tl.load(seq_ptr + pid) + 1  # this program's alone: no other program touches it
    parity = seq % 2
    for r in tl.static_range(WORLD):
        buffer = _nth(r, buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7)
        tl.store(buffer + (parity * WORLD + RANK) * capacity + offs, x, mask=mask)
    tl.debug_barrier()  # every thread's stores before the one release below
    for r in tl.static_range(WORLD):
        flags = _nth(r, flag0, flag1, flag2, flag3, flag4, flag5, flag6, flag7)
        tl.atomic_xchg(flags + RANK * max_programs + pid, seq, sem="release", scope="sys")
    own_flags = _nth(RANK, flag0, flag1, flag2, flag3, flag4, flag5, flag6, flag7)
    own = _nth(RANK, buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7)
    abort_ptr = abort_address.to(tl.pointer_type(tl.int32))
    _wait_for_sequence(own_flags + pid, seq, abort_ptr)
    total = tl.load(own + parity * WORLD * capacity + offs, mask=mask, volatile=True)  # rank 0's
    if not MAX:
        total = total.to(tl.float32)
    for r in tl.static_range(1, WORLD):
        _wait_for_sequence(own_flags + r * max_programs + pid, seq, abort_ptr)
        part = tl.load(own + (parity * WORLD + r) * capacity + offs, mask=mask, volatile=True)
        if MAX:
            total = tl.maximum(total, part)
        else:
            total += part.to(tl.float32)
    tl.store(seq_ptr + pid, seq)
    return total


@triton.jit
def _one_shot_all_reduce_kernel(
    x_ptr,
    # Each rank's buffer ([2, WORLD, capacity] of x's dtype) and flags ([WORLD, max programs]
    # int32) as mapped here; ranks past WORLD repeat this rank's. Pointers, not addresses in an
    # array: Triton then knows their alignment and moves 16 bytes a thread at a time.
    buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
    flag0, flag1, flag2, flag3, flag4, flag5, flag6, flag7,
    seq_ptr,  # int32 [max programs]: this rank's calls so far, per program
    abort_address,  # of an int32 in pinned host memory (the same address on the device: UVA)
    n,
    capacity,
    max_programs,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    MAX: tl.constexpr,  # the elementwise maximum (the sampler's packed draw keys) instead of the sum
    PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if PDL:
        # Before the sequence number too: the previous call may still be running until then (it
        # let its successor launch early, and that one let this one).
        gdc_wait()
    x = tl.load(x_ptr + offs, mask=mask)
    total = _exchange(
        x, offs, mask, pid, seq_ptr, abort_address, capacity, max_programs,
        buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
        flag0, flag1, flag2, flag3, flag4, flag5, flag6, flag7,
        RANK, WORLD, MAX,
    )  # fmt: skip
    tl.store(x_ptr + offs, total.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _one_shot_all_reduce_norm_kernel(
    x_ptr,  # [rows, HIDDEN]: this rank's partial row-parallel output
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
    flag0, flag1, flag2, flag3, flag4, flag5, flag6, flag7,
    seq_ptr,
    abort_address,
    capacity,
    max_programs,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One row a program: its all-reduce, then kernels/rmsnorm.py's add and norm, rounded at the
    same points (the sum in the activation dtype, as NCCL returns it; the residual sum; the
    normalised row): the same bits as the one-shot followed by fused_add_rms_norm."""
    row = tl.program_id(0)
    if PDL:
        gdc_launch_dependents()
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # constant: before the wait
    if PDL:
        gdc_wait()
    offs = row * HIDDEN + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + offs, mask=mask, other=0.0)  # streams while the ranks meet
    total = _exchange(
        x, offs, mask, row, seq_ptr, abort_address, capacity, max_programs,
        buf0, buf1, buf2, buf3, buf4, buf5, buf6, buf7,
        flag0, flag1, flag2, flag3, flag4, flag5, flag6, flag7,
        RANK, WORLD, False,
    )  # fmt: skip
    h = total.to(x_ptr.dtype.element_ty)
    if ADD_RESIDUAL:
        h = (h.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
    tl.store(residual_out_ptr + offs, h, mask=mask)  # the residual stream after this layer's add
    out = rms_norm_row(h, weight, HIDDEN, eps, UNIT_OFFSET)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Exchange:
    """What a rank's launches share (tensor_parallel/ipc_all_reduce.py builds it): every rank's
    buffer and flags as mapped in this process, this rank's sequence numbers, the abort word."""

    buffers: list[torch.Tensor]  # rank r's [2, ranks, capacity]
    flags: list[torch.Tensor]  # rank r's int32 [ranks, programs]
    sequences: torch.Tensor  # int32 [programs]
    abort_word: torch.Tensor  # int32 [1], pinned host memory
    capacity: int
    rank: int

    def kernel_args(self) -> list:
        """The kernels' arguments from buf0 to max_programs: every rank's buffer, then its flags
        (the slots past the group's size repeat this rank's), then the rest."""
        pad = MAX_RANKS - len(self.buffers)
        return [
            *self.buffers,
            *[self.buffers[self.rank]] * pad,
            *self.flags,
            *[self.flags[self.rank]] * pad,
            self.sequences,
            self.abort_word.data_ptr(),
        ]


def block_for(dtype: torch.dtype) -> int:
    """Elements a program owns: 1,024 of bf16, 256 int64 keys."""
    return BLOCK_BYTES // dtype.itemsize


def programs_for(numel: int, dtype: torch.dtype) -> int:
    return triton.cdiv(numel, block_for(dtype))


def one_shot_all_reduce(x: torch.Tensor, exchange: Exchange, maximum: bool = False) -> None:
    """x (contiguous, at most exchange.capacity elements) summed over the ranks in place (or its
    elementwise maximum). Every rank calls it with the same numel, in the same order. Launch
    shapes depend on python ints only: capturable in CUDA graphs."""
    pdl = dependent_launch_supported(x.device)
    _one_shot_all_reduce_kernel[(programs_for(x.numel(), x.dtype),)](
        x,
        *exchange.kernel_args(),
        x.numel(),
        exchange.capacity,
        exchange.sequences.numel(),
        RANK=exchange.rank,
        WORLD=len(exchange.buffers),
        BLOCK=block_for(x.dtype),
        MAX=maximum,
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
    exchange.capacity, rows at most its programs. residual_out may be x or residual (a program
    reads its row before it writes it). As one_shot_all_reduce: the same calls on every rank."""
    rows, hidden = x.shape
    pdl = dependent_launch_supported(x.device)
    block = triton.next_power_of_2(hidden)
    add = residual is not None
    _one_shot_all_reduce_norm_kernel[(rows,)](
        x,
        residual if add else x,
        weight,
        out,
        residual_out,
        *exchange.kernel_args(),
        exchange.capacity,
        exchange.sequences.numel(),
        eps,
        HIDDEN=hidden,
        BLOCK=block,
        ADD_RESIDUAL=add,
        UNIT_OFFSET=unit_offset,
        RANK=exchange.rank,
        WORLD=len(exchange.buffers),
        PDL=pdl,
        num_warps=row_warps(block),  # rmsnorm.py's: the same order of the sum of squares, the same bits
        **launch_options(pdl),
    )
