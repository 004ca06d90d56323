"""A one-shot all-reduce for small messages (a decode step's row-parallel outputs) through torch's
symmetric memory, without NVLink multicast (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, set in every
process Strata starts): each rank copies its partial into a buffer every rank has mapped, and one
kernel reads every rank's buffer and sums them in rank order, so every rank holds the same bits,
as with NCCL. One launch and no ring steps, where NCCL's latency dominates a message of a few
kilobytes. Captured in the CUDA graphs like NCCL's.

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
        _register_process_group(self.name, pg)
        if hasattr(_SymmetricMemory, "set_group_info"):  # torch versions that want it told
            try:
                _SymmetricMemory.set_group_info(
                    self.name, rank, size, dist.PrefixStore(f"strata/symm/{session}/", store)
                )
            except RuntimeError as e:  # (told already)
                log.debug("symmetric memory: %s", e)
        self.dtype = dtype
        self.capacity = max_bytes // torch.empty((), dtype=dtype).element_size()
        self.buffer = symm_mem.empty(self.capacity, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.name)
        self.op = torch.ops.symm_mem.one_shot_all_reduce_out

    def __call__(self, x: torch.Tensor) -> bool:
        """x summed over the ranks in place; False (nothing done) when x is not for it."""
        n = x.numel()
        if x.dtype != self.dtype or n > self.capacity or not x.is_contiguous():
            return False
        staged = self.buffer[:n]
        staged.copy_(x.view(-1))
        self.op(staged, "sum", self.name, x.view(-1))
        return True
