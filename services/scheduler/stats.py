"""The scheduler's running totals, written into engine.proto's SchedulerStats by fill_stats."""

from __future__ import annotations

from dataclasses import dataclass

from strata.v1 import engine_pb2


@dataclass(slots=True)
class Counters:
    steps: int = 0
    preemptions: int = 0
    finished: int = 0
    lookahead_decodes: int = 0
    prefill_tokens: int = 0  # context (re)computed: prompts, and outputs again after a preemption
    decode_tokens: int = 0  # each decode's input token, plus the drafts it verifies
    # Micro-batches (P stages): requests moved between them; rounds of plans, and the sum over
    # rounds of 1 - mean / most tokens among a round's plans.
    micro_batch_migrations: int = 0
    micro_batch_rounds: int = 0
    micro_batch_token_spread: float = 0.0
    prompt_logprob_positions: int = 0  # prompt logprob rows received
    resumed: int = 0  # requests that arrived with output from a lost replica
    repeated_plans: int = 0  # plans sent as repeats of a steady micro-batch's plan (repeats.py)

    def fill_stats(self, stats: engine_pb2.SchedulerStats) -> None:
        stats.lookahead_decodes = self.lookahead_decodes
        stats.prefill_tokens_computed = self.prefill_tokens
        stats.decode_tokens_computed = self.decode_tokens
        stats.steps = self.steps
        stats.preemptions = self.preemptions
        stats.finished_requests = self.finished
        stats.micro_batch_migrations = self.micro_batch_migrations
        stats.micro_batch_rounds = self.micro_batch_rounds
        stats.micro_batch_token_spread = self.micro_batch_token_spread
        stats.prompt_logprob_positions = self.prompt_logprob_positions
        stats.resumed_requests = self.resumed
        stats.repeated_plans = self.repeated_plans
