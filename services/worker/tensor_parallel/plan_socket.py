"""The plans' way from rank 0 to its peers: a TCP connection per peer and Steps stream, each plan's
bytes in a length-framed message, written from rank 0's event loop as the plan arrives.

Why a socket of its own and not a Steps stream of gRPC to each peer: measured on one host
(python -m strata.bench.plan_relay; bench/RESULTS.md), a gRPC write cost rank 0's process about
three times the CPU of a socket write per plan and peer, and three to four times the latency, and
rank 0's host work per step is what a tensor-parallel stage's step rate can hang on (every rank
does a whole step's). Everything else the relay does (Describe, InitCache, the token links) stays
on the peers' Worker services.

Frames: 4 bytes of length (little endian), then the payload. The first from rank 0 says who it
is: the InitCache session (8 bytes) and the cluster token, which the peer checks; then one frame
per plan, in step order. A peer writes back nothing but failures (a StepResult with its error, as
its Steps stream would); any frame from it, or the connection's end, breaks the group.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import struct
from collections.abc import Callable

from strata.stage_links import host_of
from strata.v1 import engine_pb2

log = logging.getLogger("strata.worker")

_LENGTH = struct.Struct("<I")
_SESSION = struct.Struct("<Q")
# A frame longer than this is a broken peer, not a plan (a plan of 16k prompt tokens is ~100 KB).
MAX_FRAME = 64 << 20


def frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame's payload; None at the connection's end (or a frame no peer sends)."""
    try:
        (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        if size > MAX_FRAME:
            return None
        return await reader.readexactly(size)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


def hello(session: int, token: str | None) -> bytes:
    return frame(_SESSION.pack(session) + (token or "").encode())


def read_hello(payload: bytes | None, token: str | None) -> int | None:
    """The session a connection's first frame names, if it carries this cluster's token."""
    if payload is None or len(payload) < _SESSION.size:
        return None
    if not hmac.compare_digest(payload[_SESSION.size :], (token or "").encode()):
        return None
    return _SESSION.unpack(payload[: _SESSION.size])[0]


class PlanListener:
    """A peer's listening socket for rank 0's plans; serve(session, reader, writer) takes each
    connection whose hello is good."""

    def __init__(self, token: str | None, serve):
        self.token, self.serve = token, serve
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self, host: str) -> int:
        self.server = await asyncio.start_server(self._connection, host, 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def _connection(self, reader, writer) -> None:
        session = read_hello(await read_frame(reader), self.token)
        if session is None:
            log.warning("tensor parallel: a plan connection without this cluster's hello, closed")
            writer.close()
            return
        try:
            await self.serve(session, reader, writer)
        except asyncio.CancelledError:
            # Only the worker's stop cancels it (rank 0's plans end the connection otherwise). On
            # Python 3.11 asyncio's stream callback asks a cancelled handler for its exception
            # and logs the CancelledError as an ERROR with a traceback: end as a closed connection.
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


class SocketPeerSteps:
    """One scheduler Steps call's relay over the peers' plan sockets: plans out as they come, and a
    watch on each connection, where anything that arrives (or its end) means the group is lost."""

    def __init__(self, peers, session: int, token: str | None, on_lost: Callable[[str], None]):
        self.peers, self.session, self.token, self.on_lost = peers, session, token, on_lost
        self.lost = False
        self.writers: list[asyncio.StreamWriter] = []
        self.watchers: list[asyncio.Task] = []

    def _lose(self, reason: str) -> None:
        if not self.lost:
            self.lost = True
            self.on_lost(reason)

    async def open(self, timeout: float) -> None:
        for peer in self.peers:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host_of(peer.address), peer.plan_port), timeout
                )
            except (OSError, asyncio.TimeoutError) as e:
                self._lose(f"tensor-parallel rank {peer.rank} ({peer.address}) takes no plans: {e}")
                return
            writer.write(hello(self.session, self.token))
            self.writers.append(writer)
            self.watchers.append(asyncio.create_task(self._watch(peer, reader)))

    async def _watch(self, peer, reader) -> None:
        payload = await read_frame(reader)
        if payload is None:
            self._lose(f"tensor-parallel rank {peer.rank} ({peer.address}) closed its plan connection")
            return
        try:
            result = engine_pb2.StepResult.FromString(payload)
            self._lose(f"tensor-parallel rank {peer.rank} failed step {result.step_id}: {result.error}")
        except Exception:
            self._lose(f"tensor-parallel rank {peer.rank} sent something else than a failure")

    async def write(self, raw: bytes) -> None:
        """A plan's bytes to every peer (its buffer full: this waits; a peer gone breaks the group)."""
        if self.lost:
            return
        message = frame(raw)
        try:
            for writer in self.writers:
                writer.write(message)
            for writer in self.writers:
                await writer.drain()  # (at once unless a peer's buffer is past its high-water mark)
        except ConnectionError as e:
            self._lose(f"a tensor-parallel peer took no plan: {e}")

    async def close(self) -> None:
        for task in self.watchers:
            task.cancel()
        for writer in self.writers:
            writer.close()
