"""Constrained decoding on the last stage: xgrammar grammar matchers and their token bitmasks.

Grammars are compiled against the model's tokenizer (xgrammar's TokenizerInfo, built from the
tokenizer files of the model directory, or `--tokenizer DIR` for a dummy model) in a thread
pool, once per distinct constraint: a bounded LRU of compile futures. Compilation starts when a
sequence is admitted, so it overlaps the sequence's prefill; the step thread waits for it only
at the sequence's first draw (the gateway parsed the constraint already, so bad input never gets
here).

A sequence's matcher consumes its output tokens in order: the ones known at admission (after a
preemption), the output tokens of its input (a recomputed prefill), and after each draw the
tokens the step emitted (read back from the device: a step with constrained rows synchronises
once, after its draw). A verify step fills the bitmask of row j after accepting drafts 0 .. j-1
into the matcher, then rolls those back (GrammarMatcher.rollback); the emitted tokens are
accepted after the draw. A matcher that is behind a plan (a draft worker's rolled-back
proposal) is rolled back to it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from strata import constraints
from strata.protocol import PLACEHOLDER_TOKEN
from strata.services.worker.step_results import accepted_rows

MAX_COMPILED_GRAMMARS = 256
MAX_ROLLBACK_TOKENS = 64


class GrammarCompilerPool:
    """Compiles constraints against one tokenizer, off the step thread, with a bounded cache."""

    def __init__(self, tokenizer_dir: str | None, vocab_size: int, stop_token_ids, threads: int = 2):
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids or [])
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[int, str], Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                if not self.tokenizer_dir:
                    raise RuntimeError(
                        "constrained decoding needs the model's tokenizer: start the worker with --tokenizer DIR"
                    )
                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, kind: int, text: str):
        grammar = constraints.grammar(kind, text)
        return self._get_compiler().compile_grammar(grammar)

    def compiled(self, kind: int, text: str) -> Future:
        key = (kind, text)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, kind, text)
            self._cache[key] = future
            while len(self._cache) > MAX_COMPILED_GRAMMARS:
                self._cache.popitem(last=False)
            return future


class _Row:
    __slots__ = ("future", "matcher", "prompt_len", "pos", "consumed", "pending", "failed")


class GrammarState:
    def __init__(self, pool: GrammarCompilerPool, max_seqs: int, vocab_size: int, device: torch.device):
        self.pool = pool
        self.vocab_size = vocab_size
        self.device = device
        self.rows: dict[int, _Row] = {}
        self.has_row = np.zeros(max_seqs + 1, dtype=bool)

    def add(self, row: int, s, num_prompt_tokens: int, history_start: int, history) -> bool:
        if not s.constraint_kind:
            return False
        r = _Row()
        r.future = self.pool.compiled(s.constraint_kind, s.constraint)
        r.matcher, r.failed = None, False
        r.prompt_len = int(num_prompt_tokens)
        r.pos = r.prompt_len  # the position of the next token the matcher takes
        r.consumed = []  # output tokens it took, in order
        history = list(history)
        skip = max(0, r.prompt_len - int(history_start))
        r.pending = history[skip:]  # output known at admission (fed once the step shows how much is computed)
        self.rows[row] = r
        self.has_row[row] = True
        return True

    def release(self, row: int) -> None:
        if self.rows.pop(row, None) is not None:
            self.has_row[row] = False

    def _matcher(self, r: _Row):
        if r.matcher is None and not r.failed:
            import xgrammar as xgr

            try:
                compiled = r.future.result()
            except Exception:  # the gateway parsed it; a failure here leaves the row unconstrained
                r.failed = True
                return None
            r.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=MAX_ROLLBACK_TOKENS)
        return r.matcher

    def _feed(self, r: _Row, position: int, tokens) -> None:
        """The output tokens at `position`... of the sequence: those the matcher has not taken
        are accepted; one that differs from what it took rolls it back first."""
        m = self._matcher(r)
        if m is None:
            return
        for i, t in enumerate(tokens):
            p = position + i
            if p < r.prompt_len:
                continue
            k = p - r.prompt_len
            if k < len(r.consumed):
                if r.consumed[k] == t:
                    continue
                back = len(r.consumed) - k
                if back <= MAX_ROLLBACK_TOKENS:
                    m.rollback(back)
                else:
                    m.reset()
                    for x in r.consumed[:k]:
                        m.accept_token(x)
                del r.consumed[k:]
                r.pos = p
            if k == len(r.consumed):
                if m.is_terminated():  # a decode lookahead past the end: the scheduler drops it
                    return
                if not m.accept_token(int(t)):  # refused (never after a masked draw): keep the matcher as it was
                    return
                r.consumed.append(int(t))
                r.pos = p + 1

    def feed_inputs(self, h, plan_tokens: np.ndarray, draft: np.ndarray, num_computed: dict) -> None:
        """Before a step's draw: the output tokens of its inputs (drafts and placeholders
        excepted: placeholders are the tokens this stage sampled, which the matcher took)."""
        step_rows = set(h.token_rows[np.nonzero(self.has_row[h.token_rows])[0]].tolist())
        for row in step_rows:
            r = self.rows[row]
            start = num_computed[row]
            if r.pending is not None:
                n = max(0, start - r.prompt_len)
                self._feed(r, r.prompt_len, r.pending[:n])
                r.pending = None
            sel = np.nonzero((h.token_rows == row) & ~draft & (plan_tokens != PLACEHOLDER_TOKEN))[0]
            if sel.size:
                self._feed(r, int(h.positions[sel[0]]), plan_tokens[sel].tolist())

    def sample_rows(self, h) -> np.ndarray:
        return np.nonzero(self.has_row[h.sample_rows])[0]

    def apply(self, logits: torch.Tensor, h, idx: np.ndarray) -> torch.Tensor:
        """Masks sample rows idx of logits with their grammars' next-token bitmasks."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(idx), self.vocab_size)
        bitmask.fill_(-1)
        seq_of = counts = None
        if h.verify is not None:  # a verifying sequence's rows are consecutive: drafts, then the bonus row
            counts = h.verify.rows_per_seq
            seq_of = np.repeat(np.arange(len(counts)), counts)
        i = 0
        while i < len(idx):
            m = self._matcher(self.rows[h.sample_rows[idx[i]]])
            n_rows = 1 if seq_of is None else int(counts[seq_of[idx[i]]])
            accepted, ok = 0, True
            for j in range(n_rows):
                if m is None or m.is_terminated():
                    break  # unconstrained (all ones) from here: nothing after an end is emitted
                if ok:
                    m.fill_next_token_bitmask(bitmask, i + j)
                else:  # a draft the grammar refuses: the masked draw cannot equal it, later rows are not emitted
                    bitmask[i + j] = bitmask[i + j - 1]
                if j < n_rows - 1 and ok:
                    ok = m.accept_token(int(h.verify.drafts[idx[i] + j]))
                    accepted += ok
            if accepted:
                m.rollback(accepted)
            i += n_rows
        sub = logits.float()
        rows = torch.from_numpy(idx.astype(np.int64)).to(logits.device)
        part = sub.index_select(0, rows) if len(idx) != logits.shape[0] else sub.clone()
        mask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(part, mask, vocab_size=self.vocab_size)
        if len(idx) == logits.shape[0]:
            return part
        return sub.index_copy(0, rows, part)

    def after_draw(self, h, idx: np.ndarray, token_ids: torch.Tensor) -> None:
        """Accepts the tokens the step emitted for constrained sequences (one host read)."""
        tokens = token_ids.cpu().numpy()
        if h.verify is None:
            emitted_rows = idx
            positions = h.sample_positions[idx]
            for k, i in enumerate(emitted_rows):
                r = self.rows[h.sample_rows[i]]
                self._feed(r, int(positions[k]), [int(tokens[i])])
            return
        num_tokens, emitted = accepted_rows(tokens, h.verify)
        counts = h.verify.rows_per_seq
        first = np.cumsum(counts) - counts
        wanted = set(idx.tolist())
        for s, f in enumerate(first):
            if f not in wanted:
                continue
            r = self.rows[h.sample_rows[f]]
            n = int(num_tokens[s])
            self._feed(r, int(h.sample_positions[f]), tokens[f : f + n].tolist())
