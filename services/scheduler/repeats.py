"""Repeated plans: a micro-batch in steady decode commits to its next K plans at once.

Pipelined decode sends each micro-batch one plan a token. In the steady state (every member of the
micro-batch decoding in place, nothing waiting to be admitted or prefilled) each plan is the
previous one with every position one further. Building it still costs the scheduler's Python
over a microsecond a sequence (the fused lookahead loop's checks and state, then the encoding),
and at the 1B shape on two GPUs the scheduler's loop takes about as long a plan as each stage's
GPU, so it bounds the pipeline there (bench/RESULTS.md, issue 50).

So when the fused loop has built the plan of a whole steady micro-batch, the scheduler commits it
for K - 1 more turns at once (`decode_repeats` = K): each member's slots for those tokens are
reserved (a new block where they cross one; never by preempting: a plan that does not fit is not
repeated), and its state advances by K - 1 in one pass. Each later turn of the micro-batch then
sends a repeat: the same sequences one position further, placeholders for input, encoded from
lists made at commit. Workers see ordinary decode lookahead plans, the same ones the fused loop
would have built, except that a block a repeat crosses into arrives with the first plan.

- A sequence released since the commit (a stop, an abort, max_tokens) is left out of the repeats
  that follow; its result in those already sent is ignored, as for any plan in flight.
- A micro-batch that stops being active drops the repeats it has not sent, and its members'
  state moves back by as many tokens; so does one whose turn comes while a request could be
  admitted (a seat is free) or prefilled (its first token waits for no repeat); a reset
  (reset_kv) drops all. Requests waiting for a seat, with every seat taken, do not stop repeats.
- Not repeated: plans with speculation, drafts, shared-KV runs (cascade attention) or prompt
  logprobs, and one stage (no micro-batches).

Part of the Scheduler (scheduler.py), as a mixin over the core's state.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.protocol import PLACEHOLDER_TOKEN
from strata.services.scheduler.plan import ScheduledSeq, StepPlan


@dataclass(slots=True)
class Repeat:
    """A micro-batch's committed plans not sent yet, and what encodes them."""

    seqs: list[ScheduledSeq]  # the committing plan's entries (the repeats' live ones, after releases)
    seq_ids: list[int]
    num_computed: list[int]  # each entry's num_computed in the committing plan
    table_keep: list[int]  # each entry's whole table: the workers hold it after the committing plan
    ends: list[int]  # each entry's repeats: fewer than left where its max_tokens comes first
    left: int  # repeats not sent yet
    sent: int = 0
    releases: int = 0  # the scheduler's release count when seqs was last filtered
    shortest: int = 0  # min(ends): past it, entries leave


class SteadyRepeats:
    """The Scheduler's repeated plans (module docstring)."""

    def _init_repeats(self, decode_repeats: int) -> None:
        if decode_repeats < 1:
            raise ValueError("decode_repeats must be >= 1")
        self.decode_repeats = decode_repeats
        self._repeats: list[Repeat | None] = [None] * self.num_micro_batches
        self._releases = 0  # sequences released so far (repeats leave them out)

    def _commit_repeats(self, plan: StepPlan, micro_batch: int) -> None:
        """Commits `plan`, just built for micro_batch, for decode_repeats - 1 more turns where
        it is a steady decode of the whole micro-batch and every member has room (module
        docstring). Else nothing changes."""
        extra = self.decode_repeats - 1
        seqs = plan.seqs
        if (
            extra < 1
            or self.spec is not None
            or plan.new_requests
            or plan.copies
            or plan.shared_kv_run
            or plan.asks_prompt_logprobs
            or plan.num_tokens != len(seqs)  # (one token each: decodes, or a chunk of one token)
            or self._admission_pending()
            or len(seqs) != len(self.micro_batch_members[micro_batch])
        ):
            return
        bm, block_size = self.block_manager, self.block_size
        ends, reach, needed = [], [], 0
        for s in seqs:
            req = s.request
            if s.input_token_ids[0] != PLACEHOLDER_TOKEN or not s.sample or s.num_draft:
                return  # not a decode lookahead (the fused loop's entries all are)
            # As many as its max_tokens leaves (req.in_flight plans each sample one token).
            left = req.max_output_tokens - len(req.output_token_ids) - req.in_flight
            end = min(extra, left)
            ends.append(end)
            # Slots up to the repeats' last, and the next plan's too where it will have one: its
            # block then comes now, and that plan's fused loop takes the request in place.
            slots = req.num_computed_tokens + end + (end < left)
            reach.append(slots)
            if (slots - 1) // block_size >= len(req.blocks.block_ids):  # (else its table holds them)
                needed += bm.blocks_needed(req, slots)
        if needed > bm.num_free_blocks or not any(ends):
            return
        table_keep = []
        for s, end, slots in zip(seqs, ends, reach):
            req = s.request
            if (slots - 1) // block_size >= len(req.blocks.block_ids):
                bm.reserve(req, slots)  # fresh blocks only: the slot before is written in place
                s.table_append = req.blocks.block_ids[s.table_keep :]  # (the committing plan carries them)
            if end:
                last = req.num_computed_tokens + end
                req.num_computed_at_step_start = last - 1
                req.num_computed_tokens = last
                req.in_flight += end
                req.spec.max_pending += end
            req.num_synced_blocks = len(req.blocks.block_ids)
            table_keep.append(req.num_synced_blocks)
        self._num_in_flight += sum(ends)
        self._repeats[micro_batch] = Repeat(
            list(seqs),
            [s.seq_id for s in seqs],
            [s.num_computed for s in seqs],
            table_keep,
            ends,
            max(ends),
            releases=self._releases,
            shortest=min(ends),
        )

    def _next_repeat(self, micro_batch: int) -> StepPlan | None:
        """The micro-batch's next committed plan (the next step id, counted as _schedule counts
        its plans), or None when it has none."""
        rep = self._repeats[micro_batch]
        if rep is None:
            return None
        if self._admission_pending():
            # The micro-batch's turn builds a plan that admits it (a request's first token waits
            # for no repeat).
            self._cancel_repeats(micro_batch)
            return None
        rep.left -= 1
        rep.sent += 1
        if rep.releases != self._releases or rep.sent > rep.shortest:
            self._drop_released(rep)
        if not rep.left or not rep.seqs:
            self._repeats[micro_batch] = None
        if not rep.seqs:
            return None
        n = len(rep.seqs)
        plan = StepPlan(self._next_step_id, [], self._pending_releases, rep.seqs, [])
        plan.num_tokens = n
        plan.repeat = (rep.seq_ids, [c + rep.sent for c in rep.num_computed], rep.table_keep)
        self._pending_releases = []
        self._next_step_id += 1
        counters = self.counters
        counters.steps += 1
        counters.decode_tokens += n
        counters.lookahead_decodes += n
        counters.repeated_plans += 1
        return plan

    def _admission_pending(self) -> bool:
        """Whether a plan could take new work now: prompt chunks in the prefill pool, or requests
        waiting while a seat is free (with every seat taken they wait for a finish either way)."""
        return bool(self.prefilling) or (bool(self.waiting) and len(self.running) < self._seat_limit())

    def _drop_released(self, rep: Repeat) -> None:
        """Leaves out of the repeat about to go the sequences released since they were last
        filtered, and those whose repeats have all gone."""
        sent = rep.sent
        keep = [i for i, s in enumerate(rep.seqs) if s.request.seq_id == s.seq_id and rep.ends[i] >= sent]
        rep.seqs = [rep.seqs[i] for i in keep]
        rep.seq_ids = [rep.seq_ids[i] for i in keep]
        rep.num_computed = [rep.num_computed[i] for i in keep]
        rep.table_keep = [rep.table_keep[i] for i in keep]
        rep.ends = [rep.ends[i] for i in keep]
        rep.releases = self._releases
        rep.shortest = min(rep.ends, default=0)

    def _cancel_repeats(self, micro_batch: int) -> None:
        """Drops the micro-batch's repeats not sent yet: its live members' state moves back by as
        many tokens (the slots reserved for them stay in their tables, and are written later)."""
        rep = self._repeats[micro_batch]
        if rep is None:
            return
        self._repeats[micro_batch] = None
        for s, end in zip(rep.seqs, rep.ends):
            req = s.request
            unsent = end - rep.sent
            if req.seq_id != s.seq_id or unsent <= 0:
                continue  # released (its in-flight count went with it), or every repeat of it sent
            req.num_computed_tokens -= unsent
            req.num_computed_at_step_start -= unsent
            req.in_flight -= unsent
            req.spec.max_pending -= unsent
            self._num_in_flight -= unsent
