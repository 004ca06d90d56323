"""The gateway servicer against a fake scheduler: fan-out, failure propagation, cancellation."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from strata.default_model import build_tiny_tokenizer
from strata.services.gateway.server import Gateway, GatewayServicer
from strata.services.gateway.validation import Limits
from strata.v1 import engine_pb2, engine_pb2_grpc, generate_pb2, generate_pb2_grpc


class FakeScheduler(engine_pb2_grpc.SchedulerServicer):
    """Streams 3 tokens per child; the child whose id starts with `fail_prefix` fails instead."""

    def __init__(self, fail_prefix: str | None = None, hang: bool = False):
        self.fail_prefix = fail_prefix
        self.hang = hang
        self.submitted: list[engine_pb2.EngineRequest] = []
        self.cancelled: list[str] = []

    async def GetModelInfo(self, request, context):
        return generate_pb2.ModelInfo(vocab_size=384, max_model_len=256, eos_token_ids=[1], pipeline_stages=1)

    async def Submit(self, request, context):
        self.submitted.append(request)
        try:
            if self.fail_prefix and request.request_id.startswith(self.fail_prefix):
                await asyncio.sleep(0.05)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV blocks for this child")
            for i in range(3):
                if self.hang and i == 1:
                    await asyncio.sleep(3600)
                yield engine_pb2.EngineOutput(
                    request_id=request.request_id,
                    token_ids=[10 + i],
                    prompt_tokens=len(request.prompt_token_ids),
                    finish_reason=engine_pb2.FINISH_REASON_LENGTH if i == 2 else 0,
                )
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=384)


async def _serve(fake: FakeScheduler, tokenizer):
    sched_server = grpc.aio.server()
    engine_pb2_grpc.add_SchedulerServicer_to_server(fake, sched_server)
    sched_port = sched_server.add_insecure_port("127.0.0.1:0")
    await sched_server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{sched_port}")
    gw_server = grpc.aio.server()
    generate_pb2_grpc.add_GatewayServicer_to_server(
        GatewayServicer(Gateway(engine_pb2_grpc.SchedulerStub(channel), tokenizer, "fake")), gw_server
    )
    gw_port = gw_server.add_insecure_port("127.0.0.1:0")
    await gw_server.start()
    client_channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw_port}")
    return generate_pb2_grpc.GatewayStub(client_channel), (client_channel, gw_server, channel, sched_server)


async def _close(handles):
    client_channel, gw_server, channel, sched_server = handles
    await client_channel.close()
    await gw_server.stop(None)
    await channel.close()
    await sched_server.stop(None)


def _request(n: int, seed: int | None = None, kind=generate_pb2.DELTA):
    params = generate_pb2.SamplingParams(n=n, max_tokens=3, output_kind=kind)
    if seed is not None:
        params.seed = seed
    return generate_pb2.GenerateRequest(
        request_id="p", prompt_token_ids=generate_pb2.TokenIds(ids=[5, 6, 7]), params=params
    )


def test_children_get_ids_and_seeds_and_merge(tokenizer):
    async def go():
        fake = FakeScheduler()
        stub, handles = await _serve(fake, tokenizer)
        try:
            responses = [r async for r in stub.Generate(_request(3, seed=41), timeout=10)]
        finally:
            await _close(handles)
        return fake, responses

    fake, responses = asyncio.run(go())
    assert sorted(r.request_id for r in fake.submitted) == ["0_p", "1_p", "2_p"]
    assert sorted(r.sampling.seed for r in fake.submitted) == [41, 42, 43]
    assert all(r.parent_id == "p" for r in fake.submitted)
    # Defaults arrive resolved, as internal messages: the scheduler reads nothing public.
    assert all(
        r.stop.max_tokens == 3 and list(r.stop.eos_token_ids) == [1] and r.sampling.top_p == 1.0 for r in fake.submitted
    )
    tokens = {}
    for r in responses:
        for o in r.outputs:
            tokens.setdefault(o.index, []).extend(o.token_ids)
    assert tokens == {0: [10, 11, 12], 1: [10, 11, 12], 2: [10, 11, 12]}
    assert responses[-1].finished and responses[-1].usage.completion_tokens == 9
    assert responses[-1].usage.prompt_tokens == 3


async def _until(condition, timeout: float = 5.0) -> None:
    """Waits for asynchronous cancellations to arrive (a fixed sleep is flaky on a loaded machine)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.02)


def test_a_failing_child_fails_the_parent_with_its_status_and_cancels_siblings(tokenizer):
    async def go():
        fake = FakeScheduler(fail_prefix="1_", hang=True)
        stub, handles = await _serve(fake, tokenizer)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in stub.Generate(_request(3, seed=1), timeout=10):
                    pass
            await _until(lambda: len(fake.cancelled) >= 2)  # cancellations reach the fake scheduler
        finally:
            await _close(handles)
        return fake, err.value

    fake, error = asyncio.run(go())
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "child 1" in error.details() and "no KV blocks" in error.details()
    assert sorted(fake.cancelled) == ["0_p", "2_p"]  # the hanging siblings were aborted


def test_a_group_member_that_fails_in_the_gateway_gets_an_error_and_the_others_their_tokens(tokenizer, monkeypatch):
    """GenerateGroups answers every member, also one whose stream breaks with an error that is
    not the scheduler's (a bug, say): it gets INTERNAL, the others finish, the call ends."""
    from strata.services.gateway import prefix_groups

    merged = prefix_groups.merged_responses

    def breaks_one(scheduler, request_id, *args, **kwargs):
        if request_id == "g1m0":
            raise RuntimeError("a bug in the gateway")
        return merged(scheduler, request_id, *args, **kwargs)

    monkeypatch.setattr(prefix_groups, "merged_responses", breaks_one)
    params = generate_pb2.SamplingParams(max_tokens=3, output_kind=generate_pb2.FINAL_ONLY)

    def groups():
        for g in range(2):
            yield generate_pb2.PrefixGroup(
                prefix_token_ids=generate_pb2.TokenIds(ids=[5, 6, 7, 8]),
                members=[
                    generate_pb2.GenerateRequest(
                        request_id=f"g{g}m{m}", params=params, prompt_token_ids=generate_pb2.TokenIds(ids=[9 + m])
                    )
                    for m in range(3)
                ],
            )

    async def go():
        stub, handles = await _serve(FakeScheduler(), tokenizer)
        try:
            return [r async for r in stub.GenerateGroups(groups(), timeout=10)]
        finally:
            await _close(handles)

    responses = asyncio.run(go())
    errors = {r.error.request_id: r.error for r in responses if r.HasField("error")}
    finished = sorted(r.response.request_id for r in responses if r.HasField("response") and r.response.finished)
    assert list(errors) == ["g1m0"] and errors["g1m0"].code == grpc.StatusCode.INTERNAL.value[0]
    assert "a bug in the gateway" in errors["g1m0"].message
    assert finished == ["g0m0", "g0m1", "g0m2", "g1m1", "g1m2"]


def test_client_cancel_aborts_every_child(tokenizer):
    async def go():
        fake = FakeScheduler(hang=True)
        stub, handles = await _serve(fake, tokenizer)
        try:
            call = stub.Generate(_request(4), timeout=10)
            await call.read()  # the first token of some child
            await _until(lambda: len(fake.submitted) == 4)  # every child reached the scheduler
            call.cancel()
            await _until(lambda: len(fake.cancelled) >= 4)
        finally:
            await _close(handles)
        return fake

    fake = asyncio.run(go())
    assert sorted(fake.cancelled) == ["0_p", "1_p", "2_p", "3_p"]
    assert len({r.sampling.seed for r in fake.submitted}) == 4  # unseeded: independent seeds


# Tokenize, TokenizeBatch and Detokenize: the ids Generate runs on, the same checks and limits.

CHAT_TEMPLATE = (
    "{% for m in messages %}<|begin_of_text|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    tok = build_tiny_tokenizer(tmp_path_factory.mktemp("chat-tok"), vocab_size=384)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _run_against_gateway(tokenizer, calls, **gateway_kw):
    """Runs `calls(stub, fake)` against a gateway (over a fake scheduler) built with gateway_kw."""

    async def go():
        fake = FakeScheduler()
        sched_server = grpc.aio.server()
        engine_pb2_grpc.add_SchedulerServicer_to_server(fake, sched_server)
        sched_port = sched_server.add_insecure_port("127.0.0.1:0")
        await sched_server.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{sched_port}")
        gateway = Gateway(engine_pb2_grpc.SchedulerStub(channel), tokenizer, "fake", **gateway_kw)
        gw_server = grpc.aio.server()
        generate_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(gateway), gw_server)
        gw_port = gw_server.add_insecure_port("127.0.0.1:0")
        await gw_server.start()
        client_channel = grpc.aio.insecure_channel(f"127.0.0.1:{gw_port}")
        try:
            return await calls(generate_pb2_grpc.GatewayStub(client_channel), fake)
        finally:
            await _close((client_channel, gw_server, channel, sched_server))

    return asyncio.run(go())


def _chat(*messages, **kw) -> generate_pb2.TokenizeRequest:
    return generate_pb2.TokenizeRequest(chat=generate_pb2.ChatConversation(messages=list(messages), **kw))


def test_tokenize_gives_the_ids_generate_submits_for_the_same_prompt(chat_tokenizer):
    prompt = "The old lighthouse stood at the edge of the harbour."

    async def calls(stub, fake):
        tokenized = await stub.Tokenize(generate_pb2.TokenizeRequest(prompt=prompt), timeout=10)
        params = generate_pb2.SamplingParams(max_tokens=3)
        [r async for r in stub.Generate(generate_pb2.GenerateRequest(prompt=prompt, params=params), timeout=10)]
        return tokenized, list(fake.submitted[0].prompt_token_ids)

    tokenized, submitted = _run_against_gateway(chat_tokenizer, calls)
    assert list(tokenized.tokens) == submitted == chat_tokenizer.encode(prompt)
    assert (tokenized.count, tokenized.max_model_len) == (len(submitted), 256)


def test_tokenize_chat_parts_and_switches_as_vllm(chat_tokenizer):
    system = generate_pb2.ChatMessage(role="system", content="Be brief.")
    text = generate_pb2.ChatMessage(role="user", content="Name a harbour.\nOne only.")
    parts = generate_pb2.ChatMessage(
        role="user",
        content_parts=[
            generate_pb2.ContentPart(type="text", text="Name a harbour."),
            generate_pb2.ContentPart(type="text", text="One only."),
        ],
    )

    async def calls(stub, fake):
        get = lambda request: stub.Tokenize(request, timeout=10)  # noqa: E731
        return [
            list((await get(_chat(system, text))).tokens),
            list((await get(_chat(system, parts))).tokens),
            list((await get(_chat(system, parts, add_generation_prompt=False))).tokens),
            list(
                (
                    await get(generate_pb2.TokenizeRequest(chat=_chat(system, parts).chat, add_special_tokens=True))
                ).tokens
            ),
            list((await get(generate_pb2.TokenizeRequest(prompt="hello", add_special_tokens=False))).tokens),
        ]

    as_text, as_parts, no_turn, with_bos, bare = _run_against_gateway(chat_tokenizer, calls)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a harbour.\nOne only."}]
    rendered = chat_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert as_text == as_parts == chat_tokenizer.encode(rendered, add_special_tokens=False)  # parts join with "\n"
    unopened = chat_tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_turn == chat_tokenizer.encode(unopened, add_special_tokens=False) != as_text
    assert with_bos == [chat_tokenizer.bos_token_id, *as_text]
    assert bare == chat_tokenizer.encode("hello", add_special_tokens=False) != chat_tokenizer.encode("hello")


TOOLS_TEMPLATE = (
    "{% if tools %}<|begin_of_text|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    + CHAT_TEMPLATE
)
TOOLS = [
    {"type": "function", "function": {"name": "get_tide", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "ring_bell", "parameters": {"type": "object", "properties": {}}}},
]


def test_a_chats_tools_reach_its_template_through_http_and_grpc_alike(tmp_path):
    """OpenAI's `tools` go to the chat template (as vLLM passes them), so the model sees what it
    may call: the same ids from an HTTP body and from the proto's tools_json."""
    from strata import openai_format
    from strata.prompt_tokens import token_ids

    tok = build_tiny_tokenizer(tmp_path / "tok", vocab_size=384)
    tok.chat_template = TOOLS_TEMPLATE
    body = {"messages": [{"role": "user", "content": "When is high tide?"}], "tools": TOOLS}
    from_http = token_ids(tok, openai_format.prompt_input(body, chat=True))
    rendered = tok.apply_chat_template(body["messages"], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "tools: get_tide ring_bell" in rendered
    assert from_http == tok.encode(rendered, add_special_tokens=False)
    without = token_ids(tok, openai_format.prompt_input({"messages": body["messages"]}, chat=True))
    assert without != from_http
    user = generate_pb2.ChatMessage(role="user", content="When is high tide?")

    async def calls(stub, fake):
        return list((await stub.Tokenize(_chat(user, tools_json=json.dumps(TOOLS)), timeout=10)).tokens)

    assert _run_against_gateway(tok, calls) == from_http
    with pytest.raises(openai_format.BadField, match="tools"):
        openai_format.prompt_input({"messages": body["messages"], "tools": "get_tide"}, chat=True)


def test_tokenize_refuses_bad_input_naming_the_field_and_a_batch_keeps_the_good_ones(chat_tokenizer):
    image = generate_pb2.ChatMessage(
        role="user",
        content_parts=[
            generate_pb2.ContentPart(type="text", text="What is in it?"),
            generate_pb2.ContentPart(type="image_url", text="http://example.com/x.png"),
        ],
    )
    both = generate_pb2.ChatMessage(role="user", content="a", content_parts=[generate_pb2.ContentPart(type="text")])
    bad = {
        "image part": (_chat(image), "chat.messages[0].content_parts[1].type", "image_url"),
        "content twice": (_chat(both), "chat.messages[0]", "not both"),
        "no role": (_chat(generate_pb2.ChatMessage(content="hi")), "chat.messages[0]", "role"),
        "no messages": (_chat(), "chat.messages", "non-empty"),
        "empty prompt": (generate_pb2.TokenizeRequest(prompt=""), "prompt", "empty"),
        "nothing": (generate_pb2.TokenizeRequest(), "prompt", "required"),
        "too long": (generate_pb2.TokenizeRequest(prompt="x" * 101), "prompt", "at most 100"),
    }

    async def calls(stub, fake):
        errors = {}
        for name, (request, _, _) in bad.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Tokenize(request, timeout=10)
            errors[name] = err.value
        good = generate_pb2.TokenizeRequest(prompt="fine")
        batch = await stub.TokenizeBatch(
            generate_pb2.TokenizeBatchRequest(requests=[good, bad["image part"][0], good, bad["too long"][0]]),
            timeout=10,
        )
        return errors, batch

    errors, batch = _run_against_gateway(chat_tokenizer, calls, limits=Limits(max_prompt_chars=100))
    for name, (_, field, words) in bad.items():
        assert errors[name].code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert field in errors[name].details() and words in errors[name].details(), (name, errors[name].details())
    results = batch.results
    assert [r.WhichOneof("result") for r in results] == ["response", "error", "response", "error"]
    assert list(results[0].response.tokens) == list(results[2].response.tokens) == chat_tokenizer.encode("fine")
    assert (
        results[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "image_url" in results[1].error.message
    )


def test_detokenize_round_trips_and_refuses_ids_out_of_the_vocabulary(chat_tokenizer):
    text = "Bread is one of the oldest prepared foods."

    async def calls(stub, fake):
        ids = (await stub.Tokenize(generate_pb2.TokenizeRequest(prompt=text, add_special_tokens=False))).tokens
        back = await stub.Detokenize(generate_pb2.DetokenizeRequest(tokens=ids), timeout=10)
        errors = []
        for tokens in ([5, 384], [-1], list(range(101))):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Detokenize(generate_pb2.DetokenizeRequest(tokens=tokens), timeout=10)
            errors.append(err.value)
        return back.prompt, errors

    back, errors = _run_against_gateway(chat_tokenizer, calls, limits=Limits(max_prompt_chars=100))
    assert back == text
    assert all(e.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokens" in e.details() for e in errors)
    assert "384" in errors[0].details() and "-1" in errors[1].details() and "at most 100" in errors[2].details()


def test_tokenize_and_detokenize_need_the_api_key_as_generate_does(chat_tokenizer):
    key = [("authorization", "Bearer sesame")]

    async def calls(stub, fake):
        codes = []
        for call, request in (
            (stub.Tokenize, generate_pb2.TokenizeRequest(prompt="x")),
            (
                stub.TokenizeBatch,
                generate_pb2.TokenizeBatchRequest(requests=[generate_pb2.TokenizeRequest(prompt="x")]),
            ),
            (stub.Detokenize, generate_pb2.DetokenizeRequest(tokens=[5])),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(request, timeout=10)
            codes.append(err.value.code())
            await call(request, timeout=10, metadata=key)  # with the key it answers
        return codes

    assert _run_against_gateway(chat_tokenizer, calls, api_key="sesame") == [grpc.StatusCode.UNAUTHENTICATED] * 3
