"""Scheduler plans to the wire (StepPlan) and StepResults back to per-sequence tokens."""

from __future__ import annotations

import itertools

from strata.protocol import PLACEHOLDER_TOKEN
from strata.sampling_rules import history_needed
from strata.services.scheduler import prompt_logprobs
from strata.services.scheduler.plan import StepPlan
from strata.v1 import engine_pb2, generate_pb2


def new_sequence(r, prefix_len: int = 0) -> engine_pb2.NewSequence:
    """A sequence's admission. Sampling that keeps state on the last stage (penalties, a
    constraint) gets the tokens known so far, which the worker reads up to its first step's
    num_computed (cached blocks and recomputed output it never sees as input). prefix_len: that
    num_computed, when the last stage proposes drafts by prompt lookup (it needs those tokens)."""
    msg = engine_pb2.NewSequence(seq_id=r.seq_id, sampling=r.sampling)
    if prefix_len:
        msg.prefix_token_ids.extend(r.token_slice(0, prefix_len))
    needs, needs_prompt = history_needed(r.sampling)
    if needs:
        num_prompt = len(r.prompt_token_ids)
        msg.num_prompt_tokens = num_prompt
        msg.history_start = 0 if needs_prompt else num_prompt
        if needs_prompt:
            msg.history_token_ids.extend(r.prompt_token_ids)
        msg.history_token_ids.extend(r.output_token_ids)
    return msg


def plan_to_proto(plan: StepPlan) -> engine_pb2.StepPlan:
    if plan.repeat is not None:
        return _repeat_to_proto(plan)
    seqs = plan.seqs
    if plan.send_prefixes and plan.new_requests:
        first = {id(s.request): s.num_computed for s in seqs}
        new_sequences = [new_sequence(r, first.get(id(r), 0)) for r in plan.new_requests]
    else:
        new_sequences = [new_sequence(r) for r in plan.new_requests]
    if plan.num_tokens == len(seqs) and not plan.has_drafts:
        # One token a sequence (num_tokens sums their num_scheduled): most decode plans. The
        # constant columns need no pass over the sequences.
        num_scheduled, num_draft = [1] * len(seqs), [0] * len(seqs)
        input_token_ids = [s.input_token_ids[0] for s in seqs]
    else:
        num_scheduled, num_draft = [len(s.input_token_ids) for s in seqs], [s.num_draft for s in seqs]
        input_token_ids = list(itertools.chain.from_iterable(s.input_token_ids for s in seqs))
    msg = engine_pb2.StepPlan(
        step_id=plan.step_id,
        new_sequences=new_sequences,
        released_seq_ids=plan.released_seq_ids,
        seq_ids=[s.seq_id for s in seqs],
        num_computed=[s.num_computed for s in seqs],
        num_scheduled=num_scheduled,
        input_token_ids=input_token_ids,
        table_keep=[s.table_keep for s in seqs],
        table_append_counts=[len(s.table_append) for s in seqs],
        table_append_ids=list(itertools.chain.from_iterable(s.table_append for s in seqs)),
        sample=[s.sample for s in seqs],
        num_draft_tokens=num_draft,
        copy_src_blocks=[src for src, _ in plan.copies],
        copy_dst_blocks=[dst for _, dst in plan.copies],
        # The shared-KV runs keep the wire names they had before they were called runs.
        shared_kv_run=plan.shared_kv_run,
        shared_kv_run_lens=plan.shared_kv_run_lens,
        rejected_drafts=plan.rejected_drafts,
    )
    if plan.linked_drafts:
        msg.linked_drafts = True
    if any(s.propose for s in seqs):
        msg.propose_drafts.extend([s.propose for s in seqs])
    if plan.verify_rounds > 1:
        msg.verify_rounds.extend([s.rounds for s in seqs])
    prompt_logprobs.add_to_plan(plan, msg)
    return msg


def _repeat_to_proto(plan: StepPlan) -> engine_pb2.StepPlan:
    """A repeated plan (repeats.py): one placeholder decode a sequence, its table already sent."""
    seq_ids, num_computed, table_keep = plan.repeat
    n = len(seq_ids)
    return engine_pb2.StepPlan(
        step_id=plan.step_id,
        released_seq_ids=plan.released_seq_ids,
        seq_ids=seq_ids,
        num_computed=num_computed,
        num_scheduled=[1] * n,
        input_token_ids=[PLACEHOLDER_TOKEN] * n,
        table_keep=table_keep,
        table_append_counts=[0] * n,
        sample=[True] * n,
        num_draft_tokens=[0] * n,
    )


def split_proposals(result: engine_pb2.StepResult) -> dict[int, list[int]]:
    """{seq_id: drafts the last stage proposed after the step} (prompt lookup on the device);
    empty when it proposed none."""
    if not result.num_proposed:
        return {}
    out, pos = {}, 0
    tokens = result.proposed_token_ids
    for seq_id, n in zip(result.seq_ids, result.num_proposed):
        out[seq_id] = list(tokens[pos : pos + n])
        pos += n
    return out


def split_rounds(result: engine_pb2.StepResult) -> dict[int, tuple[list[int], list[int]]]:
    """{seq_id: (tokens each verify round emitted, drafts proposed after each)} of a step of
    several verify rounds (StepResult.round_num_tokens); empty for any other step."""
    if not result.round_num_tokens:
        return {}
    rounds = len(result.round_num_tokens) // max(len(result.seq_ids), 1)
    tokens, proposed = result.round_num_tokens, result.round_num_proposed
    return {
        seq_id: (list(tokens[i * rounds : (i + 1) * rounds]), list(proposed[i * rounds : (i + 1) * rounds]))
        for i, seq_id in enumerate(result.seq_ids)
    }


def split_result(result: engine_pb2.StepResult):
    """Returns ({seq_id: [token ids]}, {seq_id: [TokenLogprob]}) from the flat arrays."""
    sampled: dict[int, list[int]] = {}
    logprobs: dict[int, list[generate_pb2.TokenLogprob]] = {}
    have_logprobs = len(result.logprobs) == len(result.token_ids) and len(result.token_ids) > 0
    if not have_logprobs and len(result.token_ids) == len(result.seq_ids):  # one token each: most steps
        return {seq_id: [token] for seq_id, token in zip(result.seq_ids, result.token_ids)}, logprobs
    pos = top_pos = 0
    for seq_id, n in zip(result.seq_ids, result.num_tokens):
        sampled[seq_id] = list(result.token_ids[pos : pos + n])
        if have_logprobs:
            entries = []
            for t in range(pos, pos + n):
                k = result.num_top[t] if t < len(result.num_top) else 0
                entry = generate_pb2.TokenLogprob(token_id=result.token_ids[t], logprob=result.logprobs[t])
                for j in range(top_pos, top_pos + k):
                    entry.top.add(token_id=result.top_token_ids[j], logprob=result.top_logprobs[j])
                top_pos += k
                entries.append(entry)
            logprobs[seq_id] = entries
        pos += n
    return sampled, logprobs
