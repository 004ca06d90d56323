"""The scheduler's core: the step's plan, built from the running requests and then the waiting
ones, under a token budget and a cap on running sequences. Pure Python, no RPC.

The engine loop calls schedule() to get a plan, sends it, and later hands the plan's sampled
tokens to update(). A request is in at most one plan in flight (lookaheads aside);
num_computed_tokens catches up with its tokens as plans are built (the KV of those tokens lands
before any later plan runs, as every stage executes plans in step order), and rejected draft
tokens roll it back in update().

The core's jobs, each a mixin of its own over the state kept here:
  admission.py       a waiting request's seat and first chunk (its shared or cached prefix found first)
  plan_entries.py    a request's entry in the plan: its tokens, slots, copies, what stays in flight
  lookahead.py       plans that go out before the results they follow (decode and verify lookahead)
  micro_batches.py   P stages: how many micro-batches run, their seats, the prefill pool, rebalancing
  preemption.py      preemption by recompute, and the reset after a lost stage
  results.py         a plan's result applied: tokens appended, stops, a verify step's outcome
Features live in modules of their own and keep their per-request state on the request:
  speculation/       drafts, their slots, rollback, acceptance, k (req.spec; self.spec, None when off)
  prefix_sharing.py  n > 1 siblings and prefix groups: shared blocks, pins (req.sharing; self.sharing)
  prompt_logprobs.py the prompt positions a request asks logprobs for, and their rows (req.prompt_logprobs)
  shared_kv_runs.py  which of a step's sequences share KV blocks, for cascade attention
  stop.py            check_stop: when sampled tokens end a request
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from strata.flags import DEFAULTS
from strata.protocol import DEVICE_DRAFT
from strata.services.scheduler.admission import Admission
from strata.services.scheduler.block_manager import KVBlockManager
from strata.services.scheduler.lookahead import DecodeLookahead
from strata.services.scheduler.micro_batches import MicroBatches
from strata.services.scheduler.plan import ScheduledSeq, StepPlan
from strata.services.scheduler.plan_entries import PlanEntries
from strata.services.scheduler.preemption import Preemption
from strata.services.scheduler.prefix_sharing import HOLD, PrefixSharing, SharingState
from strata.services.scheduler.prompt_logprobs import PromptLogprobState
from strata.services.scheduler.repeats import SteadyRepeats
from strata.services.scheduler.request import Request, RequestStatus, arrival_of
from strata.services.scheduler.results import ResultUpdates
from strata.services.scheduler.shared_kv_runs import find_shared_kv_runs
from strata.services.scheduler.speculation.config import SpeculativeConfig
from strata.services.scheduler.speculation.proposals import Speculation, drafts_that_fit
from strata.services.scheduler.speculation.request_state import SpecState
from strata.services.scheduler.speculation.verification import Acceptance
from strata.services.scheduler.stats import Counters
from strata.v1 import engine_pb2

__all__ = ["Scheduler"]


class Scheduler(Admission, PlanEntries, DecodeLookahead, MicroBatches, SteadyRepeats, Preemption, ResultUpdates):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int = DEFAULTS["max_num_seqs"],
        max_num_batched_tokens: int = DEFAULTS["max_num_batched_tokens"],
        enable_prefix_caching: bool = True,
        cascade_attention: bool = True,
        cache_salt: str = "",
        decode_lookahead: int = 0,
        speculation: SpeculativeConfig | None = None,
        num_micro_batches: int = 1,
        micro_batch_min_seqs: int = DEFAULTS["micro_batch_min_seqs"],
        pipeline_stages: int = 1,
        decode_repeats: int = DEFAULTS["decode_repeats"],
    ) -> None:
        if max_model_len <= 1 or max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError("max_model_len > 1, max_num_seqs > 0, max_num_batched_tokens > 0")
        if num_blocks * block_size < max_model_len:
            # A lone request must always fit, or it could never finish.
            raise ValueError(f"{num_blocks} blocks of {block_size} tokens cannot hold max_model_len={max_model_len}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_lookahead = decode_lookahead  # decodes ahead of their input token (0: off)
        # Pipelined decode over P stages: requests run in micro-batches, each a chain of plans
        # (the next a lookahead of the previous), up to max_num_seqs sequences each, so up to
        # num_micro_batches * max_num_seqs run (each stage holds KV for 1/P of the layers);
        # how many run follows the load (micro_batches.py).
        self._init_micro_batches(num_micro_batches, micro_batch_min_seqs, pipeline_stages)
        self._init_repeats(decode_repeats)  # (micro-batches only: repeats.py)
        self.max_running = max_num_seqs * num_micro_batches
        self.cascade_attention = cascade_attention  # plans list their shared-KV runs
        # Shortcuts for the steady state (a decode whose blocks need no work, one sampled token
        # that cannot stop its request). They give the same plans and outputs as the general
        # path; False sends every step through the general path (tests compare the two).
        self.fast_paths = True
        self.block_manager = KVBlockManager(num_blocks, block_size, enable_prefix_caching, cache_salt)
        # The features.
        self.speculation = speculation
        self.spec = Speculation(speculation, pipeline_stages) if speculation is not None else None  # proposals
        self.acceptance = Acceptance(speculation.num_speculative_tokens if speculation else 0)
        self.sharing = PrefixSharing(block_size, self.max_running)
        self.counters = Counters()

        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival: preemption victims come from the end
        self._requests: dict[str, Request] = {}  # unfinished, by request_id
        self._prompt_logprob_requests = 0  # unfinished requests that ask for prompt logprobs
        self._pending_releases: list[int] = []
        self._num_in_flight = 0
        self._running_shared = 0  # running requests that hold blocks they did not compute (cascade runs)
        self._drafts_in_plan = 0
        self._next_seq_id = 1
        self._next_step_id = 1
        self._next_arrival = 0

    # ------------------------------------------------------------------ requests

    def add_request(self, req: Request) -> None:
        try:
            self._check_request(req)
        except ValueError:
            self.sharing.rejected(req)
            raise
        req.arrival = self._next_arrival
        req.arrival_time = time.monotonic()
        self._next_arrival += 1
        self.counters.resumed += bool(req.output_token_ids)
        req.max_output_tokens = min(req.max_tokens, self.max_model_len - req.num_prompt_tokens)
        req.stop_check_ids = req.stop_token_ids if req.ignore_eos else req.stop_token_ids | req.eos_token_ids
        req.spec, req.sharing = SpecState(k=self.spec.k if self.spec is not None else 0), SharingState()
        req.prompt_logprobs = PromptLogprobState.of(req)
        self._prompt_logprob_requests += req.prompt_logprobs is not None
        self._requests[req.request_id] = req
        if req.parent_id:
            self.sharing.add(req)
        self.waiting.append(req)

    def _check_request(self, req: Request) -> None:
        if req.request_id in self._requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if not req.prompt_token_ids:
            raise ValueError("empty prompt")
        if req.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"prompt has {req.num_prompt_tokens} tokens; max_model_len is {self.max_model_len}")
        if req.max_tokens < 1 or req.min_tokens < 0:
            raise ValueError("stop.max_tokens must be >= 1 and stop.min_tokens >= 0")
        if req.status is not RequestStatus.WAITING or req.num_computed_tokens or req.block_ids:
            raise ValueError("request was already scheduled")
        if len(req.output_token_ids) >= min(req.max_tokens, self.max_model_len - req.num_prompt_tokens):
            # Output it brings (resumed from a lost replica) must leave a token to generate.
            raise ValueError(f"{len(req.output_token_ids)} resumed output tokens leave none to generate")
        if req.parent_id:
            self.sharing.check(req)

    def abort(self, request_id: str) -> bool:
        """Ends the request now and frees its blocks, even when it is in a plan in flight
        (that plan's result for it is then ignored). False if it is unknown or finished."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def reset_prefix_cache(self) -> None:
        self.block_manager.reset_prefix_cache()

    def unfinished_request_ids(self) -> list[str]:
        """The requests added and not finished yet, in arrival order."""
        return list(self._requests)

    @property
    def num_in_flight(self) -> int:
        """Sequences in plans whose results have not come back (one per plan they are in)."""
        return self._num_in_flight

    @property
    def pending_releases(self) -> tuple[int, ...]:
        """Worker seq ids the next plan releases (finished, aborted or preempted since the last)."""
        return tuple(self._pending_releases)

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> StepPlan | None:
        """Builds the next plan from requests not in flight, or None when none can run now.
        With micro-batches, the next one in turn that has work (micro_batches.py)."""
        if self.num_micro_batches == 1:
            return self._schedule(0)
        return self._next_plan()

    def retire(self, plan: StepPlan) -> None:
        """The plan's result came back, or its step failed (update() calls it too)."""
        if not plan.retired:
            plan.retired = True
            if self.num_micro_batches > 1:
                self.micro_batch_plans[plan.micro_batch] = max(0, self.micro_batch_plans[plan.micro_batch] - 1)

    def _schedule(self, micro_batch: int) -> StepPlan | None:
        step_id = self._next_step_id
        budget = self.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        new_requests: list[Request] = []
        preempted = False
        bm = self.block_manager
        self._drafts_in_plan = 0  # entries with drafts (_schedule_seq counts them)

        # 1. Running requests first: decodes and unfinished prefill chunks, in arrival order.
        running = self.running  # preemption shrinks it in place: its length is read every time
        spec = self.spec
        speculate = spec is not None and spec.active(len(running))
        # Drafts on the last stage's device with one stage: a request verifies them as soon as
        # its previous step is launched, without waiting for its result (_schedule_verify_ahead).
        drafts_stay = speculate and spec.drafts_stay
        # Verify rounds per verification launched ahead (small batches of decoding requests).
        rounds = spec.rounds_for_plan(running, len(self.waiting)) if drafts_stay else 1
        # One stage keeps several plans in flight for decode lookahead, which requests verifying
        # drafts their plan carries do not get. Scheduled as they come back, requests would split
        # into cohorts, one per plan, each paying a whole step; instead, while such a
        # verification is in flight, every such decode waits for it (no lookahead either), and
        # the next plan holds them all.
        merge_cohorts = speculate and self.decode_lookahead > 0 and spec.verifying_plans > 0
        micro_batches = self.num_micro_batches > 1
        if micro_batches:  # the micro-batch's own requests (the pool's prefill comes after them)
            running = self.micro_batch_members[micro_batch]
        # No speculation: runs of steady decode lookaheads take the fused loop.
        steady = self.fast_paths and not speculate and self.decode_lookahead > 0
        i = 0
        while i < len(running) and budget > 0:
            if steady:
                taken = self._look_ahead_in_place_run(running, i, budget, step_id, seqs)
                budget -= taken - i
                i = taken
                if i >= len(running) or budget <= 0:
                    break
            req = running[i]
            out = req.output_token_ids
            on_device = drafts_stay and req.spec.on_device
            # A request due to speculate with drafts its plan carries gets no decode lookahead: it
            # must come back from its plan in flight, so that a proposal can follow its latest token.
            spec_due = speculate and not on_device and len(out) >= req.spec.retry_at and req.spec.k > 0
            if req.in_flight:
                if on_device and self._schedule_verify_ahead(req, step_id, seqs, copies, budget, rounds):
                    budget -= seqs[-1].num_scheduled
                elif (
                    not spec_due
                    and not (merge_cohorts and not on_device)
                    and self._can_look_ahead(req)
                    and self._schedule_lookahead(req, step_id, seqs, copies)
                ):
                    budget -= 1
                i += 1
                continue
            decoding = out and req.num_computed_tokens == len(req.prompt_token_ids) + len(out) - 1
            if decoding and merge_cohorts and not on_device:
                i += 1  # joins the next plan with the requests verifying now: one step for all
                continue
            if decoding:
                if on_device:
                    spec.device_drafts(req)
                elif spec_due:
                    spec.propose(req)
            if (
                self.fast_paths
                and out
                and not req.spec.draft_token_ids
                and req.num_computed_tokens == len(req.prompt_token_ids) + len(out) - 1
                and bm.writes_in_place(req)
            ):
                # A decode of its latest token, without drafts or block work: the general path
                # below would take no blocks (nor preempt anyone) and schedule just this.
                self._decode_in_place(req, out[-1], step_id, seqs)
                budget -= 1
                i += 1
                continue
            num_new, num_draft = self._tokens_to_compute(req, budget)
            seq_rounds = 1
            if num_draft and rounds > 1 and on_device:  # as many verify rounds as fit too
                room = req.max_output_tokens - len(out)
                seq_rounds = max(1, min(rounds, room // num_new, budget // num_new))
                num_new *= seq_rounds
            end = req.num_computed_tokens + num_new
            if num_draft and bm.blocks_needed(req, end) > bm.num_free_blocks:
                dropped = num_new - num_new // seq_rounds + num_draft  # (every round's drafts)
                end -= dropped  # drafts are optional: drop them before preempting anyone
                num_new -= dropped
                num_draft, seq_rounds = 0, 1
            fits, evicted = self._make_room(req, end, None if micro_batches else i)
            preempted = preempted or evicted
            if not fits:
                continue  # req itself was preempted; running[i] is now the next request
            self._schedule_seq(req, end, num_draft, step_id, seqs, copies, rounds=seq_rounds)
            budget -= num_new
            i += 1

        unspent = quota = 0  # with micro-batches: this plan's prefill quota, and the budget past it
        if micro_batches and budget > 0:
            # Prefill shared out over the round's plans: the pool's chunks, then admissions.
            quota = self._prefill_quota(budget)
            unspent = budget - quota
            spent, evicted = self._schedule_prefill_pool(micro_batch, quota, step_id, seqs, copies)
            preempted = preempted or evicted
            budget = quota - spent

        # 2. Waiting requests, FCFS. After a preemption, admitting new work would only thrash.
        held: list[Request] = []
        limit = self._seat_limit()
        while self.waiting and budget > 0 and len(self.running) < limit and not (preempted and seqs):
            req = self.waiting.popleft()
            if not req.sharing.has_seat and len(self.running) + self.sharing.reserved_seats >= limit:
                self.waiting.appendleft(req)  # the free seats are held for started prefix groups
                break
            # A micro-batch seats a first chunk that samples only while it has room for it.
            may_sample = not micro_batches or self._has_seat(micro_batch, arriving=1)
            admitted = self._admit(req, step_id, budget, seqs, copies, may_sample)
            if admitted is HOLD:
                held.append(req)
                continue
            if admitted is None:
                self.waiting.appendleft(req)  # not enough blocks (or no seat): keep its place in line
                break
            new_requests.append(req)
            if micro_batches:
                self._place(req, micro_batch, seqs[-1].sample)
            budget -= admitted
        self.waiting.extendleft(reversed(held))

        if not seqs:
            return None
        if micro_batches:
            self._took_prefill(quota - budget if quota else 0)
        plan = StepPlan(step_id, new_requests, self._pending_releases, seqs, copies)
        plan.num_tokens = self.max_num_batched_tokens - budget - unspent
        if self._prompt_logprob_requests:  # (nobody else pays for the look)
            plan.asks_prompt_logprobs = any(s.prompt_rows for s in seqs)
        # (The scans below over every entry run only where some entry can match.)
        plan.has_drafts = bool(self._drafts_in_plan)
        plan.verifies = plan.has_drafts and any(s.num_draft and s.input_token_ids[-1] != DEVICE_DRAFT for s in seqs)
        if spec is not None:
            if rounds > 1:
                plan.verify_rounds = max(s.rounds for s in seqs)
            spec.verifying_plans += plan.verifies
            if any(s.num_draft for s in seqs):
                self.acceptance.verify_steps += 1
                self.acceptance.verify_rounds += plan.verify_rounds
            spec.after_plan(plan)
            plan.send_prefixes = spec.on_device and bool(new_requests)
            if all(s.sample and len(s.input_token_ids) == s.num_draft + 1 for s in seqs) and not new_requests:
                plan.max_query = 1 + max(s.num_draft for s in seqs)
        if self.cascade_attention and self._running_shared and any(s.request.sharing.num_shared_blocks for s in seqs):
            find_shared_kv_runs(plan, self.block_size)  # (reorders plan.seqs)
        if spec is not None and any(s.shifted for s in plan.seqs):
            plan.rejected_drafts = [s.request.spec.rejected for s in plan.seqs]
        self._pending_releases = []
        self._next_step_id += 1
        self.counters.steps += 1
        if micro_batches:
            self._commit_repeats(plan, micro_batch)
        return plan

    def _tokens_to_compute(self, req: Request, budget: int) -> tuple[int, int]:
        """(tokens to compute this step including drafts, drafts) for a running request."""
        remaining = req.num_tokens - req.num_computed_tokens
        if remaining > 1 or not req.spec.draft_token_ids:
            return min(remaining, budget), 0
        num_draft = drafts_that_fit(req, budget)  # they ride behind the last sampled token
        return 1 + num_draft, num_draft

    # ------------------------------------------------------------------ bookkeeping

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING:
            if req.group_size:
                self.sharing.keep_group_prefix(req, self.block_manager)  # before its blocks go
            self.block_manager.free(req)
            self._release_seq(req)
            self._remove_running(req)
            self._num_in_flight -= req.in_flight
            req.in_flight = 0
            req.spec.admitted()  # its seq_id ends with whatever was in flight
        req.status = status
        req.spec.draft_token_ids = []
        if self.spec is not None:
            self.spec.forget(req)
        del self._requests[req.request_id]
        self._prompt_logprob_requests -= req.prompt_logprobs is not None
        if req.parent_id:
            self.sharing.finished(req, self.block_manager)
        self.counters.finished += 1

    def _release_seq(self, req: Request) -> None:
        self._pending_releases.append(req.seq_id)
        self._releases += 1  # (the repeats of its micro-batch leave it out)
        if self.spec is not None:
            self.spec.release(req)
        req.seq_id = None

    def _remove_running(self, req: Request) -> None:
        index = bisect.bisect_left(self.running, req.arrival, key=arrival_of)
        assert self.running[index] is req
        del self.running[index]
        if req.sharing.num_shared_blocks:
            self._running_shared -= 1
        if self.num_micro_batches > 1:
            self._leave_micro_batch(req)

    def waiting_fill_a_plan(self) -> bool:
        """Whether the waiting requests alone would fill the next plan (its token budget or the
        free seats): holding it to gather more arrivals (plan_pacing.py) would gain nothing."""
        seats = self._seat_limit() - len(self.running)
        if len(self.waiting) >= seats:
            return True
        tokens = len(self.running)  # (about a token each for the running ones)
        for req in self.waiting:
            tokens += req.num_tokens - req.num_computed_tokens
            if tokens >= self.max_num_batched_tokens:
                return True
        return False

    def fill_stats(self, stats: engine_pb2.SchedulerStats) -> None:
        """Writes the scheduler's part of the statistics (declared in engine.proto)."""
        bm = self.block_manager
        stats.num_kv_blocks = bm.num_blocks
        stats.free_kv_blocks = bm.num_free_blocks
        stats.cached_kv_blocks = bm.num_cached_blocks
        stats.used_kv_blocks = bm.num_used_blocks
        stats.peak_used_kv_blocks = bm.peak_used_blocks
        stats.running = len(self.running)
        stats.waiting = len(self.waiting)
        stats.prefix_cache_queries = bm.prefix_cache_queries
        stats.prefix_cache_hits = bm.prefix_cache_hits
        stats.waiting_tokens = sum(r.num_tokens for r in self.waiting)
        stats.running_tokens = sum(r.num_tokens for r in self.running)
        stats.micro_batches = self.active_micro_batches
        self.counters.fill_stats(stats)
        self.acceptance.fill_stats(stats)
