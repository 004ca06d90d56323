"""What the last stage does to the logits before the draw, for sequences that ask for it:
penalties and biases (penalties.py) and grammar constraints (grammar.py).

Two paths. The general one (CPU, and steps with filtered or logprob rows, or rows with allowed
tokens or bad words): begin_step (count the step's inputs, feed matchers), apply (a float32 copy
of the logits with every control applied, for the Sampler), after_draw (commit accepted drafts,
advance matchers).

The controlled draw (CUDA, a decode or verification graph whose rows are all unfiltered): the
graph computes the logits and draws the uncontrolled rows, skipping the controlled ones, then
draw_controlled() draws those in one pass over the logits (kernels/controlled_sampling.py):
their grammar bitmasks are read by the draw itself, and penalties and biases become a sparse
patch (kernels/penalties.penalty_patches), so there is no float32 copy of the logits and no
second draw. Everything the host prepares for it (the input counts, the matchers' accepts and
bitmask fill, the per-row arrays) happens after the graph is launched, and goes up on a side
stream that the graph's forward does not wait for; the main stream waits only before the patch
and the draw. An unconstrained, unpenalised batch pays one integer test per step here.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from strata.sampling_rules import draws_unfiltered
from strata.services.worker.device.host_to_device import upload
from strata.services.worker.sampling.grammar import GrammarCompilerPool, GrammarState
from strata.services.worker.sampling.penalties import PenaltyState


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
        self.device = device
        self.last_sampled = last_sampled
        self.penalties = PenaltyState(max_seqs, vocab_size, max_model_len, device)
        self.grammar = GrammarState(
            GrammarCompilerPool(tokenizer_dir, vocab_size, stop_token_ids), max_seqs, vocab_size, device
        )
        # Per state row: under some control, and whether the controlled draw can take it (no
        # filters or logprobs, no allowed tokens or bad words).
        self.controlled = np.zeros(max_seqs + 1, dtype=bool)
        self.drawable = np.zeros(max_seqs + 1, dtype=bool)
        self._side = None  # (CUDA) the stream the controlled draw's inputs go up on
        self._mask_device = None  # (CUDA) the uploaded bitmask rows, grown on demand
        self._launched = None  # (CUDA) recorded on the main stream just before a graph's launch
        self._no_values = None  # a float32 stand-in: the patch values of a step without penalties
        # Host seconds of the controlled draw's parts, and the GPU's (CUDA event pairs around
        # the patch and the draw) when `profile` is set: bench_constrained reports them.
        self.profile = False
        self.host_seconds = {"inputs": 0.0, "masks": 0.0, "launch": 0.0}
        # Whether the logits are whole rows the controlled draw can take (not a tensor-parallel
        # rank's slice: those rows are gathered and take the general path).
        self.fused_draw = True
        self.gpu_events: list[tuple[torch.cuda.Event, ...]] = []

    @property
    def active(self) -> bool:
        return bool(self.penalties.rows or self.grammar.rows)

    def add(self, row: int, seq, unfiltered: bool | None = None) -> bool:
        """A sequence's admission (engine_pb2.NewSequence, whose options the sequence table
        checked); True when it uses a control. unfiltered: sampling_rules.draws_unfiltered of its
        options, where the caller has it."""
        s = seq.sampling
        args = (row, s, seq.num_prompt_tokens, seq.history_start, seq.history_token_ids)
        penalised = self.penalties.add(*args)
        constrained = self.grammar.add(*args)
        self.controlled[row] = penalised or constrained
        if unfiltered is None:
            unfiltered = draws_unfiltered(s)
        self.drawable[row] = unfiltered and (not penalised or self.penalties.masks_only_counts(row))
        return penalised or constrained

    def release(self, row: int) -> None:
        self.penalties.release(row)
        self.grammar.release(row)
        self.controlled[row] = self.drawable[row] = False

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

    # ------------------------------------------------------------ the general path

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

    # ------------------------------------------------------------ the controlled draw

    def can_draw(self, token_rows: np.ndarray) -> bool:
        """Whether the controlled draw serves a step whose tokens are of these state rows (CUDA,
        some row controlled, every controlled row drawable)."""
        if self.device.type != "cuda" or not self.active or not self.fused_draw:
            return False
        controlled = self.controlled[token_rows]
        return bool(controlled.any()) and bool(self.drawable[token_rows[controlled]].all())

    def mark_launch(self) -> None:
        """Called on the main stream just before the graph's launch: the side stream's work waits
        for everything queued before it (earlier steps' draws into last_sampled included)."""
        if self._launched is None:
            self._launched = torch.cuda.Event()
        self._launched.record()

    def draw_controlled(
        self,
        plan,
        h,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        settings: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        token_index: np.ndarray | None,
        store: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        """Draws the step's controlled sample rows into `tokens` (the graph's draw, which skipped
        them). logits [T, V]: the graph's (their penalised tokens are set to -inf in place);
        settings: (seeds, sample positions, inverse temperatures, greedy) per logits row, as the
        graph holds them; token_index: the logits row of each sample row (None: the same index);
        store: (last_sampled, state row per logits row) for a decode's lookahead, or None."""
        from strata.kernels.controlled_sampling import controlled_draw

        cuda = self.device.type == "cuda"  # (elsewhere: the same steps, for tests, without streams)
        main = side = None
        if cuda:
            main = torch.cuda.current_stream(self.device)
            if self._side is None:
                self._side = torch.cuda.Stream(self.device)
            side = self._side
        events = None
        if self.profile and cuda:  # the graph done -> the inputs ready (the GPU waiting for the host) -> drawn
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            events[0].record(main)
        start = time.perf_counter()
        pidx, gidx = self.penalties.sample_rows(h), self.grammar.sample_rows(h)
        cidx = np.union1d(pidx, gidx)
        logits_rows = cidx if token_index is None else token_index[cidx]
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            if cuda:
                side.wait_event(self._launched)
            self.begin_step(plan, h)
            # The controlled draw's per-row indices: -1 where a row has no patch or no bitmask.
            arrays = {"rows": logits_rows.astype(np.int64)}
            arrays["patch_index"] = np.full(cidx.size, -1, np.int32)
            arrays["mask_index"] = np.full(cidx.size, -1, np.int32)
            flags = None
            if pidx.size:
                where = np.searchsorted(cidx, pidx)
                pen, flags = self.penalties.patch_inputs(h, pidx, logits_rows[where])
                arrays["patch_index"][where] = np.arange(pidx.size, dtype=np.int32)
                arrays.update({f"pen.{k}": v for k, v in pen.items()})
            self.host_seconds["inputs"] += time.perf_counter() - start
            mask = None
            if gidx.size:
                t0 = time.perf_counter()
                bitmask, masked = self.grammar.host_masks(h, gidx)
                self.host_seconds["masks"] += time.perf_counter() - t0
                if masked.any():
                    where = np.searchsorted(cidx, gidx)
                    arrays["mask_index"][where[masked]] = np.nonzero(masked)[0].astype(np.int32)
                    mask = self._upload_mask(bitmask, main)
            t0 = time.perf_counter()
            d = upload(arrays, self.device)
            if cuda:  # made on the side stream, read on the main one (one storage: one record)
                next(iter(d.values())).record_stream(main)
                ready = torch.cuda.Event()
                ready.record(side)
        if cuda:
            main.wait_event(ready)
        if events is not None:
            events[1].record(main)
        # Absent parts are given as empty stand-ins (their indices are all -1): the kernel is one
        # compiled variant either way, and no per-step fill of a -1 tensor is launched.
        if self._no_values is None:
            self._no_values = torch.zeros(1, dtype=torch.float32, device=self.device)  # (never read)
        patch = (d["patch_index"], self._no_values, d["patch_index"])
        if flags is not None:
            pen = {k.removeprefix("pen."): v for k, v in d.items() if k.startswith("pen.")}
            patched = self.penalties.patches(logits, pen, flags)
            if patched is not None:
                patch = (*patched, d["patch_index"])
        mask_vocab = self.grammar.pool.mask_vocab
        controlled_draw(
            logits,
            d["rows"],
            *settings,
            tokens,
            mask=(mask if mask is not None else d["mask_index"], d["mask_index"], mask_vocab),
            patch=patch,
            store=store,
        )
        if events is not None:
            events[2].record(main)
            self.gpu_events.append(tuple(events))
        if h.verify is not None and pidx.size:
            index = token_index if token_index is not None else np.arange(len(h.sample_rows))
            self.penalties.commit_drafts(h, tokens[upload({"i": index.astype(np.int64)}, self.device)["i"]])
        if gidx.size:
            self.grammar.after_draw(h, gidx, tokens, token_index)
        self.host_seconds["launch"] += time.perf_counter() - t0

    def _upload_mask(self, bitmask: torch.Tensor, reader) -> torch.Tensor:
        """The host bitmask rows on the device (call on the side stream, after it waited for the
        previous draw, the buffer's last reader)."""
        n, width = bitmask.shape
        if self._mask_device is None or self._mask_device.shape[0] < n or self._mask_device.shape[1] != width:
            self._mask_device = torch.empty((max(n, 64), width), dtype=torch.int32, device=self.device)
            if reader is not None:
                self._mask_device.record_stream(reader)  # made on the side stream, read on the main one
        mask = self._mask_device[:n]
        mask.copy_(bitmask, non_blocking=True)
        self.grammar.uploaded()
        return mask
