"""Paged attention interface, KV-cache layout, and the CPU backend (the torch references).

KV cache of one layer: a tensor [2, num_blocks, num_kv_heads, block_size, head_dim]
(index 0 = keys, 1 = values): one (block, KV head) page is contiguous, so attention reads
whole pages rather than head_dim-long rows spaced num_kv_heads apart. A sequence's token at
position p lives in block block_tables[b, p // block_size] at offset p % block_size, i.e.
cache slot block_id * block_size + offset: a (block, offset) number, not a memory offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from strata.kernels.reference import cascade_attention_reference, paged_attention_reference, write_kv_cache_reference
from strata.kernels.shared_kv_runs import SharedKVRuns


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [B+1], cumulative query lengths in the flat token batch
    seq_lens: torch.Tensor  # int32 [B], context length after this step (cached + new)
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0
    slot_mapping: torch.Tensor  # int64 [T], cache slot of each new token; -1 = do not write
    max_query_len: int
    max_seq_len: int
    # The shortest query (host-side, shapes the launch: long prefills take larger tiles).
    min_query_len: int = 1
    # Sequences that share a prefix of KV: attention reads it once per shared-KV run (cascade). Layers
    # with a sliding window ignore it (a window may not see the whole prefix).
    shared_kv_runs: SharedKVRuns | None = None


class AttentionBackend(Protocol):
    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Store key/value [T, Hkv, D] into kv_cache at slot_mapping [T] (slots < 0 skipped)."""
        ...

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, Hq, D] -> [T, Hq, D] (written into out when given).

        Token i of sequence b sits at absolute position seq_lens[b] - q_len_b + i and attends
        causally to cached keys at positions <= its own (and > position - sliding_window when
        a window is set). Grouped-query: Hq % Hkv == 0.
        """
        ...

    def warm_up(
        self,
        kv_cache: torch.Tensor,
        num_q_heads: int,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None,
    ) -> None:
        """Compiles, before serving, the kernel variants that steps other than the warm-up's need.
        qk_norm: the layers' q/k norms as the kernels take them (layers.qk_norm_weights), or None."""
        ...


class TorchAttentionBackend:
    """The CPU backend: kernels/reference.py, the Triton kernels' oracle, behind this interface."""

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv_cache_reference(key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if meta.shared_kv_runs is not None and sliding_window is None:
            result = cascade_attention_reference(
                query,
                kv_cache,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                meta.shared_kv_runs,
                meta.max_query_len,
                meta.max_seq_len,
                scale,
            )
        else:
            result = paged_attention_reference(
                query,
                kv_cache,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                meta.max_query_len,
                meta.max_seq_len,
                scale,
                sliding_window,
            )
        return result if out is None else out.copy_(result)

    def warm_up(self, kv_cache: torch.Tensor, num_q_heads: int, qk_norm=None) -> None:
        pass  # nothing compiles


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[torch.Tensor]:
    """One zeroed [2, num_blocks, num_kv_heads, block_size, head_dim] tensor per layer."""
    return [
        torch.zeros(2, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
        for _ in range(num_layers)
    ]


def kv_cache_bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> int:
    """Bytes one block id costs across all of a stage's layers (keys and values)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size
