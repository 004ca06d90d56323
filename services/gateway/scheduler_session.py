"""The gateway's end of a scheduler Session (engine.proto): every request this gateway runs on one
replica goes over one stream, opened on the first request and again after a loss.

SchedulerSession.Submit(request, timeout) stands in for the scheduler stub's Submit (failover.py
calls it alike) and returns a SessionCall that behaves as grpc.aio's call does: an async iterator
of the request's EngineOutputs that ends after the finished one, raises grpc.aio.AioRpcError on
failure or at its deadline and asyncio.CancelledError once cancel() was called. The requests
submitted or cancelled within one turn of the event loop go out as one message, and each message
back is read once and handed to the calls it names: per step, one message a side.

A lost stream fails every call on it with UNAVAILABLE (a status the scheduler sent passes as it
came), which is how a lost replica's calls have always failed: failover.py moves them.
"""

from __future__ import annotations

import asyncio
import collections
import logging

import grpc

from strata.v1 import engine_pb2

log = logging.getLogger("strata.gateway")


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class SessionCall:
    """One request on a session (module docstring)."""

    def __init__(self, session: SchedulerSession, request_id: str, timeout: float | None):
        self._session = session
        self.request_id = request_id
        self._outputs: collections.deque[engine_pb2.EngineOutput] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._error: grpc.aio.AioRpcError | None = None
        self._finished = False  # its last output came (or an error): nothing more will
        self._cancelled = False
        self._deadline = None if timeout is None else asyncio.get_running_loop().call_later(timeout, self._expire)

    def __aiter__(self):
        return self

    async def __anext__(self) -> engine_pb2.EngineOutput:
        while not self._outputs:
            if self._cancelled:
                raise asyncio.CancelledError
            if self._error is not None:
                raise self._error
            if self._finished:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._outputs.popleft()

    def cancel(self) -> bool:
        """Aborts the request in the scheduler (frees its blocks); False when it had ended."""
        if self._finished or self._cancelled:
            return False
        self._cancelled = True
        self._end()
        self._session.cancel(self)
        return True

    def deliver(self, output: engine_pb2.EngineOutput) -> None:
        self._outputs.append(output)
        if output.finish_reason:
            self._end()
        self._wake()

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        self._error = error
        self._end()
        self._wake()

    def _expire(self) -> None:
        self._deadline = None
        if not self._finished:
            self.fail(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self._session.cancel(self)

    def _end(self) -> None:
        self._finished = True
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class SchedulerSession:
    """stub: the replica's SchedulerStub; metadata: what each stream carries (the cluster token)."""

    def __init__(self, stub, metadata=()):
        self._stub = stub
        self._metadata = tuple(metadata)
        self._stream = None  # the open Session call
        self._tasks: list[asyncio.Task] = []  # its writer and reader
        self._calls: dict[str, SessionCall] = {}  # requests running on it, by id
        self._submits: list[engine_pb2.EngineRequest] = []  # for the next message
        self._cancels: list[str] = []
        self._outgoing = asyncio.Event()

    def Submit(self, request: engine_pb2.EngineRequest, timeout: float | None = None) -> SessionCall:  # noqa: N802
        call = SessionCall(self, request.request_id, timeout)
        if request.request_id in self._calls:  # as the scheduler would answer a second Submit
            call.fail(
                rpc_error(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request.request_id!r} is already running")
            )
            return call
        if self._stream is None:
            self._open()
        self._calls[request.request_id] = call
        self._submits.append(request)
        self._outgoing.set()
        return call

    def cancel(self, call: SessionCall) -> None:
        if self._calls.get(call.request_id) is call:
            del self._calls[call.request_id]
            self._cancels.append(call.request_id)
            self._outgoing.set()

    async def close(self) -> None:
        """Ends the stream (the scheduler aborts what still runs on it)."""
        if self._stream is not None:
            self._lost(self._stream, rpc_error(grpc.StatusCode.UNAVAILABLE, "the gateway is closing"))

    def _open(self) -> None:
        stream = self._stub.Session(metadata=self._metadata)
        self._stream = stream
        self._tasks = [asyncio.create_task(self._write(stream)), asyncio.create_task(self._read(stream))]

    async def _write(self, stream) -> None:
        try:
            while True:
                await self._outgoing.wait()
                self._outgoing.clear()
                message = engine_pb2.SessionRequest(submit=self._submits, cancel=self._cancels)
                self._submits, self._cancels = [], []
                await stream.write(message)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            pass  # the stream is gone: its reader says why, and fails the calls

    async def _read(self, stream) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the scheduler ended the session")
        try:
            calls = self._calls
            async for message in stream:  # (the gateway's hottest loop: every token of every request)
                for output in message.outputs:
                    call = calls.get(output.request_id)
                    if call is not None:  # (None: cancelled meanwhile)
                        if output.finish_reason:
                            del calls[output.request_id]
                        call.deliver(output)
                for failure in message.failures:
                    call = calls.pop(failure.request_id, None)
                    if call is not None:
                        call.fail(rpc_error(_CODES.get(failure.code, grpc.StatusCode.UNKNOWN), failure.message))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                error = e
            else:
                error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"the scheduler session was cancelled: {e.details()}")
        except asyncio.CancelledError:
            pass
        finally:
            self._lost(stream, error)

    def _lost(self, stream, error: grpc.aio.AioRpcError) -> None:
        """The stream ended: every call on it fails with `error`; the next Submit opens another."""
        if self._stream is not stream:
            return
        self._stream = None
        stream.cancel()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._tasks = []
        calls, self._calls = self._calls, {}
        self._submits, self._cancels = [], []
        if calls:
            log.warning("scheduler session lost (%s): %d request(s) fail over", error.details(), len(calls))
        for call in calls.values():
            call.fail(error)
