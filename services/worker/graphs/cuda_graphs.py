"""CUDA graphs for decode and verification steps: the shard's forward captured once per padded
batch size and replayed with new inputs written into static buffers. Every sequence of a graph
computes the same number of tokens: 1 for a decode, d + 1 for a speculative verification of d
drafts (query_len). On the last stage the graph also samples every token's row (rows without
top-k/top-p/min-p or logprobs, the common case), except rows flagged skip_draw (rows under
penalties or a grammar, which the controlled draw takes after the graph, and every row of a step
that the Sampler draws eagerly); a decode graph keeps the tokens on the device for the next
plan's decode lookahead.

A decode step launches a few hundred small kernels; replaying a graph turns that host work into
one launch. The host's part of a step is then mostly numpy, plus a handful of torch calls: every
torch call releases and retakes the GIL, which the worker's gRPC and result threads contend for,
so each one is a chance to stall the launch behind them (at 16 streams the host's time per step
once exceeded the GPU's: bench/RESULTS.md, "Figures moved from code comments").

Padding sequences get seq_len 0 and slot -1, so they read and write no KV; their sampled token
goes to a scratch row of the worker's `last_sampled`.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from strata.kernels.shared_kv_runs import SharedKVRuns
from strata.protocol import PLACEHOLDER_TOKEN
from strata.services.worker.device import cuda_driver
from strata.services.worker.device.host_to_device import ALIGN, torch_dtype, wait_for
from strata.services.worker.model.attention import AttentionMetadata
from strata.services.worker.sampling.sampler import sample_unfiltered
from strata.services.worker.step.step_inputs import HostInputs


def capturing(graph: torch.cuda.CUDAGraph, pool=None):
    """torch.cuda.graph in thread-local mode: only the capturing thread's own unsafe CUDA calls
    fail the capture. In global mode (torch's default) any thread's do, and a tensor-parallel
    group's NCCL abort on its own thread (tensor_parallel/group.py) failed a rebuilt stage's
    captures on two H200s."""
    return torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")


def graph_batch_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


# Per-token inputs of a graph (seq_lens: per sequence). They live at fixed offsets in one device
# buffer, the step's block tables after them, so a step's inputs go up in a single copy.
_ROW_FIELDS = (
    ("input_ids", np.int64),
    ("positions", np.int64),
    ("slot_mapping", np.int64),
    ("state_rows", np.int64),  # the sequence table's row: placeholder lookup, last_sampled
    ("seeds", np.int64),
    ("sample_positions", np.int64),
    ("inv_temperature", np.float32),
    ("seq_lens", np.int32),
    ("greedy", np.uint8),
    ("skip_draw", np.uint8),  # the graph's draw leaves the row to the controlled draw (sampling_controls.py)
    # Cascade graphs (shared-KV runs): per sequence, then per run (at most max_batch // 2 + 1).
    ("seq_prefix_lens", np.int32),
    ("run_token_start", np.int32),
    ("run_prefix_lens", np.int32),
    ("run_table_rows", np.int32),
)
# What padding rows hold: no KV read (seq_len 0) or written (slot -1), a greedy draw.
_PADDING = {
    "input_ids": 0,
    "positions": 0,
    "slot_mapping": -1,
    "seeds": 0,
    "sample_positions": 0,
    "inv_temperature": 1.0,
    "seq_lens": 0,
    "greedy": 1,
    "skip_draw": 0,
    "seq_prefix_lens": 0,
}


def _layout(max_batch: int, extra_bytes: int = 0, table_bytes: int = 0) -> tuple[dict[str, tuple[int, np.dtype]], int]:
    """Each field's offset in the flat buffer; then a subclass's own staged rows (extra_bytes, at
    offset "extra") and the step's block tables, packed [n, width] (table_bytes, at "tables",
    last: a step copies the buffer only up to its own tables' end)."""
    offsets, total = {}, 0
    for name, dtype in _ROW_FIELDS:
        total = -(-total // ALIGN) * ALIGN
        offsets[name] = (total, np.dtype(dtype))
        total += max_batch * np.dtype(dtype).itemsize
    for name, size in (("extra", extra_bytes), ("tables", table_bytes)):
        total = -(-total // ALIGN) * ALIGN
        offsets[name] = (total, np.dtype(np.uint8))
        total += size
    return offsets, total


class _HostInputs:
    """Pinned host twin of the graph inputs, written through numpy views."""

    def __init__(self, layout, total: int, max_tokens: int, extra_shape=None):
        self.flat = torch.zeros(total, dtype=torch.uint8, pin_memory=True)
        flat = self.flat.numpy()
        fields = {name: v for name, v in layout.items() if name not in ("extra", "tables")}
        self.rows = {name: flat[off : off + max_tokens * dt.itemsize].view(dt) for name, (off, dt) in fields.items()}
        self.extra = _extra_view(flat, layout["extra"][0], extra_shape, np.int64) if extra_shape else None
        self.tables = flat[layout["tables"][0] :].view(np.int32)  # the step's [n, width], packed
        self.flat_ptr = self.flat.data_ptr()
        self.copied = torch.cuda.Event()
        self.copied.record()


def _extra_view(flat, offset: int, shape: tuple[int, int], dtype):
    """The int64 [rows, cols] block at `offset` of a flat uint8 buffer (numpy or torch)."""
    return flat[offset : offset + shape[0] * shape[1] * 8].view(dtype).reshape(shape)


class DecodeGraphs:
    """The graphs of one stage for one query length, one per padded batch size up to max_batch.

    last_sampled: the worker's token per state row (decode lookahead), which the graphs read for
    placeholders and, when decode graphs sample, write; scratch_row: its row for padding rows.
    """

    def __init__(
        self,
        shard,
        kv_caches: list[torch.Tensor],
        *,
        max_batch: int,
        last_sampled: torch.Tensor,
        scratch_row: int,
        device: torch.device,
        dtype: torch.dtype,
        hidden_size: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        first_stage: bool,
        last_stage: bool,
        samples: bool,
        query_len: int = 1,
        cascade: bool = False,
        extra_shape: tuple[int, int] | None = None,
        draw=None,
        compute_logits=None,
    ):
        self.shard, self.kv_caches = shard, kv_caches
        # The in-graph draw: sample_unfiltered, or a tensor-parallel rank's over its slice of the
        # logits with the all-reduce that combines the slices (ShardedSampler.draw_unfiltered).
        self.draw = draw or sample_unfiltered
        self.compute_logits = compute_logits or shard.compute_logits  # (the runner's: a rank's slice)
        self.last_sampled, self.scratch_row = last_sampled, scratch_row
        self.device = device
        self.max_model_len = max_model_len
        self.first_stage, self.last_stage = first_stage, last_stage
        self.samples = samples  # the last stage draws unfiltered rows in the graph (needs Triton)
        self.query_len = q = query_len
        # Cascade graphs attend with shared prefixes (cascade_attention), for up to half as many
        # shared-KV runs as sequences (a run has two members or more); a batch of one shares nothing.
        self.cascade = cascade
        self.sizes = [s for s in graph_batch_sizes(max_batch) if s >= 2 or not cascade]
        self.max_batch = self.sizes[-1]
        max_tokens = self.max_batch * q
        # extra_shape: int64 rows of a subclass's own, staged with the inputs in the same copy
        # (a verification graph's speculation meta rows: speculation/device_speculation.py).
        extra_bytes = extra_shape[0] * extra_shape[1] * 8 if extra_shape else 0
        layout, total = _layout(max_tokens, extra_bytes, self.max_batch * max_blocks_per_seq * 4)
        self.flat = torch.zeros(total, dtype=torch.uint8, device=device)
        self.rows = {
            name: self.flat[off : off + max_tokens * dt.itemsize].view(torch_dtype(dt))
            for name, (off, dt) in layout.items()
            if name not in ("extra", "tables")
        }
        self.extra = _extra_view(self.flat, layout["extra"][0], extra_shape, torch.int64) if extra_shape else None
        # The step's tables arrive packed [n, width] with the rows (one copy of the flat buffer's
        # head), then one device copy spreads them into the graphs' [max_batch, max_blocks_per_seq]
        # table. Copying the 2-D slice from the host instead went through temporaries on both
        # sides (a strided host-to-device copy), which py-spy found in the step thread
        # (bench/RESULTS.md, "Figures moved from code comments").
        self.tables_offset = layout["tables"][0]
        self.staged_tables = self.flat[self.tables_offset :].view(torch.int32)
        self.block_tables = torch.zeros(self.max_batch, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(0, (self.max_batch + 1) * q, q, dtype=torch.int32, device=device)
        self.hidden_in = torch.zeros(max_tokens, hidden_size, dtype=dtype, device=device)
        self.residual_in = torch.zeros_like(self.hidden_in)
        # Two host sets: the host fills one while the other's copy may still wait in the stream
        # (steps are launched ahead of the GPU); an event guards each set before reuse.
        self.host = [_HostInputs(layout, total, max_tokens, extra_shape) for _ in range(2)]
        self.step = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.executables: dict[int, int] = {}  # each graph's, launched with the GIL held (cuda_driver.py)
        self._spread_tables = cuda_driver.RowCopy()  # packed [n, width] -> block_tables[:n, :width]
        self._flat_ptr, self._staged_ptr = self.flat.data_ptr(), self.staged_tables.data_ptr()
        self._tables_ptr, self._tables_pitch = self.block_tables.data_ptr(), self.block_tables.stride(0) * 4
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.pool = None

    def max_runs(self, bs: int) -> int:
        return bs // 2 if self.cascade else 0

    def _meta(self, bs: int) -> AttentionMetadata:
        rows, shared = self.rows, None
        if self.cascade:
            from strata.kernels.cascade_attention import choose_prefix_config  # Triton: CUDA only

            r = self.max_runs(bs)
            # The run count is only a bound here: cut the prefixes as for a few large runs
            # (one program per KV head and 64 rows), where splitting pays; pairs lose little.
            splits = choose_prefix_config(
                num_runs=1,
                max_run_tokens=bs * self.query_len,
                max_prefix_len=self.max_model_len,
                num_q_heads=self.shard.config.num_attention_heads,
                num_kv_heads=self.kv_caches[0].shape[2],
                head_dim=self.kv_caches[0].shape[4],
                sm_count=torch.cuda.get_device_properties(self.device).multi_processor_count,
            ).prefix_splits
            shared = SharedKVRuns(
                token_start=rows["run_token_start"][: r + 1],
                prefix_lens=rows["run_prefix_lens"][:r],
                table_rows=rows["run_table_rows"][:r],
                seq_prefix_lens=rows["seq_prefix_lens"][:bs],
                max_run_tokens=bs * self.query_len,
                max_prefix_len=self.max_model_len,
                prefix_splits=splits,
            )
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=rows["seq_lens"][:bs],
            block_tables=self.block_tables[:bs],
            slot_mapping=rows["slot_mapping"][: bs * self.query_len],
            max_query_len=self.query_len,
            max_seq_len=self.max_model_len,
            shared_kv_runs=shared,
        )

    def _forward(self, bs: int) -> tuple[torch.Tensor, ...]:
        rows, first, t = self.rows, self.first_stage, bs * self.query_len
        state_rows = rows["state_rows"][:t]
        hidden, residual = self.shard.forward(
            rows["input_ids"][:t] if first else None,
            rows["positions"][:t],
            None if first else self.hidden_in[:t],
            None if first else self.residual_in[:t],
            self.kv_caches,
            self._meta(bs),
            placeholders=(state_rows, self.last_sampled),
        )
        if not self.last_stage:
            return hidden, residual
        logits = self.compute_logits(hidden, residual)
        if not self.samples:
            return (logits,)
        # A decode's token stays in last_sampled for the next plan's placeholders (after a
        # verification the scheduler sends real tokens, never a placeholder).
        tokens = self.draw(
            logits,
            rows["seeds"][:t],
            rows["sample_positions"][:t],
            rows["inv_temperature"][:t],
            rows["greedy"][:t],
            store=(self.last_sampled, state_rows) if self.query_len == 1 else None,
            skip=rows["skip_draw"][:t],
        )
        return logits, tokens

    def draw_settings(self, t: int) -> tuple[torch.Tensor, ...]:
        """The first t rows' draw settings as the graph holds them (seeds, sample positions,
        inverse temperatures, greedy flags), for the controlled draw of the rows it skipped."""
        rows = self.rows
        return rows["seeds"][:t], rows["sample_positions"][:t], rows["inv_temperature"][:t], rows["greedy"][:t]

    def draw_store(self, t: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where a decode graph keeps its tokens for the next plan's lookahead: (last_sampled,
        the first t rows' state rows); None for a verification graph."""
        return (self.last_sampled, self.rows["state_rows"][:t]) if self.query_len == 1 else None

    @torch.inference_mode()
    def capture(self) -> None:
        torch.cuda.synchronize(self.device)
        self._fill_padding()
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its memory pool
            self._forward(bs)  # compiles the Triton kernels outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, self.pool):
                self.outputs[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            executable = cuda_driver.graph_exec(graph)
            if executable is not None:
                self.executables[bs] = executable
        torch.cuda.synchronize(self.device)

    def _fill_padding(self) -> None:
        """Device rows start as padding (what capture runs on) with the scratch state row, and
        empty runs."""
        for name, value in {
            **_PADDING,
            "state_rows": self.scratch_row,
            "run_token_start": 0,
            "run_prefix_lens": 0,
            "run_table_rows": 0,
        }.items():
            self.rows[name].fill_(value)

    def padded_size(self, batch: int, num_runs: int = 0) -> int | None:
        """The smallest captured size that holds `batch` rows (and num_runs shared-KV runs); None when none does."""
        i = bisect.bisect_left(self.sizes, batch)
        while i < len(self.sizes) and self.max_runs(self.sizes[i]) < num_runs:
            i += 1
        return self.sizes[i] if i < len(self.sizes) else None

    def run(
        self,
        bs: int,
        h: HostInputs,
        token_rows: np.ndarray,
        sampling: dict[str, np.ndarray] | None,
        arrive=None,
        stage_extra=None,
    ) -> tuple[torch.Tensor, ...]:
        """Replays the graph of padded size bs on the step's HostInputs `h` (n sequences of
        query_len tokens each); token_rows: each token's state row; sampling: each token's seed,
        sample position, inverse temperature and greedy flag (last stage); arrive: called once
        the inputs are staged, with the graph's (hidden, residual) inputs, which it fills with
        the previous stage's activations (not on stage 0) after waiting for what the step needs
        from other stages; stage_extra: writes the subclass's extra rows into the host set (numpy
        int64 [rows, cols]). Returns the outputs' rows of the n sequences' tokens: (logits,
        tokens) on the last stage ((logits,) without Triton), else (hidden, residual)."""
        n, width = h.block_tables.shape
        t, padded = n * self.query_len, bs * self.query_len
        host = self.host[self.step % 2]
        self.step += 1
        wait_for(host.copied)  # its previous copy has left the host buffers
        rows = host.rows
        if h.input_ids is not None:
            rows["input_ids"][:t] = h.input_ids
        rows["positions"][:t] = h.positions
        rows["slot_mapping"][:t] = h.slot_mapping
        rows["state_rows"][:t] = token_rows
        if sampling is not None:
            for name, values in sampling.items():
                rows[name][:t] = values
        for name, value in _PADDING.items():
            rows[name][t:padded] = value
        rows["seq_lens"][:n] = h.seq_lens
        rows["seq_lens"][n:bs] = 0
        if self.cascade:
            self._stage_runs(rows, h, n, bs)
        rows["state_rows"][t:padded] = self.scratch_row
        if host.extra is not None:
            if stage_extra is None:  # the graph reads them: stale rows would move the wrong sequences
                raise RuntimeError("this graph stages extra rows with its inputs: pass stage_extra")
            stage_extra(host.extra)
        host.tables[: n * width].reshape(n, width)[:] = h.block_tables
        end = self.tables_offset + n * width * 4
        # The staging copy, its event, the tables' spread and the launch keep the GIL
        # (cuda_driver.py): torch's own calls each gave it away, and the step thread waited to
        # take it back from the event loop and the finisher.
        stream = cuda_driver.current_stream(self.device)
        cuda_driver.copy(self._flat_ptr, host.flat_ptr, end, stream)
        cuda_driver.record(host.copied, stream)
        self._spread_tables(self._tables_ptr, self._tables_pitch, self._staged_ptr, width * 4, width * 4, n, stream)
        if arrive is not None:  # the activations go straight into the graph's inputs
            hidden, _ = arrive((self.hidden_in, self.residual_in), self.rows["state_rows"][:t])
            if hidden is not None and hidden.shape[0] != t:
                raise RuntimeError(f"activations of {hidden.shape[0]} rows for a step of {t} tokens")
        self._launch(bs, stream)
        return tuple(out[:t] for out in self.outputs[bs])

    def move_on_one_token(self, n: int, block_size: int) -> None:
        """The staged inputs of a decode step of n sequences moved to the next one, on the device:
        each sequence fed the token it just drew (a placeholder, read from last_sampled), at the
        next position, into that position's slot (its block table holds the block). For a draft
        worker's proposal (ModelRunner.decode_again): no plan, upload or staging per step."""
        rows = self.rows
        positions = rows["positions"][:n]
        positions += 1
        rows["sample_positions"][:n] += 1
        rows["seq_lens"][:n] += 1
        rows["input_ids"][:n] = PLACEHOLDER_TOKEN
        block = self.block_tables[:n].gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
        rows["slot_mapping"][:n] = block.long() * block_size + positions % block_size

    def replay(self, bs: int) -> None:
        """The graph of size bs again, on the inputs its static buffers hold now."""
        self._launch(bs, cuda_driver.current_stream(self.device))

    def _launch(self, bs: int, stream: int) -> None:
        if bs in self.executables:
            cuda_driver.launch(self.executables[bs], stream)
        else:
            self.graphs[bs].replay()

    def keep(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst[:] = src (contiguous, one dtype) on the current stream, keeping the GIL."""
        stream = cuda_driver.current_stream(self.device)
        cuda_driver.copy(dst.data_ptr(), src.data_ptr(), src.numel() * src.element_size(), stream)

    def _stage_runs(self, rows: dict[str, np.ndarray], h: HostInputs, n: int, bs: int) -> None:
        """The step's shared-KV runs, then empty ones up to the graph's run count (they own no tokens)."""
        runs, r, most = h.shared_kv_runs, len(h.shared_kv_runs.prefix_lens), self.max_runs(bs)
        rows["seq_prefix_lens"][:n] = runs.seq_prefix_lens  # padding rows: 0 (_PADDING)
        rows["run_token_start"][: r + 1] = runs.token_start
        rows["run_token_start"][r + 1 : most + 1] = runs.token_start[-1]
        rows["run_prefix_lens"][:r] = runs.prefix_lens
        rows["run_prefix_lens"][r:most] = 0
        rows["run_table_rows"][:r] = runs.table_rows
        rows["run_table_rows"][r:most] = 0
