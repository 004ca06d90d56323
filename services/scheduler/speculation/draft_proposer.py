"""Speculative proposals from a draft model: the draft worker's plan for a target plan's
speculating sequences, and its tokens put in place of the target plan's draft placeholders:
with one target stage, DEVICE_DRAFTs that the draft worker's tokens fill on the target's GPU
(the draft link, link_drafts); else the tokens themselves, once the draft worker's result is
back (fill_drafts).

The draft model's KV cache follows the target's block tables: the positions are the same, so the
scheduler keeps one table per sequence for both models (the target's verify step reserved blocks
for every position the draft writes). What the draft worker holds of each table, and which
positions its KV is valid for, is tracked in the request's SpecState (req.spec.draft_seq_id,
draft_synced_blocks, draft_computed; request_state.py): each call catches the draft up from there
to the sequence's last token, then draws k tokens in k autoregressive steps on the draft worker.
"""

from __future__ import annotations

from strata.protocol import DEVICE_DRAFT
from strata.services.scheduler.plan import StepPlan
from strata.v1 import engine_pb2


def draft_plan(plan: StepPlan, k: int, releases: list[int]) -> engine_pb2.StepPlan | None:
    """The draft worker's plan for plan's sequences with drafts; None when there are none.
    `releases` (seq ids the draft worker may drop) are sent and cleared."""
    seqs = [s for s in plan.seqs if s.num_draft]
    if not seqs:
        return None
    msg = engine_pb2.StepPlan(step_id=plan.step_id, propose_tokens=k, released_seq_ids=releases)
    releases.clear()
    for s in seqs:
        req = s.request
        spec = req.spec
        if spec.draft_seq_id != s.seq_id:  # new to the draft worker (admitted, or re-admitted)
            msg.new_sequences.add(seq_id=s.seq_id, sampling=req.sampling)
            spec.draft_seq_id, spec.draft_synced_blocks, spec.draft_computed = s.seq_id, 0, 0
        # The verify step starts at the sequence's last token; the draft catches up to it.
        last = s.num_computed
        start = min(spec.draft_computed, last)
        table = req.blocks.block_ids
        keep = spec.draft_synced_blocks
        msg.seq_ids.append(s.seq_id)
        msg.num_computed.append(start)
        msg.num_scheduled.append(last + 1 - start)
        msg.input_token_ids.extend(req.token_slice(start, last + 1))
        msg.table_keep.append(keep)
        msg.table_append_counts.append(len(table) - keep)
        msg.table_append_ids.extend(table[keep:])
        msg.sample.append(True)
        msg.num_draft_tokens.append(0)
        spec.draft_synced_blocks = len(table)
    return msg


def link_drafts(plan: StepPlan) -> None:
    """The plan's drafts come over the draft link (one target stage): its DEVICE_DRAFT inputs are
    the draft worker's proposal for this same step, which the target's stage takes from the link
    (StepPlan.linked_drafts). Sent with the draft plan, before the proposal exists."""
    for s in plan.seqs:
        if s.num_draft:
            s.input_token_ids[-s.num_draft :] = [DEVICE_DRAFT] * s.num_draft
            _draft_fed(s)
    plan.linked_drafts = True


def _draft_fed(s) -> None:
    # The draft worker fed the last token and every draft (draft_steps.py): its KV is valid up to
    # there where they are accepted, so the next catch-up starts at the next last token.
    s.request.spec.draft_computed = s.num_computed + s.num_draft + 1


def fill_drafts(plan: StepPlan, result: engine_pb2.StepResult, k: int) -> None:
    """Puts the draft worker's k tokens per sequence in place of the plan's placeholders."""
    if result.error:
        raise RuntimeError(f"draft worker: {result.error}")
    drafts = {seq_id: result.token_ids[i * k : (i + 1) * k] for i, seq_id in enumerate(result.seq_ids)}
    for s in plan.seqs:
        if not s.num_draft:
            continue
        tokens = drafts.get(s.seq_id)
        if tokens is None or len(tokens) != s.num_draft:
            raise RuntimeError(f"draft worker returned no {s.num_draft} tokens for seq {s.seq_id}")
        s.input_token_ids[-s.num_draft :] = tokens
        _draft_fed(s)
