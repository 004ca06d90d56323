"""A request's entry in the step's plan: the tokens it computes (a prefill chunk, a decode, or a
token plus drafts, over one or more verify rounds), the blocks it reserves and copies on write,
and what it leaves in flight until its result comes back. Part of the Scheduler (scheduler.py),
as a mixin over the core's state."""

from __future__ import annotations

from strata.protocol import PLACEHOLDER_TOKEN
from strata.services.scheduler.plan import ScheduledSeq
from strata.services.scheduler.request import Request


class PlanEntries:
    """The Scheduler's entries in a plan (module docstring)."""

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
            self._drafts_in_plan += 1
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
        if req.prompt_logprobs is not None and start < num_prompt - 1:
            seqs[-1].prompt_rows = req.prompt_logprobs.rows(start, confirmed_end)
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
