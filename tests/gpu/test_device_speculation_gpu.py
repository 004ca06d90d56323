"""Speculation with prompt lookup on the device, on a GPU (issue 31): the compiled kernels against
their torch references, and the worker's CUDA-graph path (decode graphs, verification graphs
that move a plan's positions in-graph, padded mixed draft counts) giving exactly the plain
tokens in float32, with three plans in flight.

    python -m pytest tests/gpu/test_device_speculation_gpu.py -q
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from strata.services.scheduler.speculation.config import SpeculativeConfig  # noqa: E402
from strata.v1 import engine_pb2  # noqa: E402
from tests.test_device_speculation import (  # noqa: E402
    BLOCKS,
    _drive,
    _requests,
    _scheduler,
    _unfiltered_requests,
    check_history_follows_plain_steps,
)
from tests.test_spec_kernels import K, _commit_case, _history, _propose  # noqa: E402

CUDA = torch.device("cuda")


def test_compiled_lookup_equals_reference():
    rng = random.Random(3)
    for _ in range(4):
        history, hist_len = _history(rng, 64, 3000, 5)  # long rows: several blocks of positions
        rows = torch.tensor(rng.sample(range(64), 48))
        num = torch.tensor([rng.randint(0, K) for _ in range(48)])
        want = _propose(False, history, hist_len, rows, num)
        got = _propose_cuda(history, hist_len, rows, num)
        for a, b in zip(want, got):
            assert torch.equal(a, b.cpu())


def _propose_cuda(history, hist_len, rows, num):
    from strata.kernels.ngram_lookup import ngram_propose

    n, base = rows.shape[0], history.shape[0]
    out = torch.full((base + base * K,), -7, dtype=torch.int64, device=CUDA)
    valid = torch.full((base,), -1, dtype=torch.int32, device=CUDA)
    packed = torch.zeros(n, 2 + K, dtype=torch.int64, device=CUDA)
    args = (history.to(CUDA), hist_len.to(CUDA), rows.to(CUDA), num.to(CUDA), out, base, valid, packed)
    ngram_propose(*args, 1, 3, K)
    return out, valid, packed


@pytest.mark.parametrize("seed", range(4))
def test_compiled_commit_equals_reference(seed):
    from strata.kernels.spec_decode import commit

    case = _commit_case(seed)
    outs = []
    for device in ("cpu", CUDA):
        c = {k: v.clone().to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        packed = torch.zeros(c["meta"].shape[0], 2 + K, dtype=torch.int64, device=device)
        commit(
            c["draws"],
            c["meta"],
            c["rejected"],
            c["num_valid"],
            c["last_sampled"],
            c["base"],
            c["last_sampled"],
            c["history"],
            c["hist_len"],
            packed,
            K,
        )
        outs.append([packed, c["last_sampled"], c["rejected"], c["history"], c["hist_len"]])
    for a, b in zip(*outs):
        assert torch.equal(a, b.cpu())


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    from strata.services.worker.model.triton_backend import TritonAttentionBackend
    from strata.services.worker.model.weights import load_shard
    from tests.tiny_models import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("m"), seed=3)
    return load_shard(model, 0, 1, torch.float32, "cuda", attn_backend=TritonAttentionBackend())


def _cuda_runner(shard, k: int):
    from strata.services.worker.runner import ModelRunner
    from tests.test_device_speculation import BLOCK, MAX_LEN

    runner = ModelRunner(
        *shard,
        stage_index=0,
        num_stages=1,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        device=CUDA,
        dtype=torch.float32,
        max_num_seqs=48,
        cuda_graph_max_batch=16,
        num_speculative_tokens=k,
        speculative_max_batch=16,
        ngram_on_device=(1, 3) if k else None,
    )
    runner.init_cache(BLOCKS)
    return runner


@pytest.mark.parametrize("adaptive", [True, False])
def test_graph_verification_ahead_of_results_gives_the_plain_tokens(shard, adaptive):
    want, _ = _drive(_cuda_runner(shard, 0), _scheduler(3, None), _requests(1, 10), 3)
    spec = SpeculativeConfig("ngram", 4, 1, 3, max_batch=16, proposer="device", adaptive=adaptive)
    sched = _scheduler(3, spec)
    runner = _cuda_runner(shard, 4)
    replayed = []
    execute_graph = runner._execute_graph
    runner._execute_graph = lambda graphs, *a: replayed.append(graphs.query_len) or execute_graph(graphs, *a)
    got, plans = _drive(runner, sched, _requests(1, 10), 3)
    assert got == want
    stats = engine_pb2.SchedulerStats()
    sched.fill_stats(stats)
    assert stats.spec_decode_accepted_tokens > 0
    assert any(p.rejected_drafts for p in plans)  # moved back in the verification graphs
    assert max(replayed) > 1  # verification graphs ran (eager steps would give the same tokens)


def test_verification_graphs_commit_their_own_draws(shard):
    """Requests without filters (greedy, temperature alone): a verification graph's draw is the
    step's result, and the graph commits and proposes itself (gated kernels); the tokens are
    still the plain run's, with a plan sent ahead of each result."""

    def unfiltered():  # (fresh Request objects for each run)
        return [r for r in _requests(1, 12) if not r.sampling.top_k and r.sampling.top_p >= 1.0]

    want, _ = _drive(_cuda_runner(shard, 0), _scheduler(3, None), unfiltered(), 3)
    runner = _cuda_runner(shard, 4)
    in_graph = []
    committed = runner.spec.committed_in_graph
    runner.spec.committed_in_graph = lambda step: in_graph.append(step) or committed(step)
    spec = SpeculativeConfig("ngram", 4, 1, 3, max_batch=16, proposer="device")
    got, plans = _drive(runner, _scheduler(3, spec), unfiltered(), 3)
    assert got == want
    assert len(in_graph) >= 5 and any(p.rejected_drafts for p in plans)


@pytest.mark.parametrize("in_flight", [1, 3])
def test_verify_rounds_on_the_graph_give_the_plain_tokens(shard, in_flight):
    """Several verify rounds per step on the verification graphs: the graph replayed once per
    round, its inputs moved on between rounds by the captured advance; the plain tokens."""
    want, _ = _drive(_cuda_runner(shard, 0), _scheduler(in_flight, None), _unfiltered_requests(7, 8), in_flight)
    runner = _cuda_runner(shard, 3)
    rounds_on_graph = []
    graph_rounds = runner.spec.graph_rounds
    runner.spec.graph_rounds = lambda g, bs, step, draws: (
        rounds_on_graph.append(step.rounds) or graph_rounds(g, bs, step, draws)
    )
    spec = SpeculativeConfig(
        "ngram", 3, 1, 3, max_batch=16, proposer="device", adaptive=False, rounds=3, rounds_max_batch=16
    )
    got, plans = _drive(runner, _scheduler(in_flight, spec), _unfiltered_requests(7, 8), in_flight)
    assert got == want
    assert rounds_on_graph and max(rounds_on_graph) == 3


def test_decode_graphs_record_plain_steps_in_the_device_history(shard, monkeypatch):
    """A speculating worker's plain steps on decode graphs: the graph records its draws in the
    device history (no host work beside a plain cluster's), the sampler outside the graph for
    filtered rows records after it; lookups after a plain stretch see every token either way."""
    runner = _cuda_runner(shard, 4)
    replayed = []
    execute_graph = runner._execute_graph
    runner._execute_graph = lambda graphs, *a: replayed.append(graphs.query_len) or execute_graph(graphs, *a)
    check_history_follows_plain_steps(runner, monkeypatch)
    assert 1 in replayed and max(replayed) > 1
