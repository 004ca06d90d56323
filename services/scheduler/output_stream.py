"""What one request has produced and its Submit call has not sent yet (OutputStream), and how a
request fails (RequestFailed, a gRPC status code's name and a message)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from strata.v1 import engine_pb2

_RUNNING = engine_pb2.FINISH_REASON_UNSPECIFIED


class RequestFailed(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code  # a grpc.StatusCode name
        self.message = message


class OutputStream:
    """What one request has produced and its Submit call has not sent yet.

    Outputs accumulate into one pending message and the sender is woken once: when the sender
    is slower than the steps, several steps' tokens go out as one message, and a final_only
    request sends a single message when it finishes.

    output: the request's own list of output tokens. A final_only stream given it copies no token a
    step: its message takes the tokens appended to that list since the stream began (a resumed
    request's earlier ones were sent by another replica), so pushes before the last need not
    carry tokens (deliver and deliver_running skip them).

    on_ready(stream): called, in place of setting the stream's own event, when it has something
    to send: a Session (session.py) gathers its requests' outputs into one message a step."""

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        final_only: bool,
        output: list[int] | None = None,
        on_ready: Callable[[OutputStream], None] | None = None,
    ):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.final_only = final_only
        self._output = output if final_only else None
        self._first_output = len(output) if self._output is not None else 0
        # Accumulated in Python lists (cheaper than growing a message every step); next() builds
        # the message.
        self._token_ids: list[int] = []
        self._logprobs: list = []
        self._cached_prompt_tokens = 0
        self._queue_seconds = 0.0
        self._finish_reason = _RUNNING
        self._stop_token_id: int | None = None
        self._prompt_logprobs: engine_pb2.PromptLogprobRows | None = None  # until the next message takes it
        self.failure: RequestFailed | None = None
        self.ready = asyncio.Event()
        self._on_ready = on_ready

    def push(
        self,
        token_ids,
        logprobs,
        finish_reason: int = _RUNNING,
        stop_token_id: int | None = None,
        cached_prompt_tokens: int = 0,
        queue_seconds: float = 0.0,
        prompt_logprobs: engine_pb2.PromptLogprobRows | None = None,
    ) -> None:
        if prompt_logprobs is not None:
            self._prompt_logprobs = prompt_logprobs
        if self._output is None:
            self._token_ids.extend(token_ids)
        self._logprobs.extend(logprobs)
        self._cached_prompt_tokens = cached_prompt_tokens
        self._queue_seconds = queue_seconds
        if finish_reason:
            self._finish_reason, self._stop_token_id = finish_reason, stop_token_id
        if finish_reason or not self.final_only:
            self._signal()

    def fail(self, failure: RequestFailed) -> None:
        self.failure = failure
        self._signal()

    def _signal(self) -> None:
        if self._on_ready is None:
            self.ready.set()
        else:
            self._on_ready(self)

    async def next(self) -> engine_pb2.EngineOutput:
        """The next (merged) output; raises RequestFailed when the request failed."""
        await self.ready.wait()
        self.ready.clear()
        return self.take()

    def take(self) -> engine_pb2.EngineOutput:
        """What was pushed since the last take, as one output; raises RequestFailed when the
        request failed."""
        if self.failure is not None:
            raise self.failure
        out = engine_pb2.EngineOutput(
            request_id=self.request_id,
            prompt_tokens=self.prompt_tokens,
            token_ids=self._token_ids if self._output is None else self._output[self._first_output :],
            logprobs=self._logprobs,
            cached_prompt_tokens=self._cached_prompt_tokens,
            queue_seconds=self._queue_seconds,
            finish_reason=self._finish_reason,
            stop_token_id=self._stop_token_id,
            prompt_logprobs=self._prompt_logprobs,
        )
        self._token_ids, self._logprobs, self._prompt_logprobs = [], [], None
        return out


def deliver(streams: dict[str, OutputStream], upd, logprob_entries=None) -> None:
    """A RequestUpdate (and its tokens' logprob entries, where asked) into its request's stream;
    a finished request's stream leaves `streams`. A FINAL_ONLY stream takes its tokens from the
    request when it ends, so an update before that is pushed only for what else it carries."""
    req = upd.request
    stream = streams.get(req.request_id)
    if stream is None:
        return  # aborted while its step was in flight
    logprobs = logprob_entries[: len(upd.new_token_ids)] if logprob_entries and req.sampling.logprobs >= 0 else ()
    rows = req.prompt_logprobs
    if stream.final_only and not upd.finished and not logprobs and rows is None:
        return
    stream.push(
        upd.new_token_ids,
        logprobs,
        upd.finish_reason,
        upd.stop_token_id,
        req.num_cached_prompt_tokens,
        req.queue_seconds,
        rows.take() if rows is not None else None,  # (every row once, for the request's first output)
    )
    if upd.finished:
        del streams[req.request_id]


def deliver_running(streams: dict[str, OutputStream], requests, tokens) -> None:
    """A token each to requests that go on running (ResultUpdates.update_one_token_each: most steps),
    where their stream sends tokens as they come."""
    for req, token in zip(requests, tokens):
        stream = streams.get(req.request_id)
        if stream is None or stream.final_only:
            continue  # (None: aborted while its step was in flight)
        rows = req.prompt_logprobs
        stream.push(
            (token,),
            (),
            cached_prompt_tokens=req.num_cached_prompt_tokens,
            queue_seconds=req.queue_seconds,
            prompt_logprobs=rows.take() if rows is not None else None,
        )
