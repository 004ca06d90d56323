"""A one-shot all-reduce for small messages (a decode step's row-parallel outputs) through torch's
symmetric memory, without NVLink multicast (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, set in every
process Strata starts): one kernel copies each rank's partial into a buffer every rank has mapped,
meets the other ranks at a barrier, and sums every rank's buffer in rank order, so every rank holds
the same bits, as with NCCL. One launch (torch's copy-in variant: no separate copy, a launch less
per all-reduce) and no ring steps, where NCCL's latency dominates a message of a few kilobytes.
Captured in the CUDA graphs like NCCL's.

`--tensor-parallel-all-reduce symm-mem` turns it on; messages past its buffer, and other dtypes,
take NCCL. python -m strata.bench.all_reduce times both per message size.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

log = logging.getLogger("strata.worker")

# Largest message (bytes) the one-shot takes: past it every rank reads every other's whole
# buffer, and NCCL's ring moves less.
MAX_BYTES = 512 * 1024


class SymmetricMemoryAllReduce:
    """The group `pg` (rank `rank` of `size`, formed through `store`) with a symmetric buffer of
    MAX_BYTES of `dtype`. Construct on every rank at once (the rendezvous is collective)."""

    def __init__(
        self,
        pg,
        store,
        rank: int,
        size: int,
        session: int,
        device: torch.device,
        dtype: torch.dtype,
        max_bytes: int = MAX_BYTES,
    ):
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory

        self.name = f"strata-tp-{session}"
        store = dist.PrefixStore(f"strata/symm/{session}/", store)  # this session's keys only
        # The registry keeps only a weak reference: this one keeps the group alive.
        self.process_group = _as_process_group(pg, store, rank, size, device)
        _register_process_group(self.name, self.process_group)
        if hasattr(_SymmetricMemory, "set_group_info"):  # torch versions that want it told
            try:
                _SymmetricMemory.set_group_info(self.name, rank, size, store)
            except RuntimeError as e:  # (told already)
                log.debug("symmetric memory: %s", e)
        self.dtype = dtype
        self.capacity = max_bytes // torch.empty((), dtype=dtype).element_size()
        self.buffer = symm_mem.empty(self.capacity, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.name)
        self.op = torch.ops.symm_mem.one_shot_all_reduce_copy_out

    def __call__(self, x: torch.Tensor) -> bool:
        """x summed over the ranks in place; False (nothing done) when x is not for it. In place is
        safe: each thread copies its elements of x into the buffer before the barrier and writes
        the same elements' sums after it; the others read only the buffer."""
        n = x.numel()
        if x.dtype != self.dtype or n > self.capacity or not x.is_contiguous():
            return False
        if x.data_ptr() % 16:  # torch's kernel wants x aligned as the buffer is (NCCL takes no such view)
            return False
        flat = x.view(-1)
        self.op(self.buffer[:n], flat, "sum", self.name, flat)
        return True


def _as_process_group(backend, store, rank: int, size: int, device: torch.device) -> dist.ProcessGroup:
    """The group's backend (NCCL; gloo on CPUs) inside a ProcessGroup, the type symmetric memory's
    registry takes: torch 2.11 refuses the bare backend, so the one-shot never formed before."""
    group = dist.ProcessGroup(store, rank, size)
    kind = dist.ProcessGroup.BackendType.NCCL if device.type == "cuda" else dist.ProcessGroup.BackendType.GLOO
    group._set_default_backend(kind)
    group._register_backend(torch.device(device.type), kind, backend)
    return group
