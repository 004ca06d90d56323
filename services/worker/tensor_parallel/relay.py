"""Rank 0 speaks for its stage: the scheduler knows only rank 0's address, and rank 0 relays to
its peers (ranks 1 .. T-1, ordinary workers with a rank) what they need to run every plan with
it, as a client of their own Worker services:

- Describe: the peers' descriptions (found through the rank-0 store, rendezvous.py), checked to
  be this stage's other ranks; the stage's KV blocks are the fewest of any rank's.
- InitCache: each peer's own request, its links those of the next stage's rank of the same
  number (StageLink.rank_links); their receiving ends come back nested in rank 0's.
- OpenTokenLink: likewise, rank t of the last stage to rank t of stage 0.
- Steps: each plan's bytes as they arrived, written to every peer's plan socket from the event
  loop before rank 0's own step runs (plans are in flight ahead of the GPU, so a peer has its
  plan before the step's first collective; plan_socket.py says why a socket). A peer answers
  nothing but failures: any message, or the connection's end, breaks the group (the stage fails
  its steps as a lost stage's, and the scheduler rebuilds it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from strata.grpc_util import aio_channel
from strata.services.worker.tensor_parallel.plan_socket import SocketPeerSteps
from strata.stage_links import host_of
from strata.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger("strata.worker")

DESCRIBE_SECONDS = 5.0
INIT_CACHE_SECONDS = 600.0  # a peer's warm-up and graph capture run inside it


class PeersUnavailable(Exception):
    """Some peer is not registered, not reachable, or not this stage's rank."""


@dataclass
class Peer:
    rank: int
    address: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.WorkerStub
    plan_port: int = 0  # its plan socket's (plan_socket.py), from its Describe


def with_host(address: str, host: str) -> str:
    """address's port at `host`."""
    port = address.rsplit(":", 1)[-1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _nest(link: engine_pb2.StageLink, peers: list[Peer], replies: list[engine_pb2.StageLink]) -> None:
    """Peers' receiving ends into rank 0's link, each naming its worker; a rendezvous host is
    the peer's as rank 0 reaches it (the scheduler fixes rank 0's own)."""
    for peer, end in zip(peers, replies):
        entry = link.rank_links.add()
        entry.CopyFrom(end)
        entry.worker_address = peer.address
        if entry.rendezvous_address:
            entry.rendezvous_address = with_host(entry.rendezvous_address, host_of(peer.address))


def rank_link(link: engine_pb2.StageLink, rank: int, size: int) -> engine_pb2.StageLink:
    """Rank `rank`'s end of a link whose rank-0 end is `link` (rank 0: the link itself)."""
    if rank == 0:
        return link
    if len(link.rank_links) != size - 1:
        raise PeersUnavailable(
            f"the other end of the link has {len(link.rank_links) + 1} tensor-parallel rank(s), this stage {size}"
        )
    return link.rank_links[rank - 1]


class PeerRelay:
    """Rank 0's clients of its peers. rendezvous: this stage's store (rendezvous.py)."""

    def __init__(self, rendezvous, own: engine_pb2.WorkerDescription, token: str | None):
        self.rendezvous, self.own, self.token = rendezvous, own, token
        self.size = rendezvous.size
        self.peers: list[Peer] = []

    # ------------------------------------------------------------ describe

    async def describe(self) -> list[engine_pb2.WorkerDescription]:
        """The peers' descriptions, in rank order; PeersUnavailable until every one is up."""
        addresses = await asyncio.to_thread(self.rendezvous.peer_addresses)
        missing = [rank for rank, address in enumerate(addresses, 1) if not address]
        if missing:
            raise PeersUnavailable(
                f"tensor-parallel rank(s) {', '.join(map(str, missing))} of stage {self.own.stage_index} not registered yet"
            )
        await self._connect(addresses)
        try:
            found = await asyncio.gather(
                *(p.stub.Describe(engine_pb2.DescribeRequest(), timeout=DESCRIBE_SECONDS) for p in self.peers)
            )
        except grpc.aio.AioRpcError as e:
            raise PeersUnavailable(f"a tensor-parallel peer is unreachable: {e.details()}") from None
        for peer, d in zip(self.peers, found):
            self._check(peer, d)
            peer.plan_port = d.tensor_parallel_plan_port
        return list(found)

    async def _connect(self, addresses: list[str]) -> None:
        kept = []
        for rank, address in enumerate(addresses, 1):
            old = self.peers[rank - 1] if len(self.peers) >= rank else None
            if old is not None and old.address == address:
                kept.append(old)
                continue
            if old is not None:
                await old.channel.close()
            channel = aio_channel(address, self.token)
            kept.append(Peer(rank, address, channel, engine_pb2_grpc.WorkerStub(channel)))
        self.peers = kept

    def _check(self, peer: Peer, d: engine_pb2.WorkerDescription) -> None:
        own = self.own
        problem = None
        if d.tensor_parallel_size != self.size or d.tensor_parallel_rank != peer.rank:
            problem = f"is rank {d.tensor_parallel_rank} of {d.tensor_parallel_size}, expected rank {peer.rank} of {self.size}"
        elif (d.stage_index, d.num_stages, d.layer_start, d.layer_end) != (
            own.stage_index,
            own.num_stages,
            own.layer_start,
            own.layer_end,
        ):
            problem = f"serves stage {d.stage_index} of {d.num_stages} (layers {d.layer_start}-{d.layer_end})"
        elif d.model_fingerprint != own.model_fingerprint or d.block_size != own.block_size:
            problem = "serves a different model or block size"
        elif not d.tensor_parallel_plan_port:
            problem = "listens for no plans"
        if problem:
            raise PeersUnavailable(f"tensor-parallel peer {peer.address} {problem}")

    # ------------------------------------------------------------ set-up calls

    async def _each(self, call: Callable, what: str) -> list:
        """call(peer) on every peer at once; a failure names the peer."""

        async def one(peer):
            try:
                return await call(peer)
            except grpc.aio.AioRpcError as e:
                raise PeersUnavailable(
                    f"{what} on tensor-parallel rank {peer.rank} ({peer.address}): {e.details()}"
                ) from None

        return list(await asyncio.gather(*(one(p) for p in self.peers)))

    async def init_cache(self, request: engine_pb2.InitCacheRequest) -> list[engine_pb2.InitCacheReply]:
        """Each peer's InitCache: rank t's link out is the next stage's rank t's end."""
        if not self.peers:
            raise PeersUnavailable("the peers were never described (Describe first)")
        requests = []
        for peer in self.peers:
            r = engine_pb2.InitCacheRequest()
            r.CopyFrom(request)
            if request.next_stage_address:
                end = rank_link(request.next_stage_link, peer.rank, self.size)
                r.next_stage_link.CopyFrom(end)
                r.next_stage_address = end.worker_address
            requests.append(r)

        async def call(peer):
            return await peer.stub.InitCache(requests[peer.rank - 1], timeout=INIT_CACHE_SECONDS)

        return await self._each(call, "InitCache")

    def nest_links(self, link: engine_pb2.StageLink, ends: list[engine_pb2.StageLink]) -> None:
        """The peers' receiving ends (from their replies, in rank order) into rank 0's `link`."""
        _nest(link, self.peers, ends)

    async def open_token_link(self, request: engine_pb2.TokenLinkRequest) -> list[engine_pb2.TokenLinkReply]:
        """Each peer's end of the token link: on stage 0 (receive) towards the last stage's rank
        of its number (found in that stage's Describe), on the last (send) with stage 0's rank's
        end."""
        requests = []
        if request.send:
            for peer in self.peers:
                r = engine_pb2.TokenLinkRequest()
                r.CopyFrom(request)
                end = rank_link(request.link, peer.rank, self.size)
                r.link.CopyFrom(end)
                r.peer_address = end.worker_address
                requests.append(r)
        else:
            async with aio_channel(request.peer_address, self.token) as channel:
                try:
                    last = await engine_pb2_grpc.WorkerStub(channel).Describe(
                        engine_pb2.DescribeRequest(), timeout=DESCRIBE_SECONDS
                    )
                except grpc.aio.AioRpcError as e:
                    raise PeersUnavailable(f"the last stage at {request.peer_address}: {e.details()}") from None
            if len(last.tensor_parallel_peers) != self.size - 1:
                raise PeersUnavailable(
                    f"the last stage has {len(last.tensor_parallel_peers) + 1} tensor-parallel rank(s), stage 0 {self.size}"
                )
            for peer in self.peers:
                r = engine_pb2.TokenLinkRequest()
                r.CopyFrom(request)
                r.peer_address = last.tensor_parallel_peers[peer.rank - 1]
                requests.append(r)

        async def call(peer):
            return await peer.stub.OpenTokenLink(requests[peer.rank - 1], timeout=120)

        return await self._each(call, "OpenTokenLink")

    # ------------------------------------------------------------ plans

    async def open_plans(self, session: int, on_lost: Callable[[str], None]) -> SocketPeerSteps:
        """A relay of one Steps call's plans to every peer's plan socket (plan_socket.py)."""
        relay = SocketPeerSteps(self.peers, session, self.token, on_lost)
        await relay.open(DESCRIBE_SECONDS)
        return relay

    async def close(self) -> None:
        for p in self.peers:
            await p.channel.close()
        self.peers = []
