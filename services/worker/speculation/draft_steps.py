"""The draft worker's proposal: k autoregressive steps of the draft model in one call, and one
more that only writes the last draft's KV.

The scheduler's plan catches each sequence's draft KV up to its last token and draws the first
draft token; k decode steps follow, each fed the token just drawn. Those inputs are decode
placeholders, resolved on the device from the tokens the previous step sampled, so the steps
launch back to back without waiting for the host: each replays the previous step's decode graph
moved on by a token on the device (ModelRunner.decode_again), or, where that graph cannot serve,
runs a decode plan of placeholders. The last of them feeds the
k-th draft and its draw is dropped: with its KV written, the next proposal's catch-up is one
token (the target's bonus or correction) whatever was accepted, a decode the draft's decode
graphs run, where a catch-up of two tokens ran eagerly, at several times a graph step's host
time.
Draws use the request's own (seed, position) noise and filters: where the draft's distribution
agrees with the target's, it proposes exactly the token the target will draw, and verification
accepts it.
"""

from __future__ import annotations

import torch

from strata.protocol import PLACEHOLDER_TOKEN
from strata.services.worker.device.host_to_device import upload
from strata.services.worker.step.sequence_table import PlanError
from strata.services.worker.step.step_results import PendingResult
from strata.v1 import engine_pb2

MAX_PROPOSE_TOKENS = 32


class DraftProposal:
    """One launched proposal: its steps' results (the first step's, and those of any decode
    step run from a plan) and the k drafts per sequence gathered on the device, on their way to
    the host; finish() returns them."""

    def __init__(self, step_id: int, steps: list[PendingResult], drafts: torch.Tensor):
        self.step_id = step_id
        self.steps = steps
        if drafts.is_cuda:
            self.drafts = torch.empty(drafts.shape, dtype=drafts.dtype, pin_memory=True)
            self.drafts.copy_(drafts, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()
        else:
            self.drafts, self.copied = drafts, None

    def finish(self) -> engine_pb2.StepResult:
        results = [step.finish() for step in self.steps]
        if self.copied is not None:
            self.copied.synchronize()
        first = results[0]
        n, k = self.drafts.shape
        return engine_pb2.StepResult(
            step_id=self.step_id,
            seq_ids=first.seq_ids,
            num_tokens=[k] * n,
            token_ids=self.drafts.reshape(-1).tolist(),  # one sequence's k tokens, in draft order
            launch_seconds=sum(r.launch_seconds for r in results),
            execute_seconds=max(r.execute_seconds for r in results),
            gpu_seconds=sum(r.gpu_seconds for r in results),
        )


def propose(runner, plan: engine_pb2.StepPlan, link=None) -> DraftProposal:
    """Launches the plan's step and plan.propose_tokens decode steps on the draft runner: each
    replays the previous step's decode graph moved on by a token (ModelRunner.decode_again), or,
    where that cannot serve, runs a decode plan of placeholders. Each step's draws are gathered
    from last_sampled on the device (the next step overwrites it). link: the draft link's sender
    (one target stage): the k drafts per sequence also go straight to the target's stage, in
    plan order (token_handoff.DraftIntake)."""
    k = plan.propose_tokens
    n = len(plan.seq_ids)
    if not 1 <= k <= MAX_PROPOSE_TOKENS:
        raise PlanError(f"propose_tokens must be in [1, {MAX_PROPOSE_TOKENS}]")
    if list(plan.sample) != [True] * n or any(plan.num_draft_tokens):
        raise PlanError("a draft plan samples every sequence and verifies none")
    steps = [runner.execute(plan)]
    rows = upload({"rows": runner.table.lookup(plan.seq_ids)}, runner.device)["rows"]
    drawn = [runner.last_sampled.index_select(0, rows)]
    seq_lens = [c + s for c, s in zip(plan.num_computed, plan.num_scheduled)]
    table_lens = [keep + count for keep, count in zip(plan.table_keep, plan.table_append_counts)]
    for step in range(k):  # the last one feeds draft k (its KV) and draws nothing kept
        if not runner.decode_again():
            decode = engine_pb2.StepPlan(
                step_id=plan.step_id,
                seq_ids=plan.seq_ids,
                num_computed=seq_lens,
                num_scheduled=[1] * n,
                input_token_ids=[PLACEHOLDER_TOKEN] * n,
                table_keep=table_lens,
                table_append_counts=[0] * n,
                sample=[True] * n,
            )
            steps.append(runner.execute(decode))
        if step < k - 1:
            drawn.append(runner.last_sampled.index_select(0, rows))
        seq_lens = [length + 1 for length in seq_lens]
    drafts = torch.stack(drawn, dim=1)  # [n, k]
    if link is not None:
        link.send(plan.step_id, drafts.reshape(-1))
    return DraftProposal(plan.step_id, steps, drafts)
