"""One request's speculation state (req.spec): its drafts for the next step, its k, what the last
stage holds of it and what a draft worker holds of it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecState:
    """One request's speculation: its drafts for the next step, its k, what the last stage holds
    of it (device proposals) and the draft worker's view of it."""

    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next step (consumed by it)
    retry_at: int = 0  # output tokens before it speculates again (after a proposal found nothing)
    k: int = 0  # drafts it proposes now (AdaptiveK); set at admission
    expected: float = 0.0  # tokens a verify step of its k drafts emits on average (0: not known yet)
    accepted: float = 0.0  # AdaptiveK's decayed counts: drafts accepted, proposals that ended in a miss
    missed: float = 0.0
    found: float = -1.0  # AdaptiveK: drafts a proposal holds on average (-1: none seen yet)
    backoff: int = 0  # tokens it stays off after its acceptance fell too low (doubles each time)
    # Device proposals (proposer "device"), per admission (seq_id):
    on_device: bool = False  # its drafts stay on the last stage's device (one stage, no controls)
    unfiltered: bool = False  # its draws take the logits as they are (sampling_rules.draws_unfiltered)
    proposed: int = 0  # drafts its latest plan asked the last stage to propose for the next step
    last_proposed: int = 0  # drafts the latest result said were found (0: no match)
    returned: list[int] = field(default_factory=list)  # drafts a result returned, for the next plan
    rejected: int = 0  # draft tokens rejected since admission, as results reported them
    verifies_in_flight: int = 0  # plans in flight verifying its drafts
    max_pending: int = 0  # tokens its plans in flight emit at most (all drafts accepted)
    verify_pending: bool = False  # its latest plan verifies drafts
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

    def admitted(self) -> None:
        """A new seq_id (admission, re-admission): the last stage holds nothing of it yet."""
        self.proposed = self.last_proposed = self.rejected = 0
        self.verifies_in_flight = self.max_pending = 0
        self.verify_pending = False
        self.returned = []
        self.draft_token_ids = []
