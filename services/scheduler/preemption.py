"""Preemption by recompute: room made for a request by dropping the KV of later arrivals (or its
own), and the reset after a lost stage, where every running request resumes by recompute with
the tokens it would have drawn. Part of the Scheduler (scheduler.py), as a mixin over the core's
state."""

from __future__ import annotations

import bisect

from strata.services.scheduler.block_manager import BlockTable, KVBlockManager
from strata.services.scheduler.request import Request, RequestStatus, arrival_of


class Preemption:
    """The Scheduler's preemption and reset (module docstring)."""

    def _make_room(self, req: Request, end: int, index: int | None, lookahead: bool = False) -> tuple[bool, bool]:
        """Frees blocks until req can compute up to `end`, preempting the latest-arrived
        running requests not in flight (those after `index`, req's place in the running list,
        found here when None; then req itself).
        Returns (req still runs, someone was preempted). lookahead: req is in flight (a chunk
        following its previous one), so it preempts nobody and is not preempted: (False, False)."""
        bm = self.block_manager
        preempted = False
        if lookahead:
            return bm.blocks_needed(req, end) <= bm.num_free_blocks, False
        while bm.blocks_needed(req, end) > bm.num_free_blocks:
            if index is None:
                index = bisect.bisect_left(self.running, req.arrival, key=arrival_of)
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
        resumed = sorted(self.running, key=arrival_of)
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
        self._running_shared = 0
        self._reset_micro_batches()
        self._num_in_flight = 0
        self._pending_releases = []
        self.counters.preemptions += len(resumed)
        old = self.block_manager
        self.block_manager = KVBlockManager(num_blocks, self.block_size, old.enable_prefix_caching, old.cache_salt)
        self.block_manager.carry_counters(old)
