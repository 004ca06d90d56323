"""ModelRunner: applies step plans to per-sequence state and runs this stage's shard.

Workers keep what the scheduler already told them (block tables, sampling options), so a plan
only carries deltas. State lives in preallocated numpy arrays indexed by a row per sequence, so
building a step's inputs is a handful of vectorised gathers, not a loop over tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from strata.services.worker.attention import AttentionMetadata, allocate_kv_cache
from strata.services.worker.host_to_device import upload
from strata.services.worker.late_compiles import warn_on_late_compiles
from strata.services.worker.sampler import Sampler, SamplingTensors
from strata.protocol import GREEDY_TEMPERATURE, PLACEHOLDER_TOKEN
from strata.v1 import engine_pb2


class PlanError(ValueError):
    """A plan that does not fit this worker's state (a scheduler bug or a restarted worker)."""


@dataclass
class HostInputs:
    input_ids: np.ndarray | None  # [T] on the first stage
    token_rows: np.ndarray  # [T] state row of each token's sequence
    has_placeholders: bool  # some input tokens are the sequence's last sampled one, on the device
    positions: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [B+1]
    seq_lens: np.ndarray  # [B]
    slot_mapping: np.ndarray  # [T]
    block_tables: np.ndarray  # [B, blocks of the longest sequence]
    max_query_len: int
    sample_rows: np.ndarray  # state rows of the sequences that sample
    sample_token_index: np.ndarray  # index in the flat batch of the token whose logits are sampled
    sample_positions: np.ndarray  # absolute position of each sampled token
    sample_seq_ids: list[int]


class SequenceTable:
    """Per-sequence worker state: a row per live sequence holding its block table and sampling options."""

    def __init__(self, max_seqs: int, max_blocks_per_seq: int):
        self.max_blocks = max_blocks_per_seq
        self.block_tables = np.zeros((max_seqs, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(max_seqs, dtype=np.int32)
        self.temperature = np.zeros(max_seqs, dtype=np.float32)
        self.top_k = np.zeros(max_seqs, dtype=np.int32)
        self.top_p = np.ones(max_seqs, dtype=np.float32)
        self.min_p = np.zeros(max_seqs, dtype=np.float32)
        self.seed = np.zeros(max_seqs, dtype=np.int64)
        self.logprobs = np.full(max_seqs, -1, dtype=np.int32)
        # Derived once per sequence, as SamplingTensors derives them, for the decode graphs' draw.
        self.inv_temperature = np.ones(max_seqs, dtype=np.float32)
        self.greedy = np.zeros(max_seqs, dtype=np.uint8)
        self.unfiltered = np.zeros(max_seqs, dtype=bool)  # no top-k/top-p/min-p, no logprobs
        self.rows: dict[int, int] = {}
        self.free_rows = list(range(max_seqs - 1, -1, -1))

    def add(self, seq: engine_pb2.NewSequence) -> None:
        if seq.seq_id in self.rows:
            raise PlanError(f"sequence {seq.seq_id} admitted twice")
        if not self.free_rows:
            raise PlanError("more live sequences than this worker was sized for")
        row = self.free_rows.pop()
        self.rows[seq.seq_id] = row
        s = seq.sampling
        self.num_blocks[row] = 0
        self.temperature[row] = s.temperature
        self.top_k[row] = s.top_k
        self.top_p[row] = s.top_p
        self.min_p[row] = s.min_p
        # Seeds are uint64 on the wire; keep their bits in int64.
        self.seed[row] = np.uint64(s.seed).astype(np.int64)
        self.logprobs[row] = s.logprobs
        # The same float32 arithmetic as SamplingTensors.prepare, on one row (prepare's array
        # overhead, paid per admission, showed up in the launch of prefill steps).
        temperature = self.temperature[row]
        greedy = bool(temperature < GREEDY_TEMPERATURE)
        self.greedy[row] = greedy
        self.inv_temperature[row] = np.float32(1.0) / (np.float32(1.0) if greedy else temperature)
        self.unfiltered[row] = s.logprobs < 0 and (greedy or (s.top_k <= 0 and s.top_p >= 1 and s.min_p <= 0))

    def release(self, seq_id: int) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self.free_rows.append(row)

    def clear(self) -> None:
        for seq_id in list(self.rows):
            self.release(seq_id)

    def lookup(self, seq_ids) -> np.ndarray:
        try:
            return np.fromiter((self.rows[s] for s in seq_ids), dtype=np.int64, count=len(seq_ids))
        except KeyError as e:
            raise PlanError(f"unknown sequence {e.args[0]} (was this worker restarted?)") from None

    def update_tables(self, rows: np.ndarray, keep: np.ndarray, counts: np.ndarray, ids: np.ndarray) -> None:
        # Only sequences whose table changed need work: most decode steps touch none.
        changed = np.nonzero((counts > 0) | (keep != self.num_blocks[rows]))[0]
        offsets = np.concatenate(([0], np.cumsum(counts)))
        for i in changed:
            row, k, n = rows[i], keep[i], counts[i]
            if k + n > self.max_blocks:
                raise PlanError("block table longer than max_model_len allows")
            self.block_tables[row, k : k + n] = ids[offsets[i] : offsets[i] + n]
            self.num_blocks[row] = k + n


class GpuTimeline:
    """The GPU's busy and idle time per step, from CUDA events (the host's clocks cannot see it).

    A step's start event is recorded just before its first kernel is queued, its end event after
    its last copy; the GPU reaches the start event when the previous step's work is done or, if
    the host was late, when the host queued it. So end(k) -> start(k+1) is the GPU idle between
    steps, start(k) -> end(k) the step's GPU time. Steps finish in order (one finisher thread).
    """

    def __init__(self):
        self._last_end: torch.cuda.Event | None = None

    @staticmethod
    def mark() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def finished(self, start: torch.cuda.Event, end: torch.cuda.Event) -> tuple[float, float]:
        """(busy seconds, idle seconds before the step); `end` must have completed."""
        busy = start.elapsed_time(end) / 1e3
        idle = max(self._last_end.elapsed_time(start) / 1e3, 0.0) if self._last_end is not None else 0.0
        self._last_end = end
        return busy, idle


class ModelRunner:
    def __init__(self, shard, model_config, *, stage_index: int, num_stages: int, block_size: int,
                 max_model_len: int, device: torch.device, dtype: torch.dtype,
                 max_num_seqs: int = 1024, cuda_graph_max_batch: int = 0):
        self.shard = shard
        self.config = model_config
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.dtype = dtype
        self.kv_caches: list[torch.Tensor] = []
        self.num_kv_blocks = 0
        self.table = SequenceTable(max_num_seqs, (max_model_len + block_size - 1) // block_size)
        self.sampler = Sampler() if self.is_last else None
        self.graphs = None  # DecodeGraphs once captured (CUDA only)
        self.cuda_graph_max_batch = cuda_graph_max_batch if device.type == "cuda" else 0
        # The last token sampled per state row (decode lookahead), plus a scratch row that the
        # decode graphs' padding rows write to.
        self.scratch_row = max_num_seqs
        self.last_sampled = torch.zeros(max_num_seqs + 1, dtype=torch.long, device=device)
        self.timeline = GpuTimeline() if device.type == "cuda" else None

    # ------------------------------------------------------------ cache

    def init_cache(self, num_blocks: int) -> None:
        self.kv_caches = []  # free the old cache (and graphs over it) before allocating the new one
        self.graphs = None
        self.kv_caches = allocate_kv_cache(
            self.shard.num_layers, num_blocks, self.block_size, self.config.num_key_value_heads,
            self.config.head_dim, self.dtype, self.device)
        self.num_kv_blocks = num_blocks
        self.table.clear()
        if self.cuda_graph_max_batch:
            self.capture_cuda_graphs(self.cuda_graph_max_batch)
        if self.device.type == "cuda":
            self.warm_up()
            warn_on_late_compiles()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compiles now the Triton variants that serving would otherwise compile mid-traffic
        (about a second each, stalling every request): eager steps with token counts that are
        odd and a multiple of 16 (Triton specialises on both), every sampler variant (filters,
        logprobs). Block 0 is read and nothing is written (slot -1)."""
        h = self.config.hidden_size
        for q_lens in ([3, 1, 1], [15, 1]):
            total = sum(q_lens)
            inputs = upload({
                "input_ids": np.zeros(total, np.int64), "positions": np.zeros(total, np.int64),
                "query_start_loc": np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                "seq_lens": np.asarray(q_lens, np.int32), "block_tables": np.zeros((len(q_lens), 1), np.int32),
                "slot_mapping": np.full(total, -1, np.int64)}, self.device)
            meta = AttentionMetadata(
                query_start_loc=inputs["query_start_loc"], seq_lens=inputs["seq_lens"],
                block_tables=inputs["block_tables"], slot_mapping=inputs["slot_mapping"],
                max_query_len=max(q_lens), max_seq_len=max(q_lens))
            hidden = residual = None
            if not self.is_first:
                hidden = torch.zeros(total, h, dtype=self.dtype, device=self.device)
                residual = torch.zeros_like(hidden)
            hidden, residual = self.shard.forward(inputs["input_ids"] if self.is_first else None,
                                                  inputs["positions"], hidden, residual, self.kv_caches, meta)
        if self.is_last:
            logits = self.shard.compute_logits(hidden[:2], residual[:2])
            for temperature, top_k, logprobs in [(0.0, 0, -1), (1.0, 0, -1), (1.0, 5, -1), (1.0, 0, 2), (1.0, 5, 2)]:
                self.sampler(logits, SamplingTensors.build(
                    temperature=[temperature] * 2, top_k=[top_k] * 2, top_p=[1.0] * 2, min_p=[0.0] * 2,
                    seeds=[0, 1], positions=[0, 0], num_logprobs=logprobs, device=self.device))
        torch.cuda.synchronize(self.device)

    def _copy_blocks(self, src: list[int], dst: list[int]) -> None:
        if not src:
            return
        blocks = upload({"src": np.asarray(src, dtype=np.int64), "dst": np.asarray(dst, dtype=np.int64)},
                        self.device)
        for cache in self.kv_caches:
            cache[:, blocks["dst"]] = cache[:, blocks["src"]]

    # ------------------------------------------------------------ plans

    def apply_state(self, plan: engine_pb2.StepPlan) -> np.ndarray:
        """Applies the plan's deltas to the sequence table; returns the rows of the scheduled seqs."""
        for seq_id in plan.released_seq_ids:
            self.table.release(seq_id)
        for seq in plan.new_sequences:
            self.table.add(seq)
        rows = self.table.lookup(plan.seq_ids)
        self.table.update_tables(
            rows,
            np.asarray(plan.table_keep, dtype=np.int64),
            np.asarray(plan.table_append_counts, dtype=np.int64),
            np.asarray(plan.table_append_ids, dtype=np.int32),
        )
        self._copy_blocks(list(plan.copy_src_blocks), list(plan.copy_dst_blocks))
        return rows

    def host_inputs(self, plan: engine_pb2.StepPlan, rows: np.ndarray) -> HostInputs:
        """The step's inputs as numpy arrays: positions, slots and block tables, vectorised."""
        num_computed = np.asarray(plan.num_computed, dtype=np.int64)
        q_lens = np.asarray(plan.num_scheduled, dtype=np.int64)
        if q_lens.size == 0 or (q_lens <= 0).any():
            raise PlanError("a plan must schedule at least one token per sequence")
        if any(plan.num_draft_tokens):
            raise PlanError("speculative verification is not supported by this worker yet")
        seq_lens = num_computed + q_lens
        if seq_lens.max() > self.max_model_len:
            raise PlanError("a sequence exceeds max_model_len")
        qsl = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        total = int(qsl[-1])
        # Position of every token: its sequence's cached length plus its offset in the chunk.
        positions = np.repeat(num_computed - qsl[:-1], q_lens) + np.arange(total)
        token_rows = np.repeat(rows, q_lens)
        needed_blocks = (seq_lens + self.block_size - 1) // self.block_size
        if (needed_blocks > self.table.num_blocks[rows]).any():
            raise PlanError("a sequence was scheduled past the end of its block table")
        block_ids = self.table.block_tables[token_rows, positions // self.block_size].astype(np.int64)
        input_ids = None
        if self.is_first:
            if len(plan.input_token_ids) != total:
                raise PlanError(f"plan has {len(plan.input_token_ids)} input tokens for {total} scheduled")
            input_ids = np.asarray(plan.input_token_ids, dtype=np.int64)
        sample_idx = np.nonzero(np.asarray(plan.sample, dtype=bool))[0]
        return HostInputs(
            input_ids=input_ids, token_rows=token_rows,
            has_placeholders=input_ids is not None and bool((input_ids == PLACEHOLDER_TOKEN).any()),
            positions=positions, query_start_loc=qsl, seq_lens=seq_lens,
            slot_mapping=block_ids * self.block_size + positions % self.block_size,
            block_tables=self.table.block_tables[rows, : int(needed_blocks.max())],
            max_query_len=int(q_lens.max()),
            sample_rows=rows[sample_idx], sample_token_index=qsl[1:][sample_idx] - 1,
            sample_positions=seq_lens[sample_idx], sample_seq_ids=[plan.seq_ids[i] for i in sample_idx])

    def _resolve_placeholders(self, input_ids: torch.Tensor, token_rows: torch.Tensor | None) -> torch.Tensor:
        """Decode lookahead: a plan sent before the previous step's token reached the scheduler
        carries PLACEHOLDER_TOKEN; that token is still here, on the device (token_rows: each
        token's state row, on the device; None when the plan has no placeholder)."""
        if token_rows is None:
            return input_ids
        return torch.where(input_ids < 0, self.last_sampled[token_rows], input_ids)

    def _upload_step_arrays(self, h: HostInputs, eager: bool) -> tuple[dict[str, torch.Tensor], SamplingTensors | None]:
        """The step's index arrays and sampling settings on the device, in one copy (the decode
        graphs stage their own inputs; an eager step needs the attention metadata too). Built
        before anything is launched, so the GPU never waits on host work mid-step."""
        arrays = {"sample_rows": h.sample_rows, "sample_token_index": h.sample_token_index}
        if eager:
            if h.has_placeholders:
                arrays["token_rows"] = h.token_rows
            arrays.update(positions=h.positions, query_start_loc=h.query_start_loc.astype(np.int32),
                          seq_lens=h.seq_lens.astype(np.int32), block_tables=h.block_tables,
                          slot_mapping=h.slot_mapping)
            if h.input_ids is not None:
                arrays["input_ids"] = h.input_ids
        flags = None
        if self.is_last and h.sample_seq_ids:
            t, r = self.table, h.sample_rows
            sampling, flags = SamplingTensors.prepare(
                temperature=t.temperature[r], top_k=t.top_k[r], top_p=t.top_p[r], min_p=t.min_p[r],
                seeds=t.seed[r], positions=h.sample_positions, num_logprobs=int(t.logprobs[r].max()))
            arrays.update({f"sampling.{name}": a for name, a in sampling.items()})
        d = upload(arrays, self.device)
        if flags is None:
            return d, None
        fields = {name.removeprefix("sampling."): d.pop(name) for name in list(d) if name.startswith("sampling.")}
        return d, SamplingTensors(**fields, **flags)

    def capture_cuda_graphs(self, max_batch: int) -> None:
        from strata.services.worker.cuda_graphs import DecodeGraphs
        self.graphs = DecodeGraphs(self, max_batch)
        self.graphs.capture()

    @torch.inference_mode()
    def execute(self, plan: engine_pb2.StepPlan, hidden: torch.Tensor | None = None,
                residual: torch.Tensor | None = None):
        """Launches one step. Returns (hidden, residual) on a middle stage, a PendingResult on the last."""
        start = time.perf_counter()
        rows = self.apply_state(plan)
        h = self.host_inputs(plan, rows)
        gpu_start = self.timeline.mark() if self.timeline else None
        n = len(h.seq_lens)
        bs = self.graphs.padded_size(n) if self.graphs and h.max_query_len == 1 else None
        if bs is not None:  # decode-only: replay a captured graph
            return self._execute_graph(plan, h, rows, bs, hidden, residual, start, gpu_start)
        d, sampling = self._upload_step_arrays(h, eager=True)
        input_ids = d.get("input_ids")
        if input_ids is not None:
            input_ids = self._resolve_placeholders(input_ids, d.get("token_rows"))
        meta = AttentionMetadata(
            query_start_loc=d["query_start_loc"], seq_lens=d["seq_lens"], block_tables=d["block_tables"],
            slot_mapping=d["slot_mapping"], max_query_len=h.max_query_len, max_seq_len=int(h.seq_lens.max()))
        hidden, residual = self.shard.forward(input_ids, d["positions"], hidden, residual, self.kv_caches, meta)
        if not self.is_last:
            return hidden, residual
        logits = None
        if h.sample_seq_ids:
            idx = d["sample_token_index"]
            logits = self.shard.compute_logits(hidden[idx], residual[idx])
        return self._sample(plan.step_id, h, logits, d["sample_rows"], sampling, start, gpu_start)

    def _execute_graph(self, plan, h: HostInputs, rows: np.ndarray, bs: int, hidden, residual, start: float,
                       gpu_start):
        """A decode step on the graph of padded size bs. When every row samples without filters or
        logprobs, the graph's own draw is the result; otherwise the sampler runs on its logits
        (and overwrites the graph's tokens in last_sampled)."""
        t, graphs = self.table, self.graphs
        n = len(h.seq_lens)
        sampling_rows = None
        if graphs.samples:
            sampling_rows = {"seeds": t.seed[rows], "sample_positions": h.seq_lens,
                             "inv_temperature": t.inv_temperature[rows], "greedy": t.greedy[rows]}
        in_graph = graphs.samples and len(h.sample_seq_ids) == n and bool(t.unfiltered[rows].all())
        d = sampling = None
        if self.is_last and h.sample_seq_ids and not in_graph:
            d, sampling = self._upload_step_arrays(h, eager=False)
        outs = graphs.run(bs, h, rows, sampling_rows, hidden, residual)
        if not self.is_last:
            return outs
        if in_graph:
            return PendingResult(plan.step_id, start, h.sample_seq_ids, t.logprobs[h.sample_rows], [outs[1]],
                                 self.timeline, gpu_start)
        logits = sample_rows = None
        if h.sample_seq_ids:
            # Every decode token is its sequence's last: the sampled rows index the logits directly.
            logits = outs[0] if len(h.sample_seq_ids) == n else outs[0][d["sample_token_index"]]
            sample_rows = d["sample_rows"]
        return self._sample(plan.step_id, h, logits, sample_rows, sampling, start, gpu_start)

    def _sample(self, step_id: int, h: HostInputs, logits, sample_rows, sampling, start: float, gpu_start):
        if not h.sample_seq_ids:
            return PendingResult(step_id, start, [], np.zeros(0), [None], self.timeline, gpu_start)
        out = self.sampler(logits, sampling)
        # Kept on the device for the next plan's decode lookahead (placeholder input tokens).
        self.last_sampled[sample_rows] = out.token_ids
        tensors = [out.token_ids]
        if sampling.num_logprobs >= 0:
            tensors += [out.logprobs, out.top_ids, out.top_logprobs]
        return PendingResult(step_id, start, h.sample_seq_ids, self.table.logprobs[h.sample_rows], tensors,
                             self.timeline, gpu_start)


class PendingResult:
    """A step's sampled tokens on their way to the host. The copy is queued behind the step on
    the GPU; finish() waits for it (the one host-device synchronisation of the step), so the
    step thread can already launch the next plan."""

    def __init__(self, step_id: int, start: float, seq_ids: list[int], wanted_logprobs: np.ndarray,
                 tensors: list[torch.Tensor | None], timeline: GpuTimeline | None = None,
                 gpu_start: torch.cuda.Event | None = None):
        self.step_id, self.start, self.seq_ids, self.wanted = step_id, start, seq_ids, wanted_logprobs
        self.host = [None if x is None else x.to("cpu", non_blocking=True) for x in tensors]
        self.timeline, self.gpu_start = timeline, gpu_start
        self.event = GpuTimeline.mark() if gpu_start is not None else None
        self.launch_seconds = time.perf_counter() - start

    def finish(self) -> engine_pb2.StepResult:
        result = engine_pb2.StepResult(step_id=self.step_id, launch_seconds=self.launch_seconds)
        if self.event is not None:
            self.event.synchronize()
            result.gpu_seconds, result.gpu_idle_seconds = self.timeline.finished(self.gpu_start, self.event)
        if self.seq_ids:
            token_ids = self.host[0].tolist()
            n = len(token_ids)
            result.seq_ids.extend(self.seq_ids)
            result.num_tokens.extend([1] * n)
            result.token_ids.extend(token_ids)
            if len(self.host) > 1:
                _, logprobs, top_ids, top_lps = self.host
                result.logprobs.extend(logprobs.tolist())
                top_ids = top_ids.numpy() if top_ids is not None else np.zeros((n, 0), np.int64)
                top_lps = top_lps.numpy() if top_lps is not None else np.zeros((n, 0), np.float32)
                for i in range(n):  # per sampled sequence, only when logprobs were asked
                    k = max(int(self.wanted[i]), 0)
                    result.num_top.append(k)
                    result.top_token_ids.extend(top_ids[i, :k].tolist())
                    result.top_logprobs.extend(top_lps[i, :k].tolist())
        result.execute_seconds = time.perf_counter() - self.start
        return result
