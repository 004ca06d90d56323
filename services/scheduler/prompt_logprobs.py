"""Prompt logprobs in the scheduler (SamplingOptions.prompt_logprobs): which prompt positions of a
request's steps the last stage computes logprobs for, their rows gathered from the results in
order, and the whole list handed once to the request's first output.

Position p's row is the logprob of prompt token p + 1 given the tokens before it: the logits at
position p. A request of P prompt tokens has P - 1 rows.
- Each step that computes prompt positions asks for those whose rows have not been asked yet
  (StepPlan.prompt_logprob_*): a prefill chunk asks for its own, however the prompt is cut into
  chunks, over any number of stages (only the last one computes them).
- A prompt position read from the prefix cache or a sibling's blocks has no logits. An asking
  request therefore takes no shared or cached blocks past the rows it has received (vLLM's way:
  it computes the rest of its prompt itself, in blocks of its own, which stay in the cache for
  everyone else). After a preemption it asks only for the rows it still lacks, and may read what
  the cache holds below them.
- Rows come back in the results in step order; a result's rows for positions already received
  are ignored. The request's first output (its first sampled token, whose step comes after every
  prompt position) carries all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from strata.v1 import engine_pb2

if TYPE_CHECKING:
    from strata.services.scheduler.plan import StepPlan
    from strata.services.scheduler.request import Request


@dataclass(slots=True)
class PromptLogprobState:
    """One asking request's prompt logprobs: rows received, and how far the plans asked."""

    num_top: int  # k
    num_rows: int  # prompt tokens - 1
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    asked: int = 0  # rows asked by the plans of the current admission (received ones included)
    sent: bool = False

    @classmethod
    def of(cls, req: Request) -> PromptLogprobState | None:
        if not req.sampling.HasField("prompt_logprobs"):
            return None
        return cls(req.sampling.prompt_logprobs, req.num_prompt_tokens - 1)

    @property
    def received(self) -> int:
        return len(self.logprobs)

    @property
    def complete(self) -> bool:
        return self.received == self.num_rows

    def readable_prefix(self, num_tokens: int, block_size: int) -> int:
        """Of a shared or cached prefix of num_tokens tokens, the tokens the request may take
        without computing them: all of them once its rows are complete, else only whole blocks
        below the first position whose row it lacks."""
        if self.complete or num_tokens <= self.received:
            return num_tokens
        return self.received // block_size * block_size

    def admitted(self) -> None:
        """A new admission: plans of the previous one that never came back asked for nothing."""
        self.asked = self.received

    def rows(self, start: int, end: int) -> tuple[int, int] | None:
        """A step computes positions [start, end): (offset in the step's tokens, count) of the
        rows it asks for, or None."""
        first, last = max(start, self.asked), min(end, self.num_rows)
        if first >= last:
            return None
        self.asked = last
        return first - start, last - first

    def receive(self, first: int, logprobs, ranks, top_token_ids, top_logprobs) -> None:
        """Rows of positions first, first + 1, ...: those received already are dropped."""
        if first > self.received:
            raise ValueError(f"prompt logprob rows from position {first}, {self.received} received")
        skip, k = self.received - first, self.num_top
        self.logprobs.extend(logprobs[skip:])
        self.ranks.extend(ranks[skip:])
        self.top_token_ids.extend(top_token_ids[skip * k :])
        self.top_logprobs.extend(top_logprobs[skip * k :])

    def take(self) -> engine_pb2.PromptLogprobRows | None:
        """Every row, once: for the request's first output."""
        if self.sent or not self.complete:
            return None
        self.sent = True
        return engine_pb2.PromptLogprobRows(
            num_top=self.num_top,
            logprobs=self.logprobs,
            ranks=self.ranks,
            top_token_ids=self.top_token_ids,
            top_logprobs=self.top_logprobs,
        )


def add_to_plan(plan: StepPlan, msg: engine_pb2.StepPlan) -> None:
    """The plan's asked rows on the wire (nothing when no sequence asks)."""
    if not plan.asks_prompt_logprobs:
        return
    seqs = plan.seqs
    offsets, counts, targets = [], [], []
    for s in seqs:
        offset, count = s.prompt_rows or (0, 0)
        offsets.append(offset)
        counts.append(count)
        if count:  # row p is the logprob of token p + 1
            first = s.num_computed + offset + 1
            targets.extend(s.request.prompt_token_ids[first : first + count])
    msg.prompt_logprob_offsets.extend(offsets)
    msg.prompt_logprob_counts.extend(counts)
    msg.prompt_logprob_token_ids.extend(targets)


def receive(plan: StepPlan, result: engine_pb2.StepResult) -> int:
    """The result's rows to their requests (those still admitted as the plan saw them); returns
    the rows it held. Raises ValueError when the result does not match the plan."""
    asked = [(s, s.prompt_rows) for s in plan.seqs if s.prompt_rows]
    if not asked:
        return 0
    total = sum(count for _, (_, count) in asked)
    top = sum(s.request.prompt_logprobs.num_top * count for s, (_, count) in asked)
    if (
        len(result.prompt_logprobs) != total
        or len(result.prompt_logprob_ranks) != total
        or len(result.prompt_top_token_ids) != top
        or len(result.prompt_top_logprobs) != top
    ):
        raise ValueError(f"step {plan.step_id}: the result's prompt logprobs do not match the {total} rows asked")
    row = top_row = 0
    lps, ranks = result.prompt_logprobs, result.prompt_logprob_ranks
    top_ids, top_lps = result.prompt_top_token_ids, result.prompt_top_logprobs
    for s, (offset, count) in asked:
        req, k = s.request, s.request.prompt_logprobs.num_top
        if req.seq_id == s.seq_id:  # not aborted, finished or preempted since the plan
            req.prompt_logprobs.receive(
                s.num_computed + offset,
                lps[row : row + count],
                ranks[row : row + count],
                top_ids[top_row : top_row + k * count],
                top_lps[top_row : top_row + k * count],
            )
        row, top_row = row + count, top_row + k * count
    return total
