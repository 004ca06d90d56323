"""A verify step's outcome in the scheduler: the rejected drafts' slots rolled back, acceptance
counted (the spec_decode_* stats), each request's k adapted. The worker decided what was accepted
(services/worker/speculation/verification.py; on the device, kernels/spec_decode.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from strata.protocol import DEVICE_DRAFT
from strata.services.scheduler.block_manager import KVBlockManager, cdiv
from strata.v1 import engine_pb2

if TYPE_CHECKING:
    from strata.services.scheduler.plan import ScheduledSeq
    from strata.services.scheduler.request import Request
    from strata.services.scheduler.speculation.proposals import Speculation


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
        self.verify_steps = 0  # plans that carried drafts
        self.verify_rounds = 0  # verify rounds those plans ran (several a plan at small batches)

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
        stats.spec_decode_verify_steps = self.verify_steps
        stats.spec_decode_verify_rounds = self.verify_rounds
        if self.draft_tokens:
            stats.spec_decode_acceptance_rate = sum(self.accepted) / self.draft_tokens


def verified(
    req: Request,
    s: ScheduledSeq,
    emitted: int,
    per_round: tuple[list[int], list[int]] | None,
    block_manager: KVBlockManager,
    acceptance: Acceptance,
    speculation: Speculation | None,
) -> None:
    """A verify step's outcome (emitted tokens; per_round: each round's tokens and the drafts
    proposed after it): roll back the rejected drafts' slots (and the blocks past the
    accepted tokens), count the acceptance, adapt the request's k."""
    rejected = s.rounds * (s.num_draft + 1) - emitted
    if rejected:  # roll back the unaccepted draft slots and their surplus blocks
        rollback(req, rejected, block_manager)
    spec = req.spec
    spec.rejected += rejected
    spec.verifies_in_flight -= 1
    d = s.num_draft
    # Drafts the last stage looked up (some may be missing); a draft model's are all real.
    device = s.input_token_ids[-1] == DEVICE_DRAFT and speculation is not None and speculation.on_device
    # Per round: the drafts that were real (the last stage found this many: its previous
    # result, then each round's own proposal), the drafts accepted.
    if per_round is None:
        outcomes = [(min(d, spec.last_proposed) if device else d, emitted - 1)]
    else:
        tokens, proposed = per_round
        found = [spec.last_proposed] + proposed
        outcomes = [(min(d, found[r]), tokens[r] - 1) for r in range(s.rounds)]
    for valid, accepted in outcomes:
        if valid:
            acceptance.record(valid, accepted)
        if speculation is not None:
            speculation.record(req, d, valid, accepted)
