"""Speculative decoding's settings in the scheduler: who proposes, how many tokens, up to which
batch, and the verify rounds of small batches (the --speculative-* and --ngram-* flags)."""

from __future__ import annotations

from dataclasses import dataclass

from strata.flags import DEFAULTS
from strata.protocol import MAX_VERIFY_ROUNDS


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes, how many tokens, and up to which batch it may run.

    `strata scheduler` passes every field from its flags (strata/flags.py, where their defaults
    are written). A program that builds one gets the flags' defaults too, but for max_batch,
    proposer and rounds, which start from the plainest setting: prompt lookup in the scheduler,
    one verify round, a small cap."""

    method: str  # "ngram" (prompt lookup) or "draft" (a draft model's worker)
    num_speculative_tokens: int = DEFAULTS["num_speculative_tokens"]
    ngram_min: int = DEFAULTS["ngram_min"]
    ngram_max: int = DEFAULTS["ngram_max"]
    max_batch: int = 32  # running requests above this decode without drafts (a cap)
    proposer: str = "scheduler"  # ngram: "device" (the last stage) or "scheduler" (here)
    # k per request from its acceptance, and the cost model's per-step choice; off: every
    # request always proposes k (up to max_batch), as before.
    adaptive: bool = True
    # Verify rounds per plan (device proposer, one stage) while at most rounds_max_batch requests
    # run: the last stage verifies, proposes and verifies again without the host (StepPlan.
    # verify_rounds), so that one plan's host work serves several verify steps where the host's
    # time per step exceeds the GPU's (a small model at small batches: bench/RESULTS.md).
    rounds: int = 1
    rounds_max_batch: int = DEFAULTS["speculative_rounds_max_batch"]

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"unknown speculative method {self.method!r}")
        if self.proposer not in ("device", "scheduler"):
            raise ValueError(f"unknown n-gram proposer {self.proposer!r}")
        if self.num_speculative_tokens < 1 or self.max_batch < 0:
            raise ValueError("num_speculative_tokens >= 1 and max_batch >= 0")
        if not 1 <= self.rounds <= MAX_VERIFY_ROUNDS or self.rounds_max_batch < 0:
            raise ValueError(f"verify rounds in [1, {MAX_VERIFY_ROUNDS}] and rounds_max_batch >= 0")
