"""Strata's own one-shot all-reduce (kernels/one_shot_all_reduce.py) for a stage's decode messages:
the buffers it writes into, shared between the ranks by CUDA IPC, and the word that releases its
waits when the group is torn down.

`--tensor-parallel-all-reduce ipc` (the default) turns it on. Unlike NCCL's kernel and torch's symmetric-memory
one-shot it is a programmatic dependent launch: the GEMV after it streams its weights while the
ranks meet. Messages past its buffer, and other dtypes, take NCCL. Ranks of one GPU can use it too
(CUDA IPC within a device), which is how one GPU tests it: symmetric memory refuses that.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from strata.services.worker.transport.ring import export_memory, open_memory
from strata.v1 import engine_pb2

log = logging.getLogger("strata.worker")

# Largest message (bytes). With two ranks each sends the whole message once, as NCCL's ring does
# (half in its reduce-scatter, half in its all-gather), with one launch and no round trips. Up to
# where it beat NCCL on two H200s (bench/RESULTS.md, "Prefill's all-reduces through the one-shot"):
# the sum alone to 16 MiB (82.9 against 94.4 us; at 24 MiB NCCL's 128 won), the sum fused with the
# add and norm to 32 MiB, an 8B model's 4,096-token prefill rows (140 against NCCL-then-norm's 161
# us). With more ranks each sends the message to every peer, T - 1 times what the ring moves: there
# it stays at the small messages it was measured on.
MAX_BYTES_TWO_RANKS = 16 * 1024 * 1024
MAX_NORM_BYTES_TWO_RANKS = 32 * 1024 * 1024
MAX_BYTES = 512 * 1024
# The draw's maximum: one int64 key a row, for a decode batch of up to 2,048 rows.
MAX_KEY_BYTES = 16 * 1024
# What a set of buffers serves: sums (in place), maxima (the draw's int64 keys), or sums fused with
# the residual add and RMSNorm after them (add_rms_norm).
KINDS = ("sum", "max", "norm")
# Buffers of earlier sessions: a kernel released by their abort word may still be reading them.
_RETIRED: list[IpcAllReduce] = []


class IpcAllReduce:
    """Rank `rank` of `size`: construct on every rank of the session at once (each waits in
    `store` for the others' buffers)."""

    def __init__(
        self,
        store,
        rank: int,
        size: int,
        session: int,
        device: torch.device,
        dtype: torch.dtype,
        max_bytes: int | None = None,
        timeout: float = 60.0,
        kind: str = "sum",
    ):
        from strata.kernels.one_shot_all_reduce import MAX_RANKS, Exchange, mark_empty, sequence_words

        if size > MAX_RANKS:
            raise ValueError(f"the one-shot all-reduce takes at most {MAX_RANKS} ranks")
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {KINDS}")
        # One kind of call a set of buffers: a program owns the same part of them in every call,
        # which the parity argument in kernels/one_shot_all_reduce.py needs.
        self.kind, self.dtype = kind, dtype
        self.aborted = False
        # add_rms_norm's rows: a program owns one, the same place in the buffers only at one width.
        self.row_width: int | None = None
        if max_bytes is None:
            two_ranks = MAX_NORM_BYTES_TWO_RANKS if kind == "norm" else MAX_BYTES_TWO_RANKS
            max_bytes = two_ranks if size == 2 else MAX_BYTES
        self.capacity = max_bytes // dtype.itemsize
        # [2 parities, size slots, capacity]: slot r holds rank r's part of the call, marked
        # empty until it lands (this rank's own slots stay unused: its part is in registers).
        self.buffer = torch.empty(2 * size * self.capacity, dtype=dtype, device=device)
        mark_empty(self.buffer)
        self.sequences = torch.zeros(sequence_words(self.capacity, dtype), dtype=torch.int32, device=device)
        self.abort_word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        torch.cuda.synchronize(device)  # marked before any peer can see them
        keys = dist.PrefixStore(f"strata/ipc/{session}/{kind}/", store)
        keys.set(str(rank), exported_handle(self.buffer))
        keys.wait([str(r) for r in range(size)], datetime.timedelta(seconds=timeout))
        buffers = [
            self.buffer if r == rank else peer_memory(keys.get(str(r)), device, dtype, self.buffer.numel())
            for r in range(size)
        ]
        # (The peers' memory stays mapped while these tensors live.)
        self.exchange = Exchange(buffers, self.sequences, self.abort_word, self.capacity, rank)

    def __call__(self, x: torch.Tensor) -> bool:
        """x summed over the ranks in place (or its maximum); False (nothing done) when x is not
        for it."""
        from strata.kernels.one_shot_all_reduce import one_shot_all_reduce

        if self.kind == "norm" or self.aborted or x.dtype != self.dtype or x.numel() > self.capacity:
            return False
        if not x.is_contiguous():
            return False
        one_shot_all_reduce(x.view(-1), self.exchange, maximum=self.kind == "max")
        return True

    def takes_early_sends(self, numel: int, dtype: torch.dtype) -> bool:
        """Whether the kernel that computes a sum of numel elements may send them itself
        (kernels/one_shot_all_reduce.py, "Sent early"), to be finished by receive()."""
        return self.kind == "sum" and not self.aborted and self.exchange.takes_early_sends(numel, dtype)

    def receive(self, x: torch.Tensor) -> None:
        """The sum of x in place, whose kernel sent this rank's part already: the one-shot's
        launch only waits for the peers' parts and adds them."""
        from strata.kernels.one_shot_all_reduce import one_shot_all_reduce

        one_shot_all_reduce(x.view(-1), self.exchange, sent=True)

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        unit_offset: bool = False,
        residual_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rms_norm(x summed over the ranks + residual), that sum + residual) in one launch, as
        RMSNorm.add_and_norm gives them after an all-reduce; None (nothing done) when x is not for it."""
        from strata.kernels.one_shot_all_reduce import one_shot_all_reduce_add_rms_norm
        from strata.kernels.rmsnorm import norm_output_dtype

        if self.kind != "norm" or x.dim() != 2 or x.dtype != self.dtype or self.aborted or not x.is_contiguous():
            return None
        rows, width = x.shape
        if rows * width > self.capacity or self.row_width not in (None, width):
            return None
        if residual is not None and not (residual.is_contiguous() and residual.dtype == x.dtype):
            return None
        if residual_out is not None and not residual_out.is_contiguous():
            return None
        self.row_width = width
        out = torch.empty(x.shape, dtype=norm_output_dtype(x, weight, unit_offset), device=x.device)
        if residual is None:
            residual_out = x  # the sum alone, in place (a program reads its row first)
        elif residual_out is None:
            residual_out = torch.empty_like(x)
        one_shot_all_reduce_add_rms_norm(x, residual, weight, eps, unit_offset, out, residual_out, self.exchange)
        return out, residual_out

    def abort(self) -> None:
        """Releases every wait of this rank's kernels, now and later (their sums are garbage):
        the group is being torn down because a peer is gone or late."""
        self.aborted = True
        self.abort_word[0] = 1
        _RETIRED.append(self)


def exported_handle(t: torch.Tensor) -> bytes:
    """t's CUDA IPC handle, without the event that torch would have a peer wait on before using
    it: t is initialised and synchronized already, and a peer on another GPU would have to open an
    event of this GPU's only to wait on nothing."""
    m = export_memory(t)
    m.event_handle, m.event_sync_required = b"", False
    return m.SerializeToString()


def peer_memory(raw: bytes, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A peer's tensor of exported_handle, mapped here."""
    m = engine_pb2.CudaIpcMemory()
    m.ParseFromString(raw)
    return open_memory(m, device, dtype, numel)
