"""Pipelined decode: the last stage hands each step's sampled tokens straight to stage 0.

With one stage, a decode lookahead's input token (PLACEHOLDER_TOKEN in the plan) is the one the
worker sampled last for that sequence, which it keeps on the device in `last_sampled`, one entry
per sequence-table row (runner.py, kernels/embedding.py). With P stages the sampler runs on the
last stage and the embedding on stage 0; this module closes the loop the same way, so the
placeholder resolution is one mechanism for 1 and P stages: stage 0 keeps its own `last_sampled`
per row and the last stage hands it each step's tokens over a link of its own, last -> first,
on the stage transport the scheduler chose for that pair (strata/stage_links.py): grpc,
distributed or ipc, whose ends are in token_link_ends.py.

The bytes never wait for the scheduler, and no host waits for a GPU on either side: the last
stage hands a decode graph's drawn tokens, or gathers `last_sampled` at the sampling rows, on its
compute stream after the step's draw, and stage 0 scatters the tokens into its `last_sampled` on
its compute stream.

Order (TokenIntake, stage 0): both stages see every plan. When stage 0 launches a step, it notes
the step id as the latest sampling step of each row that samples in it, and keeps those rows
(on the device) under the step id. Tokens arrive in step order (one sender, one stream); each
step's are scattered at its rows. A step whose input has placeholders first waits (on its own
step thread, with a deadline; on ipc by taking announcements from the doorbell itself) until
the tokens of the latest sampling step of every placeholder's row are applied; nothing later
can have touched those rows, since any later step that samples them is launched after this one.
A released row reused by a new sequence is safe too: the new sequence's placeholders need a
later step's tokens, which are applied after the old ones.
A step that failed on the last stage hands an error instead: its rows keep their old tokens
(valid ids), and the scheduler fails that step's requests, so nothing reads them.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from strata.protocol import DEVICE_DRAFT, PLACEHOLDER_TOKEN
from strata.services.worker.device.host_to_device import upload
from strata.services.worker.transport.stage_transport import PeerLost, StepFailed
from strata.services.worker.transport.token_waits import DeviceTokenWaits

log = logging.getLogger("strata.worker")


def sampler_rows(h) -> np.ndarray:
    """The state row of each sequence that samples in the step, in plan order (a verifying
    sequence has d + 1 sample rows: its row once)."""
    if h.verify is None:
        return h.sample_rows
    return h.sample_rows[np.cumsum(h.verify.rows_per_seq) - 1]


# ------------------------------------------------------------------ stage 0


class TokenIntake:
    """Stage 0's half of pipelined decode (see the module docstring): the rows each sampling
    step's tokens go to, their application in step order, and the wait of a step whose
    placeholders need them."""

    link = "token"  # (for the log)

    def __init__(self, last_sampled: torch.Tensor, timeout: float):
        self.last_sampled = last_sampled
        self.device = last_sampled.device
        self.timeout = timeout
        self.last_step = np.zeros(last_sampled.shape[0], dtype=np.int64)  # per row: its latest sampling step
        self._rows: dict[int, torch.Tensor] = {}
        self.applied = 0  # every sampling step up to this one has its tokens in last_sampled
        self._cond = threading.Condition()
        self._closed: str | None = None
        self.wait_seconds = 0.0
        self.waits = 0
        self.need = 0  # the sampling step the latest step's placeholders waited for (0: none; GPU clock)
        # ipc: the step thread takes the tokens that have arrived itself, pump(need) blocking until
        # step `need`'s are applied (0: only what is there); else a receiving thread applies them.
        self.pump = None
        self.device_waits: DeviceTokenWaits | None = None  # ipc (slot words) or NCCL: the GPU waits instead

    def plan_started(self, plan) -> None:
        """On the step thread, as each plan's step starts, before anything that can fail it."""
        if self.device_waits is not None and any(plan.sample):
            self.device_waits.expect(plan.step_id)

    def before_step(self, step_id: int, h, staged_rows=None) -> None:
        """On the step thread, before the step is launched (staged_rows: see TokenOutlet)."""
        waits = self.device_waits
        if waits is not None:
            waits.pump()  # what has arrived: checked, applied, credited
        elif self.pump is not None:
            self.pump(0)  # what has arrived: frees the ring's slots
        self.need = 0
        if h.has_placeholders:
            rows = h.token_rows[h.input_ids == PLACEHOLDER_TOKEN]
            need = self.need = int(self.last_step[rows].max())
            if waits is not None:
                if waits.queue_through(need):
                    self.waits += 1  # the GPU waits for tokens it had no wait for yet (no host time)
            elif need > self.applied:
                self._wait(need)
        if h.sample_seq_ids:
            rows = sampler_rows(h)
            self.last_step[rows] = step_id
            on_device = upload({"rows": rows.astype(np.int64)}, self.device)["rows"]
            if waits is not None:
                waits.set_rows(step_id, on_device)
            else:
                self._rows[step_id] = on_device

    def _wait(self, step_id: int) -> None:
        started = time.perf_counter()
        if self.pump is not None:
            try:
                self.pump(step_id)
            finally:
                self.wait_seconds += time.perf_counter() - started
                self.waits += 1
            return
        with self._cond:
            ok = self._cond.wait_for(lambda: self.applied >= step_id or self._closed, self.timeout)
            closed = self._closed
        self.wait_seconds += time.perf_counter() - started
        self.waits += 1
        if closed:
            raise PeerLost(f"token link closed: {closed}")
        if not ok:
            raise StepFailed(f"step {step_id}'s sampled tokens did not reach stage 0 in {self.timeout:.0f} s")

    def apply(self, step_id: int, tokens: torch.Tensor | None) -> None:
        """Step `step_id`'s tokens (None: it failed) into last_sampled, on the calling thread's
        current stream; steps come in order."""
        rows = self._rows.pop(step_id, None)
        if rows is not None:
            self._scatter(step_id, rows, tokens)
        self._applied_through(step_id)

    def _scatter(self, step_id: int, rows: torch.Tensor, tokens: torch.Tensor | None) -> None:
        if tokens is None:
            return
        if tokens.shape[0] != rows.shape[0]:
            log.error(
                "%s link: step %d handed %d tokens for %d rows", self.link, step_id, tokens.shape[0], rows.shape[0]
            )
        else:
            self.last_sampled.index_copy_(0, rows, tokens)

    def _applied_through(self, step_id: int) -> None:
        with self._cond:
            self.applied = max(self.applied, step_id)
            self._cond.notify_all()

    def close(self, reason: str = "pipeline re-initialised") -> None:
        with self._cond:
            self._closed = reason
            self._cond.notify_all()
        if self.device_waits is not None:
            self.device_waits.close(reason)


class DraftIntake(TokenIntake):
    """One target stage with a draft model: the draft worker's proposals, handed over a link of
    their own (draft worker -> this stage, any transport above), land in the draft area of
    `last_sampled` (speculation/device_speculation.py), where the step's DEVICE_DRAFT inputs and its
    verification read them. The scheduler sends the draft plan and the target's plan together
    (StepPlan.linked_drafts), so no host waits for the proposal between the two models.

    Unlike sampled tokens, a step waits for its own step's tokens: k per verifying sequence, in
    plan order, which are exactly its DEVICE_DRAFT inputs in token order. They may arrive before
    the step's plan starts here: on the GPU path announcements are taken only for plans that
    started (token_waits.py), and on the host paths tokens without rows yet are kept until
    before_step (copied: an ipc slot is reused). A failed proposal (an error announced) leaves
    the old drafts in place: the verification's tokens stay exact, fewer are accepted."""

    takes_drafts = True
    link = "draft"

    def __init__(self, last_sampled: torch.Tensor, timeout: float):
        super().__init__(last_sampled, timeout)
        self._linked = 0  # the started plan's step id if it verifies linked drafts
        self._early: dict[int, torch.Tensor | None] = {}  # tokens that came before their rows

    def plan_started(self, plan) -> None:
        self._linked = plan.step_id if plan.linked_drafts else 0
        if self._linked and self.device_waits is not None:
            self.device_waits.expect(plan.step_id)

    def before_step(self, step_id: int, h, staged_rows=None) -> None:
        if self._linked != step_id:
            return
        if h.input_ids is None or h.source_rows is None:
            raise StepFailed(f"step {step_id} verifies linked drafts but has no DEVICE_DRAFT inputs")
        index = h.source_rows[h.input_ids == DEVICE_DRAFT]
        on_device = upload({"index": index.astype(np.int64)}, self.device)["index"]
        waits = self.device_waits
        if waits is not None:
            waits.set_rows(step_id, on_device)
            waits.pump()
            waits.queue_through(step_id)
            self.waits += 1
            return
        with self._cond:
            for old in [s for s in self._early if s < step_id]:  # steps that failed before their rows
                del self._early[old]
            early = self._early.pop(step_id, _NONE)
            if early is _NONE:
                self._rows[step_id] = on_device
        if early is not _NONE:
            self._scatter(step_id, on_device, early)
        elif step_id > self.applied:
            self._wait(step_id)

    def apply(self, step_id: int, tokens: torch.Tensor | None) -> None:
        with self._cond:  # (before_step registers rows under the same lock)
            rows = self._rows.pop(step_id, None)
            if rows is None:
                self._early[step_id] = None if tokens is None else tokens.clone()
        if rows is not None:
            self._scatter(step_id, rows, tokens)
        self._applied_through(step_id)


_NONE = object()


# ------------------------------------------------------------------ the last stage


class TokenOutlet:
    """The last stage's half: the rows of the step's sampling sequences (before_step, from the
    runner), then their tokens handed to the link (hand): the decode graph's own tokens where
    they are those rows' (drawn), else a gather from last_sampled."""

    def __init__(self, last_sampled: torch.Tensor):
        self.last_sampled = last_sampled
        self._pending: tuple[int, torch.Tensor] | None = None
        self._staged = False  # the pending rows are the graph's staged rows, in token order
        self._drawn: torch.Tensor | None = None

    def plan_started(self, plan) -> None:
        pass

    def before_step(self, step_id: int, h, staged_rows: torch.Tensor | None = None) -> None:
        """staged_rows: each token's state row, as a graph staged them on the device. A decode
        whose every token samples hands exactly those rows' tokens, and gathers through them
        instead of uploading its own (an upload showed in the last stage's step thread:
        bench/RESULTS.md, "Figures moved from code comments")."""
        self._pending, self._drawn, self._staged = None, None, False
        if h.sample_seq_ids:
            rows = sampler_rows(h)
            self._staged = (
                staged_rows is not None
                and h.source_rows is None
                and len(rows) == len(staged_rows)
                and np.array_equal(rows, h.token_rows)
            )
            if not self._staged:
                staged_rows = upload({"rows": rows.astype(np.int64)}, self.last_sampled.device)["rows"]
            self._pending = (step_id, staged_rows)

    def drawn(self, tokens: torch.Tensor) -> None:
        """The graph drew every token of the step, in token order (graph_step.py): on staged rows
        these are the tokens the gather would take, so hand() sends them and launches no gather
        (its index_select gave the GIL away: bench/RESULTS.md, "Where the 1B pipeline's time
        goes"). They are the graph's static outputs: the senders copy them on the step's stream
        before the next replay, or send a copy (token links' send())."""
        if self._staged and self._pending is not None and len(tokens) == len(self._pending[1]):
            self._drawn = tokens

    def hand(self, step_id: int, sender) -> None:
        """On the step thread, after the step (and its draw) is launched."""
        pending, self._pending = self._pending, None
        drawn, self._drawn = self._drawn, None
        if pending is not None and pending[0] == step_id:
            sender.send(step_id, drawn if drawn is not None else self.last_sampled.index_select(0, pending[1]))
