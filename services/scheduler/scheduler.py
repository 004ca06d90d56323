"""The scheduler's core: admission, chunked prefill, preemption and the step's plan. Pure
Python, no RPC.

The engine loop calls schedule() to get a plan, sends it, and later hands the plan's sampled
tokens to update(). A request is in at most one plan in flight (decode lookaheads aside);
num_computed_tokens catches up with its tokens as plans are built (the KV of those tokens lands
before any later plan runs, as every stage executes plans in step order), and rejected draft
tokens roll it back in update().

Features live in modules of their own and keep their per-request state on the request:
  speculation.py     drafts, their slots, rollback, acceptance (req.spec; self.spec, None when off)
  prefix_sharing.py  n > 1 siblings and prefix groups: shared blocks, pins (req.sharing; self.sharing)
  shared_kv_runs.py  which of a step's sequences share KV blocks, for cascade attention
  stop.py            check_stop: when sampled tokens end a request
The decode lookahead (_can_look_ahead, _schedule_lookahead) is part of this core.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from strata.protocol import DEVICE_DRAFT, PLACEHOLDER_TOKEN
from strata.services.scheduler.block_manager import BlockTable, KVBlockManager
from strata.services.scheduler.plan import RequestUpdate, ScheduledSeq, StepPlan
from strata.services.scheduler.prefix_sharing import HOLD, NO_ROOM, PrefixSharing, SharingState
from strata.services.scheduler.request import Request, RequestStatus
from strata.services.scheduler.shared_kv_runs import find_shared_kv_runs
from strata.services.scheduler.speculation import (
    Acceptance,
    SpecState,
    Speculation,
    SpeculativeConfig,
    drafts_that_fit,
    rollback,
)
from strata.services.scheduler.stats import Counters
from strata.services.scheduler.stop import check_stop
from strata.v1 import engine_pb2

__all__ = ["Scheduler", "SpeculativeConfig"]

_RUNNING = engine_pb2.FINISH_REASON_UNSPECIFIED


def _arrival(req: Request) -> int:
    return req.arrival


class Scheduler:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        cascade_attention: bool = True,
        cache_salt: str = "",
        decode_lookahead: int = 0,
        speculation: SpeculativeConfig | None = None,
        num_micro_batches: int = 1,
        micro_batch_min_seqs: int = 32,
        pipeline_stages: int = 1,
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
        # num_micro_batches * max_num_seqs run (each stage holds KV for 1/P of the layers).
        # A micro-batch opens only past micro_batch_min_seqs sequences in the others: a small
        # batch's step costs the weights' read whatever its size, so splitting it costs latency.
        if num_micro_batches < 1 or micro_batch_min_seqs < 1:
            raise ValueError("num_micro_batches and micro_batch_min_seqs must be >= 1")
        self.num_micro_batches = num_micro_batches
        self.micro_batch_min_seqs = micro_batch_min_seqs
        self.max_running = max_num_seqs * num_micro_batches
        self.micro_batch_seqs = [0] * num_micro_batches  # running requests per micro-batch
        # Plans in flight per micro-batch, at most decode_lookahead + 1: a micro-batch's requests
        # are each in every one of its plans in flight. With more (the engine allows two per
        # micro-batch), a lone micro-batch would split into two cohorts that alternate steps,
        # each reading all the weights for half the tokens.
        self.micro_batch_plans = [0] * num_micro_batches
        self._next_micro_batch = 0
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
        self._pending_releases: list[int] = []
        self._num_in_flight = 0
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
        req.max_output_tokens = min(req.max_tokens, self.max_model_len - req.num_prompt_tokens)
        req.stop_check_ids = req.stop_token_ids if req.ignore_eos else req.stop_token_ids | req.eos_token_ids
        req.spec, req.sharing = SpecState(k=self.spec.k if self.spec is not None else 0), SharingState()
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
        if req.status is not RequestStatus.WAITING or req.output_token_ids or req.block_ids:
            raise ValueError("request was already scheduled")
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
        With micro-batches, the next one in turn that has work (round robin)."""
        n = self.num_micro_batches
        if n == 1:
            return self._schedule(0)
        for k in range(n):
            mb = (self._next_micro_batch + k) % n
            if self.decode_lookahead and self.micro_batch_plans[mb] > self.decode_lookahead:
                continue
            plan = self._schedule(mb)
            if plan is not None:
                self._next_micro_batch = (mb + 1) % n
                plan.micro_batch = mb
                self.micro_batch_plans[mb] += 1
                return plan
        return None

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
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if micro_batches:  # another micro-batch's, or a prefill chunk that may follow its last
                if req.micro_batch != micro_batch:
                    i += 1
                    continue
                if req.in_flight and self._can_follow_chunk(req):
                    num_new = min(req.num_tokens - req.num_computed_tokens, budget)
                    end = req.num_computed_tokens + num_new
                    fits, evicted = self._make_room(req, end, i, lookahead=True)
                    if fits:
                        self._schedule_seq(req, end, 0, step_id, seqs, copies)
                        budget -= num_new
                    i += 1
                    continue
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
            fits, evicted = self._make_room(req, end, i)
            preempted = preempted or evicted
            if not fits:
                continue  # req itself was preempted; running[i] is now the next request
            self._schedule_seq(req, end, num_draft, step_id, seqs, copies, rounds=seq_rounds)
            budget -= num_new
            i += 1

        # 2. Waiting requests, FCFS. After a preemption, admitting new work would only thrash.
        held: list[Request] = []
        seats = self._micro_batch_seats(micro_batch) if micro_batches else self.max_running
        while self.waiting and budget > 0 and len(self.running) < self.max_running and not (preempted and seqs):
            if micro_batches and self.micro_batch_seqs[micro_batch] >= seats:
                break  # this micro-batch has its share: the next plans' micro-batches take the rest
            req = self.waiting.popleft()
            if not req.sharing.has_seat and len(self.running) + self.sharing.reserved_seats >= self.max_running:
                self.waiting.appendleft(req)  # the free seats are held for started prefix groups
                break
            admitted = self._admit(req, step_id, budget, seqs, copies)
            if admitted is HOLD:
                held.append(req)
                continue
            if admitted is None:
                self.waiting.appendleft(req)  # not enough blocks: keep its place in line
                break
            new_requests.append(req)
            req.micro_batch = micro_batch
            self.micro_batch_seqs[micro_batch] += 1
            budget -= admitted
        self.waiting.extendleft(reversed(held))

        if not seqs:
            return None
        plan = StepPlan(step_id, new_requests, self._pending_releases, seqs, copies)
        plan.verifies = any(s.num_draft and s.input_token_ids[-1] != DEVICE_DRAFT for s in seqs)
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
        if self.cascade_attention and any(s.request.sharing.num_shared_blocks for s in seqs):
            find_shared_kv_runs(plan, self.block_size)  # (reorders plan.seqs)
        if spec is not None and any(s.shifted for s in plan.seqs):
            plan.rejected_drafts = [s.request.spec.rejected for s in plan.seqs]
        self._pending_releases = []
        self._next_step_id += 1
        self.counters.steps += 1
        return plan

    def _micro_batch_seats(self, micro_batch: int) -> int:
        """Sequences a micro-batch may hold: what runs and waits, shared evenly (by decode
        tokens; each plan's prefill is bounded by its own token budget) over as many
        micro-batches as hold micro_batch_min_seqs each (at least one, at most all), at most
        max_num_seqs each. An empty micro-batch opens only while fewer than that many hold any."""
        demand = len(self.running) + len(self.waiting)
        used = min(self.num_micro_batches, max(1, -(-demand // self.micro_batch_min_seqs)))
        counts = self.micro_batch_seqs
        if not counts[micro_batch] and sum(1 for c in counts if c) >= used:
            return 0
        return min(self.max_num_seqs, -(-demand // used))

    def _can_follow_chunk(self, req: Request) -> bool:
        """A prompt's next chunk may follow its previous one without waiting for that plan's
        result: a chunk samples nothing, and every stage runs plans in step order, so its KV is
        written before the next chunk reads it (micro-batches: prefill stays pipelined)."""
        return not req.pending_sample and not req.spec.draft_token_ids and req.num_computed_tokens < req.num_tokens

    def _tokens_to_compute(self, req: Request, budget: int) -> tuple[int, int]:
        """(tokens to compute this step including drafts, drafts) for a running request."""
        remaining = req.num_tokens - req.num_computed_tokens
        if remaining > 1 or not req.spec.draft_token_ids:
            return min(remaining, budget), 0
        num_draft = drafts_that_fit(req, budget)  # they ride behind the last sampled token
        return 1 + num_draft, num_draft

    def _make_room(self, req: Request, end: int, index: int, lookahead: bool = False) -> tuple[bool, bool]:
        """Frees blocks until req can compute up to `end`, preempting the latest-arrived
        running requests not in flight (those after `index`, then req itself).
        Returns (req still runs, someone was preempted). lookahead: req is in flight (a chunk
        following its previous one), so it preempts nobody and is not preempted: (False, False)."""
        bm = self.block_manager
        preempted = False
        if lookahead:
            return bm.blocks_needed(req, end) <= bm.num_free_blocks, False
        while bm.blocks_needed(req, end) > bm.num_free_blocks:
            victim = None
            for j in range(len(self.running) - 1, index, -1):
                if not self.running[j].in_flight:
                    victim = self.running[j]
                    break
            preempted = True
            if victim is None:
                self._preempt(req)
                return False, True
            self._preempt(victim)
        return True, preempted

    def _admit(
        self,
        req: Request,
        step_id: int,
        budget: int,
        seqs: list[ScheduledSeq],
        copies: list[tuple[int, int]],
    ) -> int | object | None:
        """Admits a waiting request and schedules its first chunk. Returns the tokens it
        scheduled, HOLD to wait for a sibling (or a prefix group's other members), or None when
        its blocks do not fit now."""
        bm = self.block_manager
        found = None
        if req.parent_id or req.group_size:
            free_seats = self.max_num_seqs - len(self.running) - self.sharing.reserved_seats
            found = self.sharing.shared_prefix(req, step_id, bm, free_seats)
        if found is HOLD:
            return HOLD
        if found is NO_ROOM:
            return None
        if found is not None:  # a sibling's blocks, or its prefix group's pinned prefix
            shared, num_computed = found
        else:
            shared = bm.lookup(req)
            num_computed = len(shared) * self.block_size
        end = num_computed + min(req.num_tokens - num_computed, budget)
        free = bm.num_free_blocks - self.sharing.reserved_for_others(req)
        if bm.admission_cost(shared, num_computed, end) > free:
            return None

        bm.acquire(req, shared, cached=found is None)
        self.sharing.admitted(req)
        req.sharing.num_shared_blocks = num_computed // self.block_size  # full blocks it did not compute
        req.num_computed_tokens = num_computed
        if req.num_preemptions == 0:  # first admission
            req.num_cached_prompt_tokens = num_computed
            req.queue_seconds = time.monotonic() - req.arrival_time
            bm.record_prefix_query(req.num_prompt_tokens, num_computed)
        req.seq_id = self._next_seq_id
        self._next_seq_id += 1
        if self.spec is not None:
            self.spec.admit(req)
        req.num_synced_blocks = 0
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=_arrival)
        self._schedule_seq(req, end, 0, step_id, seqs, copies)
        return end - num_computed

    def _schedule_seq(
        self,
        req: Request,
        end: int,
        num_draft: int,
        step_id: int,
        seqs: list[ScheduledSeq],
        copies: list[tuple[int, int]],
        lookahead: bool = False,
        rounds: int = 1,
    ) -> None:
        """Schedules req up to `end` (its first round's tokens then, with several verify
        rounds, the later rounds' slots)."""
        bm = self.block_manager
        start = req.num_computed_tokens
        num_prompt = len(req.prompt_token_ids)  # runs per sequence per step: no properties
        num_tokens = num_prompt + len(req.output_token_ids)
        # Recomputing prompt tokens into a shared block leaves it as it was only when they are the
        # tokens it holds: not for a prefix-group member's own tokens after the shared prefix.
        copy = bm.reserve(req, end, rewrites_prompt=end <= num_prompt and not req.shared_prefix_len)
        if copy is not None:  # the block at `start` was replaced: the workers must get it anew
            copies.append(copy)
            req.last_copy_step = step_id
            block = start // self.block_size
            req.num_synced_blocks = min(req.num_synced_blocks, block)
            req.spec.block_copied(block, self.block_size)
        # Drafts may be rejected (and a later round's slots too): never cache their blocks.
        confirmed_end = end - num_draft if rounds == 1 else end - rounds * (num_draft + 1) + 1
        # A lookahead's input token is not known here yet: hash only blocks of known tokens.
        bm.register_full_blocks(req, min(confirmed_end, num_tokens))
        tokens = [PLACEHOLDER_TOKEN] if lookahead else req.token_slice(start, confirmed_end)
        spec = req.spec
        if num_draft:
            tokens.extend(spec.draft_token_ids[:num_draft])
        if spec.draft_token_ids:
            spec.draft_token_ids = []
        keep = req.num_synced_blocks
        seqs.append(
            ScheduledSeq(
                request=req,
                seq_id=req.seq_id,
                num_computed=start,
                num_scheduled=end - start,
                input_token_ids=tokens,
                table_keep=keep,
                table_append=req.block_ids[keep:],
                sample=lookahead or confirmed_end == num_tokens,
                num_draft=num_draft,
                rounds=rounds,
            )
        )
        req.pending_sample = seqs[-1].sample and not num_draft
        if seqs[-1].sample:
            spec.max_pending += rounds * (num_draft + 1)
            spec.verify_pending = num_draft > 0
            if num_draft:
                seqs[-1].shifted = lookahead and spec.verifies_in_flight > 0
                spec.verifies_in_flight += 1
        req.num_synced_blocks = len(req.block_ids)
        req.num_computed_at_step_start = start
        req.num_computed_tokens = end
        req.in_flight += 1
        req.last_scheduled_step = step_id
        self._num_in_flight += 1
        # Prefill: context (re)computed up to the last known token; decode: that token + drafts.
        prefill = 0 if lookahead else max(0, min(confirmed_end, max(num_prompt, num_tokens - 1)) - start)
        counters = self.counters
        counters.prefill_tokens += prefill
        counters.decode_tokens += end - start - prefill

    def _decode_in_place(self, req: Request, input_token: int, step_id: int, seqs: list[ScheduledSeq]) -> None:
        """Fast path of _schedule_seq(req, num_computed_tokens + 1, 0, ...): a one-token decode
        past the prompt, without drafts (its latest token, or a lookahead's placeholder), whose
        slot bm.writes_in_place so that reserve() would change nothing. It leaves the same plan
        and state as the general path (tests compare the two)."""
        start = req.num_computed_tokens
        # Only blocks of known tokens get hashed (a lookahead's input is not known yet).
        self.block_manager.register_full_blocks(req, len(req.prompt_token_ids) + len(req.output_token_ids))
        table = req.block_ids
        keep = req.num_synced_blocks
        # Positional (keyword arguments cost twice as much): request, seq_id, num_computed,
        # num_scheduled, input_token_ids, table_keep, table_append, sample, num_draft.
        seqs.append(ScheduledSeq(req, req.seq_id, start, 1, [input_token], keep, table[keep:], True, 0))
        spec = req.spec
        if spec.draft_token_ids:  # a lookahead's drafts are dropped, as in _schedule_seq
            spec.draft_token_ids = []
        spec.max_pending += 1
        spec.verify_pending = False
        req.pending_sample = True
        req.num_synced_blocks = len(table)
        req.num_computed_at_step_start = start
        req.num_computed_tokens = start + 1
        req.in_flight += 1
        req.last_scheduled_step = step_id
        self._num_in_flight += 1
        self.counters.decode_tokens += 1

    # ------------------------------------------------------------------ decode lookahead

    def _can_look_ahead(self, req: Request) -> bool:
        """Decode lookahead (one pipeline stage): schedule the next decode of a request whose
        previous plans are still in flight and will each sample exactly one token for it. Its
        input token goes out as PLACEHOLDER_TOKEN; the worker, which sampled it, fills it in on
        the device (steps run in order, so it holds the previous plan's token by then), and the
        GPU never waits for the scheduler. Only while those steps cannot end the request by
        length (a stop token may still end it: the extra steps are then dropped)."""
        pending = req.in_flight
        if not (0 < pending <= self.decode_lookahead and req.pending_sample):
            return False
        num_output = len(req.output_token_ids)  # runs per request per step: no properties
        # Within max_tokens and max_model_len even after this one: num_output + pending + 1 tokens.
        return (
            req.num_computed_tokens == len(req.prompt_token_ids) + num_output + pending - 1
            and num_output + pending < req.max_output_tokens
        )

    def _schedule_lookahead(
        self,
        req: Request,
        step_id: int,
        seqs: list[ScheduledSeq],
        copies: list[tuple[int, int]],
    ) -> bool:
        """Schedules the decode lookahead of a request _can_look_ahead admits; False when the
        free blocks do not allow it (a lookahead never preempts)."""
        bm = self.block_manager
        end = req.num_computed_tokens + 1
        if self.fast_paths and bm.writes_in_place(req):
            self._decode_in_place(req, PLACEHOLDER_TOKEN, step_id, seqs)
        elif bm.blocks_needed(req, end) <= bm.num_free_blocks:
            self._schedule_seq(req, end, 0, step_id, seqs, copies, lookahead=True)
        else:
            return False
        self.counters.lookahead_decodes += 1
        return True

    def _schedule_verify_ahead(
        self,
        req: Request,
        step_id: int,
        seqs: list[ScheduledSeq],
        copies: list[tuple[int, int]],
        budget: int,
        rounds: int = 1,
    ) -> bool:
        """Speculation's lookahead (one stage, drafts on the device): the next verify step of a
        request whose previous plans are in flight and each sample its next token(s). Its input
        is the token the last of them emits (PLACEHOLDER_TOKEN) and the drafts the last stage
        proposes after it (DEVICE_DRAFT), and it assumes every draft in flight accepted: it
        reserves slots from there, and the worker moves it back by the drafts rejected since
        (the plan's rejected_drafts). Only while even all of those accepted stays within
        max_tokens and max_model_len; False when it does not fit (a lookahead never preempts).
        rounds: verify rounds it may run (Speculation.rounds_for_plan), as many as fit too."""
        spec = req.spec
        if not 0 < req.in_flight <= self.decode_lookahead or not (req.pending_sample or spec.verify_pending):
            return False
        num_output = len(req.output_token_ids)
        if req.num_computed_tokens != len(req.prompt_token_ids) + num_output + spec.max_pending - 1:
            return False  # a prefill chunk that samples nothing is in flight
        room = req.max_output_tokens - num_output - spec.max_pending
        num_draft = min(spec.k, spec.proposed, room - 1, budget - 1)
        if num_draft < 1:
            return False
        rounds = max(1, min(rounds, room // (num_draft + 1), budget // (num_draft + 1)))
        end = req.num_computed_tokens + rounds * (num_draft + 1)
        bm = self.block_manager
        if bm.blocks_needed(req, end) > bm.num_free_blocks:
            return False
        spec.draft_token_ids = [DEVICE_DRAFT] * num_draft
        self._schedule_seq(req, end, num_draft, step_id, seqs, copies, lookahead=True, rounds=rounds)
        self.counters.lookahead_decodes += 1
        return True

    # ------------------------------------------------------------------ preemption and recovery

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: drop its KV; it re-enters the waiting queue at the front and
        later recomputes prompt + output under a fresh seq_id, losing no output."""
        self.block_manager.free(req)
        self._release_seq(req)
        self._remove_running(req)
        req.num_computed_tokens = 0
        req.spec.admitted()  # nothing of its seq_id is left (nor in flight: it was not)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self.counters.preemptions += 1

    def reset_kv(self, num_blocks: int) -> None:
        """The workers lost their KV caches (a stage was lost and the pipeline rebuilt, maybe
        with another block count): every running request is preempted at once, keeping what it
        generated, and a fresh pool replaces the old one. Each resumes by recompute and, as
        sampling derives from (seed, position), draws the tokens it would have drawn."""
        resumed = sorted(self.running, key=_arrival)
        for req in resumed:
            req.status = RequestStatus.WAITING
            req.num_preemptions += 1
        self.waiting.extendleft(reversed(resumed))
        for req in self._requests.values():  # nothing of the old pool or the old workers is left
            req.blocks = BlockTable()
            req.seq_id = None
            req.num_computed_tokens = req.num_synced_blocks = 0
            req.in_flight = 0
            req.pending_sample = False
            req.spec.forget_draft_worker()
            req.spec.admitted()
        self.sharing.reset()
        if self.spec is not None:
            self.spec.reset()
        self.running = []
        self.micro_batch_seqs = [0] * self.num_micro_batches
        self.micro_batch_plans = [0] * self.num_micro_batches
        self._num_in_flight = 0
        self._pending_releases = []
        self.counters.preemptions += len(resumed)
        old = self.block_manager
        self.block_manager = KVBlockManager(num_blocks, self.block_size, old.enable_prefix_caching, old.cache_salt)
        self.block_manager.carry_counters(old)

    # ------------------------------------------------------------------ update

    def update(
        self,
        plan: StepPlan,
        sampled: dict[int, list[int]],
        proposals: dict[int, list[int]] | None = None,
        rounds: dict[int, tuple[list[int], list[int]]] | None = None,
    ) -> list[RequestUpdate]:
        """Applies a plan's result: sampled[seq_id] holds the tokens of every sequence that
        sampled (1, or accepted drafts + 1, per verify round); proposals[seq_id] the drafts the
        last stage proposed after the step (device prompt lookup); rounds[seq_id] what each verify
        round emitted and proposed (plan_codec.split_rounds). Sequences aborted since the plan are
        ignored. An update's new_token_ids may be the list from `sampled` itself."""
        self.retire(plan)
        live: list[ScheduledSeq] = []
        for s in plan.seqs:  # validate everything before changing anything
            req = s.request
            if req.seq_id != s.seq_id or not req.in_flight:
                continue  # aborted, or finished by a stop, since the plan was built
            live.append(s)
            if not s.sample:
                continue
            tokens = sampled.get(s.seq_id)
            num_draft = s.num_draft
            most = s.rounds * (num_draft + 1)
            if tokens is None or not 1 <= len(tokens) <= most:
                raise ValueError(f"step {plan.step_id}: seq {s.seq_id} needs 1..{most} tokens, got {tokens!r}")
            if num_draft and s.input_token_ids[-1] != DEVICE_DRAFT:  # drafts the plan carried
                accepted = len(tokens) - 1
                if tokens[:accepted] != s.input_token_ids[-num_draft:][:accepted]:
                    raise ValueError(f"step {plan.step_id}: seq {s.seq_id} accepted tokens differ from its drafts")

        updates: list[RequestUpdate] = []
        self._num_in_flight -= len(live)
        spec = self.spec
        if spec is not None:
            spec.verifying_plans -= plan.verifies
        for s in live:
            req = s.request
            req.in_flight -= 1
            if not s.sample:
                continue
            tokens = sampled[s.seq_id]
            state = req.spec
            state.max_pending -= s.rounds * (s.num_draft + 1)
            if s.num_draft:
                self._verified(req, s, len(tokens), rounds.get(s.seq_id) if rounds else None)
            if proposals is not None:
                found = proposals.get(s.seq_id, ())
                state.last_proposed = len(found)
                # Drafts for the next plan (P stages, controls): only if none is in flight.
                state.returned = list(found) if not req.in_flight and not state.on_device else []
            updates.append(self._append_tokens(req, tokens))
        return updates

    def _verified(
        self, req: Request, s: ScheduledSeq, emitted: int, per_round: tuple[list[int], list[int]] | None
    ) -> None:
        """A verify step's outcome (emitted tokens; per_round: each round's tokens and the drafts
        proposed after it): roll back the rejected drafts' slots (and the blocks past the
        accepted tokens), count the acceptance, adapt the request's k."""
        rejected = s.rounds * (s.num_draft + 1) - emitted
        if rejected:  # roll back the unaccepted draft slots and their surplus blocks
            rollback(req, rejected, self.block_manager)
        spec = req.spec
        spec.rejected += rejected
        spec.verifies_in_flight -= 1
        d = s.num_draft
        # Drafts the last stage looked up (some may be missing); a draft model's are all real.
        device = s.input_token_ids[-1] == DEVICE_DRAFT and self.spec.on_device
        # Per round: the drafts that were real (the last stage found this many: its previous
        # result, then each round's own proposal), the drafts accepted.
        if per_round is None:
            outcomes = [(min(d, spec.last_proposed) if device else d, emitted - 1)]
        else:
            tokens, proposed = per_round
            found = [spec.last_proposed] + proposed
            outcomes = [(min(d, found[r]), tokens[r] - 1) for r in range(s.rounds)]
        for valid, accepted in outcomes:
            if valid:
                self.acceptance.record(valid, accepted)
            if self.spec is not None:
                self.spec.record(req, d, valid, accepted)

    def _append_tokens(self, req: Request, tokens: list[int]) -> RequestUpdate:
        out = req.output_token_ids
        if self.fast_paths and len(tokens) == 1 and tokens[0] not in req.stop_check_ids:
            # One token that cannot stop the request (most steps): of check_stop's rules, only
            # the length applies.
            new = tokens  # all of it is new: no copy (update() never changes the caller's lists)
            out.append(tokens[0])
            status = RequestStatus.FINISHED_LENGTH if len(out) >= req.max_output_tokens else None
        else:
            kept, status, stop_token_id = check_stop(req, len(out), tokens)
            new = tokens[:kept]  # tokens after a stop are dropped
            out.extend(new)
            if stop_token_id is not None:
                req.stop_token_id = stop_token_id
        if status is None:
            return RequestUpdate(req, new, False, _RUNNING, None)
        self._finish(req, status)
        return RequestUpdate(req, new, True, status.value, req.stop_token_id)

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
        if req.parent_id:
            self.sharing.finished(req, self.block_manager)
        self.counters.finished += 1

    def _release_seq(self, req: Request) -> None:
        self._pending_releases.append(req.seq_id)
        if self.spec is not None:
            self.spec.release(req)
        req.seq_id = None

    def _remove_running(self, req: Request) -> None:
        index = bisect.bisect_left(self.running, req.arrival, key=_arrival)
        assert self.running[index] is req
        del self.running[index]
        self.micro_batch_seqs[req.micro_batch] -= 1

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
        self.counters.fill_stats(stats)
        self.acceptance.fill_stats(stats)
