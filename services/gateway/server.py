"""The gateway: one generation path for both public fronts.

Gateway (the core) authorises, tokenizes and validates a request, then runs it through the n > 1
fan-out (fanout.py), which streams merged, detokenized outputs back; it records the serving
metrics. Every prompt, whichever front and method it comes through (Generate, Tokenize, the HTTP
completions and chat), is tokenized by Gateway.prompt_ids, so Tokenize answers with exactly the
ids Generate runs on. GatewayServicer is the gRPC front over it (the primary contract);
http_api.py is the OpenAI-compatible HTTP front over the same object, in the same process and
event loop.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import grpc

from strata import openai_format
from strata.prompt_tokens import ChatTemplateError, PromptInput, token_ids
from strata.services.gateway import response_size
from strata.services.gateway.fanout import ChildFailed, merged_responses, scheduler_streams
from strata.services.gateway.metrics import GatewayMetrics, RequestTimer
from strata.services.gateway.prefix_groups import GroupRunner
from strata.services.gateway.replicas import ReplicaSet
from strata.services.gateway.validation import (
    InvalidRequest,
    Limits,
    ValidatedParams,
    top_level_field_size,
    validate_request,
)
from strata.v1 import engine_pb2_grpc, generate_pb2, generate_pb2_grpc

GENERATE_PROMPT_FIELD = generate_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["prompt"].number
TOKENIZE_PROMPT_FIELD = generate_pb2.TokenizeRequest.DESCRIPTOR.fields_by_name["prompt"].number
# Prompts shorter than this are tokenized on the event loop: a thread hop costs more.
_INLINE_CHARACTERS = 4096

log = logging.getLogger("strata.gateway")


class GatewayError(Exception):
    """A request that cannot be served: a gRPC status and a message (naming the field at fault
    for bad input)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


class Gateway:
    def __init__(
        self,
        scheduler: engine_pb2_grpc.SchedulerStub | ReplicaSet,
        tokenizer,
        model_name: str,
        api_key: str | None = None,
        request_timeout: float = 3600.0,
        metrics: GatewayMetrics | None = None,
        limits: Limits | None = None,
    ):
        # The schedulers, one per data-parallel replica (a lone stub is a set of one).
        self.replicas = scheduler if isinstance(scheduler, ReplicaSet) else ReplicaSet.single(scheduler)
        self.limits = limits or Limits()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.request_timeout = request_timeout
        self.metrics = metrics or GatewayMetrics()
        self.metrics.add_replicas(self.replicas)
        self._model_info: generate_pb2.ModelInfo | None = None
        self._token_texts: asyncio.Future | None = None

    async def token_texts(self) -> response_size.TokenTexts:
        """Every token's text, decoded once (on a thread) when a request first needs them."""
        if self._token_texts is None:
            self._token_texts = asyncio.ensure_future(asyncio.to_thread(response_size.TokenTexts, self.tokenizer))
        return await asyncio.shield(self._token_texts)

    def check_prompt_part(self, params: ValidatedParams, prompt_len: int) -> None:
        """Refuses (InvalidRequest) prompt logprobs whose first response would pass
        --max-response-bytes."""
        if params.prompt_logprobs is not None:
            size = response_size.proto_bytes(prompt_len, params.prompt_logprobs)
            response_size.check(size, self.limits.max_response_bytes, "params.prompt_logprobs")

    def authorized(self, authorization: str | None) -> bool:
        """The `authorization` metadata or header: `Bearer KEY` when an API key is set."""
        return self.api_key is None or authorization == f"Bearer {self.api_key}"

    async def model_info(self) -> generate_pb2.ModelInfo:
        if self._model_info is None:
            try:
                info = generate_pb2.ModelInfo()
                info.CopyFrom(await self.replicas.model_info())
            except grpc.aio.AioRpcError as e:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"scheduler unavailable: {e.details()}") from None
            info.model_name = self.model_name
            self._model_info = info
        return self._model_info

    async def describe(self) -> generate_pb2.ModelInfo:
        """GetModelInfo: the model, and each data-parallel replica (up, load, routed, resumed)."""
        return self.replicas.describe(await self.model_info())

    async def prompt_ids(self, prompt: PromptInput, field: str = "prompt") -> list[int]:
        """The token ids of a prompt's text or chat; raises InvalidRequest naming `field`."""
        (ids,) = await self.prompts_ids([(prompt, field)])
        if isinstance(ids, InvalidRequest):
            raise ids
        return ids

    async def prompts_ids(self, prompts: list[tuple[PromptInput, str]]) -> list[list[int] | InvalidRequest]:
        """The one tokenization path: each (prompt, field)'s ids, or the InvalidRequest that refuses
        it. A prompt's length is checked before it is tokenized, and long ones are tokenized on a
        thread, so a huge prompt is cheap to reject and never stalls the event loop (every other
        call, health checks included)."""
        limit = self.limits.prompt_chars((await self.model_info()).max_model_len)

        def tokenize(prompt: PromptInput, field: str) -> list[int] | InvalidRequest:
            size = prompt.characters()
            if size > limit:
                return InvalidRequest(field, f"{field} has {size:,} characters; at most {limit:,}")
            try:
                return token_ids(self.tokenizer, prompt)
            except ChatTemplateError as e:
                return InvalidRequest(field, f"{field}: {e}")

        def tokenize_all() -> list[list[int] | InvalidRequest]:
            return [tokenize(prompt, field) for prompt, field in prompts]

        if sum(min(p.characters(), limit + 1) for p, _ in prompts) < _INLINE_CHARACTERS:
            return tokenize_all()
        return await asyncio.to_thread(tokenize_all)

    def encode_plain(self, text: str) -> list[int]:
        """A short text's ids without special tokens (bad_words)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def encode(self, text: str, field: str = "prompt", special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt's text (prompt_ids for text)."""
        return await self.prompt_ids(PromptInput(text=text, add_special_tokens=special_tokens), field)

    def prompt_precheck(self, field_number: int):
        """A check of a request before it is parsed: a prompt (top-level field `field_number`) of
        more than 4 bytes per allowed character is too long whatever its text (UTF-8 takes at most
        4), and refusing it from the wire format spares the event loop the parse and the text's
        copy, tens of milliseconds for a prompt of megabytes."""

        async def refuse_huge_prompt(raw: bytes) -> str | None:
            try:
                limit = self.limits.prompt_chars((await self.model_info()).max_model_len)
            except GatewayError:
                return None  # the scheduler is away: the call itself says so
            size = top_level_field_size(raw, field_number)
            if size > 4 * limit:
                return f"prompt has more than {limit:,} characters ({size:,} bytes); at most {limit:,}"
            return None

        return refuse_huge_prompt

    async def tokenize(self, request: generate_pb2.TokenizeRequest) -> generate_pb2.TokenizeResponse:
        """A TokenizeRequest's ids, as Generate (or /v1/chat/completions) would run them."""
        info = await self.model_info()
        (ids,) = await self._tokenized_requests([request])
        if isinstance(ids, InvalidRequest):
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(ids), ids.field)
        return generate_pb2.TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids)

    async def tokenize_batch(self, request: generate_pb2.TokenizeBatchRequest) -> generate_pb2.TokenizeBatchResponse:
        info = await self.model_info()
        results = []
        for ids in await self._tokenized_requests(request.requests):
            if isinstance(ids, InvalidRequest):
                error = generate_pb2.RequestError(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message=str(ids))
                results.append(generate_pb2.TokenizeResult(error=error))
            else:
                response = generate_pb2.TokenizeResponse(count=len(ids), max_model_len=info.max_model_len, tokens=ids)
                results.append(generate_pb2.TokenizeResult(response=response))
        return generate_pb2.TokenizeBatchResponse(results=results)

    async def _tokenized_requests(self, requests) -> list[list[int] | InvalidRequest]:
        parsed: list[tuple[PromptInput, str] | InvalidRequest] = []
        for r in requests:
            try:
                prompt = openai_format.prompt_from_proto(r)
                parsed.append((prompt, "chat" if prompt.is_chat else "prompt"))
            except openai_format.BadField as e:
                parsed.append(InvalidRequest(e.field, str(e)))
        tokenized = iter(await self.prompts_ids([p for p in parsed if not isinstance(p, InvalidRequest)]))
        return [p if isinstance(p, InvalidRequest) else next(tokenized) for p in parsed]

    async def detokenize(self, request: generate_pb2.DetokenizeRequest) -> generate_pb2.DetokenizeResponse:
        """The ids' text. The ids are checked as a prompt's are: in the vocabulary, and no more of
        them than the longest prompt has characters."""
        info = await self.model_info()
        ids = list(request.tokens)
        limit = self.limits.prompt_chars(info.max_model_len)
        if len(ids) > limit:
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT, f"tokens holds {len(ids):,} ids; at most {limit:,}", "tokens"
            )
        if ids and (min(ids) < 0 or max(ids) >= info.vocab_size):
            bad = next(i for i in ids if not 0 <= i < info.vocab_size)
            raise GatewayError(
                grpc.StatusCode.INVALID_ARGUMENT, f"tokens must be in [0, {info.vocab_size}), got {bad}", "tokens"
            )
        if len(ids) < _INLINE_CHARACTERS // 4:
            text = self.tokenizer.decode(ids)
        else:
            text = await asyncio.to_thread(self.tokenizer.decode, ids)
        return generate_pb2.DetokenizeResponse(prompt=text)

    async def _prompt_ids(self, request: generate_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt_input")
        if which == "prompt_token_ids":
            return list(request.prompt_token_ids.ids)
        if which == "prompt":
            prompt = request.prompt  # each read copies the whole text out of the message: once
            if prompt:
                return await self.prompt_ids(PromptInput(text=prompt))
        raise InvalidRequest("prompt", "prompt is empty: set prompt or prompt_token_ids")

    async def generate(self, request: generate_pb2.GenerateRequest) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """The request's responses, in its output kind. Raises GatewayError. Closing the
        generator early (the client went away) cancels every child, freeing its KV blocks."""
        info = await self.model_info()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            prompt_ids = await self._prompt_ids(request)
            params = validate_request(
                request,
                prompt_ids,
                vocab_size=info.vocab_size,
                max_model_len=info.max_model_len,
                max_stop_strings=self.limits.max_stop_strings,
                max_stop_length=self.limits.max_stop_length,
                encode=self.encode_plain,
            )
            self.check_prompt_part(params, len(prompt_ids))
        except InvalidRequest as e:
            raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, str(e), e.field) from None
        timer = RequestTimer(self.metrics, params.n, timed=scheduler_streams(params))
        # The children go where routing says (replicas.py), together: siblings share the prompt.
        route = self.replicas.route(prompt_ids, len(prompt_ids) * params.n)
        responses = merged_responses(
            route,
            request_id,
            params,
            prompt_ids,
            info.eos_token_ids,
            self.tokenizer,
            self.request_timeout,
            on_output=timer.output,
        )
        try:
            async for response in responses:
                timer.response(response)
                yield response
        except ChildFailed as e:
            timer.close("error")
            raise GatewayError(e.code, f"child {e.index} of {request_id}: {e.details}") from None
        finally:
            timer.close()  # the client went away: its unfinished outputs count as aborted
            await responses.aclose()

    async def generate_groups(self, groups) -> AsyncIterator[generate_pb2.GroupResponse]:
        responses = GroupRunner(self, await self.model_info()).run(groups)
        try:
            async for response in responses:
                yield response
        finally:
            await responses.aclose()


class GatewayServicer(generate_pb2_grpc.GatewayServicer):
    """The gRPC front: maps GatewayError to the call's status."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway

    async def _authorize(self, context) -> None:
        if not self.gateway.authorized(dict(context.invocation_metadata() or ()).get("authorization")):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    async def _unary(self, context, call):
        """An authorised unary call whose GatewayError becomes the call's status."""
        await self._authorize(context)
        try:
            return await call()
        except GatewayError as e:
            await context.abort(e.code, e.message)

    async def GetModelInfo(self, request, context):
        return await self._unary(context, self.gateway.describe)

    async def Tokenize(self, request, context):
        return await self._unary(context, lambda: self.gateway.tokenize(request))

    async def TokenizeBatch(self, request, context):
        return await self._unary(context, lambda: self.gateway.tokenize_batch(request))

    async def Detokenize(self, request, context):
        return await self._unary(context, lambda: self.gateway.detokenize(request))

    async def Generate(self, request, context):
        await self._authorize(context)
        responses = self.gateway.generate(request)
        try:
            async for response in responses:
                yield response
        except GatewayError as e:
            await context.abort(e.code, e.message)
        finally:
            await responses.aclose()  # the client went away: cancel every child

    async def GenerateGroups(self, request_iterator, context):
        await self._authorize(context)
        responses = self.gateway.generate_groups(request_iterator)
        try:
            async for response in responses:
                yield response
        except GatewayError as e:
            await context.abort(e.code, e.message)
        finally:
            await responses.aclose()  # the client went away: cancel every member
