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

import torch
import torch.distributed as dist

from strata.services.worker.tensor_parallel.ipc_all_reduce import exported_handle, peer_memory

# Bytes a call carries at most: 8,192 tokens of an 8B model's 4,096-wide rows in bf16. Two such
# receive buffers a rank (the parities).
MAX_BYTES = 64 * 1024 * 1024
# Buffers of earlier sessions: a kernel released by their abort word may still be reading them.
_RETIRED: list[CopyEngineAllReduce] = []


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
        self.flags = torch.zeros(2, dtype=torch.int32, device=device)
        self.abort_word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        torch.cuda.synchronize(device)  # the flags are zero before the peer can write them
        keys = dist.PrefixStore(f"strata/copy-engine/{session}/", store)
        keys.set(f"recv{rank}", exported_handle(self.recv))
        keys.set(f"flags{rank}", exported_handle(self.flags))
        peer = 1 - rank
        keys.wait([f"recv{peer}", f"flags{peer}"], datetime.timedelta(seconds=timeout))
        # (The peer's memory stays mapped while these tensors live.)
        self.peer_recv = peer_memory(keys.get(f"recv{peer}"), device, dtype, self.recv.numel())
        self.peer_flags = peer_memory(keys.get(f"flags{peer}"), device, torch.int32, 2)

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

    def _send(self, part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Steps 1-2 of a call: part into the peer's receive buffer of the call's parity, then the
        call's number into its flag. Returns this rank's buffer and flag to wait on, and the number."""
        from strata.kernels.copy_all_reduce import signal

        self.calls += 1
        parity = self.calls % 2
        start = parity * self.capacity
        self.peer_recv[start : start + part.numel()].copy_(part.view(-1))
        signal(self.peer_flags[parity : parity + 1], self.calls)
        return self.recv[start : start + part.numel()], self.flags[parity : parity + 1], self.calls

    def __call__(self, x: torch.Tensor) -> bool:
        """x summed over both ranks in place; False (nothing done) when x is not for it."""
        from strata.kernels.copy_all_reduce import wait_add

        if not self._takes(x):
            return False
        for part in x.view(-1).split(self.capacity):
            recv, flag, call = self._send(part)
            wait_add(part, recv, flag, call, self.abort_word)
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
        rows = self.capacity // x.shape[1]
        for start in range(0, x.shape[0], rows):
            part = slice(start, start + rows)
            recv, flag, call = self._send(x[part])
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
                call,
                self.abort_word,
            )
        return out, residual_out

    def abort(self) -> None:
        """Releases every wait of this rank's kernels, now and later (their sums are garbage)."""
        self.aborted = True
        self.abort_word[0] = 1
        _RETIRED.append(self)
