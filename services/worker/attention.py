"""Paged attention interface, KV-cache layout, and the torch reference backend.

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

from strata.kernels.reference import write_kv_cache_reference


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [B+1], cumulative query lengths in the flat token batch
    seq_lens: torch.Tensor  # int32 [B], context length after this step (cached + new)
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0
    slot_mapping: torch.Tensor  # int64 [T], cache slot of each new token; -1 = do not write
    max_query_len: int
    max_seq_len: int


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
    ) -> torch.Tensor:
        """query [T, Hq, D] -> [T, Hq, D].

        Token i of sequence b sits at absolute position seq_lens[b] - q_len_b + i and attends
        causally to cached keys at positions <= its own (and > position - sliding_window when
        a window is set). Grouped-query: Hq % Hkv == 0.
        """
        ...


class TorchAttentionBackend:
    """Reference backend: plain torch, float32 softmax; the oracle for the Triton kernels."""

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
    ) -> torch.Tensor:
        num_tokens, num_q_heads, head_dim = query.shape
        num_kv_heads, block_size = kv_cache.shape[2], kv_cache.shape[3]
        group = num_q_heads // num_kv_heads
        out = torch.empty_like(query)

        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        for b, seq_len in enumerate(seq_lens):
            q_start, q_end = starts[b], starts[b + 1]
            q_len = q_end - q_start
            if q_len == 0:
                continue
            num_blocks = -(-seq_len // block_size)
            blocks = meta.block_tables[b, :num_blocks].long()
            # [2, blocks, Hkv, block_size, D] -> keys/values [Hkv, seq_len, D]
            kv = kv_cache[:, blocks].transpose(1, 2).reshape(2, num_kv_heads, -1, head_dim)
            keys = kv[0, :, :seq_len].float()
            values = kv[1, :, :seq_len].float()

            # Query heads of one KV head are contiguous: [Hkv, group * q_len, D].
            q = query[q_start:q_end].float().view(q_len, num_kv_heads, group, head_dim)
            q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * q_len, head_dim)
            scores = torch.bmm(q, keys.transpose(1, 2)) * scale  # [Hkv, group*q_len, seq_len]

            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            allowed = k_pos[None, :] <= q_pos[:, None]
            if sliding_window is not None:
                allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
            scores = scores.view(num_kv_heads, group, q_len, seq_len)
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(num_kv_heads, group * q_len, seq_len)

            o = torch.bmm(probs, values).view(num_kv_heads, group, q_len, head_dim)
            out[q_start:q_end] = o.permute(2, 0, 1, 3).reshape(q_len, num_q_heads, head_dim).to(
                query.dtype
            )
        return out


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
