"""When the engine builds its next plan (one stage): not while the plans in flight will keep the GPU
busy for long.

With one stage the engine keeps 3 plans in flight, the later two decode lookaheads, so the GPU
never waits for the host between decode steps. Behind a long prefill step those extra plans are
built the moment a slot frees, and requests that arrive a millisecond apart then land in separate
plans: on two H200s a wave of 15 arrivals within 4 ms went out as prefill steps of 7, 3, 3 and 2
requests (bench/RESULTS.md), each a step of its own that the running requests decoded through.
Held until the GPU's queued work is nearly done, the next plan takes every request that arrived
meanwhile: the GPU runs the same requests in the same order, in fewer steps. The margin left
(3 decode steps, at least a quarter of the queued work) covers the host building and sending the
plan and the estimate's error, so the GPU still never waits. Nothing waits when the requests
already waiting would fill the next plan (an offline backlog): there is nothing to gather.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

log = logging.getLogger("strata.scheduler")

# Weight of the newest step in the running estimates.
SMOOTHING = 0.2
# The next plan goes out while the queued work has at least this many decode steps left...
MARGIN_DECODE_STEPS = 3.0
# ... and at least this share of the queued work left (a long step's estimate may be off). A held
# plan whose step found the GPU idle before it doubles the share, up to MAX_MARGIN_SHARE (a hold
# of a long step's first quarter still comes, so that the feedback goes on); one that did not
# brings it back toward the floor.
MARGIN_SHARE = 0.25
MAX_MARGIN_SHARE = 0.75
# GPU idle before a held plan's step that counts as the hold's fault (the host's jitter is less).
IDLE_TOLERANCE_SECONDS = 0.0005


def prompt_tokens(plan) -> int:
    """A plan's prefill work: the tokens of its prompt (or recompute) chunks. Decodes and draft
    verifications count as decode steps: pacing is about what prefills keep the GPU busy with."""
    return sum(s.num_scheduled for s in plan.seqs if s.num_scheduled > 1 and not s.num_draft)


class PlanPacer:
    """Estimates a plan's GPU time from its prompt tokens and sequences (a decode step's time,
    plus a cost per prompt token) from the steps that came back, and says how long to hold the
    next plan."""

    def __init__(self):
        self.decode_seconds: float | None = None
        self.token_seconds: float | None = None
        self.margin_share = MARGIN_SHARE

    def observe(self, prompt: int, seqs: int, seconds: float) -> None:
        """A step came back: `prompt` prompt tokens (prompt_tokens()) among `seqs` sequences."""
        if prompt <= seqs:  # a decode step, or one with a small chunk in it
            self.decode_seconds = _smoothed(self.decode_seconds, seconds)
        elif self.decode_seconds is not None:
            self.token_seconds = _smoothed(self.token_seconds, max(0.0, seconds - self.decode_seconds) / prompt)

    def held_step_idle(self, gpu_idle_seconds: float) -> None:
        """A held plan's step came back, with the GPU's idle time before it (GPU workers)."""
        if gpu_idle_seconds > IDLE_TOLERANCE_SECONDS:
            self.margin_share = min(MAX_MARGIN_SHARE, 2 * self.margin_share)
        else:
            self.margin_share = max(MARGIN_SHARE, 0.9 * self.margin_share)

    def expected(self, prompt: int, seqs: int) -> float | None:
        """A plan's expected seconds; None before a decode step and a longer one came back."""
        if self.decode_seconds is None:
            return None
        if prompt <= seqs:
            return self.decode_seconds
        if self.token_seconds is None:
            return None
        return self.decode_seconds + self.token_seconds * prompt

    def hold_seconds(self, queued: list[tuple[int, int]], started: float, now: float) -> float:
        """How long the next plan should wait: queued holds the (prompt tokens, sequences) of the
        plans in flight, the oldest running since `started`. 0: build it now."""
        total = 0.0
        for prompt, seqs in queued:
            seconds = self.expected(prompt, seqs)
            if seconds is None:
                return 0.0  # no estimate yet: as before, at once
            total += seconds
        left = total - (now - started)
        margin = max(MARGIN_DECODE_STEPS * self.decode_seconds, self.margin_share * total)
        return max(0.0, left - margin)


def _smoothed(current: float | None, sample: float) -> float:
    return sample if current is None else current + SMOOTHING * (sample - current)


class PlanHold:
    """The engine's side of pacing: holds its next plan (with a wake-up for when it may go),
    marks the plans built after a hold, and feeds the estimates the steps that come back."""

    def __init__(self, wake: Callable[[], None]):
        self.pacer = PlanPacer()
        self._wake = wake
        self._timer: asyncio.TimerHandle | None = None
        self._held = False  # the next plan was held

    def hold(self, in_flight: Sequence, started: float) -> bool:
        """True (and the wake-up set) while the plans in flight, the oldest running since
        `started`, keep the GPU busy long enough for the next plan to gather what arrives."""
        queued = [(plan.prompt_tokens, len(plan.seqs)) for plan in in_flight]
        seconds = self.pacer.hold_seconds(queued, started, time.monotonic())
        if seconds <= 0:
            return False
        self._held = True
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._wake)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("next plan held %.1f ms: %d in flight", seconds * 1e3, len(queued))
        return True

    def sent(self, plan) -> None:
        plan.after_hold, self._held = self._held, False
        plan.prompt_tokens = prompt_tokens(plan)

    def done(self, plan, seconds: float, gpu_idle_seconds: float | None) -> None:
        """Its step came back after `seconds`; gpu_idle_seconds: the GPU's wait before it, where a
        GPU worker timed it and the engine was not idle (None otherwise)."""
        self.pacer.observe(plan.prompt_tokens, len(plan.seqs), seconds)
        if plan.after_hold and gpu_idle_seconds is not None:
            self.pacer.held_step_idle(gpu_idle_seconds)
