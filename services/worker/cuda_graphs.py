"""CUDA graphs for decode steps: the shard's forward (and logits on the last stage) captured once
per padded batch size, replayed with new inputs written into static buffers.

A decode step launches a few hundred small kernels; replaying a graph turns that host work into
one launch. Padding rows get seq_len 0 and slot -1, so they read and write no KV.
"""
from __future__ import annotations

import numpy as np
import torch

from services.worker.attention import AttentionMetadata


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, runner, max_batch: int):
        self.runner = runner
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        dev = runner.device
        cfg = runner.config
        width = runner.table.max_blocks
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((self.max_batch,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(self.max_batch, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(self.max_batch, width, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(self.max_batch + 1, dtype=torch.int32, device=dev)
        self.hidden_in = torch.zeros(self.max_batch, cfg.hidden_size, dtype=runner.dtype, device=dev)
        self.residual_in = torch.zeros_like(self.hidden_in)
        # Pinned staging, so each step's inputs go up in a few asynchronous copies. Two sets:
        # the host fills one while the copies of the previous step may still wait in the stream
        # (steps are launched ahead of the GPU), and an event guards each set before reuse.
        self.staging = [_Staging(self.max_batch, width) for _ in range(2)]
        self.step = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs], slot_mapping=self.slot_mapping[:bs],
            max_query_len=1, max_seq_len=self.runner.max_model_len)

    def _forward(self, bs: int) -> tuple[torch.Tensor, ...]:
        r = self.runner
        first = r.is_first
        hidden, residual = r.shard.forward(
            self.input_ids[:bs] if first else None, self.positions[:bs],
            None if first else self.hidden_in[:bs], None if first else self.residual_in[:bs],
            r.kv_caches, self._meta(bs))
        if r.is_last:
            return (r.shard.compute_logits(hidden, residual),)
        return hidden, residual

    @torch.inference_mode()
    def capture(self) -> None:
        torch.cuda.synchronize(self.runner.device)
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            self._forward(bs)  # compiles the Triton kernels outside the capture
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.runner.device)

    def padded_size(self, batch: int) -> int | None:
        for s in self.sizes:
            if s >= batch:
                return s
        return None

    def run(self, bs: int, input_ids: np.ndarray | None, positions: np.ndarray, slot_mapping: np.ndarray,
            seq_lens: np.ndarray, block_tables: np.ndarray, hidden: torch.Tensor | None,
            residual: torch.Tensor | None, resolve=None) -> tuple[torch.Tensor, ...]:
        n, width = block_tables.shape
        st = self.staging[self.step % 2]
        self.step += 1
        st.copied.synchronize()  # its previous copies have left the host buffers
        h = st.i64
        h[0, :n] = torch.from_numpy(positions)
        h[1, :n] = torch.from_numpy(slot_mapping)
        h[1, n:bs] = -1
        if input_ids is not None:
            h[2, :n] = torch.from_numpy(input_ids)
        st.seq_lens[:n] = torch.from_numpy(seq_lens)
        st.seq_lens[n:bs] = 0
        st.tables[:n, :width] = torch.from_numpy(block_tables)
        self.positions[:bs].copy_(h[0, :bs], non_blocking=True)
        self.slot_mapping[:bs].copy_(h[1, :bs], non_blocking=True)
        if input_ids is not None:
            # Only the real rows: staged ids may hold placeholders, and padding rows must keep
            # valid (stale) ids for the embedding lookup.
            self.input_ids[:n].copy_(h[2, :n], non_blocking=True)
            if resolve is not None:
                self.input_ids[:n] = resolve(self.input_ids[:n])
        self.seq_lens[:bs].copy_(st.seq_lens[:bs], non_blocking=True)
        self.block_tables[:n, :width].copy_(st.tables[:n, :width], non_blocking=True)
        st.copied.record()
        if hidden is not None:
            self.hidden_in[:n].copy_(hidden)
            self.residual_in[:n].copy_(residual)
        self.graphs[bs].replay()
        return tuple(t[:n] for t in self.outputs[bs])


class _Staging:
    def __init__(self, max_batch: int, width: int):
        self.i64 = torch.zeros(3, max_batch, dtype=torch.long, pin_memory=True)  # positions, slots, ids
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, pin_memory=True)
        self.tables = torch.zeros(max_batch, width, dtype=torch.int32, pin_memory=True)
        self.copied = torch.cuda.Event()
        self.copied.record()
