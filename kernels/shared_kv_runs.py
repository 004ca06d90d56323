"""What cascade attention needs to know about a batch: its shared-KV runs, consecutive sequences
that share a prefix of KV (the scheduler finds them: services/scheduler/shared_kv_runs.py). Its
own module, free of Triton, so the CPU path (the torch reference) takes it too."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SharedKVRuns:
    """A batch's shared-KV runs: device tensors, plus host bounds that shape the launch."""

    token_start: torch.Tensor  # int32 [R+1]: run r's queries are batch tokens [token_start[r], token_start[r+1])
    prefix_lens: torch.Tensor  # int32 [R]: keys [0, prefix_lens[r]) are the same blocks for every member
    table_rows: torch.Tensor  # int32 [R]: the block_tables row of one member (its first blocks hold the prefix)
    seq_prefix_lens: torch.Tensor  # int32 [B]: each sequence's run's prefix length, 0 outside any run
    max_run_tokens: int  # bound on token_start[R] - token_start[0]
    max_prefix_len: int  # bound on prefix_lens
    # Parts each prefix is cut into, when the caller knows better than the bounds: a CUDA graph's
    # run count is a padded bound, so it picks this for large runs. 0: chosen from the bounds.
    prefix_splits: int = 0

    @property
    def num_runs(self) -> int:
        return self.prefix_lens.shape[0]
