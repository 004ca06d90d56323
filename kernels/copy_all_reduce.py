"""The two-rank all-reduce of prefill-sized messages through the GPUs' copy engines: the kernels.

Past the one-shot's 8 MiB (kernels/one_shot_all_reduce.py) a stage's all-reduces are prefill
chunks: 32 MiB for 4,096 tokens of an 8B model. There the one-shot's remote stores from the SMs move
about 205 GB/s and NCCL's ring 240-270; a cudaMemcpy into the peer's buffer runs on a copy engine
at 370-380 GB/s while the peer copies the other way (two H200s, bench/RESULTS.md, session 19).
With two ranks a rank sends its whole message once either way, as the ring does, so each call is:

1. this rank's part x copied into the peer's receive buffer (the copy engine, no SM);
2. signal: one thread writes the call's number into the peer's flag, a system-scope release after
   the copy ended (stream order: the copy's writes landed before this kernel starts);
3. wait_add (or wait_add_rms_norm): every program loads its part of x, waits until its own flag
   holds the call's number (the peer's copy landed), then adds the peer's part from its own
   receive buffer, in float32, rounded to x's dtype: a sum of two terms is the same bits in either
   order, so both ranks hold the same sum. The norm variant then adds the residual and normalises
   the row as rmsnorm.py does (the same rounding points as the one-shot's norm variant), so the
   launch after a row-parallel linear and the norm's own become one.

Two receive buffers and two flags alternate by the call's parity. A peer can be at most one call
ahead: its copy of call k + 2 (into the buffer this rank reads in call k) is issued after its call
k + 1 waited for this rank's signal k + 1, which this rank sends after its call k's reads ended.
Flags only grow (the call's number), so nothing resets them.

Host-side call numbers make this eager only: a captured graph would replay the numbers it was
captured with. Decode steps, which graphs replay, stay with the one-shot.

A wait gives up when the host sets the abort word (read every 1,024 spins), as the one-shot's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.rmsnorm import rms_norm_row, row_warps

BLOCK = 4096  # elements a program of the plain sum (8 KB of bf16)
WARPS = 8


# The call's number changes every call: not a specialisation (a compile) per value.
@triton.jit(do_not_specialize=["value"])
def _signal_kernel(peer_flag_ptr, value):
    """After this rank's copy into the peer's buffer: the call's number into the peer's flag."""
    tl.atomic_xchg(peer_flag_ptr, value, sem="release", scope="sys")


@triton.jit
def _wait(flag_ptr, call, abort_address):
    """Until this rank's flag holds `call` (the peer's copy of it landed) or the abort word is set.
    Each read is a system-scope acquire (an atomic, at L2): the receive buffer's loads come after."""
    abort_ptr = abort_address.to(tl.pointer_type(tl.int32))
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    spins = 0
    while seen < call:
        spins += 1
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        if spins % 1024 == 0:
            if tl.load(abort_ptr, volatile=True) != 0:
                seen = call


@triton.jit(do_not_specialize=["call"])
def _wait_add_kernel(x_ptr, recv_ptr, n, flag_ptr, call, abort_address, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)  # this rank's part: before the wait
    _wait(flag_ptr, call, abort_address)
    peer = tl.load(recv_ptr + offs, mask=mask, cache_modifier=".cg")  # (.cg: not an L1 line of the last call)
    tl.store(x_ptr + offs, (x.to(tl.float32) + peer.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit(do_not_specialize=["call"])
def _wait_add_rms_norm_kernel(
    x_ptr, recv_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    flag_ptr, call, abort_address, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ADD_RESIDUAL: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):  # fmt: skip
    """A row a program: the sum of both ranks' rows rounded to x's dtype (as NCCL returns it), plus
    the residual, stored as the residual stream and normalised."""
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    offs = tl.program_id(0).to(tl.int64) * HIDDEN + cols
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + offs, mask=mask, other=0.0)
    _wait(flag_ptr, call, abort_address)
    peer = tl.load(recv_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
    h = (x.to(tl.float32) + peer.to(tl.float32)).to(x.dtype)
    if ADD_RESIDUAL:
        h = (h.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
    tl.store(residual_out_ptr + offs, h, mask=mask)
    out = rms_norm_row(h, weight, HIDDEN, eps, UNIT_OFFSET)
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def signal(peer_flag: torch.Tensor, call: int) -> None:
    """Step 2, on the current stream after the copy: `call` into the peer's flag (an int32 slot)."""
    _signal_kernel[(1,)](peer_flag, call, num_warps=1)


def wait_add(x: torch.Tensor, recv: torch.Tensor, flag: torch.Tensor, call: int, abort_word: torch.Tensor) -> None:
    """Step 3: x += the peer's part in recv (both flat, contiguous), once flag holds `call`."""
    n = x.numel()
    _wait_add_kernel[(triton.cdiv(n, BLOCK),)](
        x, recv, n, flag, call, abort_word.data_ptr(), BLOCK=BLOCK, num_warps=WARPS
    )


def wait_add_rms_norm(
    x: torch.Tensor,
    recv: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    unit_offset: bool,
    out: torch.Tensor,
    residual_out: torch.Tensor,
    flag: torch.Tensor,
    call: int,
    abort_word: torch.Tensor,
) -> None:
    """Step 3 fused with the add and norm: out = rms_norm(x + the peer's rows (+ residual)),
    residual_out = that sum (+ residual), for contiguous [rows, hidden] tensors; residual_out may be
    x or residual (a program reads its row before it writes it)."""
    rows, hidden = x.shape
    block = triton.next_power_of_2(hidden)
    add = residual is not None
    _wait_add_rms_norm_kernel[(rows,)](
        x,
        recv,
        residual if add else x,
        weight,
        out,
        residual_out,
        flag,
        call,
        abort_word.data_ptr(),
        eps,
        HIDDEN=hidden,
        BLOCK=block,
        ADD_RESIDUAL=add,
        UNIT_OFFSET=unit_offset,
        num_warps=row_warps(block),  # rmsnorm.py's: the same order of the sum of squares, the same bits
    )
