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

The matchers see the tokenizer's vocabulary only (`mask_vocab`), not the model's padded one: a
dummy 1B model with SmolLM2's tokenizer pads 49,152 tokens to 128,256, and xgrammar treats every
padding id as a special token, which made each accept and each bitmask fill many times slower
(bench/RESULTS.md, "Figures moved from code comments"). The ids past it are forbidden wherever a
bitmask applies, as xgrammar's own processor forbids them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from strata import constraints
from strata.protocol import PLACEHOLDER_TOKEN
from strata.services.worker.device.host_to_device import upload, wait_for
from strata.services.worker.speculation.verification import accepted_rows

log = logging.getLogger("strata.worker")

MAX_COMPILED_GRAMMARS = 256
MAX_ROLLBACK_TOKENS = 64
# Threads xgrammar fills a decode step's bitmask rows on. One: more threads filled a step's rows
# slower, and slowed the accepts beside them (bench_constrained's sweep, bench/RESULTS.md).
FILL_THREADS = 1


class GrammarCompilerPool:
    """Compiles constraints against one tokenizer, off the step thread, with a bounded cache."""

    def __init__(self, tokenizer_dir: str | None, vocab_size: int, stop_token_ids, threads: int = 2):
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids or [])
        self.stop_set = frozenset(self.stop_token_ids)  # the matchers' stop tokens (set with the compiler)
        self._compiler = None
        self.mask_vocab = vocab_size  # the tokenizer's vocabulary, once the compiler is built
        self._lock = threading.RLock()  # (compile_again compiles under it, and _compile takes it)
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
                ids = tokenizer.get_vocab().values()
                vocab = min(self.vocab_size, max(ids) + 1) if ids else self.vocab_size
                stop = [t for t in self.stop_token_ids if t < vocab]
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=stop or None)
                self.stop_set = frozenset(info.stop_token_ids)
                self.mask_vocab = vocab
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

    def compile_again(self, kind: int, text: str, failed: Future) -> Future:
        """After the pool's compile of (kind, text) failed: a compile on the calling thread, once
        per failure (the rows that held the failed future get the new one). The gateway parsed the
        constraint, so a failure here is the worker's own: transformers' lazy imports, for one,
        raised ImportError while another thread of the process was importing it."""
        key = (kind, text)
        with self._lock:
            current = self._cache.get(key)
            if current is not None and current is not failed:
                return current  # another row compiled it again already
            log.warning("compiling a constraint failed (%s); compiling it again", failed.exception())
            future: Future = Future()
            try:
                future.set_result(self._compile(kind, text))
            except Exception as e:
                future.set_exception(e)
            self._cache[key] = future
            return future


class _Row:
    __slots__ = ("kind", "text", "future", "matcher", "prompt_len", "pos", "consumed", "ended", "pending", "dead")


class GrammarState:
    def __init__(self, pool: GrammarCompilerPool, max_seqs: int, vocab_size: int, device: torch.device):
        self.pool = pool
        self.vocab_size = vocab_size
        self.device = device
        self.rows: dict[int, _Row] = {}
        self.has_row = np.zeros(max_seqs + 1, dtype=bool)
        self._batch = None  # xgr.BatchGrammarMatcher: fills a decode step's rows (FILL_THREADS)
        self._bitmask = None  # host bitmask rows (pinned on CUDA), grown on demand
        self._bitmask_copied = None  # (CUDA) recorded after its upload
        self._tokens = None  # pinned host copy of the last constrained draw's tokens

        self._pending = None  # (rows, positions, verify, event): tokens drawn but not yet accepted
        # Host time (bench_constrained reports it): filling bitmasks, waiting for the last
        # draw's tokens, and accepting them (the wait included).
        self.fill_seconds = 0.0
        self.fill_rows = 0
        self.wait_seconds = 0.0
        self.accept_seconds = 0.0

    def add(self, row: int, s, num_prompt_tokens: int, history_start: int, history) -> bool:
        if not s.constraint_kind:
            return False
        r = _Row()
        r.kind, r.text = s.constraint_kind, s.constraint
        r.future = self.pool.compiled(r.kind, r.text)
        r.matcher = None
        r.prompt_len = int(num_prompt_tokens)
        r.pos = r.prompt_len  # the position of the next token the matcher takes
        r.consumed = []  # output tokens it took, in order
        r.ended = False  # its last consumed token is a stop token
        r.dead = False  # released: its sequence left the batch
        history = list(history)
        skip = max(0, r.prompt_len - int(history_start))
        r.pending = history[skip:]  # output known at admission (fed once the step shows how much is computed)
        self.rows[row] = r
        self.has_row[row] = True
        return True

    def release(self, row: int) -> None:
        r = self.rows.pop(row, None)
        if r is not None:
            r.dead = True  # a draw read back later must not feed it
            self.has_row[row] = False

    def _matcher(self, r: _Row):
        """The row's matcher, once its grammar compiled. A compile that failed is tried once
        more here; a second failure fails the step (its requests get an error), never a row
        that runs unconstrained as if it had worked."""
        if r.matcher is None:
            import xgrammar as xgr

            try:
                compiled = r.future.result()
            except Exception:
                r.future = self.pool.compile_again(r.kind, r.text, r.future)
                try:
                    compiled = r.future.result()
                except Exception as e:
                    raise RuntimeError(f"the worker could not compile a constraint the gateway accepted: {e}") from e
            r.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=MAX_ROLLBACK_TOKENS)
        return r.matcher

    def _feed(self, r: _Row, position: int, tokens) -> None:
        """The output tokens at `position`... of the sequence: those the matcher has not taken
        are accepted; one that differs from what it took rolls it back first."""
        m = self._matcher(r)
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
                r.ended = bool(r.consumed) and r.consumed[-1] in self.pool.stop_set
            if k == len(r.consumed):
                if m.is_terminated():  # a decode lookahead past the end: the scheduler drops it
                    return
                if not m.accept_token(int(t)):  # refused (never after a masked draw): keep the matcher as it was
                    return
                r.consumed.append(int(t))
                r.pos = p + 1
                r.ended = int(t) in self.pool.stop_set

    def feed_inputs(self, h, plan_tokens: np.ndarray, draft: np.ndarray, num_computed: dict) -> None:
        """Before a step's draw: the output tokens of its inputs (drafts and placeholders
        excepted: placeholders are the tokens this stage sampled, which the matchers take after
        the draw). One pass over the step's tokens, not one per row."""
        token_rows = h.token_rows
        mine = self.has_row[token_rows]
        for row in np.unique(token_rows[mine]).tolist():
            r = self.rows[row]
            if r.pending is not None:
                n = max(0, num_computed[row] - r.prompt_len)
                self._feed(r, r.prompt_len, r.pending[:n])
                r.pending = None
        sel = np.nonzero(mine & ~draft & (plan_tokens != PLACEHOLDER_TOKEN))[0]
        if not sel.size:
            return
        self._drain()  # real input tokens: the draw before them was read back (no wait on the GPU)
        rows = token_rows[sel]
        order = np.argsort(rows, kind="stable")  # each row's tokens stay in position order
        sel, rows = sel[order], rows[order]
        starts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        ends = np.r_[starts[1:], rows.size]
        for a, b in zip(starts.tolist(), ends.tolist()):
            part = sel[a:b]
            self._feed(self.rows[int(rows[a])], int(h.positions[part[0]]), plan_tokens[part].tolist())

    def sample_rows(self, h) -> np.ndarray:
        return np.nonzero(self.has_row[h.sample_rows])[0]

    def _bitmask_rows(self, n: int) -> torch.Tensor:
        self.pool._get_compiler()  # sets mask_vocab (built already once a grammar compiled)
        width = (self.pool.mask_vocab + 31) // 32  # xgrammar's bitmask: a bit per token in int32 words
        if self._bitmask is None or self._bitmask.shape[0] < n or self._bitmask.shape[1] != width:
            shape = (max(n, 64), width)
            pin = self.device.type == "cuda"
            self._bitmask = torch.empty(shape, dtype=torch.int32, pin_memory=pin)
            self._bitmask_copied = torch.cuda.Event() if pin else None
        elif self._bitmask_copied is not None:
            wait_for(self._bitmask_copied)  # the previous upload has left the host buffer
        return self._bitmask[:n]

    def _fill(self, h, idx: np.ndarray, bitmask: torch.Tensor) -> np.ndarray:
        """Fills bitmask row i for sample row idx[i]; returns which rows are masked (a row whose
        grammar ended is unconstrained: its bitmask row is all ones)."""
        import xgrammar as xgr

        start = time.perf_counter()
        masked = np.ones(len(idx), dtype=bool)
        if h.verify is None:  # one token per sequence: every matcher in one xgrammar call
            matchers, rows, table = [], [], self.rows
            for i, row in enumerate(h.sample_rows[idx].tolist()):
                r = table[row]
                m = r.matcher if r.matcher is not None else self._matcher(r)
                # A matcher ends when it takes a stop token (xgrammar's is_terminated, a call per row).
                if r.ended and m.is_terminated():
                    bitmask[i].fill_(-1)  # unconstrained: nothing after an end is emitted
                    masked[i] = False
                else:
                    matchers.append(m)
                    rows.append(i)
            if matchers:
                if self._batch is None:
                    self._batch = xgr.BatchGrammarMatcher(max_threads=FILL_THREADS)
                self._batch.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        else:
            bitmask.fill_(-1)
            counts = h.verify.rows_per_seq  # a verifying sequence's rows are consecutive: drafts, then the bonus row
            seq_of = np.repeat(np.arange(len(counts)), counts)
            i = 0
            while i < len(idx):
                m = self._matcher(self.rows[h.sample_rows[idx[i]]])
                n_rows = int(counts[seq_of[idx[i]]])
                accepted, ok = 0, True
                for j in range(n_rows):
                    if m.is_terminated():
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
        self.fill_seconds += time.perf_counter() - start
        self.fill_rows += len(idx)
        return masked

    def host_masks(self, h, idx: np.ndarray) -> tuple[torch.Tensor, np.ndarray]:
        """The controlled draw's half (sampling_controls.py): accepts the last draw's tokens (the
        step's one wait for the GPU), then fills the bitmasks of sample rows idx into the pinned
        host buffer. Returns (bitmask rows [len(idx), W] int32, on the host; whether each row is
        masked). The caller uploads them and calls uploaded() after queuing the copy."""
        self._drain()
        bitmask = self._bitmask_rows(len(idx))
        masked = self._fill(h, idx, bitmask)
        return bitmask, masked

    def uploaded(self) -> None:
        """The host bitmask's copy is queued (on the current stream): it may be refilled once done."""
        if self._bitmask_copied is not None:
            self._bitmask_copied.record()

    def apply(self, logits: torch.Tensor, h, idx: np.ndarray) -> torch.Tensor:
        """Masks sample rows idx of logits with their grammars' next-token bitmasks, in place
        (-inf is exact in any dtype, so the draw sees what it would on a float32 copy), and
        forbids the ids past the tokenizer's vocabulary there. The runner calls this after
        launching the step's forward: accepting the previous draw and filling the bitmask on the
        host overlap the GPU's forward. (The general path: the controlled draw reads the bitmask
        in its own pass instead.)"""
        bitmask, masked = self.host_masks(h, idx)
        if logits.device.type == "cpu" and logits.dtype != torch.float32:
            logits = logits.float()  # xgrammar's CPU kernel takes float32
        if not masked.any():
            return logits
        which = np.nonzero(masked)[0]
        if logits.device.type == "cpu":
            import xgrammar as xgr

            vocab = min(self.pool.mask_vocab, logits.shape[1])
            full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
            full[torch.from_numpy(idx[which].astype(np.int64))] = bitmask[torch.from_numpy(which)]
            xgr.apply_token_bitmask_inplace(logits, full, vocab_size=vocab, indices=idx[which].tolist())
            logits[torch.from_numpy(idx[which].astype(np.int64)), vocab:] = float("-inf")
            return logits
        from strata.kernels.controlled_sampling import apply_bitmask_

        d = upload({"rows": idx[which].astype(np.int64), "which": which.astype(np.int64)}, logits.device)
        mask = bitmask.to(logits.device, non_blocking=True)  # pinned: never waits for the GPU
        self.uploaded()
        apply_bitmask_(logits, mask[d["which"]], d["rows"], self.pool.mask_vocab)
        return logits

    def after_draw(self, h, idx: np.ndarray, token_ids: torch.Tensor, index: np.ndarray | None = None) -> None:
        """Starts the read-back of the step's tokens (non-blocking, into pinned memory); the
        matchers accept them at the next step (_drain), after its forward is launched, or
        whenever the runner drains them. token_ids: one per sample row, or, with index, the
        draw's tokens of which sample row i's is token_ids[index[i]]."""
        n = token_ids.shape[0]
        if self.device.type == "cuda":
            if self._tokens is None or self._tokens.shape[0] < n:
                self._tokens = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=True)
            host = self._tokens[:n]
            host.copy_(token_ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = token_ids.cpu(), None
        rows = {i: self.rows[r] for i, r in zip(idx.tolist(), h.sample_rows[idx].tolist())}
        self._pending = (rows, h.sample_positions.copy(), h.verify, idx, host, event, index)

    def _drain(self) -> None:
        """The matchers accept the tokens of the last constrained draw (the step's one wait)."""
        if self._pending is None:
            return

        rows, positions, verify, idx, host, event, index = self._pending
        self._pending = None
        start = time.perf_counter()
        if event is not None:
            event.synchronize()
        self.wait_seconds += time.perf_counter() - start
        tokens = host.numpy()
        if index is not None:
            tokens = tokens[index]
        if verify is None:
            # The common case, a matcher taking the token right after its last: all at once.
            # (A released row is marked dead: its sequence takes nothing.)
            batch, toks, stops = [], [], self.pool.stop_set
            for i, p, t in zip(idx.tolist(), positions[idx].tolist(), tokens[idx].tolist()):
                r = rows[i]
                if r.dead:
                    continue
                if p == r.pos and p >= r.prompt_len and r.matcher is not None and not r.ended:
                    batch.append(r)
                    toks.append(t)
                else:
                    self._feed(r, p, [t])
            if batch:
                # xgrammar's batch accept is serial (a few microseconds a token) and holds the
                # GIL: 4 threads accepting chunks of rows measured no faster, and a
                # second thread accepting beside the step thread slowed both (bench/RESULTS.md).
                for r, t, ok in zip(batch, toks, _batch_accept([r.matcher for r in batch], toks)):
                    if ok:  # refused (never after a masked draw): the matcher stays as it was
                        r.consumed.append(t)
                        r.pos += 1
                        r.ended = t in stops
            self.accept_seconds += time.perf_counter() - start
            return
        num_tokens, _ = accepted_rows(tokens, verify)
        counts = verify.rows_per_seq
        first = np.cumsum(counts) - counts
        wanted = set(idx.tolist())
        for s, f in enumerate(first.tolist()):
            if f not in wanted or rows[f].dead:
                continue
            n = int(num_tokens[s])
            self._feed(rows[f], int(positions[f]), tokens[f : f + n].tolist())
        self.accept_seconds += time.perf_counter() - start


def _batch_accept(matchers, tokens):
    """xgrammar's BatchGrammarMatcher.batch_accept_token without its wrapper's per-item read of
    the result: reading a step's items of the core's result array one by one took about as long
    as the accepts themselves. A masked draw is never refused, so the whole array is read only
    when it holds a refusal; `in` runs in the core."""
    import xgrammar as xgr

    core = getattr(xgr.matcher, "_core", None)
    if core is None:  # another xgrammar layout: its public call
        return xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
    result = core.BatchGrammarMatcher.batch_accept_token([m._handle for m in matchers], tokens, False)
    if 0 not in result and False not in result:  # (an array of ints today; bools would match False)
        return itertools.repeat(True, len(tokens))
    return [bool(x) for x in result]
