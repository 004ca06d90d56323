"""Speculative decoding on the last stage's device: each sequence's tokens kept by row, prompt
lookup proposals made there after every draw, verification there, and the moves of a plan that
went out before an earlier verification of its sequences came back.

What lives on the device, per sequence-table row (DeviceSpeculation):
- history [rows, max_model_len] int32: the sequence's tokens by position, written from the
  plans' known input tokens (prompt, recomputed output; NewSequence.prefix_token_ids for what it
  never sees as input) and from each step's emitted draws;
- hist_len: how many of them are known (set by each sampling step's commit);
- the drafts proposed for the row's next step, in an extension of the runner's `last_sampled`
  (index draft_base + row * max_k + j), so that a plan's DEVICE_DRAFT input tokens resolve as
  decode placeholders do: the embedding reads `last_sampled` at the token's source row
  (step_inputs.HostInputs.source_rows), and nothing in the step needs a new input path;
- num_valid: how many of those drafts the lookup found (the others are 0s, never accepted);
- rejected: the draft tokens rejected since admission (the shifts of kernels/spec_decode.py).

Per step (the runner calls in): begin_step writes the known tokens into history and builds the
step's per-sequence meta rows (kernels/spec_decode.py's columns); stage() copies them to a static
device buffer before the forward (the verification graphs read it to move positions); the
eager path calls shift_eager; after the draw, after_draw verifies and commits every sampling
sequence and proposes the next drafts (one kernel each), returning a packed int64 [n, 2 + max_k]
tensor for the step's result: emitted tokens, drafts proposed, the drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.kernels.ngram_lookup import ngram_propose
from strata.kernels.spec_decode import (
    DEVICE,
    DRAFTS,
    FIRST_ROW,
    FIRST_TOKEN,
    HOST,
    KNOWN,
    LINKED_DRAFTS,
    LOOKUP_DRAFTS,
    POS,
    PROPOSE,
    ROUNDS,
    ROW,
    advance_round,
    commit,
    meta_columns,
    shift_positions_reference,
    shifts_reference,
)
from strata.protocol import DEVICE_DRAFT
from strata.services.worker.device.host_to_device import upload
from strata.services.worker.speculation.meta_staging import GATE_COMMIT, GATE_PROPOSE, MetaStaging, fill_staged_rows
from strata.services.worker.step.sequence_table import PlanError


@dataclass
class SpecStep:
    """One step's speculation bookkeeping (host side)."""

    meta: np.ndarray  # int64 [n, columns]: a row per sequence of the step, in plan order
    sample_idx: np.ndarray  # the sequences that sample (indices into meta)
    shifted: bool  # some sequence may move back (its plan was sent before a result)
    proposes: bool  # some sequence asks for proposals
    device_meta: torch.Tensor | None = None  # the staged meta rows (static buffer)
    # A plain decode step (every sequence decodes one token, none verifies, proposes or moves
    # back): no meta rows, no commit kernel, no packed result; its tokens go into history at
    # these host (row, position) pairs: inside the decode graph when the graph draws
    # (recording_decode_graphs), else after the draw.
    plain: tuple[np.ndarray, np.ndarray] | None = None
    rounds: int = 1  # verification rounds the step runs (StepPlan.verify_rounds, most of any sequence)
    seq_rounds: np.ndarray | None = None  # each sampling sequence's rounds, with rounds > 1


class DeviceSpeculation:
    def __init__(
        self,
        *,
        max_seqs: int,
        max_model_len: int,
        max_k: int,
        ngram_min: int,
        ngram_max: int,
        block_size: int,
        last_sampled: torch.Tensor,
        device: torch.device,
    ):
        if last_sampled.shape[0] < self.last_sampled_size(max_seqs, max_k):
            raise ValueError("last_sampled has no room for the drafts")
        self.max_k, self.ngram_min, self.ngram_max = max_k, ngram_min, ngram_max
        self.block_size = block_size
        self.device = device
        self.last_sampled = last_sampled
        self.scratch_row = max_seqs
        self.draft_base = max_seqs + 1
        rows = max_seqs + 1
        self.history = torch.zeros(rows, max_model_len, dtype=torch.int32, device=device)
        self.hist_len = torch.zeros(rows, dtype=torch.int64, device=device)
        self.rejected = torch.zeros(rows, dtype=torch.int64, device=device)
        self.num_valid = torch.zeros(rows, dtype=torch.int32, device=device)
        self.columns = meta_columns(max_k)
        self.pad_row = np.full(self.columns, -1, dtype=np.int64)
        self.pad_row[ROW] = self.scratch_row
        self.pad_row[[FIRST_ROW, FIRST_TOKEN, POS, DEVICE, PROPOSE]] = 0
        self.staging = MetaStaging(rows, self.pad_row, device)
        # A verification graph's packed result (its commit and proposal write it in the graph).
        self.graph_packed = torch.zeros(rows, 2 + max_k, dtype=torch.int64, device=device)
        self._admitted: list[int] = []  # rows admitted since the last step
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        self._rounds_kept = (empty, empty)  # graph_rounds' buffers (draws, packed results)
        self._prefix: dict[int, np.ndarray] = {}  # row -> tokens before its first step

    @staticmethod
    def last_sampled_size(max_seqs: int, max_k: int) -> int:
        """last_sampled's length with the drafts' area: max_seqs rows and the scratch row, then
        max_k drafts for each of them."""
        return (max_seqs + 1) * (1 + max_k)

    def source_row(self, rows: np.ndarray, j: np.ndarray) -> np.ndarray:
        """last_sampled's index of draft j of each row."""
        return self.draft_base + rows * self.max_k + j

    def warm_up(self) -> None:
        """Compiles the commit and lookup kernels (both draw layouts) on the scratch row, before
        serving; leaves every state as it was."""
        meta = torch.as_tensor(np.tile(self.pad_row, (2, 1)), device=self.device)
        meta[0, DRAFTS], meta[0, PROPOSE], meta[0, DEVICE] = 1, self.max_k, 0
        draws = torch.zeros(2, dtype=torch.int64, device=self.device)
        row = self.scratch_row
        saved = [t[row].clone() for t in (self.rejected, self.num_valid, self.hist_len, self.last_sampled)]
        for first in (FIRST_ROW, FIRST_TOKEN):
            packed = torch.zeros(2, 2 + self.max_k, dtype=torch.int64, device=self.device)
            self._commit_and_propose(draws, meta, packed, first, proposes=first == FIRST_TOKEN)
        for t, value in zip((self.rejected, self.num_valid, self.hist_len, self.last_sampled), saved):
            t[row] = value
        self.history[row].zero_()

    # ------------------------------------------------------------ sequences

    def admit(self, row: int, seq) -> None:
        self._admitted.append(row)
        if seq.prefix_token_ids:
            self._prefix[row] = np.asarray(seq.prefix_token_ids, dtype=np.int64)
        else:
            self._prefix.pop(row, None)

    def release(self, row: int) -> None:
        self._prefix.pop(row, None)

    def reset(self) -> None:
        self._admitted.clear()
        self._prefix.clear()
        self.staging.reset(self.pad_row)
        self.rejected.zero_()
        self.num_valid.zero_()
        self.hist_len.zero_()

    # ------------------------------------------------------------ before the forward

    def begin_step(self, plan, h, tokens: np.ndarray) -> SpecStep:
        """The known tokens into history (admissions' prefixes, the plan's input tokens but
        placeholders and drafts) and the step's meta rows. tokens: the plan's input ids."""
        qsl = h.query_start_loc
        n = len(qsl) - 1
        drafts = h.draft_counts
        self._write_known(h, tokens)
        if (
            n == len(tokens)
            and len(plan.sample) == n
            and all(plan.sample)
            and not any(plan.propose_drafts)
            and not any(plan.num_draft_tokens)
            and not any(k >= 0 for k in plan.rejected_drafts)
        ):
            # Plain decodes, as a speculating cluster runs while its cost model has speculation
            # off: they cost what a plain cluster's steps cost (the commit's meta rows, kernel
            # and packed read-back made each step dearer on the host; so did this step's own
            # upload and history writes).
            return SpecStep(None, np.arange(n), False, False, plain=(h.token_rows, h.seq_lens))
        sample = np.asarray(plan.sample, dtype=bool)
        sample_idx = np.nonzero(sample)[0]
        first = qsl[:-1]
        meta = np.empty((n, self.columns), dtype=np.int64)
        meta[:, ROW] = h.token_rows[first]
        counts = drafts[sample_idx] + 1
        first_row = np.cumsum(counts) - counts
        meta[:, FIRST_ROW] = 0
        meta[sample_idx, FIRST_ROW] = first_row
        meta[:, FIRST_TOKEN] = 0  # set by stage(), in the layout the step runs in
        meta[:, DRAFTS] = -1
        meta[sample_idx, DRAFTS] = drafts[sample_idx]
        meta[:, POS] = h.seq_lens - drafts  # the position the first sample row draws
        known = np.asarray(plan.rejected_drafts, dtype=np.int64) if plan.rejected_drafts else None
        if known is not None and known.shape[0] != n:
            raise PlanError("rejected_drafts needs one entry per sequence")
        meta[:, KNOWN] = -1 if known is None else known
        meta[:, PROPOSE] = 0
        propose = np.asarray(plan.propose_drafts, dtype=np.int64) if plan.propose_drafts else None
        if propose is not None:
            if propose.shape[0] != n or (propose < 0).any() or (propose > self.max_k).any():
                raise PlanError(f"propose_drafts needs one entry in [0, {self.max_k}] per sequence")
            meta[sample_idx, PROPOSE] = propose[sample_idx]
        meta[:, DEVICE] = 0
        meta[:, HOST:] = -1
        rounds = self._rounds(plan, n, sample, drafts)
        meta[:, ROUNDS] = 1 if rounds is None else rounds
        if drafts.any():
            if (drafts > self.max_k).any():
                raise PlanError(f"at most {self.max_k} drafts per sequence")
            j = h.drafts.index
            is_draft = j >= 0
            seq_of = np.repeat(np.arange(n), np.diff(qsl))
            device = np.zeros(n, dtype=bool)
            device[seq_of[is_draft & (tokens == DEVICE_DRAFT)]] = True
            meta[:, DEVICE] = device * (LINKED_DRAFTS if plan.linked_drafts else LOOKUP_DRAFTS)
            host = is_draft & ~device[seq_of]
            meta[seq_of[host], HOST + j[host]] = tokens[host]
        if rounds is not None and (meta[rounds > 1, DEVICE] != LOOKUP_DRAFTS).any():
            raise PlanError("several verify rounds verify this device's drafts (DEVICE_DRAFT) only")
        step = SpecStep(meta, sample_idx, known is not None and bool((known >= 0).any()), propose is not None)
        if rounds is not None:
            step.rounds, step.seq_rounds = int(rounds.max()), rounds[sample_idx]
        return step

    def _rounds(self, plan, n: int, sample: np.ndarray, drafts: np.ndarray) -> np.ndarray | None:
        """Each sequence's verification rounds (StepPlan.verify_rounds; their count and range
        checked with the step's inputs), None for one each. More than one only for a sequence
        that samples and verifies drafts this device proposes (the next round's drafts are its
        proposals)."""
        if not plan.verify_rounds:
            return None
        rounds = np.asarray(plan.verify_rounds, dtype=np.int64)
        several = rounds > 1
        if (several & ~(sample & (drafts > 0))).any():
            raise PlanError("only a sequence that samples and verifies drafts runs several verify rounds")
        if not several.any():
            return None
        propose = np.asarray(plan.propose_drafts, dtype=np.int64) if plan.propose_drafts else np.zeros(n, np.int64)
        if (several & (propose <= 0)).any():
            raise PlanError("a sequence with several verify rounds must propose drafts (propose_drafts)")
        return rounds

    def _write_known(self, h, tokens: np.ndarray) -> None:
        keep = tokens >= 0
        if h.drafts is not None:  # drafts are not known tokens yet
            keep &= h.drafts.index < 0
        parts_rows, parts_pos, parts_tok = [], [], []
        if self._prefix:
            for row in np.unique(h.token_rows).tolist():
                prefix = self._prefix.pop(row, None)
                if prefix is not None:
                    parts_rows.append(np.full(prefix.size, row, np.int64))
                    parts_pos.append(np.arange(prefix.size, dtype=np.int64))
                    parts_tok.append(prefix)
        if keep.any():
            parts_rows.append(h.token_rows[keep])
            parts_pos.append(h.positions[keep])
            parts_tok.append(tokens[keep])
        arrays = {}
        if parts_rows:
            arrays.update(rows=np.concatenate(parts_rows), pos=np.concatenate(parts_pos), tok=np.concatenate(parts_tok))
        if self._admitted:
            arrays["admitted"] = np.asarray(self._admitted, dtype=np.int64)
            self._admitted.clear()
        if not arrays:
            return
        d = upload(arrays, self.device)
        if "admitted" in d:
            self.rejected[d["admitted"]] = 0
            self.num_valid[d["admitted"]] = 0
            self.hist_len[d["admitted"]] = 0
        if "rows" in d:
            self.history[d["rows"], d["pos"].clamp(0, self.history.shape[1] - 1)] = d["tok"].to(torch.int32)

    def stage(self, step: SpecStep, h, padded_seqs: int = 0, commits_in_graph: bool = False, graphs=None):
        """Stages the step's meta rows (and padding rows up to padded_seqs) before the forward.
        h: the inputs as the step runs them (a padded verification's), whose token layout a
        graph's draws follow. commits_in_graph: the verification graph's draws are the step's
        result, and its own commit and proposal (commit_in_graph) take them; otherwise
        after_draw does, after the sampler. graphs: the step's graphs; a verification graph
        stages its meta rows with its own inputs (one copy), so this returns the writer for
        its run() (stage_extra), else None. The eager commit reads this module's staging
        buffer, so a step that commits after the graph is staged there too."""
        if step.plain is not None:
            return None  # (the decode graphs read no meta rows)
        meta, idx = step.meta, step.sample_idx
        meta[idx, FIRST_TOKEN] = h.sample_token_index[meta[idx, FIRST_ROW]]
        gates = (int(commits_in_graph), int(commits_in_graph and step.proposes))
        graph_rows = getattr(graphs, "extra", None)  # (device) a verification graph's staged rows
        if graph_rows is None or not commits_in_graph:
            step.device_meta = self.staging.stage(meta, padded_seqs, self.pad_row, gates)
        if graph_rows is None:
            return None
        total = max(padded_seqs, meta.shape[0])
        if commits_in_graph:
            step.device_meta = graph_rows[1 : 1 + total]
        return lambda out: fill_staged_rows(out, meta, total, self.pad_row, gates)

    def commit_in_graph(self, draws: torch.Tensor, bs: int, staged: torch.Tensor) -> None:
        """Inside a verification graph of bs sequences, after its draw (per token of the padded
        layout): the commit and the proposal of after_draw, into graph_packed, each gated by the
        step's gates in row 0 of the graph's staged rows (shut: the step's draws are not its
        result, and after_draw runs); the meta rows follow."""
        packed = self.graph_packed[:bs]
        packed.zero_()
        self._commit_and_propose(draws, staged[1 : bs + 1], packed, FIRST_TOKEN, True, gates=staged[0])

    def committed_in_graph(self, step: SpecStep) -> torch.Tensor:
        """The packed result a verification graph's own commit wrote for the step's sequences."""
        return self.graph_packed[: step.meta.shape[0]]

    def shift_eager(self, step: SpecStep, d: dict, sampling) -> None:
        """Moves the eager step's uploaded inputs back by each sequence's shift (when the plan
        has sequences sent before a result)."""
        if not step.shifted:
            return
        meta = step.device_meta[: step.meta.shape[0]]
        q_lens = torch.diff(d["query_start_loc"]).long()
        token_seq = torch.repeat_interleave(
            torch.arange(q_lens.shape[0], device=q_lens.device), q_lens, output_size=d["positions"].shape[0]
        )
        shift_positions_reference(
            meta,
            self.rejected,
            d["positions"],
            None,
            d["slot_mapping"],
            d["seq_lens"],
            d["block_tables"],
            token_seq,
            self.block_size,
        )
        if sampling is not None:
            sampling.positions -= shifts_reference(meta, self.rejected)[token_seq][d["sample_token_index"]]

    def shift_sampling(self, step: SpecStep, sampling, sample_token_index: torch.Tensor, query_len: int) -> None:
        """The sampler's positions of a graph step whose draw runs outside the graph."""
        if step.shifted and sampling is not None:
            shift = shifts_reference(step.device_meta, self.rejected)
            sampling.positions -= shift[sample_token_index // query_len]

    # ------------------------------------------------------------ verification rounds

    def advance_eager(self, step: SpecStep, d: dict, sampling) -> None:
        """An eager step's uploaded inputs (and its sampler's positions) moved on to the next
        verification round (kernels/spec_decode.py's advance_round)."""
        n = step.meta.shape[0]
        qsl = d["query_start_loc"].long()
        q_lens = torch.diff(qsl)
        token_seq = torch.repeat_interleave(
            torch.arange(n, device=qsl.device), q_lens, output_size=d["positions"].shape[0]
        )
        moves = advance_round(
            step.device_meta[:n],
            self.hist_len,
            d["positions"],
            d["slot_mapping"],
            d["seq_lens"],
            d.get("input_ids"),
            d["block_tables"],
            token_seq,
            qsl[:-1],
            self.block_size,
            self.scratch_row,
        )
        if sampling is not None:
            sampling.positions += moves[d["sample_token_index"]].to(sampling.positions.dtype)

    def graph_rounds(self, graphs, bs: int, step: SpecStep, draws: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rounds of a verification graph that commits in the graph, after its first replay
        (draws: that replay's draws, a view of the graph's static output): each round's draws
        and packed result kept, then the inputs advanced on the device (the graph's captured
        advance) and the graph replayed. Returns draws [rounds, tokens] and packed [rounds, n,
        2 + max_k], behind the last round on the stream."""
        rounds, n, t = step.rounds, step.meta.shape[0], draws.shape[0]
        width = self.graph_packed.shape[1]
        tokens, packed = self._round_buffers(rounds * t, rounds * n * width)
        tokens, packed = tokens[: rounds * t].view(rounds, t), packed[: rounds * n * width].view(rounds, n, width)
        for r in range(rounds):
            if r:
                graphs.advance(bs)
                graphs.replay(bs)
            graphs.keep(tokens[r], draws)
            graphs.keep(packed[r], self.graph_packed[:n])
        return tokens, packed

    def _round_buffers(self, num_tokens: int, num_packed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat device buffers for every round's draws and packed results, grown on demand. A
        step's result is copied to the host behind it on the stream, before the next step
        writes them."""
        tokens, packed = self._rounds_kept
        if tokens.shape[0] < num_tokens or packed.shape[0] < num_packed:
            sizes = (max(num_tokens, tokens.shape[0]), max(num_packed, packed.shape[0]))
            self._rounds_kept = tuple(torch.zeros(k, dtype=torch.int64, device=self.device) for k in sizes)
        return self._rounds_kept

    # ------------------------------------------------------------ after the draw

    def after_draw(self, step: SpecStep, draws: torch.Tensor, per_token: bool) -> torch.Tensor:
        """Verifies and commits the step's sampling sequences, then proposes their next drafts.
        draws: the step's drawn tokens, per sample row (per_token False) or per token of the
        (padded) step layout. Returns packed [n, 2 + max_k] int64 (module docstring), or None
        for a plain step (one token each: the result's own)."""
        if step.plain is not None:  # draw i is sequence i's: one token each, in plan order
            if not per_token:  # (a decode graph's draw recorded its tokens in the graph)
                d = upload({"rows": step.plain[0], "pos": step.plain[1].astype(np.int64)}, self.device)
                self.record(d["rows"], d["pos"], draws[: d["rows"].shape[0]])
            return None
        n = step.meta.shape[0]
        meta = step.device_meta[:n]
        packed = torch.zeros(n, 2 + self.max_k, dtype=torch.int64, device=self.device)
        self._commit_and_propose(draws, meta, packed, FIRST_TOKEN if per_token else FIRST_ROW, step.proposes)
        return packed

    def record(self, rows: torch.Tensor, pos: torch.Tensor, tokens: torch.Tensor) -> None:
        """Plain decodes' tokens into history: each row's token at `pos`, its length pos + 1.
        Scatters on flat indices, so that a decode graph can capture it (padding rows write
        the scratch row)."""
        width = self.history.shape[1]
        flat = rows * width + pos.clamp(0, width - 1)
        self.history.view(-1).scatter_(0, flat, tokens.to(torch.int32))
        self.hist_len.scatter_(0, rows, pos + 1)

    def _commit_and_propose(self, draws, meta, packed, first_col: int, proposes: bool, gates=None) -> None:
        """The commit kernel (verify, emit, advance history) and, where asked, the lookup kernel
        (the next drafts), writing packed. gates: a graph's device gates (GATE_COMMIT,
        GATE_PROPOSE) that each kernel reads to run or not; None: both run as asked."""
        commit_gate = propose_gate = None
        if gates is not None:
            commit_gate, propose_gate = gates[GATE_COMMIT : GATE_COMMIT + 1], gates[GATE_PROPOSE : GATE_PROPOSE + 1]
        commit(
            draws,
            meta,
            self.rejected,
            self.num_valid,
            self.last_sampled,
            self.draft_base,
            self.last_sampled,
            self.history,
            self.hist_len,
            packed,
            self.max_k,
            first_col=first_col,
            enabled=commit_gate,
        )
        if proposes:
            ngram_propose(
                self.history,
                self.hist_len,
                meta[:, ROW],
                meta[:, PROPOSE],
                self.last_sampled,
                self.draft_base,
                self.num_valid,
                packed,
                self.ngram_min,
                self.ngram_max,
                self.max_k,
                enabled=propose_gate,
            )
