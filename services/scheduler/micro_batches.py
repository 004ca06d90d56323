"""Micro-batches of a pipeline (P > 1 stages, pipelined decode): how many run, which requests each
holds, and how prefill is shared out so that the plans of a round carry about equal work. Part of
the Scheduler (scheduler.py), as a mixin over the core's state. With one micro-batch slot (one
stage) none of this runs and the core plans as it always did.

Why: every stage runs each micro-batch's plan in turn, and a micro-batch's next decode starts
only once its previous plan has crossed all P stages. A plan heavier than the others holds every
stage up (the others' plans queue behind it downstream, and stage 0 runs dry while its tokens
travel); a micro-batch thinner than it need be makes each stage read its weights once more per
round for few tokens; one that holds more sequences than the others paces the round.

- How many (m, `active_micro_batches`): one while P micro-batches would hold fewer than
  micro_batch_min_seqs each (a small batch's step costs the weights' read whatever its size, and
  a lone micro-batch's chain of lookaheads keeps the stages as busy); P while P of them seat the
  load (each stage then runs P steps of N/P sequences a round instead of one of N, never slower
  on P GPUs); more, up to num_micro_batches (P + 2 by default), only when the load needs more
  seats (the extra ones also cover a plan's round trip: through the stages, its result to the
  scheduler, the next plan back to stage 0). More at once; fewer only
  once the smaller count has held, with a margin, for SHRINK_AFTER_PLANS plans.
- Seats: each micro-batch seats an equal share of the load, at most max_num_seqs, so each holds
  as many sequences as one stage would run.
- The prefill pool (`prefilling`): a request whose prompt (or recompute) is unfinished belongs
  to no micro-batch yet. Its chunks that sample nothing ride any plan, since every stage runs
  plans in step order (the KV is written before the next chunk reads it), under a quota per
  plan: a round's share, (pending prefill + what the previous m - 1 plans took) / m, so that a
  prompt rides the round's m plans in equal parts. Its final chunk, which samples, rides a plan
  of a micro-batch with a free seat, which becomes its home.
- Turns: the micro-batches' plans take turns; one whose turn it is but whose plans in flight are
  at the limit is waited for (two plans of one micro-batch side by side would make the second
  wait on every stage for the first one's tokens).
- Rebalancing: a micro-batch past its share (plus slack), or one no longer active, gives up its
  latest arrivals; once their plans in flight are back (about a round), each joins the
  micro-batch that holds fewest. No recompute: micro-batches exist only in the scheduler.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque

from strata.services.scheduler.request import Request, arrival_of

PREFILLING = -1  # req.micro_batch of a request in the prefill pool
MIGRATING = -2  # req.micro_batch of a request between micro-batches

# The smallest prefill quota of a plan: a smaller chunk would cost each stage a step's fixed work
# (weights read, host) for few tokens.
MIN_PREFILL_QUOTA = 256
# Fewer micro-batches only after the smaller count was wanted this many plans in a row, with
# SHRINK_MARGIN to spare: shrinking moves requests (a round each), so a load that hovers at a
# threshold must not flap.
SHRINK_AFTER_PLANS = 64
SHRINK_MARGIN = 1.1


class MicroBatches:
    """The Scheduler's micro-batches (module docstring)."""

    def _init_micro_batches(self, count: int, min_seqs: int, stages: int) -> None:
        if count < 1 or min_seqs < 1:
            raise ValueError("num_micro_batches and micro_batch_min_seqs must be >= 1")
        self.num_micro_batches = count  # the most that may run (the engine's plans in flight follow it)
        self.micro_batch_min_seqs = min_seqs
        self.pipeline_stages = max(1, stages)
        self.active_micro_batches = 1
        self.micro_batch_members: list[list[Request]] = [[] for _ in range(count)]  # homed, by arrival
        self.prefilling: list[Request] = []  # the prefill pool, by arrival
        self._migrating: list[Request] = []  # left their micro-batch; re-homed once nothing is in flight
        # Plans in flight per micro-batch, at most decode_lookahead + 1: a micro-batch's requests
        # are each in every one of its plans in flight. With more (the engine allows two per
        # micro-batch), a lone micro-batch would split into two cohorts that alternate steps,
        # each reading all the weights for half the tokens.
        self.micro_batch_plans = [0] * count
        self._next_micro_batch = 0
        self._shrink_wanted = 0  # consecutive plans that wanted fewer micro-batches
        self._round_tokens: list[int] = []  # tokens of the latest m plans
        self._recent_prefill: deque[int] = deque(maxlen=count)  # prompt tokens of the latest plans

    @property
    def micro_batch_seqs(self) -> list[int]:
        """Sequences homed in each micro-batch (with one micro-batch slot: every running one)."""
        if self.num_micro_batches == 1:
            return [len(self.running)]
        return [len(members) for members in self.micro_batch_members]

    def _seat_limit(self) -> int:
        """Sequences that may run now: max_num_seqs per active micro-batch."""
        if self.num_micro_batches == 1:
            return self.max_running
        return self.active_micro_batches * self.max_num_seqs

    # ------------------------------------------------------------------ how many

    def _wanted_micro_batches(self, demand: int) -> int:
        full = self.num_micro_batches
        fill = min(self.pipeline_stages, full)  # enough to keep every stage busy
        seats = self.max_num_seqs
        if demand > fill * seats:
            return min(full, -(-demand // seats))
        return max(1, min(fill, demand // self.micro_batch_min_seqs))

    def _update_micro_batch_count(self) -> None:
        demand = len(self.running) + len(self.waiting)
        current = self.active_micro_batches
        wanted = self._wanted_micro_batches(demand)
        if wanted > current:
            self.active_micro_batches = wanted
            self._shrink_wanted = 0
            return
        lower = self._wanted_micro_batches(int(demand * SHRINK_MARGIN))
        if lower >= current:
            self._shrink_wanted = 0
            return
        self._shrink_wanted += 1
        if self._shrink_wanted >= SHRINK_AFTER_PLANS:
            # (every running request keeps a seat)
            self.active_micro_batches = max(lower, -(-len(self.running) // self.max_num_seqs), 1)
            self._shrink_wanted = 0

    # ------------------------------------------------------------------ seats and homes

    def _micro_batch_share(self, arriving: int = 0) -> int:
        """Sequences each active micro-batch seats: the load (what runs and waits, up to the
        seats; `arriving`: requests being admitted, in neither list) shared evenly."""
        m = self.active_micro_batches
        demand = min(len(self.running) + len(self.waiting) + arriving, m * self.max_num_seqs)
        return min(self.max_num_seqs, max(1, -(-demand // m)))

    def _has_seat(self, micro_batch: int, arriving: int = 0) -> bool:
        return len(self.micro_batch_members[micro_batch]) < self._micro_batch_share(arriving)

    def _place(self, req: Request, micro_batch: int, sampled: bool) -> None:
        """A request just admitted: home in micro_batch if its first chunk samples, else the pool."""
        if sampled:
            self._home(req, micro_batch)
        else:
            req.micro_batch = PREFILLING
            bisect.insort(self.prefilling, req, key=arrival_of)

    def _home(self, req: Request, micro_batch: int) -> None:
        req.micro_batch = micro_batch
        bisect.insort(self.micro_batch_members[micro_batch], req, key=arrival_of)

    def _leave_micro_batch(self, req: Request) -> None:
        """req stops running (finished, aborted, preempted): out of its micro-batch or the pool."""
        mb = req.micro_batch
        if mb == MIGRATING:
            self._migrating.remove(req)
            return
        group = self.prefilling if mb == PREFILLING else self.micro_batch_members[mb]
        index = bisect.bisect_left(group, req.arrival, key=arrival_of)
        assert group[index] is req
        del group[index]

    def _rebalance(self) -> None:
        """Before each plan: the count follows the load; a micro-batch past its share (or no longer
        active) gives up its latest arrivals, and those whose plans are all back join the
        micro-batch that holds fewest."""
        self._update_micro_batch_count()
        m = self.active_micro_batches
        for mb in range(m, self.num_micro_batches):
            self._cancel_repeats(mb)  # (no turn of its own any more)
        share = self._micro_batch_share()
        slack = max(4, share // 20)
        for mb, members in enumerate(self.micro_batch_members):
            keep = share + slack if mb < m else 0
            if len(members) > keep:
                surplus = members[share if mb < m else 0 :]  # down to its share
                del members[share if mb < m else 0 :]
                for req in surplus:
                    req.micro_batch = MIGRATING
                self._migrating.extend(surplus)
                self.counters.micro_batch_migrations += len(surplus)
        if self._migrating:
            waiting = []
            for req in self._migrating:
                if req.in_flight:
                    waiting.append(req)  # its micro-batch's plans in flight hold it: not scheduled until back
                else:
                    counts = [len(self.micro_batch_members[mb]) for mb in range(m)]
                    self._home(req, counts.index(min(counts)))
            self._migrating = waiting

    # ------------------------------------------------------------------ prefill

    def _prefill_quota(self, budget: int) -> int:
        """Prompt tokens this plan may take (of `budget` left after its decodes): a round's share
        of the prefill, (what is pending + what the previous m - 1 plans took) / m, at least
        MIN_PREFILL_QUOTA, in whole blocks. A prompt of X tokens so rides m plans of X / m
        (counting what is pending alone, it would halve plan after plan)."""
        m = self.active_micro_batches
        if m == 1:
            return budget
        recent = sum(itertools.islice(reversed(self._recent_prefill), m - 1))
        pending = self._pending_prefill(m * budget)
        quota = max(-(-(pending + recent) // m), MIN_PREFILL_QUOTA)
        return min(budget, -(-quota // self.block_size) * self.block_size)

    def _took_prefill(self, tokens: int) -> None:
        """The prompt tokens the plan just built took (pool chunks and admissions)."""
        self._recent_prefill.append(tokens)

    def _pending_prefill(self, enough: int) -> int:
        """Prompt tokens the pool, and the waiting requests that would get seats and blocks now,
        have left to compute (counted up to `enough`)."""
        pending = 0
        for req in self.prefilling:
            pending += req.num_tokens - req.num_computed_tokens
            if pending >= enough:
                return pending
        seats = max(0, self._seat_limit() - len(self.running))
        blocks = self.block_manager.num_free_blocks * self.block_size  # (tokens; cached prefixes aside)
        for req in itertools.islice(self.waiting, seats):
            blocks -= req.num_tokens
            if blocks < 0:
                break
            pending += req.num_tokens
            if pending >= enough:
                break
        return pending

    def _schedule_prefill_pool(
        self, micro_batch: int, budget: int, step_id: int, seqs: list, copies: list
    ) -> tuple[int, bool]:
        """Chunks of the pool's requests, in arrival order, up to `budget` tokens: a final chunk
        only where micro_batch has a seat (it becomes the request's home). Returns (tokens
        scheduled, someone was preempted)."""
        pool = self.prefilling
        spent, preempted = 0, False
        i = 0
        while i < len(pool) and spent < budget:
            req = pool[i]
            if req.in_flight and not self._can_follow_chunk(req):
                i += 1
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            num_new = min(remaining, budget - spent)
            final = num_new == remaining
            if final and not self._has_seat(micro_batch):
                num_new -= 1  # all but the last token: the final chunk waits for a micro-batch with a seat
                final = False
                if not num_new:
                    i += 1
                    continue
            end = req.num_computed_tokens + num_new
            follows = req.in_flight > 0  # follows its previous chunk: preempts nobody, is not preempted
            fits, evicted = self._make_room(req, end, None, lookahead=follows)
            preempted = preempted or evicted
            if not fits:
                if follows:
                    i += 1
                continue  # (else req itself was preempted: pool[i] is now the next request)
            self._schedule_seq(req, end, 0, step_id, seqs, copies)
            spent += num_new
            if final:
                del pool[i]
                self._home(req, micro_batch)
            else:
                i += 1
        return spent, preempted

    # ------------------------------------------------------------------ plans

    def _next_plan(self):
        """The plan of the next micro-batch in turn that has work (round robin over the active
        ones). One whose turn it is but whose plans in flight are at the limit is waited for:
        running another out of turn would put two plans of one micro-batch next to each other,
        the second waiting on every stage for the first one's tokens, and such runs, once
        formed, would last (each result frees a slot of the micro-batch that filled it)."""
        self._rebalance()
        m = self.active_micro_batches
        for k in range(m):
            mb = (self._next_micro_batch + k) % m
            if self.decode_lookahead and self.micro_batch_plans[mb] > self.decode_lookahead:
                return None
            plan = self._next_repeat(mb) or self._schedule(mb)
            if plan is not None:
                self._next_micro_batch = (mb + 1) % m
                plan.micro_batch = mb
                self.micro_batch_plans[mb] += 1
                self._count_round(plan.num_tokens)
                return plan
        return None

    def _count_round(self, tokens: int) -> None:
        """How unequal the plans are (SchedulerStats): for each plan, over the round of m plans
        it ends, 1 - mean / most tokens (the share of the round that its heaviest plan would
        leave the stages idle in the others' turns, if tokens were time)."""
        window = self._round_tokens
        window.append(tokens)
        m = self.active_micro_batches
        if len(window) > m:
            del window[: len(window) - m]
        if m > 1 and len(window) == m:
            self.counters.micro_batch_rounds += 1
            self.counters.micro_batch_token_spread += 1 - sum(window) / m / max(max(window), 1)

    def _reset_micro_batches(self) -> None:
        """Every request left (reset_kv): the micro-batches start empty."""
        self.micro_batch_members = [[] for _ in range(self.num_micro_batches)]
        self.prefilling = []
        self._migrating = []
        self.micro_batch_plans = [0] * self.num_micro_batches
        self._round_tokens = []
        self._recent_prefill.clear()
        self._repeats = [None] * self.num_micro_batches
