"""Greedy outputs through gateway -> scheduler -> workers equal HF generate(), token for token."""

from __future__ import annotations

import random

import pytest

from strata.default_model import build_tiny_tokenizer
from tests.cluster import greedy_concurrently, hf_greedy, running_cluster, scheduler_stats
from tests.tiny_models import write_tiny_model

NUM_REQUESTS = 16


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=384)


def _model(tmp_path_factory, tokenizer, arch):
    path = tmp_path_factory.mktemp(arch)
    return write_tiny_model(path, arch=arch, seed=3, tokenizer=tokenizer, num_hidden_layers=3)


def _workload(vocab: int, seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(3, 40))] for _ in range(NUM_REQUESTS)]
    lengths = [rng.randint(4, 24) for _ in range(NUM_REQUESTS)]
    return prompts, lengths


@pytest.mark.parametrize(
    "arch,stages",
    [
        # Behind the slow marker (STRATA_SLOW_TESTS=1), the cases whose paths others cover: one
        # stage is qwen2-1's, three (a first, a middle and a last stage; two have the first and the
        # last) qwen2-3's; a tiny llama on three stages equals HF in tests/test_stage_transport.py
        # (over grpc and over gloo).
        pytest.param("llama", 1, marks=pytest.mark.slow),
        pytest.param("llama", 2, marks=pytest.mark.slow),
        pytest.param("llama", 3, marks=pytest.mark.slow),
        # mistral's sliding window: mistral-2 runs it within a stage's layers and across a stage
        # boundary; one stage and three are the other kept cases' paths.
        pytest.param("mistral", 1, marks=pytest.mark.slow),
        ("mistral", 2),
        pytest.param("mistral", 3, marks=pytest.mark.slow),
        # qwen2's tied embeddings: qwen2-1 with both ends on one stage, qwen2-3 on the first and
        # last of three (as qwen2-2 has them on two).
        ("qwen2", 1),
        pytest.param("qwen2", 2, marks=pytest.mark.slow),
        ("qwen2", 3),
    ],
)
def test_greedy_matches_hf(tmp_path_factory, tokenizer, arch, stages):
    model_dir = _model(tmp_path_factory, tokenizer, arch)
    prompts, lengths = _workload(len(tokenizer), seed=stages)
    expected = hf_greedy(model_dir, prompts, lengths)
    # With several stages, micro-batches of 4 that open past 2 sequences each: the 16 requests
    # run in P + 2 of them, prompts' chunks ride any plan, and they are rebalanced and fewer as
    # requests finish (services/scheduler/micro_batches.py).
    micro_batches = ("--max-num-seqs", "4", "--micro-batch-min-seqs", "2") if stages > 1 else ()
    with running_cluster(model_dir, stages, "--max-num-batched-tokens", "64", *micro_batches) as (cluster, client):
        got = greedy_concurrently(client, prompts, lengths)
        stats = scheduler_stats(cluster)
    assert got == expected
    assert stats.steps > 0 and stats.used_kv_blocks == 0
    # Decodes go out before their input token is back: one stage fills it in itself, with more
    # stages the last hands its tokens to stage 0 (pipelined decode).
    assert stats.lookahead_decodes > 0
    if stages > 1:
        assert stats.micro_batch_rounds > 0


# Behind the slow marker (STRATA_SLOW_TESTS=1): preemption by recompute leaves every token as
# it was with n-gram speculation in tests/test_speculative_e2e.py (a cache of 40 blocks), and on
# two stages after a lost stage in tests/test_recovery.py; a tiny pool on two stages returns
# every block in tests/test_e2e_parallel_sampling.py.
@pytest.mark.slow
def test_greedy_matches_hf_under_preemption(tmp_path_factory, tokenizer):
    """A KV cache far too small for 16 requests forces preemption by recompute; nothing changes."""
    model_dir = _model(tmp_path_factory, tokenizer, "llama")
    prompts, lengths = _workload(len(tokenizer), seed=11)
    expected = hf_greedy(model_dir, prompts, lengths)
    with running_cluster(model_dir, 2, "--num-kv-blocks", "24", "--max-model-len", "96") as (cluster, client):
        got = greedy_concurrently(client, prompts, lengths)
        stats = scheduler_stats(cluster)
    assert got == expected
    assert stats.preemptions > 0
    assert stats.used_kv_blocks == 0 and stats.free_kv_blocks == stats.num_kv_blocks
