"""What the last stage does to the logits before the draw, for sequences that ask for it:
penalties and biases (penalties.py) and grammar constraints (grammar.py).

The runner calls three hooks, each a no-op unless a live sequence uses a control, and each
touching only the sample rows that do: begin_step (count the step's inputs, feed matchers),
apply (the logits the sampler draws from), after_draw (commit accepted drafts, advance matchers).
An unconstrained, unpenalised batch pays one integer test per step; its rows also keep the decode
graphs' in-graph draw, since a controlled row is never `unfiltered` in the sequence table.
"""

from __future__ import annotations

import numpy as np
import torch

from strata.sampling_rules import SamplingRuleError, check_sampling_options
from strata.services.worker.grammar import GrammarCompilerPool, GrammarState
from strata.services.worker.penalties import PenaltyState
from strata.services.worker.sequence_table import PlanError


class SamplingControls:
    def __init__(
        self,
        max_seqs: int,
        vocab_size: int,
        max_model_len: int,
        device: torch.device,
        last_sampled: torch.Tensor,
        tokenizer_dir: str | None = None,
        stop_token_ids=None,
    ):
        self.vocab_size = vocab_size
        self.last_sampled = last_sampled
        self.penalties = PenaltyState(max_seqs, vocab_size, max_model_len, device)
        self.grammar = GrammarState(
            GrammarCompilerPool(tokenizer_dir, vocab_size, stop_token_ids), max_seqs, vocab_size, device
        )

    @property
    def active(self) -> bool:
        return bool(self.penalties.rows or self.grammar.rows)

    def add(self, row: int, seq) -> bool:
        """A sequence's admission (engine_pb2.NewSequence); True when it uses a control."""
        s = seq.sampling
        try:
            check_sampling_options(s, vocab_size=self.vocab_size)
        except SamplingRuleError as e:
            raise PlanError(f"invalid sampling options: {e}") from None
        args = (row, s, seq.num_prompt_tokens, seq.history_start, seq.history_token_ids)
        penalised = self.penalties.add(*args)
        constrained = self.grammar.add(*args)
        return penalised or constrained

    def release(self, row: int) -> None:
        self.penalties.release(row)
        self.grammar.release(row)

    def begin_step(self, plan, h) -> None:
        if not (self.penalties.has_row[h.token_rows].any() or self.grammar.has_row[h.token_rows].any()):
            return
        tokens = np.asarray(plan.input_token_ids, dtype=np.int64)
        q_lens = np.diff(h.query_start_loc)
        drafts = np.asarray(plan.num_draft_tokens, dtype=np.int64)
        draft = np.zeros(tokens.shape[0], dtype=bool)
        if drafts.size and drafts.any():
            offset = np.arange(tokens.shape[0]) - np.repeat(h.query_start_loc[:-1], q_lens)
            draft = offset >= np.repeat(q_lens - drafts, q_lens)
        first = h.query_start_loc[:-1]
        num_computed = dict(zip(h.token_rows[first].tolist(), h.positions[first].tolist()))
        if self.penalties.rows:
            self.penalties.count_inputs(h, tokens, draft, num_computed, self.last_sampled)
        if self.grammar.rows:
            self.grammar.feed_inputs(h, tokens, draft, num_computed)

    def apply(self, logits: torch.Tensor, h) -> tuple[torch.Tensor, np.ndarray | None]:
        """(the logits to draw from, the sample rows under a grammar or None)."""
        if not self.active:
            return logits, None
        idx = self.penalties.sample_rows(h)
        if idx.size:
            logits = self.penalties.apply(logits, h, idx)
        gidx = self.grammar.sample_rows(h)
        if gidx.size:
            logits = self.grammar.apply(logits, h, gidx)
            return logits, gidx
        return logits, None

    def after_draw(self, h, token_ids: torch.Tensor, grammar_rows: np.ndarray | None) -> None:
        if h.verify is not None and self.penalties.rows:
            self.penalties.commit_drafts(h, token_ids)
        if grammar_rows is not None:
            self.grammar.after_draw(h, grammar_rows, token_ids)
