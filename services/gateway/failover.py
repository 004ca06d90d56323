"""A child request that survives its replica (data parallelism).

A Route is where one public request's children (or one prefix group's members) run: a replica
chosen once for all of them (routing.py), so n > 1 siblings and group members share their
prefix there. Route.Submit(child) stands in for the scheduler stub's Submit (fanout.py calls it
alike): it returns a ReplicaCall, an async iterable of the child's EngineOutputs with cancel().

When the replica is lost (its calls fail with UNAVAILABLE: the scheduler is gone or says its
pipeline is; or the replica set sees it not serving for longer than --replica-failover-seconds,
replicas.py), the route moves to another replica that is up, and with it every child of the
route still running there: each is cancelled there and submitted again with
resume_output_token_ids, the tokens it had streamed so far. The scheduler admits it as a
preempted request, recomputing prompt and those tokens, and as draws derive from (seed,
position) the tokens that follow are those the lost replica would have drawn; the stream just
goes on (the fan-out, the detokenizer and the timers never see the move). A child that asked
for its output only at the end (FINAL_ONLY) had received nothing and starts again from its
prompt, with the same seed. Other failures (INVALID_ARGUMENT, INTERNAL: a bug must not repeat
elsewhere) fail the child as before, and so does a loss with no other replica up.

After a move the route's requests form a new family on the new replica: parent_id gets the
move's number and a prefix group's members no longer wait for one another there (group_size
0; those still to arrive would never complete the count), sharing their prefix as siblings do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import grpc

from strata.services.gateway.scheduler_session import rpc_error
from strata.v1 import engine_pb2

if TYPE_CHECKING:
    from strata.services.gateway.replicas import Replica, ReplicaSet

# Moves one child may make: a request that loses three replicas in a row meets a bigger problem.
MAX_RESUMES = 3


class Route:
    """Where a request's children (or a group's members) run, and the calls running there."""

    def __init__(self, replicas: ReplicaSet, replica: Replica, prompt: Sequence[int], cost: int):
        self.replicas = replicas
        self.replica = replica
        self.prompt = prompt  # what routing keys on: the prompt, or a group's prefix
        self.cost = cost
        self.moves = 0
        self.calls: set[ReplicaCall] = set()

    def Submit(self, child: engine_pb2.EngineRequest, timeout: float | None = None) -> ReplicaCall:  # noqa: N802
        return ReplicaCall(self, child, timeout)

    def move_from(self, replica: Replica) -> bool:
        """The route leaves `replica` (lost) for the least-loaded other replica that is up, and
        so do its calls there. False when none is up. A route that already left it (a sibling's
        failure moved it) stays where it went."""
        if self.replica is not replica:
            return True
        target = self.replicas.replacement(self, replica)
        if target is None:
            return False
        self.replica = target
        self.moves += 1
        for call in list(self.calls):
            if call.replica is replica:
                call.move()
        return True

    def request_for(self, child: engine_pb2.EngineRequest, received: list[int], attempt: int):
        """The child's request as it goes out now: unchanged before any move; after one, in the
        route's new family, resuming after the tokens it already streamed."""
        if not self.moves and not attempt:
            return child
        msg = engine_pb2.EngineRequest()
        msg.CopyFrom(child)
        if attempt:  # a fresh id: the lost replica may still hold the old one a moment
            msg.request_id = f"{child.request_id}~{attempt}"
        if child.parent_id:
            msg.parent_id = f"{child.parent_id}~{self.moves}"
            msg.group_size = 0
        msg.resume_output_token_ids[:] = received
        if received:  # its first output, which brought its prompt logprobs, came: not again
            msg.sampling.ClearField("prompt_logprobs")
        return msg


class ReplicaCall:
    """One child's Submit on its route's replica, moved with the route when that replica is lost
    (module docstring). Charges the replica's load with the child's tokens while it runs there."""

    def __init__(self, route: Route, child: engine_pb2.EngineRequest, timeout: float | None):
        self.route = route
        self.child = child
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.received: list[int] = []  # every token the scheduler sent, whatever the text held back
        self.replica: Replica | None = None
        self.resumes = 0
        self.cancelled = False
        self._call = None
        self._moved = False
        self._charged = 0
        # Charged now, not when the reader starts: a burst of requests routes by it at once.
        self._charge(route.replica, len(child.prompt_token_ids))

    def __aiter__(self):
        return self._outputs()

    def cancel(self) -> bool:
        """The caller is done with it (finished, a stop string, the client went away)."""
        self.cancelled = True
        if self._call is not None:
            self._call.cancel()
        self._charge(None, 0)
        return True

    def move(self) -> None:
        """The route left this call's replica: cancel it there; the reader submits it again."""
        self._moved = True
        if self._call is not None:
            self._call.cancel()

    def _charge(self, replica: Replica | None, tokens: int) -> None:
        """Moves the call's load to `replica` (None: nowhere), `tokens` of it."""
        if self.replica is not None:
            self.replica.load_tokens -= self._charged
            self.replica.calls.discard(self)
        self.replica, self._charged = replica, tokens
        if replica is not None:
            replica.load_tokens += tokens
            replica.calls.add(self)

    def _timeout(self) -> float | None:
        return None if self.deadline is None else max(0.001, self.deadline - time.monotonic())

    async def _outputs(self):
        route = self.route
        route.calls.add(self)
        try:
            while not self.cancelled:
                replica = route.replica
                request = route.request_for(self.child, self.received, self.resumes)
                self._charge(replica, len(self.child.prompt_token_ids) + len(self.received))
                self._moved = False
                self._call = call = (replica.session or replica.stub).Submit(request, timeout=self._timeout())
                received = self.received
                try:
                    async for out in call:  # (one of the gateway's hottest loops: kept lean)
                        ids = out.token_ids
                        if ids:
                            received.extend(ids)
                            if self.replica is replica:  # (not after cancel() took its load back)
                                self._charged += len(ids)
                                replica.load_tokens += len(ids)
                        yield out
                    return
                except asyncio.CancelledError:
                    # A call cancelled by move() ends its reads so; a cancelled reader is another matter.
                    task = asyncio.current_task()
                    if not self._moved or self.cancelled or (task is not None and task.cancelling()):
                        raise
                except grpc.aio.AioRpcError as e:
                    if self.cancelled or not (self._moved or e.code() == grpc.StatusCode.UNAVAILABLE):
                        raise
                    if not self._moved:
                        route.replicas.mark_down(replica, e.details())
                    if not route.move_from(replica):
                        raise
                if self.resumes >= MAX_RESUMES:
                    raise rpc_error(
                        grpc.StatusCode.UNAVAILABLE, f"replicas lost {self.resumes + 1} times under this request"
                    )
                self.resumes += 1
                route.replicas.resumed(route.replica, self)
        finally:
            route.calls.discard(self)
            self._charge(None, 0)
