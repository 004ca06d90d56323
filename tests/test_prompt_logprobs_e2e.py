"""Prompt logprobs and echo through the whole stack (issue 52): each prompt token's logprob equals
HF transformers' log-softmax on the same weights (float32, within 1e-4), its rank and top
alternatives match, on one stage with a long prompt cut into chunks, for a prompt the cache holds,
for n = 2, for a prefix group's member and on two stages with speculation; and the HTTP shapes
(vLLM's): echo with and without logprobs, max_tokens 0, prompt_logprobs on completions and chat,
token id and several prompts, streaming, and the 400s naming the field.

One cluster of this module (one stage, 16-token steps, a small --max-response-bytes), plus the
session's two-stage cluster (tests/cluster.py shared_cluster, also used by
tests/test_structured_outputs.py and tests/test_speculative_e2e.py)."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch

from strata.prompt_logprobs import positions
from strata.v1 import generate_pb2, generate_pb2_grpc
from tests.cluster import running_cluster, scheduler_stats, shared_cluster, tiny_llama_dir

TOLERANCE = 1e-4
MAX_RESPONSE_BYTES = 100_000
LONG_PROMPT = [3 + i % 300 for i in range(400)]  # top 20 over it passes MAX_RESPONSE_BYTES in any shape
CHAT_TEMPLATE = (
    "{% for m in messages %}<|begin_of_text|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tiny_llama_dir(tmp_path_factory, seed=23, layers=2)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE  # the tiny tokenizer has none
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def cluster(model_dir):
    flags = ("--max-num-batched-tokens", "16", "--max-response-bytes", str(MAX_RESPONSE_BYTES))
    with running_cluster(model_dir, 1, *flags) as (c, client):
        yield c, client


def _oracle(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def log_softmax(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)

    return log_softmax


@pytest.fixture(scope="module")
def hf(model_dir):
    return _oracle(model_dir)


def check_entries(msg, prompt: list[int], want: torch.Tensor, k: int) -> None:
    """The public message against HF: the prompt's tokens, the first alone, then each token's
    logprob, rank (tokens at least as likely) and top k ids."""
    entries = positions(msg)
    assert [e.token_id for e in entries] == prompt and msg.num_top == k
    assert entries[0].logprob is None and not entries[0].top
    for p, e in enumerate(entries[1:]):
        row, target = want[p], prompt[p + 1]
        assert abs(e.logprob - row[target].item()) <= TOLERANCE, (p, e.logprob, row[target].item())
        assert e.rank == int((row >= row[target]).sum())
        assert [t.token_id for t in e.top] == row.topk(k).indices.tolist()
        assert all(abs(t.logprob - row[t.token_id].item()) <= TOLERANCE for t in e.top)


def responses(client, prompt, **params) -> list[generate_pb2.GenerateResponse]:
    return list(client.generate(prompt, timeout=120, **{"temperature": 0.0, **params}))


def _prompt(seed: int, length: int, vocab: int = 380) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, length).tolist()


def test_a_chunked_prompt_equals_hf(cluster, hf):
    _, client = cluster
    prompt = _prompt(1, 70)  # five 16-token steps
    got = responses(client, prompt, prompt_logprobs=5, max_tokens=2, output_kind=generate_pb2.DELTA)
    assert len(got[0].prompt_logprobs.token_ids) == len(prompt)
    assert not any(r.HasField("prompt_logprobs") for r in got[1:])
    check_entries(got[0].prompt_logprobs, prompt, hf(prompt), 5)


def test_a_cached_prompt_is_recomputed_for_its_asker_and_served_from_the_cache_to_others(cluster, hf):
    c, client = cluster
    prompt = _prompt(2, 41)
    want = hf(prompt)
    before = scheduler_stats(c)
    for _ in range(2):  # the second time its blocks are cached
        (final,) = responses(client, prompt, prompt_logprobs=2, max_tokens=1, output_kind=generate_pb2.FINAL_ONLY)
        check_entries(final.prompt_logprobs, prompt, want, 2)
        assert final.usage.cached_prompt_tokens == 0  # it read none of them
    (plain,) = responses(client, prompt, max_tokens=1, output_kind=generate_pb2.FINAL_ONLY)
    assert plain.usage.cached_prompt_tokens == 40  # the cache kept them for everyone else
    after = scheduler_stats(c)
    assert after.prompt_logprob_positions - before.prompt_logprob_positions == 2 * 40


@pytest.mark.parametrize("kind", [generate_pb2.DELTA, generate_pb2.CUMULATIVE])
def test_n2_gets_the_list_once_in_its_first_response(cluster, hf, kind):
    _, client = cluster
    prompt = _prompt(3, 30)
    got = responses(client, prompt, prompt_logprobs=1, n=2, max_tokens=4, seed=7, temperature=1.0, output_kind=kind)
    assert [r.HasField("prompt_logprobs") for r in got] == [True] + [False] * (len(got) - 1)
    check_entries(got[0].prompt_logprobs, prompt, hf(prompt), 1)
    assert got[-1].usage.completion_tokens == 8


def test_a_constrained_request_asks_too(cluster, hf):
    """Constrained decoding masks the sampled logits only: the prompt's rows stay the raw ones."""
    _, client = cluster
    prompt = _prompt(12, 20)
    choice = generate_pb2.ChoiceList(choices=["yes", "no way"])
    (final,) = responses(
        client, prompt, prompt_logprobs=2, choice=choice, max_tokens=8, output_kind=generate_pb2.FINAL_ONLY
    )
    assert final.outputs[0].text in choice.choices
    check_entries(final.prompt_logprobs, prompt, hf(prompt), 2)


def test_a_prefix_group_member_gets_its_whole_prompt(cluster, hf):
    c, _ = cluster
    prefix, own = _prompt(4, 24), [[5, 6, 7], [8, 9, 10, 11]]
    group = generate_pb2.PrefixGroup(
        prefix_token_ids=generate_pb2.TokenIds(ids=prefix),
        members=[
            generate_pb2.GenerateRequest(
                request_id=f"m{i}",
                prompt_token_ids=generate_pb2.TokenIds(ids=ids),
                params=generate_pb2.SamplingParams(
                    temperature=0.0,
                    max_tokens=2,
                    output_kind=generate_pb2.FINAL_ONLY,
                    prompt_logprobs=3 if i == 0 else None,
                ),
            )
            for i, ids in enumerate(own)
        ],
    )
    import grpc

    with grpc.insecure_channel(c.gateway_address) as channel:
        got = {
            r.response.request_id: r.response
            for r in generate_pb2_grpc.GatewayStub(channel).GenerateGroups(iter([group]), timeout=120)
        }
    assert set(got) == {"m0", "m1"} and not got["m1"].HasField("prompt_logprobs")
    check_entries(got["m0"].prompt_logprobs, prefix + own[0], hf(prefix + own[0]), 3)


def test_two_stages_with_speculation(tmp_path_factory):
    """The session's two-stage cluster (n-gram speculation on): the rows come from the last stage,
    and the greedy tokens after them are HF's."""
    from tests.cluster import hf_greedy

    model = tiny_llama_dir(tmp_path_factory, seed=5, layers=2, shared=True)
    _, client = shared_cluster(model, 2, "--speculative-method", "ngram", "--num-speculative-tokens", "3")
    prompt = _prompt(5, 33) * 2  # a repeat: prompt lookup proposes
    got = responses(
        client, prompt, prompt_logprobs=4, max_tokens=12, ignore_eos=True, output_kind=generate_pb2.FINAL_ONLY
    )
    check_entries(got[0].prompt_logprobs, prompt, _oracle(model)(prompt), 4)
    assert list(got[0].outputs[0].token_ids) == hf_greedy(model, [prompt], [12])[0]


# ------------------------------------------------------------------------------ HTTP


def post(c, path: str, **body) -> httpx.Response:
    return httpx.post(c.http_address + path, json=body, timeout=120)


def test_echo_with_logprobs_in_vllms_shape(cluster, model_dir, hf):
    """lm-eval's request: echo, logprobs 1, max_tokens 1 (then 0): the prompt's tokens lead the
    lists, null first, then the generated token's entry (none with max_tokens 0)."""
    c, client = cluster
    prompt = _prompt(6, 12)
    text = client.detokenize(prompt)
    want = hf(prompt)
    for max_tokens in (1, 0):
        body = post(
            c, "/v1/completions", prompt=prompt, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0
        ).json()
        (choice,) = body["choices"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for p in range(len(prompt) - 1):
            assert abs(lp["token_logprobs"][p + 1] - want[p, prompt[p + 1]].item()) <= TOLERANCE
            # The position's best is in top_logprobs: lm-eval's is_greedy compares with ==.
            best = max(lp["top_logprobs"][p + 1].values())
            assert abs(best - want[p].max().item()) <= TOLERANCE
            assert (lp["token_logprobs"][p + 1] == best) == (want[p].argmax().item() == prompt[p + 1])
        assert lp["text_offset"][0] == 0 and choice["text"].startswith(text)
        assert body["usage"]["completion_tokens"] == max_tokens
        if max_tokens == 0:
            assert choice["text"] == text and choice["finish_reason"] == "length"


def test_echo_alone_and_prompt_logprobs_on_completions_and_chat(cluster, hf):
    c, client = cluster
    body = post(c, "/v1/completions", prompt="hello there", echo=True, max_tokens=2, temperature=0).json()
    assert body["choices"][0]["text"].startswith("hello there") and body["choices"][0]["logprobs"] is None
    prompt = _prompt(7, 10)
    body = post(c, "/v1/completions", prompt=prompt, prompt_logprobs=2, max_tokens=1, n=2, temperature=0).json()
    want = hf(prompt)
    for choice in body["choices"]:  # each choice carries the list, as vLLM's
        listed = choice["prompt_logprobs"]
        assert listed[0] is None and len(listed) == len(prompt)
        for p, position in enumerate(listed[1:]):
            own = position[str(prompt[p + 1])]
            assert abs(own["logprob"] - want[p, prompt[p + 1]].item()) <= TOLERANCE
            assert own["rank"] == int((want[p] >= want[p, prompt[p + 1]]).sum())
            assert isinstance(own["decoded_token"], str)
            assert {int(t) for t in position} >= set(want[p].topk(2).indices.tolist())
    messages = [{"role": "user", "content": "a question"}]
    body = post(c, "/v1/chat/completions", messages=messages, prompt_logprobs=0, max_tokens=1, temperature=0).json()
    ids = client.tokenize(messages).tokens
    listed = body["prompt_logprobs"]  # top level in chat
    assert len(listed) == len(ids) and listed[0] is None
    want = hf(list(ids))
    assert all(
        abs(pos[str(ids[p + 1])]["logprob"] - want[p, ids[p + 1]].item()) <= TOLERANCE
        for p, pos in enumerate(listed[1:])
    )


def test_token_id_and_several_prompts(cluster, hf):
    c, client = cluster
    prompts = [_prompt(8, 9), _prompt(9, 14)]
    body = post(c, "/v1/completions", prompt=prompts, echo=True, logprobs=0, max_tokens=1, n=2, temperature=0).json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]  # prompt * n + i
    for i, choice in enumerate(body["choices"]):
        prompt = prompts[i // 2]
        got = choice["logprobs"]["token_logprobs"][1 : len(prompt)]
        want = hf(prompt)
        assert np.allclose(got, [want[p, prompt[p + 1]].item() for p in range(len(prompt) - 1)], atol=TOLERANCE)
    assert body["usage"]["prompt_tokens"] == 23 and body["usage"]["completion_tokens"] == 4
    texts = ["one prompt", "another prompt here"]
    body = post(c, "/v1/completions", prompt=texts, max_tokens=3, temperature=0).json()
    alone = [
        post(c, "/v1/completions", prompt=t, max_tokens=3, temperature=0).json()["choices"][0]["text"] for t in texts
    ]
    assert [ch["text"] for ch in body["choices"]] == alone
    # lm-eval's token id mode: [[ids]] at batch size 1.
    body = post(c, "/v1/completions", prompt=[prompts[0]], echo=True, logprobs=1, max_tokens=1, temperature=0).json()
    assert len(body["choices"]) == 1 and len(body["choices"][0]["logprobs"]["tokens"]) == len(prompts[0]) + 1


def test_streamed_echo_and_prompt_logprobs_come_in_each_choices_first_chunk(cluster):
    c, client = cluster
    prompts = [_prompt(10, 8), _prompt(11, 6)]
    request = dict(prompt=prompts, echo=True, logprobs=1, prompt_logprobs=1, max_tokens=3, n=2, seed=3, temperature=1.0)
    whole = post(c, "/v1/completions", **request).json()
    chunks = []
    with httpx.stream("POST", c.http_address + "/v1/completions", json=dict(request, stream=True), timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    texts, tokens, firsts = {}, {}, {}
    for chunk in chunks:
        for ch in chunk["choices"]:
            i = ch["index"]
            if i not in firsts:
                firsts[i] = ch
            texts[i] = texts.get(i, "") + ch["text"]
            tokens[i] = tokens.get(i, []) + ch["logprobs"]["tokens"]
    for choice in whole["choices"]:
        i = choice["index"]
        assert texts[i] == choice["text"] and tokens[i] == choice["logprobs"]["tokens"]
        # (computed in other batches: equal up to float rounding)
        streamed, listed = firsts[i]["prompt_logprobs"], choice["prompt_logprobs"]
        assert streamed[0] is None and len(streamed) == len(listed)
        for a, b in zip(streamed[1:], listed[1:]):
            assert a.keys() == b.keys()
            assert all(abs(a[t]["logprob"] - b[t]["logprob"]) <= TOLERANCE for t in a)


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "x", "prompt_logprobs": 1.5}, "prompt_logprobs"),
        ({"prompt": "x", "echo": True, "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": [[1, 2], "x"]}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["a"] * 257}, "prompt"),
        ({"prompt": [[10**6]]}, "prompt_token_ids"),
        ({"prompt": LONG_PROMPT, "prompt_logprobs": 20, "max_tokens": 1}, "prompt_logprobs"),
        ({"prompt": LONG_PROMPT, "echo": True, "logprobs": 20, "max_tokens": 1}, "logprobs"),
    ],
)
def test_bad_values_get_a_400_naming_the_field(cluster, body, field):
    c, _ = cluster
    r = post(c, "/v1/completions", **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_chat_refuses_echo_and_grpc_refuses_past_the_response_limit(cluster):
    c, client = cluster
    r = post(c, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], echo=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    import grpc

    with pytest.raises(grpc.RpcError) as e:
        responses(client, LONG_PROMPT, prompt_logprobs=20, max_tokens=1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.prompt_logprobs" in e.value.details() and "--max-response-bytes" in e.value.details()
    assert f"at most {MAX_RESPONSE_BYTES:,}" in e.value.details()


@pytest.mark.slow  # the tiny models' cases above cover its path; this is the default model's weights
def test_smollm2_equals_hf(tmp_path_factory):
    from strata.default_model import ensure_default_model

    model = ensure_default_model()
    with running_cluster(model, 1, "--dtype", "float32", "--max-num-batched-tokens", "32") as (_, client):
        ids = client.tokenize(
            "The capital of France is Paris. The capital of Italy is Rome, and the capital of Spain"
        ).tokens
        (final,) = responses(client, list(ids), prompt_logprobs=5, max_tokens=1, output_kind=generate_pb2.FINAL_ONLY)
    check_entries(final.prompt_logprobs, list(ids), _oracle(model)(list(ids)), 5)
