"""Two ranks' all-reduce of prefill-sized messages through the copy engines, waited on in the
streams' front ends: `--tensor-parallel-copy-engine` (with `--tensor-parallel-all-reduce ipc`).

Past the one-shot's 8 MiB (ipc_all_reduce.py) a stage's all-reduces are prefill chunks: 32 MiB for
4,096 tokens of an 8B model. NCCL moves 240-270 GB/s there on two H200s; a cudaMemcpy into the
peer's buffer runs on a copy engine at 370-380 GB/s while the peer copies the other way
(bench/peer_copy.py). With two ranks each sends its whole message once either way, as NCCL's ring
does. A message goes in up to PIECES pieces; for each:
1. the copy stream (after what the current stream queued so far) copies the piece into the peer's
   receive buffer of the message's parity, then writes the message's number into the peer's word
   for that piece (cuStreamWriteValue32, behind a memory barrier: the copy landed first);
2. the current stream waits for this rank's own copy of the piece (it is about to overwrite it),
   then for its own word to reach the message's number (cuStreamWaitValue32: no SM held), then
   adds the peer's piece (kernels/copy_all_reduce.py), fused with the residual add and RMSNorm
   where the layer norms next.
The copy of piece i + 1 runs while piece i is added.

Words live in host memory (stream_memops.SharedWords, a /dev/shm file both ranks map): the host can
release its own waits with a plain store when the group is torn down. Two receive buffers and two
sets of words alternate by the message's parity. A peer is at most one message ahead: its copies of
message m + 2 (into the buffer this rank reads in message m) follow, on its copy stream, its
current stream's adds of message m + 1, which waited for this rank's words of m + 1, written after
this rank's copy stream was ordered after its own adds of message m. Words only grow (the message's
number, which every rank counts alike: the same plans, the same sizes), so nothing resets them.

The numbers are the host's, so this runs eagerly only: a captured graph would replay the numbers it
was captured with. Decode steps, which graphs replay, stay with the one-shot.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from strata.services.worker.tensor_parallel.ipc_all_reduce import exported_handle, peer_memory

# Bytes a message carries at most: 8,192 tokens of an 8B model's 4,096-wide rows in bf16. Two such
# receive buffers a rank (the parities). Longer all-reduces go in several messages.
MAX_BYTES = 64 * 1024 * 1024
# A message's pieces: up to PIECES, of at least MIN_PIECE_BYTES (a piece's add then costs less
# than the next piece's copy, which it overlaps).
PIECES = 4
MIN_PIECE_BYTES = 4 * 1024 * 1024
RELEASED = 2**31 - 1  # a word's value that every wait passes (the group was torn down)
# Buffers and words of earlier sessions: operations queued before an abort may still use them.
_RETIRED: list[CopyEngineAllReduce] = []


@dataclass
class Sent:
    """A message as this rank sent it: its number and parity, each piece's element range, and
    the event after each piece's copy (what this rank's add of the piece waits for)."""

    call: int
    parity: int
    bounds: list[tuple[int, int]]
    copied: list


class CopyEngineAllReduce:
    """Rank `rank` of two: construct on both ranks of the session at once (each waits in `store`
    for the other's buffer, rank 1 for rank 0's words)."""

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
        from strata.services.worker.transport import stream_memops

        if not stream_memops.usable(device):
            raise RuntimeError("the stream memory operations are unusable here")
        self.dtype, self.rank = dtype, rank
        self.capacity = max_bytes // dtype.itemsize
        self.min_numel = min_bytes // dtype.itemsize  # smaller messages are the one-shot's
        self.aborted = False
        self.calls = 0
        self.recv = torch.empty(2 * self.capacity, dtype=dtype, device=device)
        self.copy_stream = torch.cuda.Stream(device)
        keys = dist.PrefixStore(f"strata/copy-engine/{session}/", store)
        count = 2 * 2 * PIECES  # [owner rank, parity, piece]
        if rank == 0:
            self.words = stream_memops.SharedWords.create(count, device)
            keys.set("words", self.words.path)
        torch.cuda.synchronize(device)
        keys.set(f"recv{rank}", exported_handle(self.recv))
        peer = 1 - rank
        keys.wait(["words", f"recv{peer}"], datetime.timedelta(seconds=timeout))
        if rank == 1:
            self.words = stream_memops.SharedWords(keys.get("words").decode(), count, False, device)
            self.words.unlink()  # (both have it mapped)
        # (The peer's memory stays mapped while this tensor lives.)
        self.peer_recv = peer_memory(keys.get(f"recv{peer}"), device, dtype, self.recv.numel())

    def _takes(self, x: torch.Tensor) -> bool:
        """Every rank decides alike: the same dtype, sizes and captures on each."""
        return (
            not self.aborted
            and x.dtype == self.dtype
            and x.device == self.recv.device
            and x.is_contiguous()
            and x.numel() >= self.min_numel
            and not torch.cuda.is_current_stream_capturing()
        )

    def _bounds(self, numel: int, unit: int) -> list[tuple[int, int]]:
        """A message's pieces: element ranges of whole units (rows, for the norm)."""
        units = numel // unit
        pieces = max(1, min(PIECES, numel * self.dtype.itemsize // MIN_PIECE_BYTES, units))
        per = -(-units // pieces)
        return [(u * unit, min(u + per, units) * unit) for u in range(0, units, per)]

    def _word(self, owner: int, parity: int, piece: int) -> int:
        return self.words.address((owner * 2 + parity) * PIECES + piece)

    def _send(self, message: torch.Tensor, unit: int = 1) -> Sent:
        """Step 1 for a message (at most the buffer), piece by piece on the copy stream."""
        from strata.services.worker.transport.stream_memops import write

        self.calls += 1
        sent = Sent(self.calls, self.calls % 2, self._bounds(message.numel(), unit), [])
        flat, base, stream = message.view(-1), sent.parity * self.capacity, self.copy_stream
        stream.wait_stream(torch.cuda.current_stream(message.device))
        with torch.cuda.stream(stream):
            for i, (a, b) in enumerate(sent.bounds):
                self.peer_recv[base + a : base + b].copy_(flat[a:b])
                sent.copied.append(stream.record_event())
                write(stream, self._word(1 - self.rank, sent.parity, i), sent.call)
        return sent

    def _pieces(self, sent: Sent):
        """Step 2's waits, piece by piece on the current stream; yields each piece's element range
        and the peer's part of it in this rank's receive buffer, to add."""
        from strata.services.worker.transport.stream_memops import wait_geq

        stream, base = torch.cuda.current_stream(), sent.parity * self.capacity
        for i, (a, b) in enumerate(sent.bounds):
            stream.wait_event(sent.copied[i])
            wait_geq(stream, self._word(self.rank, sent.parity, i), sent.call)
            yield a, b, self.recv[base + a : base + b]

    def __call__(self, x: torch.Tensor) -> bool:
        """x summed over both ranks in place; False (nothing done) when x is not for it."""
        from strata.kernels.copy_all_reduce import add_

        if not self._takes(x):
            return False
        for message in x.view(-1).split(self.capacity):
            for a, b, peer in self._pieces(self._send(message)):
                add_(message[a:b], peer)
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
        """As IpcAllReduce.add_rms_norm: (rms_norm(x summed + residual), that sum + residual), in
        pieces of whole rows; None (nothing done) when x is not for it."""
        from strata.kernels.copy_all_reduce import add_rms_norm
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
            for a, b, peer in self._pieces(self._send(x[start : start + rows], unit=width)):
                part = slice(start + a // width, start + b // width)
                add = None if residual is None else residual[part]
                add_rms_norm(x[part], peer, add, weight, eps, unit_offset, out[part], residual_out[part])
        return out, residual_out

    def abort(self) -> None:
        """Releases this rank's waits, queued and later (their sums are garbage): the group is
        being torn down because the peer is gone or late."""
        self.aborted = True
        own = slice(self.rank * 2 * PIECES, (self.rank + 1) * 2 * PIECES)
        self.words.host[own] = RELEASED
        _RETIRED.append(self)
