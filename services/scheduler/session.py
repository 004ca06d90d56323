"""One gateway's Session (engine.proto): every request of that gateway over one stream.

Submits and cancels come in; what the requests produced goes back as one SessionOutputs message
carrying each ready request's merged output (OutputStream). With a Submit call per request, a step
of 16 streams cost the scheduler and the gateway 16 gRPC messages each and a request a call of its
own (about 0.5 ms of CPU a side), which spread a burst's arrivals over several steps; here a step
costs one message. A gateway that closes its side gets its requests' outputs to the end; one that
goes away (the call cancelled, the connection lost) has its requests aborted: nothing it started
outlives its session.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc

from strata.services.scheduler.engine import Engine
from strata.services.scheduler.output_stream import OutputStream, RequestFailed
from strata.services.scheduler.request import Request
from strata.v1 import engine_pb2

# Prompt logprob rows one message carries before the other ready outputs wait for the next: each
# request's rows fit the gateway's response limit, but a step's worth of them together need not.
MESSAGE_PROMPT_LOGPROB_BYTES = 64 << 20


class Session:
    """parse(EngineRequest) -> Request, raising ValueError for what Submit refuses as INVALID_ARGUMENT."""

    def __init__(self, engine: Engine, parse: Callable[[engine_pb2.EngineRequest], Request]):
        self.engine = engine
        self.parse = parse
        self.streams: dict[str, OutputStream] = {}  # this session's running requests
        self._ready: dict[str, OutputStream] = {}  # those with something to send (insertion-ordered)
        self._failures: list[engine_pb2.SessionFailure] = []
        self._waiting: dict[str, asyncio.Task] = {}  # submits waiting for the pipeline to be ready
        self._wake = asyncio.Event()

    async def run(self, requests: AsyncIterator[engine_pb2.SessionRequest]) -> AsyncIterator[engine_pb2.SessionOutputs]:
        """The session's messages: after the gateway closes its side, until its last request ends.
        A gateway gone (the call cancelled) ends it at once."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if reader.done():
                    reader.result()  # an undecodable message's abort, or the peer's error
                message = self._message()
                if message is not None:
                    yield message
                if reader.done() and not (self.streams or self._waiting or self._failures):
                    return
        finally:
            reader.cancel()
            self._abort_all()

    async def _read(self, requests: AsyncIterator[engine_pb2.SessionRequest]) -> None:
        try:
            async for message in requests:
                for request in message.submit:
                    self._submit(request)
                for request_id in message.cancel:
                    self._cancel(request_id)
        finally:
            self._wake.set()

    # ------------------------------------------------------------ requests in

    def _submit(self, msg: engine_pb2.EngineRequest) -> None:
        if msg.request_id in self._waiting:
            self._fail(
                msg.request_id, RequestFailed("ALREADY_EXISTS", f"request_id {msg.request_id!r} is already running")
            )
        elif self.engine.ready:
            self._admit(msg)
        else:  # the model's limits are unknown while the pipeline reconnects: as Submit, wait for it
            self._waiting[msg.request_id] = asyncio.create_task(self._admit_when_ready(msg))

    async def _admit_when_ready(self, msg: engine_pb2.EngineRequest) -> None:
        try:
            await self.engine.wait_ready()
        except RequestFailed as e:
            self._fail(msg.request_id, e)
            return
        finally:
            self._waiting.pop(msg.request_id, None)
        self._admit(msg)

    def _admit(self, msg: engine_pb2.EngineRequest) -> None:
        try:
            request = self.parse(msg)
            self.streams[msg.request_id] = self.engine.add(request, msg.final_only, self._mark_ready)
        except ValueError as e:
            self._fail(msg.request_id, RequestFailed("INVALID_ARGUMENT", str(e)))
        except RequestFailed as e:
            self._fail(msg.request_id, e)

    def _cancel(self, request_id: str) -> None:
        """The gateway is done with it (an id already finished is no error: the two crossed)."""
        waiting = self._waiting.pop(request_id, None)
        if waiting is not None:
            waiting.cancel()
        if self.streams.pop(request_id, None) is not None:
            self.engine.abort(request_id)

    def _abort_all(self) -> None:
        for task in self._waiting.values():
            task.cancel()
        self._waiting.clear()
        streams, self.streams = self.streams, {}
        for request_id in streams:
            self.engine.abort(request_id)

    # ------------------------------------------------------------ outputs back

    def _mark_ready(self, stream: OutputStream) -> None:
        self._ready[stream.request_id] = stream
        self._wake.set()

    def _fail(self, request_id: str, failure: RequestFailed) -> None:
        code = grpc.StatusCode[failure.code].value[0]
        self._failures.append(engine_pb2.SessionFailure(request_id=request_id, code=code, message=failure.message))
        self._wake.set()

    def _message(self) -> engine_pb2.SessionOutputs | None:
        """Every ready request's output (and failures) as one message; None when there is none."""
        outputs = []
        budget = MESSAGE_PROMPT_LOGPROB_BYTES
        ready, self._ready = self._ready, {}
        for request_id, stream in ready.items():
            if self.streams.get(request_id) is not stream:
                continue  # cancelled by the gateway meanwhile: it wants nothing more
            if budget <= 0:
                self._ready[request_id] = stream  # the next message's
                continue
            try:
                out = stream.take()
            except RequestFailed as e:
                del self.streams[request_id]
                self._fail(request_id, e)
                continue
            if out.HasField("prompt_logprobs"):
                budget -= out.prompt_logprobs.ByteSize()
            if out.finish_reason:
                del self.streams[request_id]
            outputs.append(out)
        if self._ready:
            self._wake.set()
        failures, self._failures = self._failures, []
        if not outputs and not failures:
            return None
        return engine_pb2.SessionOutputs(outputs=outputs, failures=failures)
