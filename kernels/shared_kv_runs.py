"""What cascade attention needs to know about a batch: its shared-KV runs, consecutive sequences
that share a prefix of KV (the scheduler finds them: services/scheduler/shared_kv_runs.py). Its
own module, free of Triton, so the CPU path (the torch reference) takes it too. Inside the
kernels a run is still called a group (num_groups, max_grouped_tokens, g)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SharedKVRuns:
    """A batch's shared-KV runs: device tensors, plus host bounds that shape the launch."""

    token_start: torch.Tensor  # int32 [G+1]: group g's queries are batch tokens [token_start[g], token_start[g+1])
    prefix_lens: torch.Tensor  # int32 [G]: keys [0, prefix_lens[g]) are the same blocks for every member
    table_rows: torch.Tensor  # int32 [G]: the block_tables row of one member (its first blocks hold the prefix)
    seq_prefix_lens: torch.Tensor  # int32 [B]: each sequence's group prefix length, 0 outside any group
    max_grouped_tokens: int  # bound on token_start[G] - token_start[0]
    max_prefix_len: int  # bound on prefix_lens
    # Parts each prefix is cut into, when the caller knows better than the bounds: a CUDA graph's
    # group count is a padded bound, so it picks this for large groups. 0: chosen from the bounds.
    prefix_splits: int = 0

    @property
    def num_groups(self) -> int:
        return self.prefix_lens.shape[0]
