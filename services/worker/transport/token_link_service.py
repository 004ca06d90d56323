"""The Worker service's token link (pipelined decode over several stages): stage 0 opens the
receiving end and calls the last stage's HandTokens, the last stage opens the sending end, and
each sampling step's tokens go from the last stage to stage 0 (token_handoff.py, token_waits.py).
With tensor parallelism each rank of the last stage hands to stage 0's rank of its number, and
rank 0 relays the set-up to its peers (tensor_parallel/relay.py). A mixin of WorkerServicer
(server.py), whose state it uses: the runner, the link session, the stage's ranks.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from strata.grpc_util import aio_channel
from strata.services.worker.tensor_parallel.ranks import PeersUnavailable
from strata.services.worker.transport.token_handoff import DraftIntake, TokenIntake, TokenOutlet
from strata.services.worker.transport.token_link_ends import TOKEN_RING_SLOTS, open_token_receiver, open_token_sender
from strata.stage_links import TransportError, name_of
from strata.v1 import engine_pb2, engine_pb2_grpc

log = logging.getLogger("strata.worker")


class TokenLinkService:
    async def OpenTokenLink(self, request, context):
        """Pipelined decode: stage 0 opens the receiving end of the token link, returns it and
        calls the last stage's HandTokens; the last stage opens the sending end with it (after
        InitCache of the same session)."""
        runner = self.runner
        if not request.session or request.session != self._link_session:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "OpenTokenLink needs InitCache of its session first"
            )
        if request.drafts:  # the draft link: draft worker -> the one target stage
            if request.send != self.description.draft or not (runner.is_first and runner.is_last):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, "the draft link runs from a draft worker to a one-stage target"
                )
            if not request.send and runner.spec is None:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "this target keeps no drafts on its device (--speculative-method)",
                )
        elif runner.is_first == runner.is_last or request.send != runner.is_last:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the token link runs from the last stage to stage 0 of several"
            )
        if not 0 <= request.transport_timeout_seconds <= 3600:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "transport_timeout_seconds must be in [0, 3600]")
        if request.drafts and self.ranks.size > 1:  # the scheduler then fills drafts into the plans
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no draft link to a tensor-parallel stage")
        await self._close_token_link()
        try:
            peer_replies = await self.ranks.token_link_peers(request)
        except PeersUnavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        reply = engine_pb2.TokenLinkReply()
        loop = asyncio.get_running_loop()
        try:
            if not request.send:
                timeout = request.transport_timeout_seconds or 120.0
                max_tokens = runner.table.block_tables.shape[0]  # one per sequence, or k drafts each
                intake = (
                    DraftIntake(runner.last_sampled, timeout)
                    if request.drafts
                    else TokenIntake(runner.last_sampled, timeout)
                )
                receiver = open_token_receiver(
                    request,
                    intake,
                    max_tokens=max_tokens * (runner.spec.max_k if request.drafts else 1),
                    vocab_size=runner.config.vocab_size,
                    slots=TOKEN_RING_SLOTS,
                )
                self._token_receiver = receiver
                runner.handoff = intake
                reply.link.CopyFrom(receiver.link())
                self.ranks.nest(reply.link, [r.link for r in peer_replies])
                self._token_task = asyncio.create_task(self._take_tokens_from(request.peer_address, receiver))
            else:
                queue: asyncio.Queue = asyncio.Queue()

                def emit(msg, queue=queue):  # from any thread
                    loop.call_soon_threadsafe(queue.put_nowait, msg)

                self._token_sender = open_token_sender(request, emit, device=runner.device)
                self._token_queue = queue
                if not request.drafts:  # (a draft worker hands its proposals itself: draft_steps.py)
                    runner.handoff = TokenOutlet(runner.last_sampled)
        except (TransportError, RuntimeError, ValueError) as e:
            await self._close_token_link()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"token link: {e}")
        ends = ("to the target", "from the draft worker") if request.drafts else ("to stage 0", "from the last stage")
        log.info(
            "stage %d: %s link %s by %s (session %d)",
            runner.stage_index,
            "draft" if request.drafts else "token",
            ends[0] if request.send else ends[1],
            name_of(request.transport),
            request.session,
        )
        return reply

    async def _take_tokens_from(self, address: str, receiver) -> None:
        """Stage 0: the HandTokens stream from the last stage, its tokens into the intake and
        credits back. When it ends, steps waiting for tokens fail at once (the scheduler rebuilds
        the pipeline around a lost last stage)."""

        async def credits():
            yield engine_pb2.TokenCredit(session=receiver.session, hello=True)
            while (ack := await receiver.acks.get()) is not None:
                yield engine_pb2.TokenCredit(session=receiver.session, step_id=ack.step_id, slot=ack.slot)

        try:
            async with aio_channel(address, self.token) as channel:
                stub = engine_pb2_grpc.WorkerStub(channel)
                async for msg in stub.HandTokens(credits(), wait_for_ready=True):
                    if msg.session == receiver.session:
                        receiver.deliver_tokens(msg)
        except grpc.aio.AioRpcError as e:
            log.warning("token stream from %s ended: %s", address, e.details())
        finally:
            receiver.intake.close("the last stage's token stream ended")

    async def HandTokens(self, request_iterator, context):
        """The last stage: each sampling step's tokens to stage 0, which called."""
        hello = await anext(aiter(request_iterator), None)
        if hello is None or not hello.hello:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "HandTokens starts with a hello naming the session")
        # Stage 0 calls as soon as its end is open; this end opens right after (OpenTokenLink).
        deadline = time.monotonic() + 60.0
        while self._token_sender is None or self._token_sender.session != hello.session:
            if time.monotonic() > deadline:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no token link of session {hello.session}")
            await asyncio.sleep(0.01)
        sender, queue = self._token_sender, self._token_queue
        if sender is None or sender.session != hello.session:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no token link of session {hello.session}")

        async def read():
            async for credit in request_iterator:
                sender.on_ack(engine_pb2.ForwardAck(step_id=credit.step_id, slot=credit.slot))

        reader = asyncio.create_task(read())
        try:
            while (msg := await queue.get()) is not None:
                yield msg
        finally:
            reader.cancel()

    async def _close_token_link(self) -> None:
        self.runner.handoff = None
        if self._token_sender is not None:
            self._token_sender.close()
            self._token_sender = None
        if self._token_queue is not None:
            self._token_queue.put_nowait(None)  # ends the HandTokens call serving it
            self._token_queue = None
        if self._token_receiver is not None:
            self._token_receiver.close()  # a step waiting for tokens fails; the credits end
            self._token_receiver = None
        if self._token_task is not None:
            self._token_task.cancel()
            try:
                await self._token_task
            except (asyncio.CancelledError, Exception):
                pass
            self._token_task = None
