"""Verify or decode, per step: the cost model fed with what each kind of step costs the pipeline
at the current batch."""

from __future__ import annotations

import logging
import math

import numpy as np

log = logging.getLogger("strata.scheduler")


class CostModel:
    """Verify or decode, per step, from what the two cost at this batch: the wall time of
    windows of steps of one kind, result to result (WINDOW). Measured on GPU workers only.

    Per batch bucket it keeps an exponential average of a decode step's time and of a verify
    step's time (and, for the log, of the tokens per sequence verify steps delivered). A step
    verifies when the tokens its requests expect per sequence (AdaptiveK's, which follows each
    request's acceptance and turns a request's drafting off where it does not pay) times the
    decode time beats the verify time: verifying must beat the plain steps it replaces, so that
    speculation never makes a batch slower than plain decoding. Only pipelined steps count
    (observe; and verify steps whose drafts ride in their plans, Speculation.observe), and plain
    steps of a speculating cluster ask for no proposals while it is off, so that the decode time
    is a plain cluster's. A bucket not measured yet follows the nearest one
    measured for a while, then measures what it lacks (_unmeasured). The option not taken runs
    for a window now and then (after REFRESH choices, a wait that doubles each time the choice
    stood, up to MAX_REFRESH) to follow the times as contexts grow. The host's part counts:
    where the stack is host-bound, fewer steps for the same tokens pay even if the GPU's time
    does not. Without GPU timing (CPU workers) it has no data and speculation stays on, up to
    max_batch.

    Verify times are also kept per query length (the window's longest), for AdaptiveK's cost of
    a verify step of k drafts (verify_cost)."""

    REFRESH, MAX_REFRESH = 256, 4096
    MARGIN = 1.05  # the other option must be this much faster to change the choice
    HOLD = 32  # choices a change holds for: each change costs a bubble (a verify in flight
    # must come back before its request decodes plainly), so estimates near the line must not flip it
    # Consecutive steps of one kind (decode or verify, at one bucket) timed together. With several
    # plans in flight results often arrive together, so one step's result-to-result time says
    # little (the GPU time was its floor, and a host-bound verify step looked shorter than the
    # run's steps took); a window's wall time is what its steps cost.
    WINDOW = 8
    AVERAGE = 0.2  # weight of a new window in the averages

    def __init__(self) -> None:
        self.times: dict[tuple[int, int], float] = {}  # (bucket, query) -> seconds a step
        self.step: dict[tuple[int, bool], float] = {}  # (bucket, verifies) -> seconds a step
        self.tokens: dict[int, float] = {}  # bucket -> tokens a verify step emitted per sequence
        self.choices: dict[int, int] = {}
        self.borrowed: dict[int, int] = {}  # per bucket not measured yet: choices another bucket's made
        self.current: dict[int, tuple[bool, int]] = {}  # per bucket: (speculating, choice it changed at)
        # Per bucket: the choice number the next exploration starts at, the wait before it, and
        # the choice when the last one ended.
        self.explore_at: dict[int, int] = {}
        self.explore_wait: dict[int, int] = {}
        self.explored_choice: dict[int, bool] = {}
        self.enabled = False
        # Per (bucket, verifies), the window being summed: seconds, steps, longest query, tokens
        # emitted and sequences sampled.
        self._windows: dict[tuple[int, bool], tuple[float, int, int, int, int]] = {}
        self._last_result: float | None = None
        self._pipelines = False  # some step was sent before the previous result came back
        # verify_cost per bucket, until the next window is recorded: every verifying request
        # asks for it after every verify step, and a least-squares fit each was a visible part of
        # the scheduler's step (bench/scheduler_step.py --speculate).
        self._verify_costs: dict[int, tuple[float, float]] = {}

    @staticmethod
    def bucket(batch: int) -> int:
        """The decode graphs' padded sizes: 1, 2, 4, 8, then multiples of 16."""
        if batch <= 8:
            return 1 << max(0, math.ceil(math.log2(max(batch, 1))))
        return -(-batch // 16) * 16

    def observe(
        self,
        batch: int,
        query: int,
        seconds: float,
        now: float | None = None,
        tokens: int | None = None,
        pipelined: bool = True,
        rounds: int = 1,
    ) -> None:
        """A decode (query 1) or verify step's result, `seconds` after the previous result (or its
        send), at time `now`, having emitted `tokens` over its `batch` sequences (None: one
        each); a step of several verify `rounds` counts as one step of a round's average. A step
        costs the pipeline the time from the previous result to its own (with `now`; without it,
        `seconds`, its own time); steps of one kind at one bucket are summed
        until WINDOW of them were seen, whether or not steps of another kind came between. Once
        any step was `pipelined` (sent before the previous result came back), steps that were
        not are left out: a plain step that had to wait for a verify step's result (the change of kind's
        bubble) took a whole round trip, half again a pipelined decode step, and made plain
        decoding look dearer than it is."""
        self.enabled = True
        tokens = batch if tokens is None else tokens
        if now is None:
            self._record(self.bucket(batch), query, seconds / rounds, tokens / rounds / max(batch, 1))
            return
        # From the previous result: the host's part between it and this step's send counts (a
        # verify step that waited for it); at most twice the step's own time, which leaves out
        # an idle gap with nothing in flight.
        interval = seconds if self._last_result is None else min(max(seconds, now - self._last_result), 2 * seconds)
        self._last_result = now
        interval, tokens = interval / rounds, tokens / rounds
        self._pipelines = self._pipelines or pipelined
        if self._pipelines and not pipelined:
            return
        kind = (self.bucket(batch), query > 1)
        total, steps, longest, emitted, sampled = self._windows.get(kind, (0.0, 0, 1, 0, 0))
        total, steps, longest = total + interval, steps + 1, max(longest, query)
        emitted, sampled = emitted + tokens, sampled + batch
        if steps < self.WINDOW:
            self._windows[kind] = (total, steps, longest, emitted, sampled)
            return
        del self._windows[kind]
        self._record(kind[0], longest, total / steps, emitted / max(sampled, 1))

    def _record(self, b: int, query: int, seconds: float, tokens_per_seq: float) -> None:
        self._verify_costs.pop(b, None)
        verifies = query > 1
        self._average(self.times, (b, query), seconds)
        self._average(self.step, (b, verifies), seconds)
        if verifies:
            self._average(self.tokens, b, tokens_per_seq)

    def _average(self, table: dict, key, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + self.AVERAGE * (value - old)

    def speculate(self, batch: int, expected_per_seq: float) -> bool:
        """Whether this step verifies; expected_per_seq: the tokens per sequence the requests
        expect from a verify step (AdaptiveK's)."""
        if not self.enabled:
            return True
        b = self.bucket(batch)
        decode, verify = self.step.get((b, False)), self.step.get((b, True))
        if decode is None or verify is None:
            return self._unmeasured(b, decode is not None)
        n = self.choices[b] = self.choices.get(b, 0) + 1
        gain = expected_per_seq * decode / verify
        current, since = self.current.get(b, (gain > 1, 0))
        if n - since >= self.HOLD and (gain > self.MARGIN if not current else gain < 1 / self.MARGIN):
            current, since = not current, n
            log.info(
                "speculation %s at batch %d: %.2f tokens a sequence expected per verify step (%.2f delivered"
                " lately) of %.3f ms, decode %.3f ms",
                "on" if current else "off",
                b,
                expected_per_seq,
                self.tokens.get(b, 0.0),
                verify * 1e3,
                decode * 1e3,
            )
        self.current[b] = (current, since)
        return self._explore(b, n, current)

    def _unmeasured(self, b: int, decode_known: bool) -> bool:
        """A bucket without both times. As a batch drains (16 requests finishing one by one
        pass buckets 16, 8, 4, 2, 1), measuring both kinds afresh at each bucket cost a short
        run a window of each: the nearest bucket's choice stands in for HOLD choices, then the
        kind not measured here runs until it is. With no choice anywhere yet: a plain step
        first, then a verify step."""
        decided = [other for other in self.current if other != b]
        if decided:
            n = self.borrowed[b] = self.borrowed.get(b, 0) + 1
            if n <= self.HOLD:
                nearest = min(decided, key=lambda other: abs(math.log2(other) - math.log2(b)))
                return self.current[nearest][0]
        return decode_known  # the kind not measured yet

    def _explore(self, b: int, n: int, current: bool) -> bool:
        """The choice, or for WINDOW steps now and then the option not taken. The wait between
        two explorations doubles each time the choice stood, and starts over when it changed."""
        start = self.explore_at.get(b, self.REFRESH)
        if n < start:
            return current
        if n < start + self.WINDOW:
            return not current
        stood = self.explored_choice.get(b, current) == current
        wait = min(2 * self.explore_wait.get(b, self.REFRESH), self.MAX_REFRESH) if stood else self.REFRESH
        self.explore_wait[b], self.explore_at[b], self.explored_choice[b] = wait, n + wait, current
        return current

    def verify_cost(self, batch: int) -> tuple[float, float]:
        """A verify step's extra cost over a decode step at this batch, in decode steps, as
        (fixed, per position): a line through the verify times measured at each query length
        (least squares; with one length, all of it per position; (0, 0.05) until then: small
        batches read the weights once either way)."""
        b = self.bucket(batch)
        cost = self._verify_costs.get(b)
        if cost is None:
            cost = self._verify_costs[b] = self._fit_verify_cost(b)
        return cost

    def _fit_verify_cost(self, b: int) -> tuple[float, float]:
        decode = self.times.get((b, 1))
        points = [(q, t) for (bb, q), t in self.times.items() if bb == b and q > 1]
        if decode is None or not points:
            return 0.0, 0.05
        if len(points) == 1:
            ((q, t),) = points
            return 0.0, max((t / decode - 1) / (q - 1), 0.0)
        qs = np.array([q for q, _ in points], dtype=np.float64)
        ts = np.array([t for _, t in points], dtype=np.float64) / decode
        slope, intercept = np.polyfit(qs, ts, 1)
        slope = max(float(slope), 0.0)
        # verify(q) = intercept + slope q decode steps; k drafts: q = k + 1, so the extra cost
        # over a decode step is (intercept + slope - 1) + slope k.
        fixed = max(float(intercept) + slope - 1.0, 0.0)
        return fixed, slope
