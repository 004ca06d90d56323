"""Attention on GPUs: the Triton kernels in kernels/, behind the worker's backend interface."""

from __future__ import annotations

import torch

from strata.kernels import decode_attention
from strata.kernels.cascade_attention import cascade_attention, compile_serving_variants
from strata.kernels.kv_cache_write import write_kv_cache
from strata.kernels.paged_attention import paged_attention
from strata.services.worker.model.attention import AttentionMetadata


class TritonAttentionBackend:
    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        write_kv_cache(key, value, kv_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if meta.shared_kv_runs is not None and sliding_window is None:
            return cascade_attention(
                query,
                kv_cache,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                meta.shared_kv_runs,
                meta.max_query_len,
                meta.max_seq_len,
                scale,
                out,
            )
        return paged_attention(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.max_query_len,
            meta.max_seq_len,
            scale,
            sliding_window=sliding_window,
            out=out,
            min_query_len=meta.min_query_len,
        )

    def warm_up(
        self,
        kv_cache: torch.Tensor,
        num_q_heads: int,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None,
    ) -> None:
        compile_serving_variants(kv_cache, num_q_heads)
        decode_attention.compile_serving_variants(kv_cache, num_q_heads, qk_norm)
