"""What a worker remembers about each live sequence between steps.

The scheduler sends a sequence's sampling options once, at admission, and afterwards only the
deltas of its block table, so every stage keeps that state itself. It lives in preallocated
numpy arrays with one row per sequence: building a step's inputs is then a few vectorised
gathers by row, never a loop over tokens.
"""

from __future__ import annotations

import numpy as np

from strata.sampling_rules import (
    SamplingRuleError,
    check_sampling_options,
    draws_unfiltered,
    greedy_and_inverse_temperature,
)
from strata.v1 import engine_pb2


class PlanError(ValueError):
    """A plan that does not fit this worker's state (a scheduler bug or a restarted worker)."""


class SequenceTable:
    """A row per live sequence: its block table and sampling options."""

    def __init__(self, max_seqs: int, max_blocks_per_seq: int, vocab_size: int | None = None):
        self.max_blocks = max_blocks_per_seq
        self.vocab_size = vocab_size  # token ids in the options (biases, allowed, bad words) stay below it
        self.block_tables = np.zeros((max_seqs, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(max_seqs, dtype=np.int32)
        self.temperature = np.zeros(max_seqs, dtype=np.float32)
        self.top_k = np.zeros(max_seqs, dtype=np.int32)
        self.top_p = np.ones(max_seqs, dtype=np.float32)
        self.min_p = np.zeros(max_seqs, dtype=np.float32)
        self.seed = np.zeros(max_seqs, dtype=np.int64)
        self.logprobs = np.full(max_seqs, -1, dtype=np.int32)
        self.prompt_logprobs = np.full(max_seqs, -1, dtype=np.int32)  # top k of asked prompt positions; -1: none
        # Derived once per sequence, as SamplingTensors derives them, for the decode graphs' draw.
        self.inv_temperature = np.ones(max_seqs, dtype=np.float32)
        self.greedy = np.zeros(max_seqs, dtype=np.uint8)
        self.unfiltered = np.zeros(max_seqs, dtype=bool)  # no top-k/top-p/min-p, no logprobs
        self.rows: dict[int, int] = {}
        # The last stage's penalties and grammars (sampling_controls.SamplingControls), if any,
        # and its speculation state (device_speculation.DeviceSpeculation): both follow admissions.
        self.controls = None
        self.speculation = None
        self.free_rows = list(range(max_seqs - 1, -1, -1))
        self.num_kv_blocks = 0  # block ids must be below it (set with the cache)

    def apply(self, plan: engine_pb2.StepPlan) -> np.ndarray:
        """Applies the plan's releases, admissions and block-table deltas; returns the rows of
        its scheduled sequences, in plan order."""
        for seq_id in plan.released_seq_ids:
            self.release(seq_id)
        for seq in plan.new_sequences:
            self.add(seq)
        rows = self.lookup(plan.seq_ids)
        self.update_tables(
            rows,
            np.asarray(plan.table_keep, dtype=np.int64),
            np.asarray(plan.table_append_counts, dtype=np.int64),
            np.asarray(plan.table_append_ids, dtype=np.int32),
        )
        return rows

    def add(self, seq: engine_pb2.NewSequence) -> None:
        if seq.seq_id in self.rows:
            raise PlanError(f"sequence {seq.seq_id} admitted twice")
        if not self.free_rows:
            raise PlanError("more live sequences than this worker was sized for")
        s = seq.sampling
        # The worker's one check of a sequence's options, at plan intake (strata/sampling_rules.py):
        # the scheduler checked them too, but a bad plan fails here, not with NaNs on the device.
        try:
            check_sampling_options(s, vocab_size=self.vocab_size)
        except SamplingRuleError as e:
            raise PlanError(f"invalid sampling options: {e}") from None
        row = self.free_rows.pop()
        self.rows[seq.seq_id] = row
        self.num_blocks[row] = 0
        self.temperature[row] = s.temperature
        self.top_k[row] = s.top_k
        self.top_p[row] = s.top_p
        self.min_p[row] = s.min_p
        # Seeds are uint64 on the wire; keep their bits in int64.
        self.seed[row] = np.uint64(s.seed).astype(np.int64)
        self.logprobs[row] = s.logprobs
        self.prompt_logprobs[row] = s.prompt_logprobs if s.HasField("prompt_logprobs") else -1
        # SamplingTensors.prepare's rule on one row (prepare's array overhead, paid per
        # admission, showed up in the launch of prefill steps).
        greedy, self.inv_temperature[row] = greedy_and_inverse_temperature(self.temperature[row])
        self.greedy[row] = greedy
        self.unfiltered[row] = unfiltered = draws_unfiltered(s, greedy)
        if self.controls is not None and self.controls.add(row, seq, unfiltered):
            self.unfiltered[row] = False  # its logits go through the controls before the draw
        if self.speculation is not None:
            self.speculation.admit(row, seq)

    def release(self, seq_id: int) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self.free_rows.append(row)
            if self.controls is not None:
                self.controls.release(row)
            if self.speculation is not None:
                self.speculation.release(row)

    def reset(self, num_kv_blocks: int) -> None:
        """Forgets every sequence: a new KV cache of num_kv_blocks blocks was allocated."""
        for seq_id in list(self.rows):
            self.release(seq_id)
        if self.speculation is not None:
            self.speculation.reset()
        self.num_kv_blocks = num_kv_blocks

    def lookup(self, seq_ids) -> np.ndarray:
        try:
            return np.fromiter((self.rows[s] for s in seq_ids), dtype=np.int64, count=len(seq_ids))
        except KeyError as e:
            raise PlanError(f"unknown sequence {e.args[0]} (was this worker restarted?)") from None

    def update_tables(self, rows: np.ndarray, keep: np.ndarray, counts: np.ndarray, ids: np.ndarray) -> None:
        # Only sequences whose table changed need work: most decode steps touch none.
        if not len(keep) == len(counts) == len(rows) or (keep < 0).any() or (counts < 0).any():
            raise PlanError("table_keep and table_append_counts need one non-negative entry per sequence")
        if counts.sum() != len(ids):
            raise PlanError(f"table_append_ids holds {len(ids)} ids for {counts.sum()} appended")
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_kv_blocks):
            raise PlanError(f"block ids must be in [0, {self.num_kv_blocks})")
        if (keep > self.num_blocks[rows]).any():
            raise PlanError("table_keep exceeds a sequence's block table")
        changed = np.nonzero((counts > 0) | (keep != self.num_blocks[rows]))[0]
        offsets = np.concatenate(([0], np.cumsum(counts)))
        for i in changed:
            row, k, n = rows[i], keep[i], counts[i]
            if k + n > self.max_blocks:
                raise PlanError("block table longer than max_model_len allows")
            self.block_tables[row, k : k + n] = ids[offsets[i] : offsets[i] + n]
            self.num_blocks[row] = k + n
