"""Admission: a waiting request gets a seat and its first chunk (its shared or cached prefix
found first); with micro-batches a first chunk that samples needs a seat in the plan's micro-batch
(micro_batches.py). Part of the Scheduler (scheduler.py),
as a mixin over the core's state: the running list, the block manager, prefix sharing."""

from __future__ import annotations

import bisect
import time

from strata.services.scheduler.plan import ScheduledSeq
from strata.services.scheduler.prefix_sharing import HOLD, NO_ROOM
from strata.services.scheduler.request import Request, RequestStatus, arrival_of


class Admission:
    """The Scheduler's admission of waiting requests (module docstring)."""

    def _admit(
        self,
        req: Request,
        step_id: int,
        budget: int,
        seqs: list[ScheduledSeq],
        copies: list[tuple[int, int]],
        may_sample: bool = True,
    ) -> int | object | None:
        """Admits a waiting request and schedules its first chunk (one that samples only if
        may_sample). Returns the tokens it scheduled, HOLD to wait for a sibling (or a prefix
        group's other members), or None when its blocks (or, without may_sample, a chunk) do
        not fit now."""
        bm = self.block_manager
        found = None
        if req.parent_id or req.group_size:
            free_seats = self._seat_limit() - len(self.running) - self.sharing.reserved_seats
            found = self.sharing.shared_prefix(req, step_id, bm, free_seats)
        asks = req.prompt_logprobs is not None and not req.prompt_logprobs.complete
        if found is HOLD and asks and not req.group_size:
            found = None  # it computes its prompt itself (no logits in a sibling's blocks): no wait
        if found is HOLD:
            return HOLD
        if found is NO_ROOM:
            return None
        if found is not None:  # a sibling's blocks, or its prefix group's pinned prefix
            shared, num_computed = found
        else:
            shared = bm.lookup(req)
            num_computed = len(shared) * self.block_size
        if req.prompt_logprobs is not None:  # prompt positions it still needs rows of are computed
            req.prompt_logprobs.admitted()
            num_computed = req.prompt_logprobs.readable_prefix(num_computed, self.block_size)
            shared = shared[: -(-num_computed // self.block_size)]
        end = num_computed + min(req.num_tokens - num_computed, budget)
        if end == req.num_tokens and not may_sample:
            end -= 1  # all but the last token: its final chunk waits for a seat
            if end <= num_computed:
                return None
        free = bm.num_free_blocks - self.sharing.reserved_for_others(req)
        if bm.admission_cost(shared, num_computed, end) > free:
            return None

        bm.acquire(req, shared, cached=found is None)
        self.sharing.admitted(req)
        req.sharing.num_shared_blocks = num_computed // self.block_size  # full blocks it did not compute
        self._running_shared += req.sharing.num_shared_blocks > 0
        req.num_computed_tokens = num_computed
        if req.num_preemptions == 0:  # first admission
            # (a request resumed from a lost replica may find its output's blocks too)
            req.num_cached_prompt_tokens = min(num_computed, req.num_prompt_tokens)
            req.queue_seconds = time.monotonic() - req.arrival_time
            bm.record_prefix_query(req.num_prompt_tokens, req.num_cached_prompt_tokens)
        req.seq_id = self._next_seq_id
        self._next_seq_id += 1
        if self.spec is not None:
            self.spec.admit(req)
        req.num_synced_blocks = 0
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=arrival_of)
        self._schedule_seq(req, end, 0, step_id, seqs, copies)
        return end - num_computed
