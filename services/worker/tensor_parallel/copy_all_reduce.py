"""Two ranks' all-reduce of prefill-sized messages through the copy engines
(kernels/copy_all_reduce.py): the receive buffers and flags each rank shares by CUDA IPC, the call
numbers, and the abort word.

With `--tensor-parallel-all-reduce ipc` and two ranks it takes what the one-shot
(ipc_all_reduce.py) cannot: messages past its 8 MiB, eagerly (not in a graph capture). A message
past this one's buffer goes in parts of it, one call each. Every rank makes the same calls in the
same order (the same plans, the same sizes), so the call numbers agree without a word between them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from strata.services.worker.tensor_parallel.ipc_all_reduce import exported_handle, peer_memory

# Bytes a message carries at most: 8,192 tokens of an 8B model's 4,096-wide rows in bf16. Two such
# receive buffers a rank (the parities). Longer messages go in parts, a message each.
MAX_BYTES = 64 * 1024 * 1024
# A message goes in up to PIECES pieces of at least MIN_PIECE_BYTES: the copy stream copies piece
# i + 1 while the add of piece i runs, so only the last piece's add follows the copies.
PIECES = 4
MIN_PIECE_BYTES = 4 * 1024 * 1024
# Buffers of earlier sessions: a kernel released by their abort word may still be reading them.
_RETIRED: list[CopyEngineAllReduce] = []


@dataclass
class Sent:
    """A message's pieces as this rank sent them: each one's element range, and the event after its
    copy (None on CPU), to wait for before its add overwrites x."""

    call: int
    parity: int
    bounds: list[tuple[int, int]]
    copied: list


class CopyEngineAllReduce:
    """Rank `rank` of two: construct on both ranks of the session at once (each waits in `store`
    for the other's buffers)."""

    def __init__(
        self,
        store,
        rank: int,
        session: int,
        device: torch.device,
        dtype: torch.dtype,
        max_bytes: int = MAX_BYTES,
        timeout: float = 60.0,
        min_bytes: int = 0,
    ):
        self.dtype, self.rank = dtype, rank
        self.capacity = max_bytes // dtype.itemsize
        self.min_numel = min_bytes // dtype.itemsize  # smaller messages are the one-shot's
        self.aborted = False
        self.calls = 0
        self.recv = torch.empty(2 * self.capacity, dtype=dtype, device=device)
        self.flags = torch.zeros(2 * PIECES, dtype=torch.int32, device=device)
        self.abort_word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.copy_stream = torch.cuda.Stream(device)
        torch.cuda.synchronize(device)  # the flags are zero before the peer can write them
        keys = dist.PrefixStore(f"strata/copy-engine/{session}/", store)
        keys.set(f"recv{rank}", exported_handle(self.recv))
        keys.set(f"flags{rank}", exported_handle(self.flags))
        peer = 1 - rank
        keys.wait([f"recv{peer}", f"flags{peer}"], datetime.timedelta(seconds=timeout))
        # (The peer's memory stays mapped while these tensors live.)
        self.peer_recv = peer_memory(keys.get(f"recv{peer}"), device, dtype, self.recv.numel())
        self.peer_flags = peer_memory(keys.get(f"flags{peer}"), device, torch.int32, self.flags.numel())

    def _takes(self, x: torch.Tensor) -> bool:
        """Every rank decides alike: the same dtype, sizes and captures on each."""
        return (
            not self.aborted
            and x.dtype == self.dtype
            and x.device == self.recv.device
            and x.is_contiguous()
            and x.numel() >= self.min_numel
            and not (x.is_cuda and torch.cuda.is_current_stream_capturing())
        )

    def _bounds(self, numel: int, unit: int) -> list[tuple[int, int]]:
        """A message's pieces: element ranges of whole units (rows, for the norm)."""
        units = numel // unit
        pieces = max(1, min(PIECES, numel * self.dtype.itemsize // MIN_PIECE_BYTES, units))
        per = -(-units // pieces)
        return [(u * unit, min(u + per, units) * unit) for u in range(0, units, per)]

    def _send(self, message: torch.Tensor, unit: int = 1) -> Sent:
        """Steps 1-2 of a message (at most the buffer), piece by piece on the copy stream, after
        what the current stream did so far: each piece into the peer's receive buffer of the
        message's parity, then the message's number into that piece's flag there."""
        from strata.kernels.copy_all_reduce import signal

        self.calls += 1
        sent = Sent(self.calls, self.calls % 2, self._bounds(message.numel(), unit), [])
        flat, base = message.view(-1), sent.parity * self.capacity
        stream = self.copy_stream if message.is_cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(message.device))
        with torch.cuda.stream(stream):
            for i, (a, b) in enumerate(sent.bounds):
                self.peer_recv[base + a : base + b].copy_(flat[a:b])
                signal(self.peer_flags[sent.parity * PIECES + i :][:1], sent.call)
                sent.copied.append(None if stream is None else stream.record_event())
        return sent

    def _pieces(self, sent: Sent):
        """Step 3's arguments, piece by piece, on the current stream once the piece's copy left x:
        its element range, this rank's receive buffer and flag for it."""
        base = sent.parity * self.capacity
        for i, (a, b) in enumerate(sent.bounds):
            if sent.copied[i] is not None:
                torch.cuda.current_stream().wait_event(sent.copied[i])
            yield a, b, self.recv[base + a : base + b], self.flags[sent.parity * PIECES + i :][:1]

    def __call__(self, x: torch.Tensor) -> bool:
        """x summed over both ranks in place; False (nothing done) when x is not for it."""
        from strata.kernels.copy_all_reduce import wait_add

        if not self._takes(x):
            return False
        for message in x.view(-1).split(self.capacity):
            sent = self._send(message)
            for a, b, recv, flag in self._pieces(sent):
                wait_add(message[a:b], recv, flag, sent.call, self.abort_word)
        return True

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        unit_offset: bool = False,
        residual_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """As IpcAllReduce.add_rms_norm: (rms_norm(x summed + residual), that sum + residual), rows
        past the buffer in parts; None (nothing done) when x is not for it."""
        from strata.kernels.copy_all_reduce import wait_add_rms_norm
        from strata.kernels.rmsnorm import norm_output_dtype

        if x.dim() != 2 or not self._takes(x) or x.shape[1] > self.capacity:
            return None
        if residual is not None and not (residual.is_contiguous() and residual.dtype == x.dtype):
            return None
        if residual_out is not None and not residual_out.is_contiguous():
            return None
        out = torch.empty(x.shape, dtype=norm_output_dtype(x, weight, unit_offset), device=x.device)
        if residual is None:
            residual_out = x  # the sum alone, in place (a program reads its row first)
        elif residual_out is None:
            residual_out = torch.empty_like(x)
        width = x.shape[1]
        rows = self.capacity // width
        for start in range(0, x.shape[0], rows):
            sent = self._send(x[start : start + rows], unit=width)
            for a, b, recv, flag in self._pieces(sent):
                part = slice(start + a // width, start + b // width)
                wait_add_rms_norm(
                    x[part],
                    recv,
                    None if residual is None else residual[part],
                    weight,
                    eps,
                    unit_offset,
                    out[part],
                    residual_out[part],
                    flag,
                    sent.call,
                    self.abort_word,
                )
        return out, residual_out

    def abort(self) -> None:
        """Releases every wait of this rank's kernels, now and later (their sums are garbage)."""
        self.aborted = True
        self.abort_word[0] = 1
        _RETIRED.append(self)
