"""Lookahead: plans that go out before the results they follow. A decode lookahead (one stage, or
pipelined decode over P stages) decodes a token the worker has sampled but the scheduler has not
seen (PLACEHOLDER_TOKEN); speculation's lookahead verifies drafts still on the last stage's device
(DEVICE_DRAFT); a prompt's next chunk may follow its previous one in a micro-batch. Part of the
Scheduler (scheduler.py), as a mixin over the core's state."""

from __future__ import annotations

from strata.protocol import DEVICE_DRAFT, PLACEHOLDER_TOKEN
from strata.services.scheduler.plan import ScheduledSeq
from strata.services.scheduler.request import Request


class DecodeLookahead:
    """The Scheduler's lookahead plans (module docstring)."""

    def _can_follow_chunk(self, req: Request) -> bool:
        """A prompt's next chunk may follow its previous one without waiting for that plan's
        result: a chunk samples nothing, and every stage runs plans in step order, so its KV is
        written before the next chunk reads it (micro-batches: prefill stays pipelined)."""
        return not req.pending_sample and not req.spec.draft_token_ids and req.num_computed_tokens < req.num_tokens

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

    def _look_ahead_in_place_run(self, running: list[Request], i: int, most: int, step_id: int, seqs: list) -> int:
        """The steady decode lookahead, fused: from running[i] on, at most `most` requests that
        _can_look_ahead admits and whose slot bm.writes_in_place are scheduled as
        _decode_in_place(req, PLACEHOLDER_TOKEN) schedules them, in one loop without a call a
        request (pipelined decode runs this for every sequence of every plan). Returns the index
        of the first request it did not take, for the general loop. The same plans and state as
        the general path (tests compare the two)."""
        bm = self.block_manager
        ref, cached = bm.slot_owners()
        block_size, lookahead = self.block_size, self.decode_lookahead
        caching = bm.enable_prefix_caching
        append = seqs.append
        end = min(len(running), i + most)
        first = i
        while i < end:
            req = running[i]
            pending = req.in_flight
            if not (0 < pending <= lookahead and req.pending_sample):
                break
            num_output = len(req.output_token_ids)
            num_known = len(req.prompt_token_ids) + num_output
            start = req.num_computed_tokens
            # _can_look_ahead: every plan in flight samples one token, and this one stays within
            # max_tokens and max_model_len.
            if start != num_known + pending - 1 or num_output + pending >= req.max_output_tokens:
                break
            blocks = req.blocks
            table = blocks.block_ids
            index = start // block_size
            if index >= len(table) or ref[table[index]] != 1 or cached[table[index]] is not None:
                break  # (writes_in_place: a new block, or one shared or cached)
            if caching and num_known // block_size > blocks.num_hashed:
                bm.register_full_blocks(req, num_known)
            keep = req.num_synced_blocks
            append(ScheduledSeq(req, req.seq_id, start, 1, [PLACEHOLDER_TOKEN], keep, table[keep:], True, 0))
            spec = req.spec
            if spec.draft_token_ids:
                spec.draft_token_ids = []
            spec.max_pending += 1
            spec.verify_pending = False
            req.num_synced_blocks = len(table)
            req.num_computed_at_step_start = start
            req.num_computed_tokens = start + 1
            req.in_flight = pending + 1
            req.last_scheduled_step = step_id
            i += 1
        taken = i - first
        self._num_in_flight += taken
        counters = self.counters
        counters.decode_tokens += taken
        counters.lookahead_decodes += taken
        return i

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
