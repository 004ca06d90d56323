"""Data-parallel replicas through the whole stack: `strata serve --data-parallel-size 2
--pipeline-stages 2` on CPUs, one cluster for the module. Greedy outputs equal HF transformers;
routing keeps n > 1 siblings, a shared system prompt and a prefix group's members each on one
replica (their cached prompt tokens show it) and spreads groups by load; killing a replica mid-
stream (kill -9 of its scheduler, or of one of its stages) loses no request and changes no token,
while the gateway stays SERVING; every KV block ends free."""

from __future__ import annotations

import random
import signal
import subprocess
import threading
import time

import grpc
import pytest

from strata.grpc_util import bearer, check_health
from strata.v1 import engine_pb2, engine_pb2_grpc, generate_pb2
from tests.cluster import (
    greedy_concurrently,
    hf_greedy,
    mixed_requests,
    run_all,
    running_cluster,
    tiny_llama_dir,
)

# Long enough that every stream is far from its end when a replica goes (each run decodes them).
MAX_TOKENS = 150


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, seed=5, layers=2, shared=True)  # (the session shares its build)


@pytest.fixture(scope="module")
def dp(model_dir):
    """The module's cluster: 2 replicas of 2 stages; a replica NOT_SERVING for a second hands its
    requests over (--replica-failover-seconds 1)."""
    flags = ("--data-parallel-size", "2", "--max-num-batched-tokens", "64", "--replica-failover-seconds", "1")
    with running_cluster(model_dir, 2, *flags) as (cluster, client):
        yield cluster, client


def replica_stats(cluster) -> list[engine_pb2.SchedulerStats]:
    out = []
    for replica in cluster.replicas:
        with grpc.insecure_channel(replica.scheduler) as ch:
            out.append(
                engine_pb2_grpc.SchedulerStub(ch).GetStats(
                    engine_pb2.GetStatsRequest(), timeout=10, metadata=bearer(cluster.cluster_token)
                )
            )
    return out


def finished_per_replica(cluster, before) -> list[int]:
    return [a.finished_requests - b.finished_requests for a, b in zip(replica_stats(cluster), before)]


def test_greedy_matches_hf_over_two_replicas_of_two_stages(dp, model_dir):
    cluster, client = dp
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 384) for _ in range(rng.randint(3, 40))] for _ in range(16)]
    lengths = [rng.randint(4, 24) for _ in range(16)]
    expected = hf_greedy(model_dir, prompts, lengths)
    before = replica_stats(cluster)
    assert greedy_concurrently(client, prompts, lengths) == expected
    served = finished_per_replica(cluster, before)
    assert sum(served) == 16 and min(served) > 0  # both replicas took a share
    info = client.model_info()
    assert info.data_parallel_size == 2 and [r.up for r in info.replicas] == [True, True]
    assert all(r.pipeline_stages == 2 for r in info.replicas)


def test_siblings_a_shared_system_prompt_and_group_members_stay_together(dp):
    cluster, client = dp
    rng = random.Random(5)
    kw = dict(temperature=0.0, ignore_eos=True, output_kind=generate_pb2.FINAL_ONLY)

    # n = 4 siblings: one replica serves all four.
    before = replica_stats(cluster)
    prompt = [rng.randrange(3, 384) for _ in range(30)]
    list(client.generate(prompt, n=4, max_tokens=8, **kw))
    assert sorted(finished_per_replica(cluster, before)) == [0, 4]

    # A 48-token system prompt: the requests after the first find it cached where they land.
    system = [rng.randrange(3, 384) for _ in range(48)]
    before = replica_stats(cluster)
    cached = []
    for i in range(3):
        (last,) = list(client.generate(system + [rng.randrange(3, 384) for _ in range(5 + i)], max_tokens=4, **kw))
        cached.append(last.usage.cached_prompt_tokens)
    assert cached[0] < 48 and all(c >= 48 for c in cached[1:]), cached
    assert sorted(finished_per_replica(cluster, before)) == [0, 3]

    # Two prefix groups of three: each group on one replica, the groups spread by load.
    groups = []
    for g in range(2):
        prefix = [rng.randrange(3, 384) for _ in range(40)]
        members = [
            generate_pb2.GenerateRequest(
                request_id=f"g{g}m{m}",
                prompt_token_ids=generate_pb2.TokenIds(ids=[rng.randrange(3, 384) for _ in range(6)]),
                params=generate_pb2.SamplingParams(
                    max_tokens=30, temperature=0.0, ignore_eos=True, output_kind=generate_pb2.FINAL_ONLY
                ),
            )
            for m in range(3)
        ]
        groups.append(generate_pb2.PrefixGroup(prefix_token_ids=generate_pb2.TokenIds(ids=prefix), members=members))
    before = replica_stats(cluster)
    routed_before = [r.routed for r in client.model_info().replicas]
    responses = [r.response for r in client.stub.GenerateGroups(iter(groups), timeout=120)]
    assert len(responses) == 6 and all(r.finished for r in responses)
    assert finished_per_replica(cluster, before) == [3, 3]
    assert [a.routed - b for a, b in zip(client.model_info().replicas, routed_before)] == [1, 1]
    for g in range(2):  # the prefix computed once: the others took its blocks
        cached = sorted(r.usage.cached_prompt_tokens for r in responses if r.request_id.startswith(f"g{g}"))
        assert cached[1] >= 40, cached


@pytest.fixture(scope="module")
def uninterrupted(dp):
    threads, plain, errors = run_all(dp[1], mixed_requests(MAX_TOKENS))
    for t in threads:
        t.join()
    assert not errors and len(plain) == 16
    return plain


def wait_until_both_up(client, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(r.up for r in client.model_info().replicas):
        assert time.monotonic() < deadline, "the restarted replica did not come back"
        time.sleep(0.3)


@pytest.mark.parametrize(
    "victim",
    [
        "replica 0 scheduler",  # its Submit calls fail at once: they resume on replica 1
        # Its scheduler pauses the requests (NOT_SERVING): past --replica-failover-seconds they move.
        # (Slow: the same resume on another replica as above, reached through the grace period;
        # tests/test_replica_failover.py covers that path in process.)
        pytest.param("replica 1 worker 1", marks=pytest.mark.slow),
    ],
)
def test_killing_a_replica_mid_stream_loses_no_request_and_changes_no_token(dp, uninterrupted, victim):
    cluster, client = dp
    work = mixed_requests(MAX_TOKENS)
    resumed_before = sum(s.resumed_requests for s in replica_stats(cluster))
    started = threading.Barrier(len(work) + 1)
    threads, resumed, errors = run_all(client, work, started)
    started.wait(timeout=60)  # every request has streamed tokens: the replica goes mid-stream
    index = next(i for i, (name, _) in enumerate(cluster.procs) if name == victim)
    proc = cluster.procs[index][1]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    serving = []
    while any(t.is_alive() for t in threads):
        serving.append(check_health(cluster.gateway_address, timeout=1))
        time.sleep(0.2)
    assert not errors, errors
    assert resumed == uninterrupted
    assert serving and all(serving), "the gateway stopped serving while a replica was up"
    survivor = 1 if victim.startswith("replica 0") else 0
    # Back to two replicas for the next case: the lost service starts again, its replica rejoins.
    cluster.procs[index] = (victim, subprocess.Popen(proc.args, env=cluster.service_env()))
    wait_until_both_up(client)
    stats = replica_stats(cluster)
    assert sum(s.resumed_requests for s in stats) > resumed_before  # some requests did move
    assert all(s.used_kv_blocks == 0 for s in stats)
    info = client.model_info()
    assert info.replicas[survivor].resumed > 0 and all(r.load_tokens == 0 for r in info.replicas)
