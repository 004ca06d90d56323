"""Scheduling policy: continuous batching with chunked prefill, paged KV, prefix sharing,
preemption by recompute, several plans in flight over disjoint requests. Pure Python, no RPC.

The engine loop calls schedule() to get a plan, sends it, and later hands the plan's sampled
tokens to update(). A request is in at most one plan in flight; num_computed_tokens advances
when a plan is built (the KV of those tokens lands before any later plan runs, as every stage
executes plans in step order), and rejected draft tokens roll it back in update().
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from strata.protocol import DRAFT_PLACEHOLDER, PLACEHOLDER_TOKEN
from strata.services.scheduler.block_manager import BlockTable, KVBlockManager, cdiv
from strata.services.scheduler.ngram_proposer import NgramProposer
from strata.services.scheduler.plan import RequestUpdate, ScheduledSeq, StepPlan
from strata.services.scheduler.request import Request, RequestStatus
from strata.v1 import engine_pb2

_HOLD = object()  # admission verdict: wait for a sibling's prompt instead of computing it again
_RUNNING = engine_pb2.FINISH_REASON_UNSPECIFIED
# After a prompt lookup finds nothing, the request decodes this many tokens (pipelined with decode
# lookahead) before it looks again.
NGRAM_RETRY_TOKENS = 8


def _arrival(req: Request) -> int:
    return req.arrival


def _common_prefix_len(a: list[int], b: list[int], guess: int) -> int:
    """Length of the common leading run of a and b. Checked first at `guess` (the previous
    neighbours' run: a group's members all share the same one), then by binary search, each
    probe one C-level slice compare: os.path.commonprefix walked the lists in Python, ~3 ms a
    step for 512 sequences of 125-block prefixes, on the scheduler's critical path."""
    n = min(len(a), len(b))
    g = min(guess, n)
    if a[:g] == b[:g]:
        if g == n or a[g] != b[g]:
            return g
        lo, hi = g + 1, n
    else:
        lo, hi = 0, g - 1
    while lo < hi:  # invariant: a[:lo] == b[:lo], and a[:hi + 1] != b[:hi + 1] unless hi == n
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def group_shared_prefixes(plan: StepPlan, block_size: int) -> None:
    """Finds the plan's sequences that share leading KV blocks, so attention reads each shared
    prefix once per group (cascade attention), and makes each group's members consecutive.

    Sharing is read from the block tables themselves, over the full blocks before each
    sequence's first query token (a prefix must lie wholly in the cache). Sorted by those block
    ids, sequences that share blocks are adjacent, and two neighbours share exactly their common
    leading run (BatchLLM's sort plus longest common prefix). A family is cut from its neighbour
    where that run falls below half of the runs on either side: unrelated requests that only
    share a chat template's first block must not shorten a family's prefix to that block."""
    by_first_block: dict[int, list[ScheduledSeq]] = {}
    for s in plan.seqs:
        table = s.request.blocks.block_ids
        if table and s.num_computed >= block_size:
            by_first_block.setdefault(table[0], []).append(s)
    groups: list[tuple[int, list[ScheduledSeq]]] = []  # (prefix blocks, members)
    for candidates in by_first_block.values():
        if len(candidates) < 2:
            continue
        keys = sorted(
            ((s.request.blocks.block_ids[: s.num_computed // block_size], s) for s in candidates),
            key=lambda pair: pair[0],
        )
        common = []
        for (a, _), (b, _) in zip(keys, keys[1:]):
            common.append(_common_prefix_len(a, b, common[-1] if common else 0))
        run = [keys[0][1]]
        for i, shared in enumerate(common):
            neighbours = max(common[i - 1] if i else 0, common[i + 1] if i + 1 < len(common) else 0)
            if 2 * shared < neighbours:  # a cut: close the run
                groups.append((min(common[i - len(run) + 1 : i], default=0), run))
                run = []
            run.append(keys[i + 1][1])
        groups.append((min(common[len(common) - len(run) + 1 :], default=0), run))
    groups = [(blocks, members) for blocks, members in groups if len(members) >= 2 and blocks > 0]
    if not groups:
        return
    group_of = {s.seq_id: g + 1 for g, (_, members) in enumerate(groups) for s in members}
    plan.seqs = [s for s in plan.seqs if s.seq_id not in group_of] + [s for _, members in groups for s in members]
    plan.shared_prefix_group = [group_of.get(s.seq_id, 0) for s in plan.seqs]
    plan.shared_prefix_lens = [blocks * block_size for blocks, _ in groups]


@dataclass
class PrefixGroup:
    """An explicit prefix group (EngineRequest.group_size): admitted together, prefix pinned."""

    size: int  # members still expected to run (aborted ones before the start no longer count)
    started: bool = False
    pinned: list[int] = field(default_factory=list)  # full prefix blocks held until the last member ends


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes, how many tokens, and up to which batch it pays."""

    method: str  # "ngram" (prompt lookup, here) or "draft" (a draft model's worker)
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    max_batch: int = 32  # running requests above this decode without drafts

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"unknown speculative method {self.method!r}")
        if self.num_speculative_tokens < 1 or self.max_batch < 0:
            raise ValueError("num_speculative_tokens >= 1 and max_batch >= 0")


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
    ) -> None:
        self.decode_lookahead = decode_lookahead  # decodes ahead of their input token (0: off)
        self.cascade_attention = cascade_attention  # plans list the sequences sharing prefix blocks
        self.speculation = speculation
        # ngram drafts come from here; a draft model's drafts are DRAFT_PLACEHOLDERs that the engine
        # fills in from the draft worker before it sends the plan (all k or none, so that one
        # call of k steps serves every sequence).
        self._ngram = None
        if speculation is not None and speculation.method == "ngram":
            self._ngram = NgramProposer(
                speculation.num_speculative_tokens, speculation.ngram_min, speculation.ngram_max
            )
        self.draft_releases: list[int] = []  # seq ids the draft worker may drop (draft method)
        self._lookaheads = 0
        # Shortcuts for the steady state (a decode whose blocks need no work, one sampled token
        # that cannot stop its request). They give the same plans and outputs as the general
        # path; False sends every step through the general path (tests compare the two).
        self.fast_paths = True
        if max_model_len <= 1 or max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError("max_model_len > 1, max_num_seqs > 0, max_num_batched_tokens > 0")
        if num_blocks * block_size < max_model_len:
            # A lone request must always fit, or it could never finish.
            raise ValueError(f"{num_blocks} blocks of {block_size} tokens cannot hold max_model_len={max_model_len}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = KVBlockManager(num_blocks, block_size, enable_prefix_caching, cache_salt)

        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival: preemption victims come from the end
        self._requests: dict[str, Request] = {}  # unfinished, by request_id
        self._groups: dict[str, list[Request]] = {}  # parent_id -> unfinished children or group members
        self._prefix_groups: dict[str, PrefixGroup] = {}  # explicit prefix groups, by parent_id
        self._reserved_blocks = 0  # promised to members of started groups not admitted yet
        self._pending_releases: list[int] = []
        self._num_in_flight = 0
        self._verifying_plans = 0  # plans in flight that verify drafts
        self._next_seq_id = 1
        self._next_step_id = 1
        self._next_arrival = 0
        self._prefill_tokens = 0
        self._decode_tokens = 0
        self._steps = 0
        self._preemptions = 0
        self._finished = 0
        self._spec_drafts = 0
        self._spec_draft_tokens = 0
        self._spec_accepted = [0] * (speculation.num_speculative_tokens if speculation else 0)

    # ------------------------------------------------------------------ requests

    def add_request(self, req: Request) -> None:
        try:
            self._check_request(req)
        except ValueError:
            self._member_rejected(req)
            raise
        req.arrival = self._next_arrival
        req.arrival_time = time.monotonic()
        self._next_arrival += 1
        req.max_output_tokens = min(req.max_tokens, self.max_model_len - req.num_prompt_tokens)
        req.stop_check_ids = req.stop_token_ids if req.ignore_eos else req.stop_token_ids | req.eos_token_ids
        self._requests[req.request_id] = req
        if req.parent_id:
            self._groups.setdefault(req.parent_id, []).append(req)
            if req.group_size and req.parent_id not in self._prefix_groups:
                self._prefix_groups[req.parent_id] = PrefixGroup(req.group_size)
        self.waiting.append(req)

    def _member_rejected(self, req: Request) -> None:
        """A prefix group's other members no longer wait for a member that was rejected."""
        if not req.group_size or req.parent_id in self._groups and req in self._groups[req.parent_id]:
            return
        group = self._prefix_groups.setdefault(req.parent_id, PrefixGroup(req.group_size))
        group.size -= 1
        if group.size <= 0 and req.parent_id not in self._groups:
            del self._prefix_groups[req.parent_id]

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
            self._check_sibling(req)

    def _check_sibling(self, req: Request) -> None:
        """Requests that share a parent share their first shared_len tokens: checked once here,
        so admission can take a sibling's blocks without comparing tokens."""
        if req.shared_prefix_len >= req.num_prompt_tokens:
            raise ValueError("shared_prefix_len must leave at least one prompt token of the request's own")
        if req.group_size and not req.shared_prefix_len:
            raise ValueError("a prefix group's members need shared_prefix_len")
        siblings = self._groups.get(req.parent_id)
        if not siblings:
            return
        first = siblings[0]
        n = req.shared_len
        if (
            n != first.shared_len
            or req.group_size != first.group_size
            or req.prompt_token_ids[:n] != first.prompt_token_ids[:n]
        ):
            raise ValueError(
                f"requests of {req.parent_id!r} must share their first {first.shared_len} tokens "
                f"and group_size {first.group_size}"
            )
        group = self._prefix_groups.get(req.parent_id)
        if group is not None and (group.started or len(siblings) >= group.size):
            raise ValueError(f"prefix group {req.parent_id!r} already has its {group.size} members")

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

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> StepPlan | None:
        """Builds the next plan from requests not in flight, or None when none can run now."""
        step_id = self._next_step_id
        budget = self.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        copies: list[tuple[int, int]] = []
        new_requests: list[Request] = []
        preempted = False
        bm = self.block_manager

        # 1. Running requests first: decodes and unfinished prefill chunks, in arrival order.
        running = self.running  # preemption shrinks it in place: its length is read every time
        spec = self.speculation
        speculate = spec is not None and len(running) <= spec.max_batch
        # One stage keeps several plans in flight for decode lookahead, which speculating requests
        # do not get. Scheduled as they come back, requests would split into cohorts, one per
        # plan, each paying a whole step; instead, while a verification is in flight, every decode
        # waits for it (no lookahead either), and the next plan holds them all.
        merge_cohorts = speculate and self.decode_lookahead > 0 and self._verifying_plans > 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            out = req.output_token_ids
            # A request due to speculate gets no decode lookahead: it must come back from its plan
            # in flight, so that a proposal can follow its latest token.
            spec_due = speculate and len(out) >= req.spec_retry_at
            if req.in_flight:
                if (
                    not spec_due
                    and not merge_cohorts
                    and self._can_look_ahead(req)
                    and self._schedule_lookahead(req, step_id, seqs, copies)
                ):
                    budget -= 1
                i += 1
                continue
            decoding = out and req.num_computed_tokens == len(req.prompt_token_ids) + len(out) - 1
            if decoding and merge_cohorts:
                i += 1  # joins the next plan with the requests verifying now: one step for all
                continue
            if spec_due and decoding:
                self._propose(req)
            if (
                self.fast_paths
                and out
                and not req.draft_token_ids
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
            end = req.num_computed_tokens + num_new
            if num_draft and bm.blocks_needed(req, end) > bm.num_free_blocks:
                end -= num_draft  # drafts are optional: drop them before preempting anyone
                num_new -= num_draft
                num_draft = 0
            fits, evicted = self._make_room(req, end, i)
            preempted = preempted or evicted
            if not fits:
                continue  # req itself was preempted; running[i] is now the next request
            self._schedule_seq(req, end, num_draft, step_id, seqs, copies)
            budget -= num_new
            i += 1

        # 2. Waiting requests, FCFS. After a preemption, admitting new work would only thrash.
        held: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not (preempted and seqs):
            req = self.waiting.popleft()
            admitted = self._admit(req, step_id, budget, seqs, copies)
            if admitted is _HOLD:
                held.append(req)
                continue
            if admitted is None:
                self.waiting.appendleft(req)  # not enough blocks: keep its place in line
                break
            new_requests.append(req)
            budget -= admitted
        self.waiting.extendleft(reversed(held))

        if not seqs:
            return None
        plan = StepPlan(step_id, new_requests, self._pending_releases, seqs, copies)
        plan.verifies = any(s.num_draft for s in seqs)
        self._verifying_plans += plan.verifies
        if self.cascade_attention and any(s.request.num_shared_blocks for s in seqs):
            group_shared_prefixes(plan, self.block_size)
        self._pending_releases = []
        self._next_step_id += 1
        self._steps += 1
        return plan

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
        self._lookaheads += 1
        return True

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
        if req.draft_token_ids:  # a lookahead's drafts are dropped, as in _schedule_seq
            req.draft_token_ids = []
        req.pending_sample = True
        req.num_synced_blocks = len(table)
        req.num_computed_at_step_start = start
        req.num_computed_tokens = start + 1
        req.in_flight += 1
        req.last_scheduled_step = step_id
        self._num_in_flight += 1
        self._decode_tokens += 1

    def _propose(self, req: Request) -> None:
        """Drafts for a request about to decode its latest token, as long as even all of them
        accepted (plus the bonus token) stays within max_tokens and max_model_len."""
        room = req.max_output_tokens - len(req.output_token_ids) - 1
        if self._ngram is not None:
            req.draft_token_ids = self._ngram.propose(req, room)
            if not req.draft_token_ids:  # nothing to look up: decode (with lookahead) for a while
                req.spec_retry_at = len(req.output_token_ids) + NGRAM_RETRY_TOKENS
        elif room >= self.speculation.num_speculative_tokens:
            req.draft_token_ids = [DRAFT_PLACEHOLDER] * self.speculation.num_speculative_tokens

    def _tokens_to_compute(self, req: Request, budget: int) -> tuple[int, int]:
        """(tokens to compute this step including drafts, drafts) for a running request."""
        remaining = req.num_tokens - req.num_computed_tokens
        drafts = req.draft_token_ids
        if remaining > 1 or not drafts:
            return min(remaining, budget), 0
        # Decode with speculation: the drafts ride behind the last sampled token, as long as even
        # all of them accepted (plus the bonus token) stays within max_tokens and max_model_len.
        room = req.max_output_tokens - len(req.output_token_ids)
        num_draft = max(0, min(len(drafts), budget - 1, room - 1))
        if num_draft < len(drafts) and drafts[0] == DRAFT_PLACEHOLDER:
            num_draft = 0  # a draft model proposes k tokens or none
        return 1 + num_draft, num_draft

    def _make_room(self, req: Request, end: int, index: int) -> tuple[bool, bool]:
        """Frees blocks until req can compute up to `end`, preempting the latest-arrived
        running requests not in flight (those after `index`, then req itself).
        Returns (req still runs, someone was preempted)."""
        bm = self.block_manager
        preempted = False
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
        scheduled, _HOLD to wait for a sibling (or a prefix group's other members), or None when
        its blocks do not fit now."""
        bm = self.block_manager
        group = self._prefix_groups.get(req.parent_id) if req.group_size else None
        if group is not None and not group.started:
            verdict = self._start_group(req.parent_id, group)
            if verdict is not True:
                return verdict
        first_admission = req.num_preemptions == 0
        shared, num_computed, from_cache = [], 0, True
        if req.parent_id:
            found = self._shared_prefix(req, step_id, first_admission, group)
            if found is _HOLD:
                return _HOLD
            if found is not None:
                (shared, num_computed), from_cache = found, False
        if from_cache:
            shared = bm.lookup(req)
            num_computed = len(shared) * self.block_size
        end = num_computed + min(req.num_tokens - num_computed, budget)
        free = bm.num_free_blocks - (self._reserved_blocks - req.reserved_blocks)
        if bm.admission_cost(shared, num_computed, end) > free:
            return None

        bm.acquire(req, shared, cached=from_cache)
        self._reserved_blocks -= req.reserved_blocks
        req.reserved_blocks = 0
        req.num_shared_blocks = num_computed // self.block_size  # full blocks it did not compute
        req.num_computed_tokens = num_computed
        if first_admission:
            req.num_cached_prompt_tokens = num_computed
            req.queue_seconds = time.monotonic() - req.arrival_time
            bm.record_prefix_query(req.num_prompt_tokens, num_computed)
        req.seq_id = self._next_seq_id
        self._next_seq_id += 1
        req.num_synced_blocks = 0
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=_arrival)
        self._schedule_seq(req, end, 0, step_id, seqs, copies)
        return end - num_computed

    def _shared_prefix(
        self, req: Request, step_id: int, first_admission: bool, group: PrefixGroup | None
    ) -> tuple[list[int], int] | object | None:
        """The blocks and token count req takes from its siblings instead of computing them:
        a running sibling's, once an earlier plan wrote them (copying the shared partial block on
        write), else a prefix group's pinned full blocks. _HOLD while a sibling is still
        computing them; None when req must compute them itself."""
        need = req.shared_len
        if first_admission:
            source = self._sibling_source(req, need, step_id)
            if isinstance(source, Request):
                return source.blocks.block_ids[: cdiv(need, self.block_size)], need
            if source is _HOLD and not (group and group.pinned):
                return _HOLD
        if group is not None and group.pinned:
            return list(group.pinned), len(group.pinned) * self.block_size
        return None

    def _sibling_source(self, req: Request, need: int, step_id: int) -> Request | object | None:
        """A running sibling whose shared prefix (need tokens) is written by an earlier plan:
        share it. _HOLD while a sibling is still computing it; None when no sibling is running."""
        computing = False
        for other in self._groups.get(req.parent_id, ()):
            if other is req or other.status is not RequestStatus.RUNNING:
                continue
            # Copies run before the step, so what this step adds does not count, nor a table
            # whose block this step copies (the copy's contents do not exist yet).
            if other.last_scheduled_step != step_id:
                written = other.num_computed_tokens
            elif other.last_copy_step != step_id:
                written = other.num_computed_at_step_start
            else:
                written = 0
            if written >= need:
                group = self._prefix_groups.get(req.parent_id)
                if group is not None and not group.pinned:
                    self._pin(group, other.blocks.block_ids[: need // self.block_size])
                return other
            computing = True
        return _HOLD if computing else None

    # ------------------------------------------------------------------ prefix groups

    def _start_group(self, parent_id: str, group: PrefixGroup) -> bool | object | None:
        """A prefix group starts once all of its members arrived and its prefix plus every
        member's own first blocks fit beside what started groups hold in reserve. True: start
        (the blocks of the members admitted later are reserved); _HOLD: members are missing;
        None: not enough free blocks yet."""
        members = self._groups[parent_id]
        if len(members) < group.size:
            return _HOLD
        bs = self.block_size
        shared_blocks = members[0].shared_len // bs
        own = [cdiv(m.num_prompt_tokens, bs) - shared_blocks for m in members]
        if shared_blocks + sum(own) > self.block_manager.num_blocks:
            # More than the whole cache: with every member's blocks reserved it could never start.
            # Only its prefix is held; its members compete for blocks as other requests do.
            own = [0] * len(own)
        if shared_blocks + sum(own) > self.block_manager.num_free_blocks - self._reserved_blocks:
            return None
        group.started = True
        for member, blocks in zip(members, own):
            member.reserved_blocks = blocks
            self._reserved_blocks += blocks
        return True

    def _pin(self, group: PrefixGroup, blocks: list[int]) -> None:
        """Keeps the group's full prefix blocks out of the free queue until its last member ends."""
        if blocks:
            self.block_manager.pin(blocks)
            group.pinned = list(blocks)

    def _schedule_seq(
        self,
        req: Request,
        end: int,
        num_draft: int,
        step_id: int,
        seqs: list[ScheduledSeq],
        copies: list[tuple[int, int]],
        lookahead: bool = False,
    ) -> None:
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
            # The draft's copy of that block is not copied: it recomputes the block's tokens.
            req.draft_synced_blocks = min(req.draft_synced_blocks, block)
            req.draft_computed = min(req.draft_computed, block * self.block_size)
        confirmed_end = end - num_draft  # drafts may be rejected: never cache their blocks
        # A lookahead's input token is not known here yet: hash only blocks of known tokens.
        bm.register_full_blocks(req, min(confirmed_end, num_tokens))
        tokens = [PLACEHOLDER_TOKEN] if lookahead else req.token_slice(start, confirmed_end)
        if num_draft:
            tokens.extend(req.draft_token_ids[:num_draft])
        if req.draft_token_ids:
            req.draft_token_ids = []
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
            )
        )
        req.pending_sample = seqs[-1].sample and not num_draft
        req.num_synced_blocks = len(req.block_ids)
        req.num_computed_at_step_start = start
        req.num_computed_tokens = end
        req.in_flight += 1
        req.last_scheduled_step = step_id
        self._num_in_flight += 1
        # Prefill: context (re)computed up to the last known token; decode: that token + drafts.
        prefill = 0 if lookahead else max(0, min(confirmed_end, max(num_prompt, num_tokens - 1)) - start)
        self._prefill_tokens += prefill
        self._decode_tokens += end - start - prefill

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: drop its KV; it re-enters the waiting queue at the front and
        later recomputes prompt + output under a fresh seq_id, losing no output."""
        self.block_manager.free(req)
        self._release_seq(req)
        self._remove_running(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        self._preemptions += 1

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
            req.seq_id = req.draft_seq_id = None
            req.num_computed_tokens = req.num_synced_blocks = req.draft_synced_blocks = req.draft_computed = 0
            req.in_flight = 0
            req.pending_sample = False
            req.draft_token_ids = []
        for group in self._prefix_groups.values():
            group.pinned = []
        self.running = []
        self._num_in_flight = 0
        self._verifying_plans = 0
        self._pending_releases = []
        self.draft_releases = []
        self._preemptions += len(resumed)
        old = self.block_manager
        self.block_manager = KVBlockManager(num_blocks, self.block_size, old.enable_prefix_caching, old.cache_salt)
        self.block_manager.carry_counters(old)

    # ------------------------------------------------------------------ update

    def update(self, plan: StepPlan, sampled: dict[int, list[int]]) -> list[RequestUpdate]:
        """Applies a plan's result: sampled[seq_id] holds the tokens of every sequence that
        sampled (1, or accepted drafts + 1). Sequences aborted since the plan are ignored.
        An update's new_token_ids may be the list from `sampled` itself."""
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
            if tokens is None or not 1 <= len(tokens) <= num_draft + 1:
                raise ValueError(f"step {plan.step_id}: seq {s.seq_id} needs 1..{num_draft + 1} tokens, got {tokens!r}")
            if num_draft:
                accepted = len(tokens) - 1
                if tokens[:accepted] != s.input_token_ids[-num_draft:][:accepted]:
                    raise ValueError(f"step {plan.step_id}: seq {s.seq_id} accepted tokens differ from its drafts")

        updates: list[RequestUpdate] = []
        self._num_in_flight -= len(live)
        self._verifying_plans -= plan.verifies
        for s in live:
            req = s.request
            req.in_flight -= 1
            if not s.sample:
                continue
            tokens = sampled[s.seq_id]
            if s.num_draft:
                rejected = s.num_draft - (len(tokens) - 1)
                if rejected:  # roll back the unaccepted draft slots and their surplus blocks
                    req.num_computed_tokens -= rejected
                    kept = cdiv(req.num_computed_tokens, self.block_size)
                    self.block_manager.truncate(req, kept)
                    req.num_synced_blocks = min(req.num_synced_blocks, kept)
                    req.draft_synced_blocks = min(req.draft_synced_blocks, kept)
                accepted = len(tokens) - 1
                self._spec_drafts += 1
                self._spec_draft_tokens += s.num_draft
                if accepted > len(self._spec_accepted):
                    self._spec_accepted.extend([0] * (accepted - len(self._spec_accepted)))
                for position in range(accepted):
                    self._spec_accepted[position] += 1
            updates.append(self._append_tokens(req, tokens))
        return updates

    def _append_tokens(self, req: Request, tokens: list[int]) -> RequestUpdate:
        out = req.output_token_ids
        status = None
        if self.fast_paths and len(tokens) == 1 and tokens[0] not in req.stop_check_ids:
            # One token that cannot stop the request (most steps): only the length rule applies.
            new = tokens  # all of it is new: no copy (update() never changes the caller's lists)
            out.append(tokens[0])
            if len(out) >= req.max_output_tokens:
                status = RequestStatus.FINISHED_LENGTH
        else:
            new = []
            # Runs for every sequence of every step: plain locals, no properties.
            can_stop_eos = not req.ignore_eos and req.eos_token_ids
            stop_ids, min_tokens, max_out = req.stop_token_ids, req.min_tokens, req.max_output_tokens
            for token in tokens:
                can_stop = len(out) >= min_tokens  # min_tokens come out before any stop
                out.append(token)
                new.append(token)
                if can_stop and can_stop_eos and token in can_stop_eos:
                    status = RequestStatus.FINISHED_STOPPED
                elif can_stop and stop_ids and token in stop_ids:
                    status = RequestStatus.FINISHED_STOPPED
                    req.stop_token_id = token
                elif len(out) >= max_out:
                    status = RequestStatus.FINISHED_LENGTH
                if status is not None:
                    break  # tokens after a stop are dropped
        if status is None:
            return RequestUpdate(req, new, False, _RUNNING, None)
        self._finish(req, status)
        return RequestUpdate(req, new, True, status.value, req.stop_token_id)

    # ------------------------------------------------------------------ bookkeeping

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING:
            self._keep_group_prefix(req)
            self.block_manager.free(req)
            self._release_seq(req)
            self._remove_running(req)
            self._num_in_flight -= req.in_flight
            req.in_flight = 0
        req.status = status
        req.draft_token_ids = []
        if self._ngram is not None:
            self._ngram.forget(req)
        del self._requests[req.request_id]
        self._reserved_blocks -= req.reserved_blocks
        req.reserved_blocks = 0
        if req.parent_id:
            siblings = self._groups[req.parent_id]
            siblings.remove(req)
            group = self._prefix_groups.get(req.parent_id)
            if group is not None and not group.started:
                group.size -= 1  # cancelled before the start: the others no longer wait for it
            if not siblings:
                del self._groups[req.parent_id]
                if group is not None:
                    self.block_manager.unpin(group.pinned)
                    del self._prefix_groups[req.parent_id]
        self._finished += 1

    def _keep_group_prefix(self, req: Request) -> None:
        """A prefix group's member that ends before anyone pinned the prefix (one that finishes in
        its prefill step, or the only one running when the group is larger than the cache) pins
        the prefix blocks it computed for the members still to run."""
        group = self._prefix_groups.get(req.parent_id) if req.group_size else None
        if group is None or group.pinned or len(self._groups[req.parent_id]) < 2:
            return
        full = req.shared_len // self.block_size
        if req.num_computed_tokens >= full * self.block_size:
            self._pin(group, req.blocks.block_ids[:full])

    def _release_seq(self, req: Request) -> None:
        self._pending_releases.append(req.seq_id)
        if req.draft_seq_id is not None:
            self.draft_releases.append(req.draft_seq_id)
            req.draft_seq_id = None
        req.seq_id = None

    def _remove_running(self, req: Request) -> None:
        index = bisect.bisect_left(self.running, req.arrival, key=_arrival)
        assert self.running[index] is req
        del self.running[index]

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
        stats.lookahead_decodes = self._lookaheads
        stats.prefix_cache_queries = bm.prefix_cache_queries
        stats.prefix_cache_hits = bm.prefix_cache_hits
        stats.prefill_tokens_computed = self._prefill_tokens
        stats.decode_tokens_computed = self._decode_tokens
        stats.steps = self._steps
        stats.preemptions = self._preemptions
        stats.finished_requests = self._finished
        stats.spec_decode_drafts = self._spec_drafts
        stats.spec_decode_draft_tokens = self._spec_draft_tokens
        stats.spec_decode_accepted_tokens = sum(self._spec_accepted)
        stats.spec_decode_accepted_per_position.extend(self._spec_accepted)
        if self._spec_draft_tokens:
            stats.spec_decode_acceptance_rate = sum(self._spec_accepted) / self._spec_draft_tokens
