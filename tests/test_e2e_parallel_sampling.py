"""n > 1 through the whole stack: seeds, output kinds, one prompt copy, blocks back to the pool."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest

from strata.launcher import free_port
from strata.v1 import generate_pb2
from tests.cluster import collect, running_cluster, scheduler_stats, tiny_llama_dir

BLOCK = 4  # running_cluster's block size


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, seed=9)


@pytest.fixture(scope="module")
def cluster(model_dir):
    metrics_port = free_port()
    with running_cluster(model_dir, 1, "--metrics-port", str(metrics_port)) as (c, client):
        c.metrics_port = metrics_port
        yield c, client


def _outputs(client, prompt, kind=generate_pb2.DELTA, **params):
    responses = list(client.generate(prompt, timeout=120, output_kind=kind, **params))
    return responses, collect(responses) if kind == generate_pb2.DELTA else None


SAMPLED = dict(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True)


def test_seeded_n4_equals_four_n1_requests_with_seed_plus_i(cluster):
    _, client = cluster
    prompt = "The keeper climbed the steps"
    _, fan = _outputs(client, prompt, n=4, seed=100, **SAMPLED)
    assert sorted(fan) == [0, 1, 2, 3] and all(len(t) == 12 for t in fan.values())
    for i in range(4):
        _, single = _outputs(client, prompt, seed=100 + i, **SAMPLED)
        assert single[0] == fan[i]
    _, again = _outputs(client, prompt, n=4, seed=100, **SAMPLED)
    assert again == fan
    _, unseeded = _outputs(client, prompt, n=4, **SAMPLED)
    assert len({tuple(t) for t in unseeded.values()}) == 4, "children without a seed must sample independently"


def test_output_kinds_agree(cluster):
    _, client = cluster
    params = dict(n=3, seed=7, **SAMPLED)
    delta, _ = _outputs(client, "Sailors said", generate_pb2.DELTA, **params)
    final, _ = _outputs(client, "Sailors said", generate_pb2.FINAL_ONLY, **params)
    cumulative, _ = _outputs(client, "Sailors said", generate_pb2.CUMULATIVE, **params)
    assert len(final) == 1 and final[0].finished and cumulative[-1].finished
    joined = {}
    for r in delta:
        for o in r.outputs:
            text, ids, reason = joined.get(o.index, ("", [], ""))
            joined[o.index] = (text + o.text, ids + list(o.token_ids), o.finish_reason or reason)
    for kind_outputs in (final[0].outputs, cumulative[-1].outputs):
        got = {o.index: (o.text, list(o.token_ids), o.finish_reason) for o in kind_outputs}
        assert got == joined
    assert all(len(r.outputs) == 3 for r in cumulative)
    assert final[0].usage.completion_tokens == 36
    assert final[0].usage.prompt_tokens == cumulative[-1].usage.prompt_tokens > 0


def test_n8_computes_a_200_token_prompt_once(cluster):
    c, client = cluster
    prompt = [(17 * i + 3) % 300 + 2 for i in range(200)]
    before = scheduler_stats(c)
    responses, tokens = _outputs(client, prompt, n=8, seed=1, temperature=1.0, max_tokens=8, ignore_eos=True)
    after = scheduler_stats(c)
    assert sorted(tokens) == list(range(8))
    prefill = after.prefill_tokens_computed - before.prefill_tokens_computed
    # Once for the prompt, plus the last prompt token each other child computes for its own sample.
    assert prefill == 200 + 7
    assert responses[-1].usage.cached_prompt_tokens >= 199
    # Peak blocks: one prompt copy plus each child's generated tokens, far below 8 prompt copies.
    per_child = -(-(200 % BLOCK + 8) // BLOCK)
    assert after.peak_used_kv_blocks <= 200 // BLOCK + 8 * per_child
    assert after.peak_used_kv_blocks < 2 * (200 // BLOCK)


def test_mixed_n_cancel_and_preempt_return_every_block(model_dir):
    with running_cluster(model_dir, 2, "--num-kv-blocks", "40", "--max-model-len", "128") as (c, client):
        errors = []

        def run(i):
            try:
                _outputs(
                    client,
                    f"request {i} " * (3 + i),
                    n=1 + i % 4,
                    seed=i,
                    temperature=0.8,
                    max_tokens=20 + i,
                    ignore_eos=True,
                )
            except Exception as e:  # collected: the assertion below reports them
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        cancelled = [
            client.generate(
                "cancel " * 10, n=3, max_tokens=60, ignore_eos=True, seed=5, output_kind=generate_pb2.DELTA, timeout=120
            )
            for _ in range(3)
        ]
        for s in cancelled:
            next(s)
            s.cancel()
        for t in threads:
            t.join(120)
        assert not errors, errors
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            stats = scheduler_stats(c)
            if stats.used_kv_blocks == 0 and stats.running == 0 and stats.waiting == 0:
                break
            time.sleep(0.1)
        assert stats.preemptions > 0
        assert stats.used_kv_blocks == 0 and stats.free_kv_blocks == stats.num_kv_blocks
        # Cached blocks are evictable: distinct prompts needing the whole pool still run.
        _outputs(client, [5] * 100, max_tokens=20, temperature=0.0, ignore_eos=True)


def test_prometheus_metrics(cluster):
    c, client = cluster
    _outputs(client, "metrics please", max_tokens=4, temperature=0.0, ignore_eos=True)
    deadline = time.monotonic() + 5
    while True:
        body = urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_port}/metrics", timeout=5).read().decode()
        line = [ln for ln in body.splitlines() if ln.startswith("strata_scheduler_prefill_tokens_computed_total ")]
        if line and float(line[0].split()[1]) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert line and float(line[0].split()[1]) > 0
    # Counters carry Prometheus' _total suffix and their TYPE; gauges keep the plain name.
    for name in ("prefix_cache_hits_total", "prefix_cache_queries_total", "free_kv_blocks", "used_kv_blocks"):
        assert f"strata_scheduler_{name} " in body
    assert "# TYPE strata_scheduler_preemptions_total counter" in body
    assert "# TYPE strata_scheduler_used_kv_blocks gauge" in body
