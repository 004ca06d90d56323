"""Prefix sharing between requests of one parent: n > 1 siblings and explicit prefix groups.

Requests with the same parent_id share their first shared_len prompt tokens (checked once, when
they arrive). A sibling admitted after another one wrote those tokens takes its blocks instead of
computing them again (copying the shared partial block on write); while a sibling is still
computing them, the others wait (HOLD) rather than compute them twice.

An explicit prefix group (EngineRequest.group_size, the client's PrefixGroup) is admitted
together: it starts once all of its members arrived, its prefix plus every member's own first
blocks fit beside what started groups hold in reserve, and its members find running seats
(max_num_seqs) beside the seats other started groups hold; its full prefix blocks are pinned (kept
out of the free queue) until its last member ends, so members admitted later, or re-admitted after
a preemption, find them. Held seats keep a group together: without them, the next groups' first
members took the seats of members waiting for their prefix, and a group's first member decoded
alone beside the others' runs (a long context outside every shared-KV run, the cascade's slowest
program) while its siblings waited a whole wave.

Which sequences of a step share KV blocks, however they came to share them, is another question,
answered per step for cascade attention: shared_kv_runs.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from strata.services.scheduler.block_manager import KVBlockManager, cdiv
from strata.services.scheduler.request import RequestStatus

if TYPE_CHECKING:
    from strata.services.scheduler.request import Request

HOLD = object()  # admission verdict: wait for a sibling's prompt instead of computing it again
NO_ROOM = object()  # admission verdict: a prefix group cannot start before blocks are freed


@dataclass(slots=True)
class SharingState:
    """One request's prefix sharing."""

    num_shared_blocks: int = 0  # leading full blocks it took from others at its latest admission
    reserved_blocks: int = 0  # blocks its started prefix group holds for its admission
    has_seat: bool = False  # its started prefix group holds a running seat for its admission


@dataclass
class PrefixGroup:
    """An explicit prefix group (EngineRequest.group_size): admitted together, prefix pinned."""

    size: int  # members still expected to run (aborted ones before the start no longer count)
    started: bool = False
    pinned: list[int] = field(default_factory=list)  # full prefix blocks held until the last member ends


class PrefixSharing:
    """The scheduler's families (requests by parent_id) and prefix groups."""

    def __init__(self, block_size: int, max_num_seqs: int) -> None:
        self.block_size = block_size
        # A group larger than this many seats starts with what is free (at least this many) and
        # its other members compete for seats as other requests do: waiting for all of its seats
        # would leave the rest of the batch empty (16 x 400 at 512 seats: a second group must
        # start in the 112 seats the first leaves).
        self.min_seats_to_start = max(1, max_num_seqs // 8)
        self.families: dict[str, list[Request]] = {}  # parent_id -> unfinished children or group members
        self.prefix_groups: dict[str, PrefixGroup] = {}  # explicit prefix groups, by parent_id
        self.reserved_blocks = 0  # promised to members of started groups not admitted yet
        self.reserved_seats = 0  # running seats promised to members of started groups not admitted yet

    # ------------------------------------------------------------------ arrival

    def check(self, req: Request) -> None:
        """Requests that share a parent share their first shared_len tokens: checked once here,
        so admission can take a sibling's blocks without comparing tokens."""
        if req.shared_prefix_len >= req.num_prompt_tokens:
            raise ValueError("shared_prefix_len must leave at least one prompt token of the request's own")
        if req.group_size and not req.shared_prefix_len:
            raise ValueError("a prefix group's members need shared_prefix_len")
        siblings = self.families.get(req.parent_id)
        if not siblings:
            return
        first = siblings[0]
        n = req.shared_len
        if (
            n != first.shared_len
            or req.group_size != first.group_size
            or req.prompt_token_ids[:n] != first.prompt_token_ids[:n]
        ):
            raise ValueError(
                f"requests of {req.parent_id!r} must share their first {first.shared_len} tokens "
                f"and group_size {first.group_size}"
            )
        group = self.prefix_groups.get(req.parent_id)
        if group is not None and (group.started or len(siblings) >= group.size):
            raise ValueError(f"prefix group {req.parent_id!r} already has its {group.size} members")

    def add(self, req: Request) -> None:
        self.families.setdefault(req.parent_id, []).append(req)
        if req.group_size and req.parent_id not in self.prefix_groups:
            self.prefix_groups[req.parent_id] = PrefixGroup(req.group_size)

    def rejected(self, req: Request) -> None:
        """A prefix group's other members no longer wait for a member that was rejected."""
        if not req.group_size or req.parent_id in self.families and req in self.families[req.parent_id]:
            return
        group = self.prefix_groups.setdefault(req.parent_id, PrefixGroup(req.group_size))
        group.size -= 1
        if group.size <= 0 and req.parent_id not in self.families:
            del self.prefix_groups[req.parent_id]

    # ------------------------------------------------------------------ admission

    def shared_prefix(
        self, req: Request, step_id: int, bm: KVBlockManager, free_seats: int
    ) -> tuple[list[int], int] | object | None:
        """What req, about to be admitted, takes from its siblings: (blocks, tokens) instead of
        computing them; HOLD to wait for a sibling or the group's other members; NO_ROOM when its
        prefix group cannot start yet; None when req computes them itself (the prefix cache may
        still hold them). free_seats: running seats neither taken nor held for started groups."""
        group = self.prefix_groups.get(req.parent_id) if req.group_size else None
        if group is not None and not group.started:
            verdict = self._start_group(req, group, bm, free_seats)
            if verdict is not True:
                return verdict
        if not req.parent_id:
            return None
        need = req.shared_len
        if req.num_preemptions == 0:  # first admission
            source = self._sibling_source(req, need, step_id, bm)
            if source is not None and source is not HOLD:
                return source.blocks.block_ids[: cdiv(need, self.block_size)], need
            if source is HOLD and not (group and group.pinned):
                return HOLD
        if group is not None and group.pinned:
            return list(group.pinned), len(group.pinned) * self.block_size
        return None

    def reserved_for_others(self, req: Request) -> int:
        """Free blocks that started prefix groups hold for members other than req."""
        return self.reserved_blocks - req.sharing.reserved_blocks

    def admitted(self, req: Request) -> None:
        """req took its blocks and its seat: its group's reservations for it end."""
        self._release(req.sharing)

    def _release(self, state: SharingState) -> None:
        self.reserved_blocks -= state.reserved_blocks
        state.reserved_blocks = 0
        self.reserved_seats -= state.has_seat
        state.has_seat = False

    def _start_group(self, req: Request, group: PrefixGroup, bm: KVBlockManager, free_seats: int) -> bool | object:
        """A prefix group starts once all of its members arrived, its prefix plus every member's
        own first blocks fit beside what started groups hold in reserve, and its members find
        seats. True: start (the blocks and seats of the members admitted later are reserved); HOLD:
        members are missing; NO_ROOM: not enough free blocks or seats yet."""
        members = self.families[req.parent_id]
        if len(members) < group.size:
            return HOLD
        seats = min(len(members), free_seats)
        if seats < min(len(members), self.min_seats_to_start):
            return NO_ROOM
        bs = self.block_size
        shared_blocks = members[0].shared_len // bs
        own = [cdiv(m.num_prompt_tokens, bs) - shared_blocks for m in members]
        if shared_blocks + sum(own) > bm.num_blocks:
            # More than the whole cache: with every member's blocks reserved it could never start.
            # Only its prefix is held; its members compete for blocks as other requests do.
            own = [0] * len(own)
        if shared_blocks + sum(own) > bm.num_free_blocks - self.reserved_blocks:
            return NO_ROOM
        group.started = True
        for member, blocks in zip(members, own):
            member.sharing.reserved_blocks = blocks
            self.reserved_blocks += blocks
        # req (admitted now) first, then the others in arrival order.
        for member in [req] + [m for m in members if m is not req][: seats - 1]:
            member.sharing.has_seat = True
        self.reserved_seats += seats
        return True

    def _sibling_source(self, req: Request, need: int, step_id: int, bm: KVBlockManager) -> Request | object | None:
        """A running sibling whose shared prefix (need tokens) is written by an earlier plan:
        share it. HOLD while a sibling is still computing it; None when no sibling is running."""
        computing = False
        for other in self.families.get(req.parent_id, ()):
            if other is req or other.status is not RequestStatus.RUNNING:
                continue
            # Copies run before the step, so what this step adds does not count, nor a table
            # whose block this step copies (the copy's contents do not exist yet).
            if other.last_scheduled_step != step_id:
                written = other.num_computed_tokens
            elif other.last_copy_step != step_id:
                written = other.num_computed_at_step_start
            else:
                written = 0
            if written >= need:
                group = self.prefix_groups.get(req.parent_id)
                if group is not None and not group.pinned:
                    self._pin(group, other.blocks.block_ids[: need // self.block_size], bm)
                return other
            computing = True
        return HOLD if computing else None

    def _pin(self, group: PrefixGroup, blocks: list[int], bm: KVBlockManager) -> None:
        """Keeps the group's full prefix blocks out of the free queue until its last member ends."""
        if blocks:
            bm.pin(blocks)
            group.pinned = list(blocks)

    # ------------------------------------------------------------------ the end of a request

    def keep_group_prefix(self, req: Request, bm: KVBlockManager) -> None:
        """A prefix group's member that ends before anyone pinned the prefix (one that finishes in
        its prefill step, or the only one running when the group is larger than the cache) pins
        the prefix blocks it computed for the members still to run. Called before its blocks
        are freed."""
        group = self.prefix_groups.get(req.parent_id)
        if group is None or group.pinned or len(self.families[req.parent_id]) < 2:
            return
        full = req.shared_len // self.block_size
        if req.num_computed_tokens >= full * self.block_size:
            self._pin(group, req.blocks.block_ids[:full], bm)

    def finished(self, req: Request, bm: KVBlockManager) -> None:
        """req (with a parent_id) ended: it leaves its family; the last to leave unpins the prefix."""
        self._release(req.sharing)
        siblings = self.families[req.parent_id]
        siblings.remove(req)
        group = self.prefix_groups.get(req.parent_id)
        if group is not None and not group.started:
            group.size -= 1  # cancelled before the start: the others no longer wait for it
        if not siblings:
            del self.families[req.parent_id]
            if group is not None:
                bm.unpin(group.pinned)
                del self.prefix_groups[req.parent_id]

    def reset(self) -> None:
        """The pool was rebuilt: nothing is pinned any more."""
        for group in self.prefix_groups.values():
            group.pinned = []
