"""The OpenAI-compatible HTTP front, driven by the official `openai` client and by plain HTTP:
the same tokens as the gRPC API, streamed deltas that join to the whole text, n = 3 as three
seeds, usage, OpenAI's error shape and statuses, and a client that disconnects freeing its KV."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from strata.openai_format import chat_prompt_ids
from strata.v1 import generate_pb2
from tests.cluster import running_cluster, scheduler_stats, tiny_llama_dir

CHAT_TEMPLATE = (
    "{% for m in messages %}<|begin_of_text|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tiny_llama_dir(tmp_path_factory, seed=17)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE  # the tiny tokenizer has none
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def cluster(model_dir):
    with running_cluster(model_dir, 1) as (c, client):
        yield c, client


@pytest.fixture(scope="module")
def oai(cluster):
    c, _ = cluster
    return openai.OpenAI(base_url=c.http_address + "/v1", api_key="unused", max_retries=0)


def grpc_text(client, prompt, **params) -> tuple[str, list[int]]:
    text, ids = "", []
    for r in client.generate(prompt, output_kind=generate_pb2.DELTA, timeout=60, **params):
        for o in r.outputs:
            text += o.text
            ids += o.token_ids
    return text, ids


def metric_values(c) -> dict[str, float]:
    """The gateway's /metrics as {sample name with labels: value}."""
    text = httpx.get(c.http_address + "/metrics", timeout=10).text
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


class MetricDelta:
    """How much each gateway metric grew since the snapshot."""

    def __init__(self, c):
        self.c, self.before = c, metric_values(c)

    def __call__(self, name: str) -> float:
        return metric_values(self.c).get(name, 0.0) - self.before.get(name, 0.0)


TTFT, ITL, E2E, QUEUE = (
    "strata_time_to_first_token_seconds",
    "strata_inter_token_latency_seconds",
    "strata_e2e_request_latency_seconds",
    "strata_request_queue_time_seconds",
)


def test_models_and_health(cluster, model_dir, oai):
    c, client = cluster
    (model,) = oai.models.list().data
    assert model.id == client.model_info().model_name == model_dir.name  # the name every request uses
    assert httpx.get(c.http_address + "/health").status_code == 200


def test_metrics_count_every_request_of_both_fronts(cluster, model_dir, oai):
    c, client = cluster
    kw = dict(model=model_dir.name, temperature=0.5, seed=3, extra_body={"ignore_eos": True})
    grew = MetricDelta(c)
    list(oai.completions.create(prompt="one stream", max_tokens=20, stream=True, **kw))
    assert (grew(TTFT + "_count"), grew(E2E + "_count"), grew(QUEUE + "_count")) == (1, 1, 1)
    # Every token after the first is one gap (fewer when a slow reader gets two steps in one message).
    assert 10 <= grew(ITL + "_count") <= 19
    assert 0 < grew(TTFT + "_sum") < grew(E2E + "_sum")
    assert grew("strata_generation_tokens_total") == 20
    assert grew('strata_request_success_total{finished_reason="length"}') == 1

    # n = 2: gaps are measured within each output, not between siblings that step together.
    grew = MetricDelta(c)
    list(oai.completions.create(prompt="two streams", max_tokens=20, n=2, stream=True, **kw))
    assert (grew(TTFT + "_count"), grew(E2E + "_count"), grew(QUEUE + "_count")) == (1, 1, 2)
    assert 20 <= grew(ITL + "_count") <= 2 * 19
    assert grew('strata_request_success_total{finished_reason="length"}') == 2

    # Not streamed: the scheduler sends each output once, finished, which says nothing about when
    # its first token came; the request counts everywhere else.
    grew = MetricDelta(c)
    got = oai.completions.create(prompt="whole answers", max_tokens=6, n=2, **kw)
    assert (grew(E2E + "_count"), grew(QUEUE + "_count"), grew(TTFT + "_count"), grew(ITL + "_count")) == (1, 2, 0, 0)
    assert grew("strata_generation_tokens_total") == 12
    assert grew("strata_prompt_tokens_total") == got.usage.prompt_tokens

    # The gRPC front goes through the same path and the same metrics.
    grew = MetricDelta(c)
    grpc_text(client, "over grpc", max_tokens=5, temperature=0.0, ignore_eos=True)
    assert (grew(TTFT + "_count"), grew(E2E + "_count"), grew("strata_generation_tokens_total")) == (1, 1, 5)


def test_greedy_completion_and_chat_equal_grpc(cluster, model_dir, oai):
    from transformers import AutoTokenizer

    _, client = cluster
    prompt = "The old lighthouse stood"
    got = oai.completions.create(
        model=model_dir.name, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    text, ids = grpc_text(client, prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert got.choices[0].text == text and got.usage.completion_tokens == len(ids) == 12
    assert got.usage.prompt_tokens == len(AutoTokenizer.from_pretrained(model_dir).encode(prompt))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a harbour."}]
    chat = oai.chat.completions.create(
        model=model_dir.name, messages=messages, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    prompt_ids = chat_prompt_ids(AutoTokenizer.from_pretrained(model_dir), messages)
    text, ids = grpc_text(client, prompt_ids, max_tokens=10, temperature=0.0, ignore_eos=True)
    assert chat.choices[0].message.content == text and chat.choices[0].message.role == "assistant"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(prompt_ids), 10)


@pytest.mark.parametrize("chat", [False, True])
def test_streamed_deltas_join_to_the_whole_text(model_dir, oai, chat):
    kw = dict(model=model_dir.name, max_tokens=16, temperature=0.7, seed=5, extra_body={"ignore_eos": True})
    if chat:
        messages = [{"role": "user", "content": "Tell me about bread."}]
        whole = oai.chat.completions.create(messages=messages, **kw).choices[0].message.content
        chunks = list(
            oai.chat.completions.create(messages=messages, stream=True, stream_options={"include_usage": True}, **kw)
        )
        joined = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
    else:
        whole = oai.completions.create(prompt="Bread is", **kw).choices[0].text
        chunks = list(
            oai.completions.create(prompt="Bread is", stream=True, stream_options={"include_usage": True}, **kw)
        )
        joined = "".join(c.choices[0].text for c in chunks if c.choices)
    assert joined == whole and whole
    assert chunks[-1].usage.completion_tokens == 16 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_sse_ends_with_done(cluster):
    c, _ = cluster
    with httpx.stream(
        "POST",
        c.http_address + "/v1/completions",
        json={"prompt": "one two", "max_tokens": 4, "stream": True, "temperature": 0},
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_n3_with_a_seed_equals_three_seeds(model_dir, oai):
    kw = dict(
        model=model_dir.name,
        prompt="The market square",
        max_tokens=10,
        temperature=0.8,
        extra_body={"ignore_eos": True},
    )
    three = oai.completions.create(n=3, seed=40, **kw)
    assert sorted(c.index for c in three.choices) == [0, 1, 2]
    by_index = {c.index: c.text for c in three.choices}
    for i in range(3):
        assert oai.completions.create(seed=40 + i, **kw).choices[0].text == by_index[i]
    assert three.usage.completion_tokens == 30


def test_logprobs_in_openai_shape(model_dir, oai):
    got = oai.completions.create(
        model=model_dir.name, prompt="A river", max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    chat = oai.chat.completions.create(
        model=model_dir.name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.token == t.top_logprobs[0].token for t in content)  # greedy draws the top token


BAD = [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 2}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 10**7]}, "prompt_token_ids"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stop_token_ids": [10**7]}, "stop_token_ids"),
    ({"prompt": "x", "min_p": 3}, "min_p"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": "x", "seed": "s"}, "seed"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 9}, "min_tokens"),
]


@pytest.mark.parametrize("body, field", BAD)
def test_bad_input_gets_400_naming_the_field(cluster, body, field):
    c, _ = cluster
    for stream in (False, True):
        r = httpx.post(c.http_address + "/v1/completions", json={**body, "stream": stream}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == field and field in error["message"]


def test_other_errors(cluster):
    c, _ = cluster
    r = httpx.post(c.http_address + "/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = httpx.post(c.http_address + "/v1/chat/completions", json={"messages": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(c.http_address + "/v1/completions", json={"prompt": "x", "model": "gpt-5"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def _left_early(c, before, full: int):
    """Waits for every block to be free; the request computed far fewer tokens than it asked."""
    deadline = time.monotonic() + 10
    while (stats := scheduler_stats(c)).used_kv_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats.used_kv_blocks == 0 and stats.running == 0
    assert stats.decode_tokens_computed - before.decode_tokens_computed < full / 2, "it ran to the end"


def test_a_disconnect_mid_stream_frees_the_requests_blocks(cluster):
    c, _ = cluster
    before = scheduler_stats(c)
    grew = MetricDelta(c)
    with httpx.stream(
        "POST",
        c.http_address + "/v1/completions",
        timeout=30,
        json={
            "prompt": "long story",
            "max_tokens": 400,
            "n": 16,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0.5,
        },
    ) as r:
        next(r.iter_lines())
    _left_early(c, before, 16 * 400)
    assert grew('strata_request_success_total{finished_reason="abort"}') == 16  # each output, once
    assert grew(E2E + "_count") == 0


def test_a_disconnect_before_a_whole_answer_frees_its_blocks(cluster):
    c, _ = cluster
    before = scheduler_stats(c)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(
            c.http_address + "/v1/completions",
            timeout=0.3,
            json={"prompt": "long story", "max_tokens": 400, "n": 16, "ignore_eos": True, "temperature": 0.5},
        )
    _left_early(c, before, 16 * 400)


def test_api_key_and_503_while_the_pipeline_is_down(model_dir):
    with running_cluster(model_dir, 1, "--api-key", "sesame", "--stage-recovery-timeout", "30") as (c, _):
        url = c.http_address + "/v1/completions"
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        auth = {"Authorization": "Bearer sesame"}
        ok = {"prompt": "x", "max_tokens": 2, "ignore_eos": True}
        assert httpx.post(url, json=ok, headers=auth, timeout=30).status_code == 200
        for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})):
            assert httpx.post(c.http_address + path, json=body, timeout=30).status_code == 401
            assert httpx.post(c.http_address + path, json=body, headers=auth, timeout=30).status_code == 200
        worker = next(proc for name, proc in c.procs if name == "worker 0")
        worker.kill()
        worker.wait()
        deadline = time.monotonic() + 15
        while httpx.get(c.http_address + "/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert httpx.get(c.http_address + "/health").status_code == 503
        r = httpx.post(url, json={"prompt": "x", "max_tokens": 2}, headers=auth, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        # A replacement worker: the pipeline comes back and the gateway's metrics go on counting
        # from where they were (they live in the gateway, not in the pipeline that was rebuilt).
        served = metric_values(c)
        assert served[E2E + "_count"] == 1 and served["strata_generation_tokens_total"] == 2
        assert served['strata_request_success_total{finished_reason="error"}'] == 1  # the 503
        c.start("worker 0 (restarted)", worker.args[3:])  # python -m strata.cli ARGS
        deadline = time.monotonic() + 60
        while httpx.get(c.http_address + "/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        r = httpx.post(url, json=ok, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        after = metric_values(c)
        assert after[E2E + "_count"] == 2 and after["strata_generation_tokens_total"] == 4


def test_tokenize_detokenize_round_trip_and_give_the_ids_generate_runs_on(cluster, model_dir, oai):
    c, client = cluster
    url = c.http_address
    prompt = "The old lighthouse stood"
    got = httpx.post(url + "/tokenize", json={"model": model_dir.name, "prompt": prompt}, timeout=30).json()
    over_grpc = client.tokenize(prompt)
    assert got["tokens"] == list(over_grpc.tokens) and got["count"] == len(got["tokens"]) == over_grpc.count
    assert got["max_model_len"] == client.model_info().max_model_len == over_grpc.max_model_len
    # Generate on the text and Generate on the ids Tokenize gave: the same prompt, the same tokens.
    by_text = grpc_text(client, prompt, max_tokens=8, temperature=0.0, ignore_eos=True)
    assert grpc_text(client, got["tokens"], max_tokens=8, temperature=0.0, ignore_eos=True) == by_text
    completion = oai.completions.create(model=model_dir.name, prompt=prompt, max_tokens=1)
    assert completion.usage.prompt_tokens == got["count"]

    bare = httpx.post(url + "/tokenize", json={"prompt": prompt, "add_special_tokens": False}, timeout=30).json()
    assert bare["tokens"] == got["tokens"][1:]  # the tiny tokenizer adds one BOS
    back = httpx.post(url + "/detokenize", json={"model": model_dir.name, "tokens": bare["tokens"]}, timeout=30)
    assert back.json() == {"prompt": prompt}
    assert client.detokenize(bare["tokens"]) == prompt

    # A chat: its ids are the ones /v1/chat/completions runs on (same usage, same greedy answer).
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a harbour."}]
    chat_ids = httpx.post(url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    assert chat_ids == chat_prompt_ids(AutoTokenizer.from_pretrained(model_dir), messages)
    chat = oai.chat.completions.create(
        model=model_dir.name, messages=messages, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.usage.prompt_tokens == len(chat_ids)
    assert (
        grpc_text(client, chat_ids, max_tokens=6, temperature=0.0, ignore_eos=True)[0]
        == chat.choices[0].message.content
    )
    grpc_chat = generate_pb2.TokenizeRequest(
        chat=generate_pb2.ChatConversation(messages=[generate_pb2.ChatMessage(**m) for m in messages])
    )
    assert list(client.stub.Tokenize(grpc_chat, timeout=30).tokens) == chat_ids
    parts = [messages[0], {"role": "user", "content": [{"type": "text", "text": "Name a harbour."}]}]
    assert list(client.tokenize(parts).tokens) == chat_ids
    unopened = httpx.post(url + "/tokenize", json={"messages": messages, "add_generation_prompt": False}, timeout=30)
    assert unopened.json()["tokens"] != chat_ids and chat_ids[: unopened.json()["count"]] == unopened.json()["tokens"]


TOKENIZE_BAD = [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": ""}, 400, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"prompt": "x" * 20_000}, 400, "prompt"),  # the tiny model's 512 x 32 characters
    ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (
        "/tokenize",
        {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        400,
        "messages[0].content[0].type",
    ),
    ("/tokenize", {"prompt": "x", "model": "gpt-5"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 10**12]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
]


@pytest.mark.parametrize("path, body, status, field", TOKENIZE_BAD)
def test_tokenize_and_detokenize_refuse_bad_input_naming_the_field(cluster, path, body, status, field):
    c, _ = cluster
    r = httpx.post(c.http_address + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == field


def test_a_huge_tokenize_prompt_is_refused_before_it_is_parsed(cluster):
    import grpc

    _, client = cluster
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Tokenize(generate_pb2.TokenizeRequest(prompt="p" * (10 << 20)), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "characters" in err.value.details()
    assert time.monotonic() - started < 5


def test_chat_content_as_text_parts_through_the_openai_client(model_dir, oai):
    kw = dict(model=model_dir.name, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Name a harbour."}, {"type": "text", "text": "One."}]},
    ]
    joined = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a harbour.\nOne."}]
    by_parts = oai.chat.completions.create(messages=parts, **kw)
    by_text = oai.chat.completions.create(messages=joined, **kw)
    assert by_parts.choices[0].message.content == by_text.choices[0].message.content
    assert by_parts.usage.prompt_tokens == by_text.usage.prompt_tokens
    streamed = oai.chat.completions.create(messages=parts, stream=True, **kw)
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == by_text.choices[0].message.content
    )

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}], **kw
        )
    assert err.value.status_code == 400 and "image_url" in err.value.message
    assert err.value.body["param"] == "messages[0].content[1].type"
