"""Speculative decoding through the whole stack, on CPU in float32: every request gets the tokens
it gets without speculation, whichever proposer, stage count, sampling or stop rule.

One workload runs on a cluster without speculation and on clusters with it (n-gram and draft
model, 1 and 2 stages, a cache small enough to preempt); every output is compared token for
token, and each speculating run must have verified and accepted drafts."""

from __future__ import annotations

import contextlib
import threading

import grpc
import pytest

from strata.v1 import generate_pb2
from tests.cluster import collect, running_cluster, scheduler_stats, shared_cluster, tiny_llama_dir

GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=11)
PROMPTS = ["the cat the cat the cat the", "one two three one two three one", "hello there", "a b a b a b"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # tests/test_structured_outputs.py's model: it runs on the plain and ngram-2 clusters too.
    return tiny_llama_dir(tmp_path_factory, seed=5, layers=2, shared=True)


def _tokens(client, prompt, **kw):
    responses = list(
        client.generate(
            prompt, timeout=120, output_kind=generate_pb2.DELTA, **{"max_tokens": 40, "ignore_eos": True, **kw}
        )
    )
    outs = {}
    for r in responses:
        for o in r.outputs:
            entry = outs.setdefault(o.index, [[], "", "", None])
            entry[0] += o.token_ids
            entry[1] += o.text
            if o.finish_reason:
                entry[2] = o.finish_reason
                entry[3] = o.WhichOneof("stop_reason") and getattr(o, o.WhichOneof("stop_reason"))
    return [tuple(outs[i][:2]) + tuple(outs[i][2:]) for i in sorted(outs)]


def workload(client, stops):
    """Every kind of request the issue names; `stops` gives stop tokens and strings taken from
    the plain run's outputs, so that they fall inside (accepted) drafts."""
    results = {}
    for i, prompt in enumerate(PROMPTS):  # (stop_rules takes positions up to 33 of greedy0's 48)
        results[f"greedy{i}"] = _tokens(client, prompt, max_tokens=48, **GREEDY)
        results[f"sampled{i}"] = _tokens(client, prompt, **SAMPLED)
    results["n4"] = _tokens(client, PROMPTS[0], n=4, **SAMPLED)
    results.update(stopped(client, stops))

    def one(i):  # 16 at once: greedy and sampled, short and long
        kw = GREEDY if i % 2 else dict(SAMPLED, seed=100 + i)
        results[f"concurrent{i}"] = _tokens(
            client, PROMPTS[i % len(PROMPTS)] * (1 + i % 3), max_tokens=20 + 5 * i, **kw
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def stopped(client, stops):
    """The workload's requests with stop tokens and stop strings."""
    results = {}
    for name, (token_ids, strings) in stops.items():
        results[f"stop_tokens_{name}"] = _tokens(client, PROMPTS[0], stop_token_ids=token_ids, **GREEDY)
        results[f"stop_strings_{name}"] = _tokens(client, PROMPTS[1], stop=strings, **SAMPLED)
    return results


def stop_rules(plain):
    """Stop tokens at several positions of a greedy output, stop strings cut from a sampled one."""
    greedy = plain["greedy0"][0][0]
    text = plain["sampled1"][0][1]
    cuts = [int(len(text) * f) for f in (0.1, 0.4, 0.7)]
    assert len(greedy) > 33 and len(text) > 20
    return {f"at{k}": ([greedy[k]], [text[cut : cut + 3]]) for k, cut in zip((5, 17, 33), cuts)}


@pytest.fixture(scope="module")
def plain(model_dir):
    """The workload without speculation. The stop rules come from its first outputs, so the
    requests with stops run after them (the rest of the workload is the same with or without)."""
    _, client = shared_cluster(model_dir, 1)
    first = workload(client, {})
    stops = stop_rules(first)
    return stops, {**first, **stopped(client, stops)}


@pytest.fixture(scope="module")
def cluster_for(model_dir):
    """A running cluster of `stages` with `flags`: the one the previous test ran on when it was
    started the same way (the draft cluster the cancellation test shares with draft-1), else a new
    one, after the previous one stopped (one cluster at a time); ngram-2's is the session's, shared
    with tests/test_structured_outputs.py."""
    current = {}

    def get(stages, *flags):
        if current and current["how"] != (stages, *flags):
            current.pop("stack").close()
            current.clear()
        if (stages, *flags) == CASES["ngram-2"]:
            return shared_cluster(model_dir, stages, *flags)
        if not current:
            stack = contextlib.ExitStack()
            cluster, client = stack.enter_context(running_cluster(model_dir, stages, *flags))
            current.update(how=(stages, *flags), stack=stack, cluster=cluster, client=client)
        return current["cluster"], current["client"]

    yield get
    if current:
        current["stack"].close()


DRAFT_1 = (1, "--speculative-method", "draft", "--draft-num-layers", "1")
CASES = {
    "ngram-1": (1, "--speculative-method", "ngram", "--ngram-max", "3"),
    "ngram-2": (2, "--speculative-method", "ngram", "--num-speculative-tokens", "3"),
    # One stage: the draft worker hands its proposals straight to the stage (the draft link, ipc
    # through /dev/shm here), or over gRPC, or back through the scheduler. draft-1 comes last
    # (below): the cancellation test runs on its cluster.
    "draft-1-grpc-link": (1, "--speculative-method", "draft", "--draft-num-layers", "1", "--stage-transport", "grpc"),
    "draft-1-scheduler": (
        1,
        "--speculative-method",
        "draft",
        "--draft-num-layers",
        "1",
        "--draft-proposals",
        "scheduler",
    ),
    "draft-2": (2, "--speculative-method", "draft", "--draft-num-layers", "1", "--num-speculative-tokens", "3"),
    # Several verify rounds per step (greedy requests; a top-p one running keeps plans at one).
    "ngram-rounds": (
        1,
        "--speculative-method",
        "ngram",
        "--speculative-rounds",
        "3",
        "--speculative-rounds-max-batch",
        "16",
    ),
    # 40 blocks of 4 tokens, one request's worth: 16 concurrent requests preempt each other.
    "ngram-preempting": (1, "--speculative-method", "ngram", "--num-kv-blocks", "40", "--max-model-len", "160"),
    # ngram-1, ngram-rounds and ngram-preempting on one cluster: CI's one-stage n-gram case, with
    # each one's assertions (verify rounds, preemptions).
    "ngram-1-rounds-preempting": (
        1,
        "--speculative-method",
        "ngram",
        "--ngram-max",
        "3",
        "--speculative-rounds",
        "3",
        "--speculative-rounds-max-batch",
        "16",
        "--num-kv-blocks",
        "40",
        "--max-model-len",
        "160",
    ),
    "draft-preempting": (
        1,
        "--speculative-method",
        "draft",
        "--draft-num-layers",
        "1",
        "--num-kv-blocks",
        "40",
        "--max-model-len",
        "160",
    ),
    "draft-1": DRAFT_1,
}


# Behind the `slow` marker (STRATA_SLOW_TESTS=1): variants whose paths another case covers in
# CI (ngram-1-rounds-preempting one stage of n-gram speculation with several rounds and with
# preemption, ngram-2 two stages, draft-1 the draft link), 15-36 s each.
SLOW_CASES = {
    "ngram-1",
    "ngram-rounds",
    "ngram-preempting",
    "draft-1-grpc-link",
    "draft-1-scheduler",
    "draft-2",
    "draft-preempting",
}


def _delta(after, before, field: str) -> int:
    return getattr(after, field) - getattr(before, field)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES])
def test_speculation_gives_every_request_the_plain_tokens(cluster_for, plain, case):
    stops, expected = plain
    stages, *flags = CASES[case]
    cluster, client = cluster_for(stages, *flags)
    before = scheduler_stats(cluster)  # counts of this workload: a shared cluster's are deltas
    got = workload(client, stops)
    stats = scheduler_stats(cluster)
    different = sorted(name for name in expected if got[name] != expected[name])
    assert not different, (different[:3], [(got[n], expected[n]) for n in different[:1]])
    assert _delta(stats, before, "spec_decode_drafts") > 0 and _delta(stats, before, "spec_decode_accepted_tokens") > 0
    if "--num-kv-blocks" in flags:  # the preempting cases
        assert _delta(stats, before, "preemptions") > 0
    linked = case.startswith("draft-") and stages == 1 and "--draft-proposals" not in flags
    if linked:  # every proposal went over the draft link, none failed
        verify_steps = _delta(stats, before, "spec_decode_verify_steps")
        assert _delta(stats, before, "spec_decode_linked_proposals") >= verify_steps > 0
    else:
        assert _delta(stats, before, "spec_decode_linked_proposals") == 0
    assert _delta(stats, before, "spec_decode_failed_proposals") == 0
    if "--speculative-rounds" in flags:  # steps ran several verify rounds
        assert _delta(stats, before, "spec_decode_verify_rounds") > _delta(stats, before, "spec_decode_verify_steps")
    assert stats.used_kv_blocks == 0


def test_cancelled_speculating_streams_free_every_block(cluster_for):
    c, client = cluster_for(*DRAFT_1)  # draft-1's cluster, when that case ran just before
    before = scheduler_stats(c)
    streams = [client.generate(f"cancel {i} " * 3, max_tokens=300, ignore_eos=True, temperature=0.0) for i in range(8)]
    for stream in streams:
        next(stream)
    for stream in streams:
        stream.cancel()
        with pytest.raises(grpc.RpcError):
            list(stream)
    assert collect(client.generate("after", max_tokens=10, ignore_eos=True, temperature=0.0))
    stats = scheduler_stats(c)
    assert stats.spec_decode_drafts > before.spec_decode_drafts
    assert stats.used_kv_blocks == 0 and stats.running == 0
