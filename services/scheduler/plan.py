"""What one engine step computes (StepPlan) and what a step's result did to a request
(RequestUpdate). The engine loop converts StepPlan to the engine.proto StepPlan message."""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.services.scheduler.request import Request


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence in a step. Workers keep its block table and apply the delta: keep the
    first `table_keep` entries, then append `table_append`."""

    request: Request
    seq_id: int
    num_computed: int  # tokens already in the KV cache before this step
    num_scheduled: int  # KV slots this step: a prefill chunk, 1, k + 1 (drafts), or rounds x (k + 1)
    input_token_ids: list[int]  # the step's (first round's) tokens, drafts at the end
    table_keep: int
    table_append: list[int]
    sample: bool  # the last stage samples after this step
    num_draft: int = 0
    propose: int = 0  # drafts the last stage proposes after this step for the next (device prompt lookup)
    shifted: bool = False  # sent before a verification of its request came back: may move back on the device
    rounds: int = 1  # verify rounds the last stage runs for it (StepPlan.verify_rounds), k + 1 slots each
    prompt_rows: tuple[int, int] | None = None  # prompt logprob rows asked: (offset in its tokens, count)


@dataclass(slots=True)
class StepPlan:
    step_id: int
    # Sequences admitted by this plan (first admission or re-admission after preemption):
    # workers create their state (seq_id = request.seq_id, sampling options).
    new_requests: list[Request]
    # Finished, aborted or preempted since the previous plan: workers drop their state.
    released_seq_ids: list[int]
    seqs: list[ScheduledSeq]
    # Copy-on-write block copies (src, dst), done by the workers before the step, in order.
    copies: list[tuple[int, int]]
    # Shared-KV runs for cascade attention (shared_kv_runs.find_shared_kv_runs): per sequence its
    # run's index + 1 (0: none), per run its shared prefix in tokens. Empty when nothing is
    # shared. On the wire: StepPlan.shared_kv_run / shared_kv_run_lens.
    shared_kv_run: list[int] = field(default_factory=list)
    shared_kv_run_lens: list[int] = field(default_factory=list)
    sent_at: float = 0.0  # when the engine sent it (the hung-stage deadline counts from here)
    after_hold: bool = False  # built after the engine held it (plan_pacing.py): did the GPU wait for it?
    prompt_tokens: int = 0  # its prefill tokens (plan_pacing.prompt_tokens), where the engine paces plans
    after_idle: bool = False  # nothing ran before it: the GPU's wait for it is no bubble (StepPlan.after_idle)
    verifies: bool = False  # some sequence verifies drafts that the plan carries
    micro_batch: int = 0  # pipelined decode: the micro-batch it runs
    num_tokens: int = 0  # KV slots it computes: the sum of its sequences' num_scheduled
    retired: bool = False  # its result came back (Scheduler.retire), whatever it was
    # Per sequence, when some sequence is `shifted`: the rejected drafts its num_computed
    # accounts for (StepPlan.rejected_drafts); empty otherwise.
    rejected_drafts: list[int] = field(default_factory=list)
    # Every sequence decodes or verifies (no prefill chunk): 1 + the most drafts of any; 0 else.
    # The cost model times such steps.
    max_query: int = 0
    send_prefixes: bool = False  # new sequences carry their tokens before their first step
    verify_rounds: int = 1  # the most verify rounds of any sequence (the cost model times a round)
    linked_drafts: bool = False  # its drafts come over the draft link (StepPlan.linked_drafts)
    asks_prompt_logprobs: bool = False  # some sequence has prompt_rows
    has_drafts: bool = False  # some sequence has drafts (carried, or on the device)
    # A repeat of a steady micro-batch's plan (repeats.py): its wire columns (seq_ids,
    # num_computed, table_keep); the rest is one placeholder decode a sequence.
    repeat: tuple[list[int], list[int], list[int]] | None = None


@dataclass(slots=True)
class RequestUpdate:
    """What update() did to one request. new_token_ids are the first len(new_token_ids) tokens
    the step sampled for it: tokens after a stop are dropped."""

    request: Request
    new_token_ids: list[int]
    finished: bool
    finish_reason: int  # engine_pb2.FinishReason (FINISH_REASON_UNSPECIFIED while running)
    stop_token_id: int | None  # the stop_token_ids entry that ended it (None for eos and length)
