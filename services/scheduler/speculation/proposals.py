"""Speculative decoding in the scheduler: proposals, their slots, rollback, acceptance counts,
each request's k and the cost model that decides per step whether verifying pays.

A speculating request decodes its latest token plus k draft tokens in one verify step (k + 1
slots of KV); the last stage samples up to k + 1 tokens, and the slots of rejected drafts are
rolled back when the result comes back. Drafts come from:

- prompt lookup on the last stage's device (proposer "device", the default): every plan asks
  the last stage to propose k drafts after its draw (StepPlan.propose_drafts). With one stage
  the drafts never leave the device: a verify step's plan carries DEVICE_DRAFT placeholders, and
  it may go out before the previous step's result came back (a lookahead for speculation, as
  plain decoding has one): it assumes every draft in flight accepted, reserves the slots for
  that, and the worker moves the sequence back by the rejections it counted since (the plan's
  rejected_drafts says how many the scheduler knew of). With P stages, or for a request whose
  sampling keeps state on the last stage (penalties, a grammar), the result returns the drafts
  and the next plan carries them;
- prompt lookup here (proposer "scheduler", ngram_proposer.py);
- a draft model's worker: the plan carries DRAFT_PLACEHOLDERs that the engine fills in before it
  sends the plan (draft_proposer.py), and each request's SpecState tracks what the draft worker
  holds of it.

Each request's k follows its acceptance (AdaptiveK: 0 turns drafting off for a while), and a
CostModel fed with the GPU time of each step decides per step whether verification beats plain
decoding at the current batch; max_batch (--speculative-max-batch) caps it.

Verify rounds (rounds_for_plan): up to rounds_max_batch decoding requests with drafts on the
device, a verification runs several rounds in one step (StepPlan.verify_rounds): the last stage verifies,
proposes and verifies again without the host. The plan reserves rounds x (k + 1) slots; the
result says what each round emitted and proposed (record per round, rollback of the rest).

The scheduler core calls in at a few points: Speculation.active once per step, propose for a
request due to speculate, drafts_that_fit when it sizes a decode, device_verify for a request
whose drafts are on the device, after_plan on each plan, rollback and record when a verify
step's result comes back. Drafts set on a request by anyone else (tests do) are scheduled and
verified the same way.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from strata.protocol import DEVICE_DRAFT, DRAFT_PLACEHOLDER, MAX_VERIFY_ROUNDS
from strata.sampling_rules import draws_unfiltered, history_needed
from strata.services.scheduler.block_manager import KVBlockManager, cdiv
from strata.services.scheduler.ngram_proposer import NgramProposer
from strata.v1 import engine_pb2

log = logging.getLogger("strata.scheduler")

if TYPE_CHECKING:
    from strata.services.scheduler.plan import StepPlan
    from strata.services.scheduler.request import Request

# After a prompt lookup finds nothing, the request decodes this many tokens (pipelined with decode
# lookahead) before it looks again.
NGRAM_RETRY_TOKENS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes, how many tokens, and up to which batch it may run."""

    method: str  # "ngram" (prompt lookup) or "draft" (a draft model's worker)
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    max_batch: int = 32  # running requests above this decode without drafts (a cap)
    proposer: str = "scheduler"  # ngram: "device" (the last stage) or "scheduler" (here)
    # k per request from its acceptance, and the cost model's per-step choice; off: every
    # request always proposes k (up to max_batch), as before.
    adaptive: bool = True
    # Verify rounds per plan (device proposer, one stage) while at most rounds_max_batch requests
    # run: the last stage verifies, proposes and verifies again without the host (StepPlan.
    # verify_rounds), so that one plan's host work serves several verify steps where the host's
    # time per step exceeds the GPU's (SmolLM2 on an H200: at batches 1 to 64).
    rounds: int = 1
    rounds_max_batch: int = 64

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"unknown speculative method {self.method!r}")
        if self.proposer not in ("device", "scheduler"):
            raise ValueError(f"unknown n-gram proposer {self.proposer!r}")
        if self.num_speculative_tokens < 1 or self.max_batch < 0:
            raise ValueError("num_speculative_tokens >= 1 and max_batch >= 0")
        if not 1 <= self.rounds <= MAX_VERIFY_ROUNDS or self.rounds_max_batch < 0:
            raise ValueError(f"verify rounds in [1, {MAX_VERIFY_ROUNDS}] and rounds_max_batch >= 0")


@dataclass(slots=True)
class SpecState:
    """One request's speculation: its drafts for the next step, its k, what the last stage holds
    of it (device proposals) and the draft worker's view of it."""

    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step (consumed by it)
    retry_at: int = 0  # output tokens before it speculates again (after a proposal found nothing)
    k: int = 0  # drafts it proposes now (AdaptiveK); set at admission
    expected: float = 0.0  # tokens a verify step of its k drafts emits on average (0: not known yet)
    accepted: float = 0.0  # AdaptiveK's decayed counts: drafts accepted, proposals that ended in a miss
    missed: float = 0.0
    found: float = -1.0  # AdaptiveK: drafts a proposal holds on average (-1: none seen yet)
    backoff: int = 0  # tokens it stays off after its acceptance fell too low (doubles each time)
    # Device proposals (proposer "device"), per admission (seq_id):
    on_device: bool = False  # its drafts stay on the last stage's device (one stage, no controls)
    unfiltered: bool = False  # its draws take the logits as they are (sampling_rules.draws_unfiltered)
    proposed: int = 0  # drafts its latest plan asked the last stage to propose for the next step
    last_proposed: int = 0  # drafts the latest result said were found (0: no match)
    returned: list[int] = field(default_factory=list)  # drafts a result returned, for the next plan
    rejected: int = 0  # draft tokens rejected since admission, as results reported them
    verifies_in_flight: int = 0  # plans in flight verifying its drafts
    max_pending: int = 0  # tokens its plans in flight emit at most (all drafts accepted)
    verify_pending: bool = False  # its latest plan verifies drafts
    # Draft model: what the draft worker holds (draft_proposer.py keeps these).
    draft_seq_id: int | None = None  # the seq_id the draft worker holds state for
    draft_synced_blocks: int = 0  # leading block-table entries the draft worker holds
    draft_computed: int = 0  # positions whose draft KV is valid (its tokens never changed since)

    def block_copied(self, block: int, block_size: int) -> None:
        """The target's block `block` was copied on write: the draft worker's copy of it is not
        copied; it recomputes the block's tokens."""
        self.draft_synced_blocks = min(self.draft_synced_blocks, block)
        self.draft_computed = min(self.draft_computed, block * block_size)

    def forget_draft_worker(self) -> None:
        """The draft worker lost its state (the pipeline was rebuilt)."""
        self.draft_seq_id = None
        self.draft_synced_blocks = self.draft_computed = 0
        self.draft_token_ids = []

    def admitted(self) -> None:
        """A new seq_id (admission, re-admission): the last stage holds nothing of it yet."""
        self.proposed = self.last_proposed = self.rejected = 0
        self.verifies_in_flight = self.max_pending = 0
        self.verify_pending = False
        self.returned = []
        self.draft_token_ids = []


class Speculation:
    """The scheduler's proposer side: who proposes, for whom, how many, and whether this step
    verifies at all."""

    def __init__(self, config: SpeculativeConfig, pipeline_stages: int = 1) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_batch = config.max_batch
        # Prompt lookup on the last stage's device; with one stage its drafts never leave it and
        # verify steps may go out before the previous result (Scheduler._schedule_verify_ahead).
        self.on_device = config.method == "ngram" and config.proposer == "device"
        self.drafts_stay = self.on_device and pipeline_stages == 1
        # Scheduler-side ngram drafts come from here; a draft model's drafts are DRAFT_PLACEHOLDERs
        # that the engine fills in from the draft worker before it sends the plan (all k or none,
        # so that one call of k steps serves every sequence).
        self.ngram = (
            NgramProposer(self.k, config.ngram_min, config.ngram_max)
            if config.method == "ngram" and not self.on_device
            else None
        )
        self.draft_releases: list[int] = []  # seq ids the draft worker may drop (draft method)
        self.verifying_plans = 0  # plans in flight that verify drafts they carry (not the device's)
        self.adaptive = AdaptiveK(self.k, all_or_nothing=config.method == "draft") if config.adaptive else None
        self.costs = CostModel() if config.adaptive else None
        # What the latest plan's sampling sequences expect per step if they verify (tokens per
        # sequence), for the cost model's next choice.
        self.expected_per_seq = expected_tokens(0.7, self.k)
        self.batch = 1  # running requests at the latest choice
        self.speculating = True  # the latest choice

    def admit(self, req: Request) -> None:
        """req got a (new) seq_id: the last stage holds nothing of it."""
        spec = req.spec
        spec.admitted()
        # Sampling that keeps state on the last stage (penalties, a grammar) needs its drafts on
        # the host before the step: they come back with the result and ride in the next plan.
        spec.on_device = self.drafts_stay and not history_needed(req.sampling)[0]
        spec.unfiltered = draws_unfiltered(req.sampling)

    def active(self, num_running: int) -> bool:
        """Whether requests verify drafts this step: up to max_batch running requests, where the
        cost model finds that it pays at this batch."""
        self.batch = num_running
        if num_running > self.max_batch:
            self.speculating = False
        elif self.costs is None:
            self.speculating = True
        else:
            self.speculating = self.costs.speculate(num_running, self.expected_per_seq)
        return self.speculating

    def rounds_for_plan(self, running: list[Request], waiting: int) -> int:
        """Verify rounds a verification the next plan launches ahead may run (1: one). Several
        only with one stage and drafts on the device, at most rounds_max_batch running requests
        and none waiting, while every running request decodes (no prefill chunk would ride
        along) and draws unfiltered (the rounds run inside the verification graph)."""
        rounds = self.config.rounds
        if rounds <= 1 or not self.drafts_stay or waiting or len(running) > self.config.rounds_max_batch:
            return 1
        for req in running:
            spec = req.spec
            if not (spec.on_device and spec.unfiltered) or req.num_computed_tokens < len(req.prompt_token_ids):
                return 1
        return rounds

    def propose(self, req: Request) -> None:
        """Drafts for a request about to decode its latest token (its plan carries them), as
        long as even all of them accepted (plus the bonus token) stays within max_tokens and
        max_model_len."""
        room = req.max_output_tokens - len(req.output_token_ids) - 1
        spec = req.spec
        if spec.k <= 0:
            return
        if self.on_device:  # the drafts the latest result returned (P stages, or controls)
            spec.draft_token_ids = spec.returned[: min(spec.k, room)]
            spec.returned = []
        elif self.ngram is not None:
            spec.draft_token_ids = self.ngram.propose(req, min(spec.k, room))
            if not spec.draft_token_ids:  # nothing to look up: decode (with lookahead) for a while
                spec.retry_at = len(req.output_token_ids) + NGRAM_RETRY_TOKENS
        elif room >= self.k:
            spec.draft_token_ids = [DRAFT_PLACEHOLDER] * self.k

    def device_drafts(self, req: Request) -> None:
        """A request not in flight, about to decode its latest token, whose drafts are on the
        device: verify those the last stage found (its latest result says how many)."""
        spec = req.spec
        room = req.max_output_tokens - len(req.output_token_ids) - 1
        n = min(spec.k, spec.proposed, spec.last_proposed, room)
        spec.draft_token_ids = [DEVICE_DRAFT] * n if n > 0 else []

    def after_plan(self, plan: StepPlan) -> None:
        """The plan's sampling sequences of speculating requests ask the last stage for their next
        drafts (device proposer), and their expected tokens per verify step feed the next choice."""
        expected = count = 0.0
        adaptive, on_device = self.adaptive, self.on_device
        for s in plan.seqs:
            if not s.sample:
                continue
            spec = s.request.spec
            if adaptive is not None and spec.k <= 0 and len(s.request.output_token_ids) >= spec.retry_at:
                adaptive.resume(spec)
            k = spec.k
            if on_device:
                # While speculation is off, no proposals: a plain step in a speculating cluster
                # then costs what a plain cluster's does (the lookup kernel and its proposals'
                # read-back made plain steps 35% dearer in host time). The step after it turns
                # back on proposes; the one after that verifies.
                s.propose = spec.proposed = k if self.speculating else 0
            count += 1
            if k > 0:
                expected += spec.expected or expected_tokens(0.7, k)
            else:
                expected += 1
        if count:
            self.expected_per_seq = expected / count

    def record(self, req: Request, num_draft: int, valid: int, accepted: int) -> None:
        """A verify step's outcome for req: num_draft slots, valid of them real proposals."""
        if self.adaptive is not None:
            self.adaptive.record(req, num_draft, valid, accepted, self.costs.verify_cost(self.batch))

    def observe(
        self,
        plan: StepPlan,
        seconds: float,
        now: float | None = None,
        tokens: int | None = None,
        pipelined: bool = True,
    ) -> None:
        """A step's cost and the tokens it emitted, for the cost model: pure decode or verify
        steps only. A verify step whose drafts ride in its plan (a draft model's, the scheduler's
        lookup, P stages, controls) always waits for the previous result: that wait is its cost,
        so it counts as pipelined. (Left out as a bubble, no such verify step was ever timed
        once a plain step had pipelined: the dummy 8B with a 1B draft accepting nothing kept
        verifying in 472 of 512 steps at 0.37x, the choice stuck on "not measured yet".)"""
        if self.costs is not None and plan.max_query and seconds > 0:
            pipelined = pipelined or plan.verifies
            self.costs.observe(len(plan.seqs), plan.max_query, seconds, now, tokens, pipelined, plan.verify_rounds)

    def release(self, req: Request) -> None:
        """req's seq_id ends: the draft worker may drop what it holds for it."""
        spec = req.spec
        if spec.draft_seq_id is not None:
            self.draft_releases.append(spec.draft_seq_id)
            spec.draft_seq_id = None

    def forget(self, req: Request) -> None:
        if self.ngram is not None:
            self.ngram.forget(req)

    def reset(self) -> None:
        """The pipeline was rebuilt: nothing is in flight, the draft worker holds nothing."""
        self.verifying_plans = 0
        self.draft_releases = []


def expected_tokens(alpha: float, k: float) -> float:
    """Tokens one verification of k drafts emits when each draft is accepted with probability
    alpha once those before it were (a geometric run, plus the target's own token)."""
    if alpha >= 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class AdaptiveK:
    """Each request's k, from its drafts so far.

    A proposal's drafts are accepted left to right until the first miss, so a request's record
    is a run of accepted drafts and (unless all were) one miss per verify step: alpha, the chance
    that a draft is accepted once the ones before it were, is accepted / (accepted + missed),
    over decayed counts (recent steps weigh more) with a prior of 2 / 3. A proposal also holds
    only the drafts the lookup found (`found`, decayed, one more where it filled every slot: it
    may have found more). Verifying k slots then emits expected_tokens(alpha, min(k, found)),
    and k maximises that per unit of the step's cost, (1 + f + c k) decode steps: f the fixed
    part of a verify step's extra cost and c one more position's (the cost model's, at the
    current batch: at batch 1 a verify step of SmolLM2 on an H200 costs 1.5-2 decode steps
    whatever its k, at batch 64 its cost grows with k). Where no k beats a plain decode (alpha
    too low, or nothing found), k is 0: the request proposes nothing for `backoff` tokens (16,
    doubling while it keeps failing), then tries again."""

    DECAY = 0.8
    PRIOR_ACCEPTED, PRIOR_MISSED = 2.0, 1.0
    MIN_BACKOFF, MAX_BACKOFF = 16, 512

    def __init__(self, k: int, all_or_nothing: bool = False) -> None:
        self.k = k
        self.all_or_nothing = all_or_nothing  # a draft model proposes k tokens or none

    def alpha(self, spec: SpecState) -> float:
        return (spec.accepted + self.PRIOR_ACCEPTED) / (
            spec.accepted + spec.missed + self.PRIOR_ACCEPTED + self.PRIOR_MISSED
        )

    def record(self, req: Request, num_draft: int, valid: int, accepted: int, cost: tuple[float, float]) -> None:
        spec = req.spec
        spec.accepted = spec.accepted * self.DECAY + accepted
        spec.missed = spec.missed * self.DECAY + (1 if accepted < valid else 0)
        seen = valid + (1 if valid == num_draft else 0)
        spec.found = seen if spec.found < 0 else spec.found * self.DECAY + seen * (1 - self.DECAY)
        alpha = self.alpha(spec)
        fixed, c = cost
        c = max(c, 1e-3)
        candidates = (self.k,) if self.all_or_nothing else range(1, self.k + 1)
        best_k, best, best_tokens = 0, 1.0, 1.0
        for k in candidates:
            tokens = expected_tokens(alpha, min(k, spec.found))
            value = tokens / (1 + fixed + c * k)
            if value > best * 1.02:
                best_k, best, best_tokens = k, value, tokens
            if k >= spec.found:
                break  # a larger k finds no more drafts: it only costs more
        spec.expected = best_tokens
        if best_k == 0 and spec.k > 0:
            spec.backoff = min(max(2 * spec.backoff, self.MIN_BACKOFF), self.MAX_BACKOFF)
            spec.retry_at = len(req.output_token_ids) + spec.backoff
        elif best_k > 0 and alpha > 0.5:
            spec.backoff = 0
        spec.k = best_k

    def resume(self, spec: SpecState) -> None:
        """Its backoff is over: it proposes again, from the prior."""
        spec.accepted = spec.missed = 0.0
        spec.found = -1.0
        spec.k = self.k if self.all_or_nothing else max(1, self.k // 2)
        spec.expected = expected_tokens(self.alpha(spec), spec.k)


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
    # little (the GPU time was its floor, and a host-bound verify step looked 1.4 ms long where the
    # H200 run's steps took 2.3 ms); a window's wall time is what its steps cost.
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
        # asks for it after every verify step (16 least-squares fits a step cost the scheduler
        # 0.48 ms at batch 16 on a CPU, bench/scheduler_step.py --speculate).
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
        bubble) took a whole round trip, 1.5-1.6 ms against 1.0 for the pipelined decode steps
        of SmolLM2 at batch 1 on an H200, and made plain decoding look dearer than it is."""
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


def drafts_that_fit(req: Request, budget: int) -> int:
    """How many of req's drafts ride behind its last token in a step with `budget` tokens left:
    as many as fit, as long as even all of them accepted (plus the bonus token) stays within
    max_tokens and max_model_len; a draft model's placeholders go all k or none."""
    drafts = req.spec.draft_token_ids
    room = req.max_output_tokens - len(req.output_token_ids)
    num_draft = max(0, min(len(drafts), budget - 1, room - 1))
    if num_draft < len(drafts) and drafts[0] == DRAFT_PLACEHOLDER:
        return 0  # a draft model proposes k tokens or none
    return num_draft


def rollback(req: Request, rejected: int, block_manager: KVBlockManager) -> None:
    """Rolls back the slots of `rejected` drafts and the blocks past the accepted tokens."""
    req.num_computed_tokens -= rejected
    kept = cdiv(req.num_computed_tokens, block_manager.block_size)
    block_manager.truncate(req, kept)
    req.num_synced_blocks = min(req.num_synced_blocks, kept)
    req.spec.draft_synced_blocks = min(req.spec.draft_synced_blocks, kept)


class Acceptance:
    """Verify steps, drafts verified and drafts accepted by position: the spec_decode_* stats."""

    def __init__(self, k: int) -> None:
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = [0] * k  # accepted[i]: verify steps that accepted draft i
        self.verify_steps = 0  # plans that carried drafts
        self.verify_rounds = 0  # verify rounds those plans ran (several a plan at small batches)

    def record(self, num_draft: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += num_draft
        if accepted > len(self.accepted):
            self.accepted.extend([0] * (accepted - len(self.accepted)))
        for position in range(accepted):
            self.accepted[position] += 1

    def fill_stats(self, stats: engine_pb2.SchedulerStats) -> None:
        stats.spec_decode_drafts = self.drafts
        stats.spec_decode_draft_tokens = self.draft_tokens
        stats.spec_decode_accepted_tokens = sum(self.accepted)
        stats.spec_decode_accepted_per_position.extend(self.accepted)
        stats.spec_decode_verify_steps = self.verify_steps
        stats.spec_decode_verify_rounds = self.verify_rounds
        if self.draft_tokens:
            stats.spec_decode_acceptance_rate = sum(self.accepted) / self.draft_tokens
