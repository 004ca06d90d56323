"""CUDA graphs for decode steps: the shard's forward captured once per padded batch size and
replayed with new inputs written into static buffers. On the last stage the graph also samples
(rows without top-k/top-p/min-p or logprobs, the common case) and keeps the tokens on the device
for the next plan's decode lookahead.

A decode step launches a few hundred small kernels; replaying a graph turns that host work into
one launch. The host's part of a step is then mostly numpy, plus a handful of torch calls: every
torch call releases and retakes the GIL, which the worker's gRPC and result threads contend for,
so each one is a chance to stall the launch behind them (measured on an H200 at 16 streams:
~2 ms of host time per step with ~80 torch calls, against a 1.3 ms GPU step).

Padding rows get seq_len 0 and slot -1, so they read and write no KV; their sampled token goes
to a scratch row of the runner's `last_sampled`.
"""
from __future__ import annotations

import numpy as np
import torch

from strata.kernels.gumbel_sampling import HAVE_TRITON
from strata.services.worker.attention import AttentionMetadata
from strata.services.worker.host_to_device import ALIGN, torch_dtype
from strata.services.worker.sampler import sample_unfiltered


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


# Per-row inputs of a decode graph. They live at fixed offsets in one device buffer, so a step's
# rows go up in a single copy (the block tables, 2-D, in a second).
_ROW_FIELDS = (
    ("input_ids", np.int64), ("positions", np.int64), ("slot_mapping", np.int64),
    ("state_rows", np.int64),  # the runner's per-sequence row: placeholder lookup, last_sampled
    ("seeds", np.int64), ("sample_positions", np.int64), ("inv_temperature", np.float32),
    ("seq_lens", np.int32), ("greedy", np.uint8),
)
# What padding rows hold: no KV read (seq_len 0) or written (slot -1), a greedy draw.
_PADDING = {"input_ids": 0, "positions": 0, "slot_mapping": -1, "seeds": 0, "sample_positions": 0,
            "inv_temperature": 1.0, "seq_lens": 0, "greedy": 1}


def _layout(max_batch: int) -> tuple[dict[str, tuple[int, np.dtype]], int]:
    offsets, total = {}, 0
    for name, dtype in _ROW_FIELDS:
        total = -(-total // ALIGN) * ALIGN
        offsets[name] = (total, np.dtype(dtype))
        total += max_batch * np.dtype(dtype).itemsize
    return offsets, total


class _HostInputs:
    """Pinned host twin of the graph inputs, written through numpy views."""

    def __init__(self, layout, total: int, max_batch: int, width: int):
        self.flat = torch.zeros(total, dtype=torch.uint8, pin_memory=True)
        flat = self.flat.numpy()
        self.rows = {name: flat[off:off + max_batch * dt.itemsize].view(dt) for name, (off, dt) in layout.items()}
        self.tables_t = torch.zeros(max_batch, width, dtype=torch.int32, pin_memory=True)
        self.tables = self.tables_t.numpy()
        self.copied = torch.cuda.Event()
        self.copied.record()


class DecodeGraphs:
    def __init__(self, runner, max_batch: int):
        self.runner = runner
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.samples = runner.is_last and HAVE_TRITON
        dev = runner.device
        cfg = runner.config
        width = runner.table.max_blocks
        layout, total = _layout(self.max_batch)
        self.flat = torch.zeros(total, dtype=torch.uint8, device=dev)
        self.rows = {name: self.flat[off:off + self.max_batch * dt.itemsize].view(torch_dtype(dt))
                     for name, (off, dt) in layout.items()}
        self.block_tables = torch.zeros(self.max_batch, width, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(self.max_batch + 1, dtype=torch.int32, device=dev)
        self.hidden_in = torch.zeros(self.max_batch, cfg.hidden_size, dtype=runner.dtype, device=dev)
        self.residual_in = torch.zeros_like(self.hidden_in)
        # Two host sets: the host fills one while the other's copy may still wait in the stream
        # (steps are launched ahead of the GPU); an event guards each set before reuse.
        self.host = [_HostInputs(layout, total, self.max_batch, width) for _ in range(2)]
        self.step = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1], seq_lens=self.rows["seq_lens"][:bs],
            block_tables=self.block_tables[:bs], slot_mapping=self.rows["slot_mapping"][:bs],
            max_query_len=1, max_seq_len=self.runner.max_model_len)

    def _forward(self, bs: int) -> tuple[torch.Tensor, ...]:
        r, rows = self.runner, self.rows
        input_ids = None
        if r.is_first:
            # Decode lookahead: a placeholder (< 0) is the token this worker sampled last for the row.
            ids = rows["input_ids"][:bs]
            input_ids = torch.where(ids < 0, r.last_sampled[rows["state_rows"][:bs]], ids)
        first = r.is_first
        hidden, residual = r.shard.forward(
            input_ids, rows["positions"][:bs], None if first else self.hidden_in[:bs],
            None if first else self.residual_in[:bs], r.kv_caches, self._meta(bs))
        if not r.is_last:
            return hidden, residual
        logits = r.shard.compute_logits(hidden, residual)
        if not self.samples:
            return (logits,)
        tokens = sample_unfiltered(logits, rows["seeds"][:bs], rows["sample_positions"][:bs],
                                   rows["inv_temperature"][:bs], rows["greedy"][:bs])
        r.last_sampled[rows["state_rows"][:bs]] = tokens
        return logits, tokens

    @torch.inference_mode()
    def capture(self) -> None:
        torch.cuda.synchronize(self.runner.device)
        self._fill_padding()
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

    def _fill_padding(self) -> None:
        """Device rows start as padding (what capture runs on) with the scratch state row."""
        scratch = self.runner.scratch_row
        for name, value in {**_PADDING, "state_rows": scratch}.items():
            self.rows[name].fill_(value)

    def padded_size(self, batch: int) -> int | None:
        for s in self.sizes:
            if s >= batch:
                return s
        return None

    def run(self, bs: int, h, state_rows: np.ndarray, sampling: dict[str, np.ndarray] | None,
            hidden: torch.Tensor | None, residual: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """Replays the graph of padded size bs on the step's HostInputs `h`; sampling: the
        per-row seeds, positions, inverse temperatures and greedy flags (last stage). Returns
        the outputs' first n rows: (logits, tokens) on the last stage ((logits,) without
        Triton), else (hidden, residual)."""
        n, width = h.block_tables.shape
        host = self.host[self.step % 2]
        self.step += 1
        host.copied.synchronize()  # its previous copy has left the host buffers
        rows = host.rows
        if h.input_ids is not None:
            rows["input_ids"][:n] = h.input_ids
        rows["positions"][:n] = h.positions
        rows["slot_mapping"][:n] = h.slot_mapping
        rows["seq_lens"][:n] = h.seq_lens
        rows["state_rows"][:n] = state_rows
        if sampling is not None:
            for name, values in sampling.items():
                rows[name][:n] = values
        for name, value in _PADDING.items():
            rows[name][n:bs] = value
        rows["state_rows"][n:bs] = self.runner.scratch_row
        host.tables[:n, :width] = h.block_tables
        self.flat.copy_(host.flat, non_blocking=True)
        self.block_tables[:n, :width].copy_(host.tables_t[:n, :width], non_blocking=True)
        host.copied.record()
        if hidden is not None:
            self.hidden_in[:n].copy_(hidden)
            self.residual_in[:n].copy_(residual)
        self.graphs[bs].replay()
        return tuple(t[:n] for t in self.outputs[bs])

