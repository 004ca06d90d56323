"""A step's inputs: from a plan and the sequence table to the arrays the model and sampler read.

Built on the host with numpy, vectorised over the batch (no loop over tokens), then sent to the
device in one copy through pinned memory (host_to_device.upload). Each torch call on this path
releases and retakes the GIL that the worker's gRPC and result threads contend for, so the host
side stays in numpy and the device side is one upload per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.protocol import DEVICE_DRAFT, MAX_VERIFY_ROUNDS, PLACEHOLDER_TOKEN
from strata.services.worker.device.host_to_device import upload
from strata.services.worker.sampling.sampler import SamplingTensors
from strata.services.worker.speculation.verification import DraftLayout, Verification, add_verification
from strata.services.worker.step.cascade_inputs import SharedKVRunInputs, shared_kv_run_inputs
from strata.services.worker.step.sequence_table import PlanError, SequenceTable
from strata.v1 import engine_pb2

# An eager step's head runs on its sampled rows rounded up to a multiple of this (padded_rows):
# cuBLAS chooses its kernel per GEMM shape, and mixed steps sample a different number of rows
# each, which put the 1B's last-stage lm_head at 9% of its step thread (bench/RESULTS.md, issue
# 50, session 12). Padding costs at most this many rows' logits.
LOGITS_ROWS_MULTIPLE = 32


def padded_rows(index: np.ndarray) -> np.ndarray:
    """index (not empty) repeated at its last entry up to a multiple of LOGITS_ROWS_MULTIPLE."""
    return np.pad(index, (0, -len(index) % LOGITS_ROWS_MULTIPLE), mode="edge")


@dataclass
class HostInputs:
    """One step's inputs on the host (numpy), in plan order; T tokens of B sequences."""

    input_ids: np.ndarray | None  # [T] on the first stage
    token_rows: np.ndarray  # [T] state row of each token's sequence
    has_placeholders: bool  # some input tokens are the sequence's last sampled one, on the device
    positions: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [B+1]
    seq_lens: np.ndarray  # [B]
    slot_mapping: np.ndarray  # [T]
    block_tables: np.ndarray  # [B, blocks of the longest sequence]
    max_query_len: int
    uniform_query_len: int  # every sequence's query length when they are all equal, else 0
    # Sample rows: one per sequence that samples, or d + 1 for one verifying d drafts.
    sample_rows: np.ndarray  # [R] state row of each sample row's sequence
    sample_token_index: np.ndarray  # [R] index in the flat batch of the token whose logits it samples
    sample_positions: np.ndarray  # [R] absolute position of the token it samples
    sample_seq_ids: list[int]  # [S] the sequences that sample
    verify: Verification | None  # set when some sequence verifies drafts
    shared_kv_runs: SharedKVRunInputs | None = None  # sequences sharing KV blocks, for cascade attention
    # [T] where a placeholder input token (< 0) is read from last_sampled: the token's state row,
    # or for a DEVICE_DRAFT token the draft's slot (speculation/device_speculation.py); None: token_rows.
    source_rows: np.ndarray | None = None
    drafts: DraftLayout | None = None  # set when some sequence verifies drafts (as built, unpadded)

    @property
    def draft_counts(self) -> np.ndarray:
        """[B] each sequence's drafts."""
        return self.drafts.per_seq if self.drafts is not None else np.zeros(len(self.seq_lens), np.int64)

    @property
    def placeholder_rows(self) -> np.ndarray:
        return self.token_rows if self.source_rows is None else self.source_rows


class StepInputBuilder:
    """Turns plans into HostInputs for this stage, and HostInputs into device tensors."""

    def __init__(
        self,
        table: SequenceTable,
        *,
        block_size: int,
        max_model_len: int,
        first_stage: bool,
        last_stage: bool,
        device: torch.device,
        vocab_size: int,
    ):
        self.table = table
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.first_stage = first_stage
        self.last_stage = last_stage
        self.device = device
        # The last stage's DeviceSpeculation when it proposes drafts (one stage: stage 0 too),
        # whose DEVICE_DRAFT input tokens then resolve to its drafts; None: they are refused.
        self.speculation = None

    def build(self, plan: engine_pb2.StepPlan, rows: np.ndarray, shared_kv: bool = True) -> HostInputs:
        """The step's inputs as numpy arrays: positions, slots and block tables, vectorised.
        rows: the state rows of the plan's sequences (SequenceTable.apply). shared_kv False
        leaves the shared-KV runs out (a verification graph's step, which attends without them;
        attach_shared_kv_runs adds them if the step runs another way)."""
        num_computed = np.asarray(plan.num_computed, dtype=np.int64)
        q_lens = np.asarray(plan.num_scheduled, dtype=np.int64)
        if q_lens.size == 0 or (q_lens <= 0).any():
            raise PlanError("a plan must schedule at least one token per sequence")
        if not len(num_computed) == len(q_lens) == len(rows) == len(plan.sample) or (num_computed < 0).any():
            raise PlanError("num_computed, num_scheduled and sample need one entry per sequence, num_computed >= 0")
        seq_lens = num_computed + q_lens
        # Several verify rounds (StepPlan.verify_rounds) move a sequence on by up to a round's
        # tokens each: its block table must hold the last round's slots too.
        reach = seq_lens
        if plan.verify_rounds:
            rounds = np.asarray(plan.verify_rounds, dtype=np.int64)
            if rounds.shape != q_lens.shape or (rounds < 1).any() or (rounds > MAX_VERIFY_ROUNDS).any():
                raise PlanError(f"verify_rounds needs one entry in [1, {MAX_VERIFY_ROUNDS}] per sequence")
            reach = seq_lens + (rounds - 1) * q_lens
        if reach.max() > self.max_model_len:
            raise PlanError("a sequence exceeds max_model_len")
        qsl = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=qsl[1:])
        total = int(qsl[-1])
        # Position of every token: its sequence's cached length plus its offset in the chunk.
        positions = np.repeat(num_computed - qsl[:-1], q_lens) + np.arange(total)
        token_rows = np.repeat(rows, q_lens)
        table, block_size = self.table, self.block_size
        needed_blocks = (reach + block_size - 1) // block_size
        if (needed_blocks > table.num_blocks[rows]).any():
            raise PlanError("a sequence was scheduled past the end of its block table")
        block_ids = table.block_tables[token_rows, positions // block_size].astype(np.int64)
        input_ids = None
        if self.first_stage:
            if len(plan.input_token_ids) != total:
                raise PlanError(f"plan has {len(plan.input_token_ids)} input tokens for {total} scheduled")
            input_ids = np.asarray(plan.input_token_ids, dtype=np.int64)
            placeholder = input_ids == PLACEHOLDER_TOKEN
            if self.speculation is not None:
                placeholder |= input_ids == DEVICE_DRAFT
            if ((input_ids < 0) & ~placeholder).any() or (input_ids >= self.vocab_size).any():
                raise PlanError(f"input token ids must be in [0, {self.vocab_size})")
        # (ids taken in numpy below: one protobuf index per sequence took 9x as long)
        sample_idx = np.nonzero(np.asarray(plan.sample, dtype=bool))[0]
        last_token = qsl[1:] - 1
        h = HostInputs(
            input_ids=input_ids,
            token_rows=token_rows,
            has_placeholders=input_ids is not None and bool((input_ids < 0).any()),
            positions=positions,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            slot_mapping=block_ids * block_size + positions % block_size,
            block_tables=table.block_tables[rows, : int(needed_blocks.max())],
            max_query_len=int(q_lens.max()),
            uniform_query_len=int(q_lens[0]) if (q_lens == q_lens[0]).all() else 0,
            sample_rows=rows[sample_idx],
            sample_token_index=last_token[sample_idx],
            sample_positions=seq_lens[sample_idx],
            sample_seq_ids=np.asarray(plan.seq_ids, dtype=np.int64)[sample_idx].tolist(),
            verify=None,
        )
        if any(plan.num_draft_tokens):
            drafts = add_verification(h, plan, q_lens, sample_idx, rows)
            h.drafts = DraftLayout(drafts, positions - np.repeat(seq_lens - drafts, q_lens))
        if h.has_placeholders and self.speculation is not None:
            self._add_device_drafts(h)
        if shared_kv:
            self.attach_shared_kv_runs(plan, h)
        return h

    def attach_shared_kv_runs(self, plan: engine_pb2.StepPlan, h: HostInputs) -> None:
        """The plan's shared-KV runs (cascade attention's inputs, checked) into h."""
        qsl = h.query_start_loc
        num_computed = h.seq_lens - np.diff(qsl)
        h.shared_kv_runs = shared_kv_run_inputs(plan, qsl, num_computed, h.seq_lens, h.block_tables, self.block_size)

    def _add_device_drafts(self, h: HostInputs) -> None:
        """DEVICE_DRAFT input tokens read the last stage's draft j of their row, j their index
        among the sequence's drafts (they must be drafts: the last num_draft_tokens inputs)."""
        device = h.input_ids == DEVICE_DRAFT
        if not device.any():
            return
        if h.drafts is None or (h.drafts.index[device] < 0).any():
            raise PlanError("DEVICE_DRAFT tokens must be a verifying sequence's drafts")
        j = h.drafts.index
        h.source_rows = np.where(device, self.speculation.source_row(h.token_rows, j), h.token_rows)

    def pad_queries(self, h: HostInputs, q: int) -> HostInputs | None:
        """A verification step whose sequences compute different numbers of tokens (1 + their
        drafts), padded to q tokens each so that a verification graph of query length q runs it.
        A sequence's pad tokens follow its real ones: they write no KV (slot -1), sit at its last
        real position, and nothing samples them, so its real rows compute exactly what they would
        unpadded (causal attention never reads a later position). None when the step cannot be
        padded: a sequence that does not sample every token, or one that would pass max_model_len."""
        qsl, n = h.query_start_loc, len(h.seq_lens)
        q_lens = np.diff(qsl)
        num_computed = h.seq_lens - q_lens
        if (
            h.verify is None
            or len(h.sample_rows) != int(qsl[-1])
            or q_lens.max() > q
            or (num_computed + q > self.max_model_len).any()
        ):
            return None
        offset = np.arange(int(qsl[-1])) - np.repeat(qsl[:-1], q_lens)  # each token's index in its sequence
        seq_of = np.repeat(np.arange(n), q_lens)
        index = seq_of * q + offset  # where each real token goes
        total = n * q
        last = np.repeat(h.seq_lens - 1, q)  # every pad sits at its sequence's last real position
        positions, slots, token_rows = last.copy(), np.full(total, -1, np.int64), np.repeat(h.token_rows[qsl[:-1]], q)
        positions[index], slots[index] = h.positions, h.slot_mapping
        input_ids = None
        if h.input_ids is not None:
            input_ids = np.zeros(total, np.int64)
            input_ids[index] = h.input_ids
        source_rows = None
        if h.source_rows is not None:
            source_rows = token_rows.copy()
            source_rows[index] = h.source_rows
        return HostInputs(
            input_ids=input_ids,
            token_rows=token_rows,
            has_placeholders=h.has_placeholders,
            positions=positions,
            query_start_loc=np.arange(0, (n + 1) * q, q, dtype=np.int64),
            seq_lens=num_computed + q,
            slot_mapping=slots,
            block_tables=h.block_tables,
            max_query_len=q,
            uniform_query_len=q,
            sample_rows=h.sample_rows,
            sample_token_index=index[h.sample_token_index],
            sample_positions=h.sample_positions,
            sample_seq_ids=h.sample_seq_ids,
            verify=h.verify,
            source_rows=source_rows,
        )

    def upload(self, h: HostInputs, *, eager: bool) -> tuple[dict[str, torch.Tensor], SamplingTensors | None]:
        """The step's index arrays and sampling settings on the device, in one copy (the decode
        graphs stage their own inputs; an eager step needs the attention metadata too). Called
        before anything is launched, so the GPU never waits on host work mid-step."""
        arrays = {"sample_rows": h.sample_rows, "sample_token_index": h.sample_token_index}
        if eager:
            if h.has_placeholders:
                arrays["token_rows"] = h.placeholder_rows
            arrays.update(
                positions=h.positions,
                query_start_loc=h.query_start_loc.astype(np.int32),
                seq_lens=h.seq_lens.astype(np.int32),
                block_tables=h.block_tables,
                slot_mapping=h.slot_mapping,
            )
            if h.input_ids is not None:
                arrays["input_ids"] = h.input_ids
            if h.shared_kv_runs is not None:
                arrays.update(h.shared_kv_runs.arrays())
            if self.last_stage and h.sample_seq_ids:
                arrays["logits_token_index"] = padded_rows(h.sample_token_index)
        flags = None
        if self.last_stage and h.sample_seq_ids:
            t, r = self.table, h.sample_rows
            sampling, flags = SamplingTensors.prepare(
                temperature=t.temperature[r],
                top_k=t.top_k[r],
                top_p=t.top_p[r],
                min_p=t.min_p[r],
                seeds=t.seed[r],
                positions=h.sample_positions,
                num_logprobs=int(t.logprobs[r].max()),
            )
            arrays.update({f"sampling.{name}": a for name, a in sampling.items()})
        d = upload(arrays, self.device)
        if flags is None:
            return d, None
        fields = {name.removeprefix("sampling."): d.pop(name) for name in list(d) if name.startswith("sampling.")}
        return d, SamplingTensors(**fields, **flags)
