"""A worker's place in its stage's tensor-parallel group, as the Worker service (server.py) uses
it: the group (group.py), the rank-0 store (rendezvous.py) and, on rank 0, the relay to its
peers (relay.py). With one rank every part is a no-op and the worker serves as it always did.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from strata.services.worker.tensor_parallel.group import ABORT_GRACE_SECONDS, TensorParallelGroup, single_rank
from strata.services.worker.tensor_parallel.plan_socket import SocketPeerSteps
from strata.services.worker.tensor_parallel.relay import PeerRelay, PeersUnavailable
from strata.services.worker.tensor_parallel.rendezvous import Rendezvous
from strata.v1 import engine_pb2

log = logging.getLogger("strata.worker")

__all__ = ["StageRanks", "PeersUnavailable"]


class StageRanks:
    def __init__(
        self, group: TensorParallelGroup, rendezvous: Rendezvous | None = None, relay: PeerRelay | None = None
    ):
        self.group, self.rendezvous, self.relay = group, rendezvous, relay

    @classmethod
    def single(cls, device: torch.device) -> StageRanks:
        return cls(single_rank(device))

    @classmethod
    def join(
        cls,
        group: TensorParallelGroup,
        master: str,
        advertise: str,
        description: engine_pb2.WorkerDescription,
        token: str | None,
    ) -> StageRanks:
        """The group's rank in a stage whose rank 0 hosts the store at `master` (rank 0 opens
        it here); advertise: this worker's address as the other ranks reach it."""
        if group.size == 1:
            return cls(group)
        rendezvous = Rendezvous(group.rank, group.size, master, advertise, group.timeout)
        relay = PeerRelay(rendezvous, description, token) if group.rank == 0 else None
        return cls(group, rendezvous, relay)

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def answers(self) -> bool:
        """Whether this worker answers for its stage (rank 0): results and Describe."""
        return self.group.rank == 0

    async def describe(self, own: engine_pb2.WorkerDescription) -> engine_pb2.WorkerDescription:
        """The stage as the scheduler sees it: rank 0's description with its peers listed and the
        fewest KV blocks of any rank; PeersUnavailable until every peer is up."""
        if self.relay is None:
            return own
        peers = await self.relay.describe()
        out = engine_pb2.WorkerDescription()
        out.CopyFrom(own)
        out.num_kv_blocks = min([own.num_kv_blocks, *(p.num_kv_blocks for p in peers)])
        del out.tensor_parallel_peers[:]
        out.tensor_parallel_peers.extend(p.address for p in self.relay.peers)
        return out

    def form(self, session: int) -> None:
        """On the step thread, inside InitCache: the group of `session` (every rank joins)."""
        if self.size > 1:
            self.group.form(self.rendezvous.group_store(), session)

    def abort(self, reason: str) -> None:
        self.group.abort(reason)

    def fail(self, reason: str) -> None:
        self.group.fail(reason)

    def vouch(self, result):
        """A fetched step's result, or a lost peer's failure in its place when the group broke
        before the step ended: the abort releases kernels that waited for the lost rank with
        partial sums, so their tokens are garbage (the scheduler then rebuilds the stage)."""
        broken = self.group.broken
        if broken is None or not isinstance(result, engine_pb2.StepResult) or result.error:
            return result
        return engine_pb2.StepResult(step_id=result.step_id, error=f"tensor parallel: {broken}", peer_lost=True)

    async def init_peers(self, request: engine_pb2.InitCacheRequest) -> list[engine_pb2.InitCacheReply]:
        return await self.relay.init_cache(request) if self.relay is not None else []

    async def token_link_peers(self, request: engine_pb2.TokenLinkRequest) -> list[engine_pb2.TokenLinkReply]:
        return await self.relay.open_token_link(request) if self.relay is not None else []

    def nest(self, link: engine_pb2.StageLink, ends: list[engine_pb2.StageLink]) -> None:
        if self.relay is not None:
            self.relay.nest_links(link, ends)

    async def open_plans(self, session: int, on_lost) -> SocketPeerSteps | None:
        """Rank 0: a relay of one Steps call's plans to every peer (session: the InitCache's);
        on_lost(reason) when a peer is lost (the caller breaks the group)."""
        return await self.relay.open_plans(session, on_lost) if self.relay is not None else None

    async def close(self) -> None:
        self.group.abort("the worker is stopping")
        if self.group.aborting is not None:  # NCCL's teardown ends before the process does (or the grace passes)
            await asyncio.to_thread(self.group.aborting.join, min(self.group.timeout, ABORT_GRACE_SECONDS))
        if self.relay is not None:
            await self.relay.close()
        if self.rendezvous is not None:
            self.rendezvous.close()
