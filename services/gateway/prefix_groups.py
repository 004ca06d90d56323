"""Offline batches that share prefixes (Gateway.GenerateGroups).

The client streams PrefixGroups in; each member's prompt is the group's prefix followed by the
member's own tokens. Valid members go to the scheduler as one prefix group (fanout.py's
GroupMembership: admitted together, the prefix computed once and pinned until the last member
ends); an invalid or failing member gets a MemberError of its own and the rest run. Responses of
all members stream back as they come, each under its member's request_id.

Back-pressure: the next group is read only while fewer than max_in_flight members run, so a
stream of a million requests holds a bounded number of them in memory and in the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import grpc

from strata.services.gateway.fanout import ChildFailed, GroupMembership, merged_responses, scheduler_streams
from strata.services.gateway.metrics import RequestTimer
from strata.services.gateway.validation import InvalidRequest, ValidatedParams, validate_request
from strata.v1 import generate_pb2

log = logging.getLogger("strata.gateway")

MAX_MEMBERS_IN_FLIGHT = 4096
_MEMBER_ENDED = object()  # queued by a member's task after its last response
_READER_ENDED = object()  # queued when the input stream has been read (or broke)


class GroupRunner:
    def __init__(self, gateway, info: generate_pb2.ModelInfo, max_in_flight: int = MAX_MEMBERS_IN_FLIGHT):
        self.gateway = gateway  # server.Gateway: the replicas, the tokenizer, the limits
        self.info = info
        self.max_in_flight = max_in_flight

    async def run(self, groups: AsyncIterator[generate_pb2.PrefixGroup]) -> AsyncIterator[generate_pb2.GroupResponse]:
        # Responses, and a marker when a member or the reader ends: the loop below waits on this
        # queue alone. (It waited on every running member's task as well: asyncio.wait over 512
        # tasks per response kept the gateway's loop busy enough to deliver members at half the
        # rate of single requests, so groups ran more steps than the cache way.)
        out: asyncio.Queue = asyncio.Queue()
        room = asyncio.Condition()
        running: set[asyncio.Task] = set()
        in_flight = 0  # members holding room (the back-pressure's count)
        active = 0  # member tasks whose end marker the loop has not taken yet

        async def member(
            request_id: str, params: ValidatedParams, prompt: list[int], group: GroupMembership | None, route
        ):
            nonlocal in_flight
            try:
                await self._answer(out, request_id, params, prompt, group, route)
            except Exception as e:  # never a member that ends without an answer
                log.exception("group member %s failed", request_id)
                out.put_nowait(_error(request_id, grpc.StatusCode.INTERNAL, f"the member failed in the gateway: {e}"))
            finally:
                try:
                    async with room:
                        in_flight -= 1
                        room.notify_all()
                finally:
                    out.put_nowait(_MEMBER_ENDED)

        async def read_groups():
            nonlocal in_flight, active
            try:
                async for group in groups:
                    members, errors = await self._prepare(group)
                    for error in errors:
                        out.put_nowait(error)
                    async with room:  # wait for room, but never refuse a group larger than the limit
                        await room.wait_for(lambda: in_flight == 0 or in_flight + len(members) <= self.max_in_flight)
                        in_flight += len(members)
                    for args, route in zip(members, self._routes(members)):
                        task = asyncio.create_task(member(*args, route))
                        active += 1
                        running.add(task)
                        task.add_done_callback(running.discard)
            finally:
                out.put_nowait(_READER_ENDED)

        reader = asyncio.create_task(read_groups())
        reader_ended = False
        try:
            while not (reader_ended and active == 0):
                item = await out.get()
                if item is _MEMBER_ENDED:
                    active -= 1
                elif item is _READER_ENDED:
                    reader_ended = True
                else:
                    yield item
            reader.result()  # a broken input stream ends the call with its error
        finally:  # the client went away, or all is done: nothing a member started is left running
            reader.cancel()
            for task in list(running):
                task.cancel()

    async def _answer(
        self,
        out: asyncio.Queue,
        request_id: str,
        params: ValidatedParams,
        prompt: list[int],
        group: GroupMembership | None,
        route,
    ) -> None:
        """Runs one member on its route (the replica its group runs on), queueing its responses
        (or its scheduler's error) on `out`."""
        gw = self.gateway
        timer = RequestTimer(gw.metrics, params.n, timed=scheduler_streams(params))  # as Generate's
        responses = merged_responses(
            route,
            request_id,
            params,
            prompt,
            self.info.eos_token_ids,
            gw.tokenizer,
            gw.request_timeout,
            group,
            on_output=timer.output,
        )
        try:
            async for response in responses:
                timer.response(response)
                out.put_nowait(generate_pb2.GroupResponse(response=response))
        except ChildFailed as e:
            timer.close("error")
            out.put_nowait(_error(request_id, e.code, e.details))
        except Exception:
            timer.close("error")
            raise
        finally:
            timer.close()
            await responses.aclose()

    def _routes(self, members: list) -> list:
        """Each member's route (replicas.py), chosen as it starts: a group's members all on one
        replica, which computes their prefix once (the group is spread over replicas by load, by
        its prefix's affinity); members without a prefix each on their own."""
        replicas = self.gateway.replicas
        if members and members[0][3] is not None:
            prefix = members[0][2][: members[0][3].prefix_len]
            cost = sum(len(prompt) * params.n for _, params, prompt, _ in members)
            return [replicas.route(prefix, cost, group=True)] * len(members)
        return [replicas.route(prompt, len(prompt) * params.n) for _, params, prompt, _ in members]

    async def _prepare(self, group: generate_pb2.PrefixGroup):
        """(members to run: (request_id, params, prompt ids, membership), their errors)."""
        errors, valid = [], []
        limits = self.gateway.limits
        try:
            prefix = await self._prefix_ids(group)
        except InvalidRequest as e:
            return [], [_error(m.request_id, grpc.StatusCode.INVALID_ARGUMENT, str(e)) for m in group.members]
        for m in group.members:
            request_id = m.request_id or uuid.uuid4().hex
            try:
                prompt = prefix + await self._own_ids(m)
                params = validate_request(
                    m,
                    prompt,
                    vocab_size=self.info.vocab_size,
                    max_model_len=self.info.max_model_len,
                    max_stop_strings=limits.max_stop_strings,
                    max_stop_length=limits.max_stop_length,
                    encode=self.gateway.encode_plain,
                )
                self.gateway.check_prompt_part(params, len(prompt))
            except InvalidRequest as e:
                errors.append(_error(request_id, grpc.StatusCode.INVALID_ARGUMENT, str(e)))
                continue
            valid.append((request_id, params, prompt))
        membership = None
        if prefix and valid:
            size = sum(params.n for _, params, _ in valid)
            membership = GroupMembership(f"group-{uuid.uuid4().hex}", len(prefix), size)
        return [(rid, params, prompt, membership) for rid, params, prompt in valid], errors

    async def _prefix_ids(self, group: generate_pb2.PrefixGroup) -> list[int]:
        which = group.WhichOneof("prefix_input")
        if which == "prefix_token_ids":
            ids = list(group.prefix_token_ids.ids)
        elif which == "prefix":
            ids = await self.gateway.encode(group.prefix, "prefix")
        else:
            return []
        if ids and (min(ids) < 0 or max(ids) >= self.info.vocab_size):
            raise InvalidRequest("prefix_token_ids", f"prefix_token_ids must be in [0, {self.info.vocab_size})")
        return ids

    async def _own_ids(self, member: generate_pb2.GenerateRequest) -> list[int]:
        """The member's tokens after the prefix: its ids, or its text tokenized on its own."""
        which = member.WhichOneof("prompt_input")
        if which == "prompt_token_ids":
            return list(member.prompt_token_ids.ids)
        if which == "prompt" and member.prompt:
            return await self.gateway.encode(member.prompt, special_tokens=False)
        raise InvalidRequest("prompt", "a member needs its own prompt or prompt_token_ids after the prefix")


def _error(request_id: str, code: grpc.StatusCode, message: str) -> generate_pb2.GroupResponse:
    return generate_pb2.GroupResponse(
        error=generate_pb2.MemberError(request_id=request_id, code=code.value[0], message=message)
    )
