"""n > 1 in one place: a public request fans out into n child requests, and their streams merge
back into public GenerateResponses.

Children are named `{i}_{request_id}` (n = 1 included, so nothing special-cases n) and get seed
+ i when the request has a seed, else independent random seeds: sampling randomness comes from
(seed, position), so the scheduler always needs one.

Output kinds of the merged stream:
- CUMULATIVE: each response holds every output (all n) whole so far.
- DELTA: each response holds only the outputs that advanced, and only their new part; an
  output that finishes appears once more with its finish_reason even when nothing is new.
- FINAL_ONLY: a single response, once every child has finished.

Whatever the kind, the text of each index concatenated over the DELTA responses equals the
FINAL_ONLY text, which equals the last CUMULATIVE response's.

Prompt logprobs (params.prompt_logprobs) are computed once, by child 0 (the others share its
prompt), and answered in the request's first response, whatever its output kind: until child 0's
first output brings them, nothing is sent (other children's progress waits and goes out whole
with them).

Usage: prompt_tokens counts the prompt once; completion_tokens sums the children's tokens;
cached_prompt_tokens is the largest count any child found in the prefix cache. The children
share one prompt, so this is the parent's cached prompt, reported once as vLLM does, whether
the first child or a later one (after its siblings filled the cache) found it.
Every response carries usage so far, not just the last.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from strata.services.gateway.detokenizer import OutputTextStream
from strata.services.gateway.validation import ValidatedParams
from strata.v1 import engine_pb2, generate_pb2

_SEED_MODULUS = 2**64
# The public finish_reason strings (vLLM's) of the internal enum.
FINISH_REASONS = {
    engine_pb2.FINISH_REASON_STOP: "stop",
    engine_pb2.FINISH_REASON_LENGTH: "length",
    engine_pb2.FINISH_REASON_ABORT: "abort",
}


class ChildFailed(Exception):
    """A child request failed in the scheduler; the whole request fails with its status."""

    def __init__(self, index: int, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.index = index
        self.code = code
        self.details = details


# ---------------------------------------------------------------------------------- fan out


def child_request_id(index: int, request_id: str) -> str:
    return f"{index}_{request_id}"


def child_seeds(params: ValidatedParams, rng: random.Random | None = None) -> list[int]:
    """One 64-bit seed per child: seed + i with a user seed (so children differ), else random."""
    if params.seed is not None:
        return [(params.seed + i) % _SEED_MODULUS for i in range(params.n)]
    if rng is not None:
        return [rng.getrandbits(64) for _ in range(params.n)]
    return [secrets.randbits(64) for _ in range(params.n)]


def scheduler_streams(params: ValidatedParams) -> bool:
    """Whether the scheduler streams a child's tokens as they are sampled. Not when only the
    final result is wanted and no stop string needs the text as it grows: the scheduler then
    sends each child once, when it has finished."""
    return params.output_kind != generate_pb2.FINAL_ONLY or bool(params.stop)


@dataclass(frozen=True)
class GroupMembership:
    """A request that is a member of a prefix group (prefix_groups.py): its children join it."""

    group_id: str
    prefix_len: int  # prompt tokens shared with the other members
    size: int  # the group's children in all


def child_requests(
    request_id: str,
    params: ValidatedParams,
    prompt_token_ids: Sequence[int],
    eos_token_ids: Sequence[int] = (),
    *,
    group: GroupMembership | None = None,
    rng: random.Random | None = None,
) -> list[engine_pb2.EngineRequest]:
    """The n scheduler requests of one public request, i = 0 .. n-1: siblings sharing their
    whole prompt, or members of the prefix group `group` sharing its prefix.

    `rng` makes unseeded requests reproducible in tests; by default seeds come from `secrets`.
    """
    prompt = list(prompt_token_ids)
    stop = params.stop_criteria(eos_token_ids)
    final_only = not scheduler_streams(params)
    sharing = {"parent_id": request_id}
    if group is not None:
        sharing = {"parent_id": group.group_id, "shared_prefix_len": group.prefix_len, "group_size": group.size}
    return [
        engine_pb2.EngineRequest(
            request_id=child_request_id(i, request_id),
            prompt_token_ids=prompt,
            sampling=params.sampling_options(seed, prompt_logprobs=i == 0),
            stop=stop,
            final_only=final_only,
            **sharing,
        )
        for i, seed in enumerate(child_seeds(params, rng))
    ]


# ---------------------------------------------------------------------------------- merge


async def merged_responses(
    scheduler,
    request_id: str,
    params: ValidatedParams,
    prompt_token_ids: Sequence[int],
    eos_token_ids: Sequence[int],
    tokenizer,
    timeout: float,
    group: GroupMembership | None = None,
    on_output=None,
) -> AsyncIterator[generate_pb2.GenerateResponse]:
    """Submits the request's children to the scheduler and yields the merged responses.

    Raises ChildFailed when a child fails. However it ends (finished, a failure, or the caller
    closing the generator when its client went away), every child still running is cancelled,
    which aborts it in the scheduler and frees its blocks at once. on_output(index, output): each
    scheduler output of child `index` as it arrives (the serving metrics' clock).
    """
    children = child_requests(request_id, params, prompt_token_ids, eos_token_ids, group=group)
    state = RequestOutputState(
        request_id,
        len(children),
        params.output_kind,
        params.logprobs is not None,
        len(prompt_token_ids),
        want_prompt_logprobs=params.prompt_logprobs is not None,
    )
    texts = [
        OutputTextStream(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            min_tokens=params.min_tokens,
        )
        for _ in children
    ]
    merged: asyncio.Queue = asyncio.Queue()
    calls = [scheduler.Submit(child, timeout=timeout) for child in children]
    readers = [asyncio.create_task(_pump(i, call, merged)) for i, call in enumerate(calls)]
    try:
        while not state.finished:
            index, out = await merged.get()
            if isinstance(out, ChildFailed):
                raise out
            if state.child_finished(index):
                continue  # outputs that were already on their way after a stop string
            if on_output is not None:
                on_output(index, out)
            if out.HasField("prompt_logprobs"):
                response = state.prompt_logprobs_ready(prompt_logprobs_message(prompt_token_ids, out.prompt_logprobs))
                if response is not None:
                    yield response
            response = _advance(index, texts[index], out, state, calls[index])
            if response is not None:
                yield response
    finally:
        for call in calls:
            call.cancel()
        for task in readers:
            task.cancel()


def _advance(
    index: int, text_stream: OutputTextStream, out: engine_pb2.EngineOutput, state: RequestOutputState, call
) -> generate_pb2.GenerateResponse | None:
    """Applies one scheduler output of child `index`; returns the response to send, if any."""
    finish_reason = FINISH_REASONS.get(out.finish_reason, "")
    # The scheduler finishes with "stop" only on an EOS or stop token, which stays out of the text.
    text, matched, num_tokens = text_stream.push(
        out.token_ids, finished=bool(finish_reason), ends_with_stop_token=finish_reason == "stop"
    )
    token_ids, logprobs = list(out.token_ids[:num_tokens]), list(out.logprobs[:num_tokens])
    stop = {}
    if matched is not None:
        finish_reason, stop = "stop", {"stop_string": matched}
        call.cancel()  # the stop string was found here: the scheduler frees the child's blocks
    elif out.HasField("stop_token_id"):
        stop = {"stop_token_id": out.stop_token_id}
    return state.update(index, text, token_ids, logprobs, finish_reason, stop, out.cached_prompt_tokens)


async def _pump(index: int, call, merged: asyncio.Queue) -> None:
    try:
        async for out in call:
            merged.put_nowait((index, out))
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            merged.put_nowait((index, ChildFailed(index, e.code(), e.details())))
    except asyncio.CancelledError:
        pass


def prompt_logprobs_message(
    prompt_token_ids: Sequence[int], rows: engine_pb2.PromptLogprobRows
) -> generate_pb2.PromptLogprobs:
    """The public form of a prompt's logprobs: the scheduler's rows beside the prompt's tokens."""
    return generate_pb2.PromptLogprobs(
        token_ids=prompt_token_ids,
        num_top=rows.num_top,
        logprobs=rows.logprobs,
        ranks=rows.ranks,
        top_token_ids=rows.top_token_ids,
        top_logprobs=rows.top_logprobs,
    )


ABORT = "abort"


@dataclass
class _ChildOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[generate_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""
    stop: dict = field(default_factory=dict)  # the stop_reason oneof: {"stop_string": s} or {"stop_token_id": t}
    cached_prompt_tokens: int = 0

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)


class RequestOutputState:
    """The merged outputs of one public request, fed one child update at a time."""

    def __init__(
        self,
        request_id: str,
        n: int,
        output_kind: int,
        want_logprobs: bool,
        prompt_tokens: int,
        want_prompt_logprobs: bool = False,
    ):
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        if output_kind not in generate_pb2.OutputKind.values():
            raise ValueError(f"unknown output kind {output_kind}")
        self.request_id = request_id
        self.output_kind = output_kind
        self.want_logprobs = want_logprobs
        self.prompt_tokens = prompt_tokens
        self._children = [_ChildOutput(i) for i in range(n)]
        self._num_unfinished = n
        # Prompt logprobs: None until they come (nothing is sent before), then sent once.
        self._awaiting_prompt_logprobs = want_prompt_logprobs
        self._prompt_logprobs: generate_pb2.PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self._num_unfinished == 0

    def child_finished(self, index: int) -> bool:
        return self._children[index].finished

    def update(
        self,
        index: int,
        new_text: str = "",
        new_token_ids: Sequence[int] = (),
        new_logprobs: Sequence[generate_pb2.TokenLogprob] = (),
        finish_reason: str = "",
        stop: dict | None = None,
        cached_prompt_tokens: int = 0,
    ) -> generate_pb2.GenerateResponse | None:
        """Record child `index`'s progress; return the response to send now, if any.

        Updates to a child that already finished (late outputs after a stop string, say) are
        ignored.
        """
        child = self._children[index]
        if child.finished:
            return None
        child.cached_prompt_tokens = max(child.cached_prompt_tokens, cached_prompt_tokens)
        if not (new_text or new_token_ids or finish_reason):
            return None
        child.text += new_text
        child.token_ids.extend(new_token_ids)
        if self.want_logprobs:
            child.logprobs.extend(new_logprobs)
        if finish_reason:
            self._finish(child, finish_reason, stop or {})
        if self._awaiting_prompt_logprobs:
            return None  # goes out whole with the prompt logprobs
        delta = self._completion(child, new_text, new_token_ids, new_logprobs if self.want_logprobs else ())
        return self._respond([delta])

    def prompt_logprobs_ready(self, entries: generate_pb2.PromptLogprobs) -> generate_pb2.GenerateResponse | None:
        """The prompt logprobs came: the response of what waited for them, if anything did (the
        next response carries them otherwise)."""
        if not self._awaiting_prompt_logprobs:
            return None
        self._awaiting_prompt_logprobs = False
        self._prompt_logprobs = entries
        started = [c for c in self._children if c.text or c.token_ids or c.finished]
        if not started:
            return None
        return self._respond([self._whole(c) for c in started])

    def snapshot(self) -> generate_pb2.GenerateResponse:
        """Every output whole so far, whatever the output kind."""
        return self._response([self._whole(child) for child in self._children])

    def usage(self) -> generate_pb2.Usage:
        return generate_pb2.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=sum(len(child.token_ids) for child in self._children),
            cached_prompt_tokens=max(child.cached_prompt_tokens for child in self._children),
        )

    def _finish(self, child: _ChildOutput, finish_reason: str, stop: dict) -> None:
        child.finish_reason = finish_reason
        child.stop = stop
        self._num_unfinished -= 1

    def _respond(self, deltas: list[generate_pb2.CompletionOutput]) -> generate_pb2.GenerateResponse | None:
        if self.output_kind == generate_pb2.DELTA:
            return self._response(deltas)
        if self.output_kind == generate_pb2.FINAL_ONLY and not self.finished:
            return None
        return self.snapshot()

    def _response(self, outputs: list[generate_pb2.CompletionOutput]) -> generate_pb2.GenerateResponse:
        response = generate_pb2.GenerateResponse(
            request_id=self.request_id,
            outputs=outputs,
            finished=self.finished,
            usage=self.usage(),
        )
        if self._prompt_logprobs is not None:  # the first response: once
            response.prompt_logprobs.CopyFrom(self._prompt_logprobs)
            self._prompt_logprobs = None
        return response

    def _whole(self, child: _ChildOutput) -> generate_pb2.CompletionOutput:
        return self._completion(child, child.text, child.token_ids, child.logprobs)

    @staticmethod
    def _completion(
        child: _ChildOutput,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[generate_pb2.TokenLogprob],
    ) -> generate_pb2.CompletionOutput:
        return generate_pb2.CompletionOutput(
            index=child.index,
            text=text,
            token_ids=token_ids,
            finish_reason=child.finish_reason,
            logprobs=logprobs,
            **child.stop,
        )
