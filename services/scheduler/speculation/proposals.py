"""Who proposes drafts, for whom, how many, and whether this step verifies at all (Speculation).

A speculating request decodes its latest token plus k draft tokens in one verify step (k + 1
slots of KV); the last stage samples up to k + 1 tokens, and the slots of rejected drafts are
rolled back when the result comes back (verification.py). Drafts come from:

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

Each request's k follows its acceptance (adaptive_k.py: 0 turns drafting off for a while), and a
CostModel (cost_model.py) fed with the GPU time of each step decides per step whether
verification beats plain decoding at the current batch; max_batch (--speculative-max-batch) caps it.

Verify rounds (rounds_for_plan): up to rounds_max_batch decoding requests with drafts on the
device, a verification runs several rounds in one step (StepPlan.verify_rounds): the last stage
verifies, proposes and verifies again without the host. The plan reserves rounds x (k + 1) slots;
the result says what each round emitted and proposed (record per round, rollback of the rest).

The scheduler core calls in at a few points: Speculation.active once per step, propose for a
request due to speculate, drafts_that_fit when it sizes a decode, device_drafts for a request
whose drafts are on the device, after_plan on each plan, and verification.verified when a
verify step's result comes back. Drafts set on a request by anyone else (tests do) are scheduled
and verified the same way.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from strata.protocol import DEVICE_DRAFT, DRAFT_PLACEHOLDER
from strata.sampling_rules import draws_unfiltered, history_needed
from strata.services.scheduler.speculation.adaptive_k import AdaptiveK, expected_tokens
from strata.services.scheduler.speculation.config import SpeculativeConfig
from strata.services.scheduler.speculation.cost_model import CostModel
from strata.services.scheduler.speculation.ngram_proposer import NgramProposer

log = logging.getLogger("strata.scheduler")

if TYPE_CHECKING:
    from strata.services.scheduler.plan import StepPlan
    from strata.services.scheduler.request import Request

# After a prompt lookup finds nothing, the request decodes this many tokens (pipelined with decode
# lookahead) before it looks again.
NGRAM_RETRY_TOKENS = 8


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
                # read-back made plain steps dearer in host time). The step after it turns
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
        once a plain step had pipelined, and a draft that accepted nothing kept verifying, the
        choice stuck on "not measured yet".)"""
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
