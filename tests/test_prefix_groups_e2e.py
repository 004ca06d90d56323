"""Gateway.GenerateGroups through the whole stack: every member gets the tokens it gets alone,
each group's prefix is computed once, KV use stays within the prefixes plus the members' own
tokens, a bad member fails alone, and a client that leaves frees every block."""

from __future__ import annotations

import random

import grpc
import pytest

from strata.v1 import generate_pb2, generate_pb2_grpc
from tests.cluster import collect, running_cluster, scheduler_stats, tiny_llama_dir

BLOCK = 4  # running_cluster's block size
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with running_cluster(tiny_llama_dir(tmp_path_factory, seed=9), 1) as (c, client):
        yield c, client


def make_groups(vocab: int, seed: int, sizes=(5, 1, 3, 8)) -> list[generate_pb2.PrefixGroup]:
    rng = random.Random(seed)
    groups = []
    for g, size in enumerate(sizes):
        prefix = [rng.randrange(3, vocab) for _ in range(rng.randint(9, 30))]  # mid-block and not
        members = []
        for m in range(size):
            params = generate_pb2.SamplingParams(
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
                output_kind=generate_pb2.DELTA,
                temperature=0.0 if m % 2 else 0.8,
                seed=100 * g + m,
            )
            own = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 7))]
            members.append(
                generate_pb2.GenerateRequest(
                    request_id=f"s{seed}g{g}m{m}", params=params, prompt_token_ids=generate_pb2.TokenIds(ids=own)
                )
            )
        groups.append(generate_pb2.PrefixGroup(prefix_token_ids=generate_pb2.TokenIds(ids=prefix), members=members))
    return groups


def run_groups(cluster, groups):
    with grpc.insecure_channel(cluster.gateway_address) as channel:
        stub = generate_pb2_grpc.GatewayStub(channel)
        outputs, errors = {}, {}
        for r in stub.GenerateGroups(iter(groups), timeout=120):
            if r.HasField("error"):
                errors[r.error.request_id] = r.error
            else:
                for o in r.response.outputs:
                    outputs.setdefault(r.response.request_id, []).extend(o.token_ids)
    return outputs, errors


def test_members_get_their_own_tokens_and_each_prefix_is_computed_once(cluster):
    c, client = cluster
    vocab = client.model_info().vocab_size
    groups = make_groups(vocab, seed=1)
    before = scheduler_stats(c)
    outputs, errors = run_groups(c, groups)
    after = scheduler_stats(c)
    assert not errors and len(outputs) == sum(len(g.members) for g in groups)
    own = sum(len(m.prompt_token_ids.ids) for g in groups for m in g.members)
    prefixes = sum(len(g.prefix_token_ids.ids) for g in groups)
    # Each prefix once, each member's own tokens once (and the decode steps as decodes).
    assert after.prefill_tokens_computed - before.prefill_tokens_computed == prefixes + own
    bound = sum(
        len(g.prefix_token_ids.ids) // BLOCK
        + sum(
            -(-(len(g.prefix_token_ids.ids) % BLOCK + len(m.prompt_token_ids.ids) + MAX_TOKENS) // BLOCK)
            for m in g.members
        )
        for g in groups
    )
    assert after.peak_used_kv_blocks <= bound
    for g in groups:
        for m in g.members:
            alone = collect(
                client.generate(
                    list(g.prefix_token_ids.ids) + list(m.prompt_token_ids.ids),
                    max_tokens=MAX_TOKENS,
                    ignore_eos=True,
                    output_kind=generate_pb2.DELTA,
                    temperature=m.params.temperature,
                    seed=m.params.seed,
                    timeout=60,
                )
            )[0]
            assert outputs[m.request_id] == alone, m.request_id
    assert scheduler_stats(c).used_kv_blocks == 0


def finished_by_length(c) -> float:
    """The gateway's strata_request_success_total{finished_reason="length"} (/metrics)."""
    import httpx

    for line in httpx.get(c.http_address + "/metrics", timeout=10).text.splitlines():
        if line.startswith('strata_request_success_total{finished_reason="length"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_bad_member_fails_alone(cluster):
    c, client = cluster
    vocab = client.model_info().vocab_size
    groups = make_groups(vocab, seed=2, sizes=(4,))
    bad = groups[0].members[1]
    bad.prompt_token_ids.ids.append(vocab + 5)
    too_long = groups[0].members[2]
    too_long.params.max_tokens = 100_000
    finished_before = finished_by_length(c)
    outputs, errors = run_groups(c, groups)
    # Members count in the gateway's serving metrics as Generate's requests do (the two refused
    # ones never started, as refused Generate calls do not).
    assert finished_by_length(c) - finished_before == 2
    assert set(errors) == {bad.request_id, too_long.request_id}
    assert all(e.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for e in errors.values())
    assert "prompt_token_ids" in errors[bad.request_id].message
    assert "max_tokens" in errors[too_long.request_id].message
    assert set(outputs) == {groups[0].members[0].request_id, groups[0].members[3].request_id}
    assert all(len(tokens) == MAX_TOKENS for tokens in outputs.values())
    assert scheduler_stats(c).used_kv_blocks == 0


def test_a_client_that_leaves_frees_every_block(cluster):
    import time

    c, client = cluster
    vocab = client.model_info().vocab_size
    groups = make_groups(vocab, seed=3, sizes=(6, 6))
    for g in groups:
        for m in g.members:
            m.params.max_tokens = 200
    with grpc.insecure_channel(c.gateway_address) as channel:
        call = generate_pb2_grpc.GatewayStub(channel).GenerateGroups(iter(groups), timeout=120)
        next(call)
        call.cancel()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = scheduler_stats(c)
        if stats.used_kv_blocks == 0 and stats.running == 0 and stats.waiting == 0:
            break
        time.sleep(0.1)
    assert stats.used_kv_blocks == 0 and stats.running == 0 and stats.waiting == 0
