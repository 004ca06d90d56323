"""Speculative decoding in the scheduler: proposals, their slots, rollback and acceptance counts.

A speculating request decodes its latest token plus k draft tokens in one verify step (k + 1
slots of KV); the last stage samples up to k + 1 tokens, and the slots of rejected drafts are
rolled back when the result comes back. Drafts come from a prompt lookup here
(ngram_proposer.py) or from a draft model's worker: then the plan carries DRAFT_PLACEHOLDERs that
the engine fills in before it sends the plan (draft_proposer.py), and each request's SpecState
tracks what the draft worker holds of it.

The scheduler core calls in at a few points: Speculation.active once per step, propose for a
request due to speculate, drafts_that_fit when it sizes a decode, rollback and
Acceptance.record when a verify step's result comes back. Drafts set on a request by anyone
else (tests do) are scheduled and verified the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from strata.protocol import DRAFT_PLACEHOLDER
from strata.services.scheduler.block_manager import KVBlockManager, cdiv
from strata.services.scheduler.ngram_proposer import NgramProposer
from strata.v1 import engine_pb2

if TYPE_CHECKING:
    from strata.services.scheduler.request import Request

# After a prompt lookup finds nothing, the request decodes this many tokens (pipelined with decode
# lookahead) before it looks again.
NGRAM_RETRY_TOKENS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: who proposes, how many tokens, and up to which batch it pays."""

    method: str  # "ngram" (prompt lookup, here) or "draft" (a draft model's worker)
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    max_batch: int = 32  # running requests above this decode without drafts

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise ValueError(f"unknown speculative method {self.method!r}")
        if self.num_speculative_tokens < 1 or self.max_batch < 0:
            raise ValueError("num_speculative_tokens >= 1 and max_batch >= 0")


@dataclass(slots=True)
class SpecState:
    """One request's speculation: its drafts for the next step and the draft worker's view of it."""

    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step (consumed by it)
    retry_at: int = 0  # output tokens before it speculates again (after a proposal found nothing)
    # Draft model: what the draft worker holds (draft_proposer.py keeps these).
    draft_seq_id: int | None = None  # the seq_id the draft worker holds state for
    draft_synced_blocks: int = 0  # leading block-table entries the draft worker holds
    draft_computed: int = 0  # positions whose draft KV is valid (its tokens never changed since)

    def block_copied(self, block: int, block_size: int) -> None:
        """The target's block `block` was copied on write: the draft worker's copy of it is not
        copied; it recomputes the block's tokens."""
        self.draft_synced_blocks = min(self.draft_synced_blocks, block)
        self.draft_computed = min(self.draft_computed, block * block_size)

    def forget_draft_worker(self) -> None:
        """The draft worker lost its state (the pipeline was rebuilt)."""
        self.draft_seq_id = None
        self.draft_synced_blocks = self.draft_computed = 0
        self.draft_token_ids = []


class Speculation:
    """The scheduler's proposer side: who proposes, for whom, and the draft worker's releases."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_batch = config.max_batch
        # ngram drafts come from here; a draft model's drafts are DRAFT_PLACEHOLDERs that the
        # engine fills in from the draft worker before it sends the plan (all k or none, so that
        # one call of k steps serves every sequence).
        self.ngram = NgramProposer(self.k, config.ngram_min, config.ngram_max) if config.method == "ngram" else None
        self.draft_releases: list[int] = []  # seq ids the draft worker may drop (draft method)
        self.verifying_plans = 0  # plans in flight that verify drafts

    def active(self, num_running: int) -> bool:
        """Whether requests speculate this step: up to max_batch running requests it pays."""
        return num_running <= self.max_batch

    def propose(self, req: Request) -> None:
        """Drafts for a request about to decode its latest token, as long as even all of them
        accepted (plus the bonus token) stays within max_tokens and max_model_len."""
        room = req.max_output_tokens - len(req.output_token_ids) - 1
        spec = req.spec
        if self.ngram is not None:
            spec.draft_token_ids = self.ngram.propose(req, room)
            if not spec.draft_token_ids:  # nothing to look up: decode (with lookahead) for a while
                spec.retry_at = len(req.output_token_ids) + NGRAM_RETRY_TOKENS
        elif room >= self.k:
            spec.draft_token_ids = [DRAFT_PLACEHOLDER] * self.k

    def release(self, req: Request) -> None:
        """req's seq_id ends: the draft worker may drop what it holds for it."""
        spec = req.spec
        if spec.draft_seq_id is not None:
            self.draft_releases.append(spec.draft_seq_id)
            spec.draft_seq_id = None

    def forget(self, req: Request) -> None:
        if self.ngram is not None:
            self.ngram.forget(req)

    def reset(self) -> None:
        """The pipeline was rebuilt: nothing is in flight, the draft worker holds nothing."""
        self.verifying_plans = 0
        self.draft_releases = []


def drafts_that_fit(req: Request, budget: int) -> int:
    """How many of req's drafts ride behind its last token in a step with `budget` tokens left:
    as many as fit, as long as even all of them accepted (plus the bonus token) stays within
    max_tokens and max_model_len; a draft model's placeholders go all k or none."""
    drafts = req.spec.draft_token_ids
    room = req.max_output_tokens - len(req.output_token_ids)
    num_draft = max(0, min(len(drafts), budget - 1, room - 1))
    if num_draft < len(drafts) and drafts[0] == DRAFT_PLACEHOLDER:
        return 0  # a draft model proposes k tokens or none
    return num_draft


def rollback(req: Request, rejected: int, block_manager: KVBlockManager) -> None:
    """Rolls back the slots of `rejected` drafts and the blocks past the accepted tokens."""
    req.num_computed_tokens -= rejected
    kept = cdiv(req.num_computed_tokens, block_manager.block_size)
    block_manager.truncate(req, kept)
    req.num_synced_blocks = min(req.num_synced_blocks, kept)
    req.spec.draft_synced_blocks = min(req.spec.draft_synced_blocks, kept)


class Acceptance:
    """Verify steps, drafts verified and drafts accepted by position: the spec_decode_* stats."""

    def __init__(self, k: int) -> None:
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = [0] * k  # accepted[i]: verify steps that accepted draft i

    def record(self, num_draft: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += num_draft
        if accepted > len(self.accepted):
            self.accepted.extend([0] * (accepted - len(self.accepted)))
        for position in range(accepted):
            self.accepted[position] += 1

    def fill_stats(self, stats: engine_pb2.SchedulerStats) -> None:
        stats.spec_decode_drafts = self.drafts
        stats.spec_decode_draft_tokens = self.draft_tokens
        stats.spec_decode_accepted_tokens = sum(self.accepted)
        stats.spec_decode_accepted_per_position.extend(self.accepted)
        if self.draft_tokens:
            stats.spec_decode_acceptance_rate = sum(self.accepted) / self.draft_tokens
