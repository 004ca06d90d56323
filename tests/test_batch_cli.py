"""`strata batch`: OpenAI batch files through prefix groups. Every line gets exactly one answer
(also across an interruption), bad lines get error lines, each shared prefix is computed once,
and every answer equals the same request sent alone."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from strata.batch import Item, shared_prefix_groups
from strata.openai_format import chat_prompt_ids
from tests.cluster import running_cluster, scheduler_stats, tiny_llama_dir

CHAT_TEMPLATE = (
    "{% for m in messages %}<|begin_of_text|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CONTEXTS = [
    "The old lighthouse stood at the edge of the harbour for more than two hundred years, and every "
    "evening the keeper climbed the steps, trimmed the wick and polished the brass. ",
    "Bread is one of the oldest prepared foods: flour, water, salt and yeast are mixed into a dough, "
    "kneaded until smooth and left in a warm place to rise before it is shaped and baked. ",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tiny_llama_dir(tmp_path_factory, seed=13)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE  # the tiny tokenizer has none: give it one
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def cluster(model_dir):
    with running_cluster(model_dir, 1) as (c, client):
        yield c, client


def lines(max_tokens=5):
    out = []
    for c, context in enumerate(CONTEXTS):
        for q in range(4):
            out.append(
                {
                    "custom_id": f"c{c}q{q}",
                    "method": "POST",
                    "url": "/v1/completions",
                    "body": {
                        "prompt": context + f"Question {q}: what happens next?",
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                }
            )
        out.append(
            {
                "custom_id": f"chat{c}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [
                        {"role": "system", "content": context},
                        {"role": "user", "content": f"Summarise it, {c}."},
                    ],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
        )
    return out


def write_input(path, entries, extra=()):
    with open(path, "w") as f:
        for entry in entries:
            f.write(json.dumps(entry) + "\n")
        for raw in extra:
            f.write(raw + "\n")


def run_batch(c, model_dir, tmp_path, name="out.jsonl", **kw):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "strata.cli",
            "batch",
            str(tmp_path / "in.jsonl"),
            str(tmp_path / name),
            "--address",
            c.gateway_address,
            "--tokenizer",
            str(model_dir),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        **kw,
    )


def read_output(path):
    return [json.loads(line) for line in open(path)]


def test_every_line_answered_once_each_prefix_computed_once_and_answers_equal_alone(cluster, model_dir, tmp_path):
    from transformers import AutoTokenizer

    c, client = cluster
    bad = [
        '{"custom_id": "broken", "url": ',
        json.dumps({"custom_id": "bad-url", "url": "/v1/embeddings", "body": {}}),
        json.dumps({"custom_id": "bad-temp", "url": "/v1/completions", "body": {"prompt": "x", "temperature": "hot"}}),
        json.dumps(lines()[0]),
    ]  # a repeated custom_id
    write_input(tmp_path / "in.jsonl", lines(), bad)
    before = scheduler_stats(c)
    done = run_batch(c, model_dir, tmp_path)
    assert done.returncode == 0, done.stderr
    after = scheduler_stats(c)
    out = read_output(tmp_path / "out.jsonl")
    by_id = {}
    for line in out:
        assert line["custom_id"] not in by_id or line["custom_id"] == "c0q0"
        by_id.setdefault(line["custom_id"], []).append(line)
    assert len(by_id["c0q0"]) == 2 and sum(1 for x in by_id["c0q0"] if x["error"]) == 1  # the duplicate
    errors = {line["custom_id"]: line["error"] for line in out if line["error"]}
    assert set(errors) == {"line-11", "bad-url", "bad-temp", "c0q0"}
    assert "temperature" in errors["bad-temp"]["message"] and "url" in errors["bad-url"]["message"]
    # Each shared prefix once: the prefill the scheduler did is at most the groups' prefixes plus
    # every request's own tokens (the client's grouping, recomputed here; the prefix cache may find
    # more), against every prompt whole without groups.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    items = []
    for entry in lines():
        body = entry["body"]
        prompt = (
            chat_prompt_ids(tokenizer, body["messages"]) if "messages" in body else tokenizer.encode(body["prompt"])
        )
        items.append(Item(entry["custom_id"], "messages" in body, list(prompt), None))
    groups = shared_prefix_groups(items)
    assert sum(1 for prefix, members in groups if prefix and len(members) > 1) >= 2
    expected = sum(prefix + sum(len(m.prompt) - prefix for m in members) for prefix, members in groups)
    computed = after.prefill_tokens_computed - before.prefill_tokens_computed
    assert computed <= expected < sum(len(i.prompt) for i in items)
    for entry in lines():
        (answer,) = [x for x in by_id[entry["custom_id"]] if not x["error"]]
        body = answer["response"]["body"]
        text = body["choices"][0]["message"]["content"] if "messages" in entry["body"] else body["choices"][0]["text"]
        alone = next(i for i in items if i.custom_id == entry["custom_id"]).prompt
        want = "".join(
            o.text
            for r in client.generate(alone, max_tokens=5, temperature=0.0, ignore_eos=True)
            for o in r.outputs
            if r.finished
        )
        assert text == want, entry["custom_id"]
        assert body["usage"]["completion_tokens"] == 5 and body["usage"]["prompt_tokens"] == len(alone)
    assert scheduler_stats(c).used_kv_blocks == 0


def test_a_rerun_after_an_interruption_answers_every_line_exactly_once(cluster, model_dir, tmp_path):
    c, _ = cluster
    # Lengths staggered from 10 to 110 tokens: the first lines are written while the longest still
    # run (with one length for all, the whole file could land between two polls, nothing to kill).
    entries = [dict(e, custom_id=f"{e['custom_id']}-{k}") for k in range(6) for e in lines(max_tokens=10 + 20 * k)]
    write_input(tmp_path / "in.jsonl", entries)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "strata.cli",
            "batch",
            str(tmp_path / "in.jsonl"),
            str(tmp_path / "out.jsonl"),
            "--address",
            c.gateway_address,
            "--tokenizer",
            str(model_dir),
            "--no-progress",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if (tmp_path / "out.jsonl").exists() and len(open(tmp_path / "out.jsonl").read().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.kill()  # mid-batch, maybe mid-line
    proc.wait()
    first = len(open(tmp_path / "out.jsonl").read().splitlines())
    assert 3 <= first < len(entries)
    done = run_batch(c, model_dir, tmp_path)
    assert done.returncode == 0, done.stderr
    ids = [line["custom_id"] for line in read_output(tmp_path / "out.jsonl")]
    assert sorted(ids) == sorted(e["custom_id"] for e in entries)  # each exactly once
    assert all(line["error"] is None for line in read_output(tmp_path / "out.jsonl"))


def run_batch_through_gateway(c, tmp_path, *extra, name="out.jsonl"):
    """`strata batch --address` with no --model: whatever tokenizes, it is not a guess."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "strata.cli",
            "batch",
            str(tmp_path / "in.jsonl"),
            str(tmp_path / name),
            "--address",
            c.gateway_address,
            "--no-progress",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_without_a_tokenizer_the_gateway_tokenizes_and_every_answer_equals_a_plain_generate(cluster, tmp_path):
    import httpx

    c, client = cluster
    entries = lines()
    as_parts = {
        "custom_id": "parts",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": CONTEXTS[0]}]},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Summarise it,"}, {"type": "text", "text": "0."}],
                },
            ],
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        },
    }
    ids = {
        "custom_id": "ids",
        "url": "/v1/completions",
        "body": {"prompt": [1, 40, 41, 42, 43], "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    }
    image = {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}
    bad = {
        "image": {"url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": [image]}]}},
        "too-long": {"url": "/v1/completions", "body": {"prompt": "x" * 20_000}},  # 512 x 32 characters at most
        "out-of-vocab": {"url": "/v1/completions", "body": {"prompt": [1, 10**6]}},
    }
    write_input(
        tmp_path / "in.jsonl",
        [*entries, as_parts, ids, *({"custom_id": k, **v} for k, v in bad.items())],
    )
    done = run_batch_through_gateway(c, tmp_path)
    assert done.returncode == 0, done.stderr
    out = {line["custom_id"]: line for line in read_output(tmp_path / "out.jsonl")}
    assert len(out) == len(entries) + 2 + len(bad)
    assert {k for k, line in out.items() if line["error"]} == set(bad)
    assert "image_url" in out["image"]["error"]["message"] and "characters" in out["too-long"]["error"]["message"]
    assert "prompt_token_ids" in out["out-of-vocab"]["error"]["message"]

    def plain(entry) -> tuple[str, int]:
        """What the same request alone gives: gRPC Generate on the text, or HTTP chat."""
        body = entry["body"]
        if "messages" in body:
            r = httpx.post(c.http_address + "/v1/chat/completions", json=body, timeout=60).json()
            return r["choices"][0]["message"]["content"], r["usage"]["prompt_tokens"]
        (last,) = [
            r for r in client.generate(body["prompt"], max_tokens=5, temperature=0.0, ignore_eos=True) if r.finished
        ]
        return last.outputs[0].text, last.usage.prompt_tokens

    for entry in [*entries, as_parts, ids]:
        body = out[entry["custom_id"]]["response"]["body"]
        choice = body["choices"][0]
        text = choice["message"]["content"] if "messages" in entry["body"] else choice["text"]
        assert (text, body["usage"]["prompt_tokens"]) == plain(entry), entry["custom_id"]
    # The parts join as vLLM joins them: the same prompt as the string "Summarise it,\n0.".
    chat0 = next(e for e in entries if e["custom_id"] == "chat0")
    joined = dict(
        chat0["body"], messages=[chat0["body"]["messages"][0], {"role": "user", "content": "Summarise it,\n0."}]
    )
    assert plain({"body": joined}) == plain(as_parts)


def test_a_tokenizer_of_another_model_is_refused_before_any_request(cluster, model_dir, tmp_path):
    from strata.default_model import build_tiny_tokenizer

    c, _ = cluster
    other = tmp_path / "other-tokenizer"
    build_tiny_tokenizer(other, vocab_size=320)  # trained on the same text: close, but not the same ids
    write_input(tmp_path / "in.jsonl", lines())
    before = scheduler_stats(c)
    done = run_batch_through_gateway(c, tmp_path, "--tokenizer", str(other))
    assert done.returncode == 2
    assert str(other) in done.stderr and repr(model_dir.name) in done.stderr, done.stderr
    after = scheduler_stats(c)
    assert after.prefill_tokens_computed == before.prefill_tokens_computed  # no Generate, no group
    assert after.finished_requests == before.finished_requests
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()


# Behind the slow marker (STRATA_SLOW_TESTS=1): the first test's batch runs with the served
# model's own tokenizer (the same command line), checked against the gateway first.
@pytest.mark.slow
def test_the_served_models_own_tokenizer_passes_the_check(cluster, model_dir, tmp_path):
    c, _ = cluster
    write_input(tmp_path / "in.jsonl", lines())
    assert run_batch_through_gateway(c, tmp_path, "--tokenizer", str(model_dir)).returncode == 0
    assert len(read_output(tmp_path / "out.jsonl")) == len(lines())


def test_with_an_address_a_model_is_not_taken_for_the_gateways(cluster, model_dir, tmp_path):
    c, _ = cluster
    write_input(tmp_path / "in.jsonl", lines()[:1])
    done = run_batch_through_gateway(c, tmp_path, "--model", str(model_dir))
    assert done.returncode == 2 and "--model" in done.stderr


def test_with_an_address_the_local_clusters_shape_is_refused(cluster, tmp_path):
    c, _ = cluster
    write_input(tmp_path / "in.jsonl", lines()[:1])
    done = run_batch_through_gateway(c, tmp_path, "--data-parallel-size", "2")
    assert done.returncode == 2 and "--data-parallel-size" in done.stderr


def test_a_local_cluster_of_two_replicas_answers_every_line_as_one_does(cluster, model_dir, tmp_path):
    """`strata batch --model DIR --data-parallel-size 2` starts two replicas behind its gateway
    (issue 50: an offline batch on several GPUs), and every answer equals the one-replica
    cluster's. (That a group runs whole on one replica is tests/test_data_parallel.py's.)"""
    c, _ = cluster
    write_input(tmp_path / "in.jsonl", lines())
    assert run_batch(c, model_dir, tmp_path, name="one.jsonl").returncode == 0
    done = subprocess.run(
        [sys.executable, "-m", "strata.cli", "batch", str(tmp_path / "in.jsonl"), str(tmp_path / "two.jsonl")]
        + ["--model", str(model_dir), "--device", "cpu", "--data-parallel-size", "2", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr

    def answers(name):
        out = read_output(tmp_path / name)
        assert not [x["error"] for x in out if x["error"]], name
        choices = {x["custom_id"]: x["response"]["body"]["choices"][0] for x in out}
        return {i: c["message"]["content"] if "message" in c else c["text"] for i, c in choices.items()}

    two = answers("two.jsonl")
    assert two == answers("one.jsonl") and len(two) == len(lines())


def test_echo_prompt_logprobs_and_token_ids_answer_as_the_http_front_does(cluster, model_dir, tmp_path):
    """Batch lines share the HTTP front's body parsing and shapes (issue 52): lm-eval's echo with
    logprobs over token ids, and prompt_logprobs on a chat; a line of several prompts is refused."""
    import httpx

    c, _ = cluster
    bodies = {
        "echo": (
            "/v1/completions",
            {"prompt": [1, 40, 41, 42, 43, 44], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0},
        ),
        "echo-text": ("/v1/completions", {"prompt": CONTEXTS[0], "echo": True, "max_tokens": 0}),
        "chat": (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Name a river."}],
                "prompt_logprobs": 2,
                "max_tokens": 2,
                "temperature": 0,
            },
        ),
        "several": ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 1}),
    }
    write_input(
        tmp_path / "in.jsonl", [{"custom_id": k, "url": url, "body": body} for k, (url, body) in bodies.items()]
    )
    done = run_batch(c, model_dir, tmp_path)
    assert done.returncode == 0, done.stderr
    out = {line["custom_id"]: line for line in read_output(tmp_path / "out.jsonl")}
    assert "a batch line takes one" in out["several"]["error"]["message"]
    for key in ("echo", "echo-text", "chat"):
        url, body = bodies[key]
        got, want = out[key]["response"]["body"], httpx.post(c.http_address + url, json=body, timeout=60).json()
        usage = ("prompt_tokens", "completion_tokens", "total_tokens")  # (the second run finds the cache)
        assert [got["usage"][k] for k in usage] == [want["usage"][k] for k in usage]
        for g, w in zip(got["choices"], want["choices"], strict=True):
            assert g.get("text") == w.get("text") and g.get("message") == w.get("message")
            if w["logprobs"] is not None:
                assert g["logprobs"]["tokens"] == w["logprobs"]["tokens"]
                assert g["logprobs"]["token_logprobs"][0] is None
                assert g["logprobs"]["token_logprobs"][1:] == pytest.approx(
                    w["logprobs"]["token_logprobs"][1:], abs=1e-4
                )
        if "prompt_logprobs" in want:
            assert len(got["prompt_logprobs"]) == len(want["prompt_logprobs"]) > 1
            for g, w in zip(got["prompt_logprobs"][1:], want["prompt_logprobs"][1:]):
                assert g.keys() == w.keys() and all(g[t]["decoded_token"] == w[t]["decoded_token"] for t in g)
    assert out["echo-text"]["response"]["body"]["choices"][0]["text"] == CONTEXTS[0]
