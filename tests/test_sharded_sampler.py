"""Sampling on tensor-parallel slices of the logits (services/worker/sampling/sharded.py) draws the
unsharded Sampler's tokens bit for bit: random [N, V] logits split by columns over 2 and 3 ranks
(thread ranks over gloo, tests/tp_threads.py), every mode (greedy, temperature, top-k, top-p with
and without top-k, min-p, logprobs), ties across slices (the smaller index wins, as argmax), a
vocabulary whose last slice is short and padded. The Triton kernel's slice draw: under the
interpreter in tests/test_sampler_kernel.py."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from strata.kernels.gumbel_sampling import pack_draw_keys, unpack_draw_tokens
from strata.services.worker.sampling.sampler import Sampler, SamplingTensors
from strata.services.worker.sampling.sharded import ShardedSampler, unpack_draw_values
from strata.services.worker.tensor_parallel.vocab import VocabShard
from tests.tp_threads import form_groups, run_ranks


@pytest.fixture(scope="module")
def groups():
    made = {size: form_groups(size) for size in (2, 3)}
    yield made
    made.clear()
    gc.collect()  # gloo's groups go before the interpreter's exit, which they would abort


def slices(logits: torch.Tensor, vocab: VocabShard, pad_value: float = 7.0) -> torch.Tensor:
    """Rank vocab.rank's [N, local] slice, its padding columns filled with a value that would win
    every draw if it were read."""
    x = torch.full((logits.shape[0], vocab.local), pad_value, dtype=logits.dtype)
    x[:, : vocab.valid] = logits[:, vocab.offset : vocab.offset + vocab.valid]
    return x


def sharded_outputs(groups, logits: torch.Tensor, st: SamplingTensors):
    size = len(groups)
    vocab_size = logits.shape[1]

    def rank(r, group):
        vocab = VocabShard(vocab_size, r, size)
        return ShardedSampler(group, vocab, "torch")(slices(logits, vocab), st)

    return run_ranks(groups, rank)


def settings(rng, n: int, **kw) -> SamplingTensors:
    base = dict(
        temperature=[1.0] * n,
        top_k=[0] * n,
        top_p=[1.0] * n,
        min_p=[0.0] * n,
        seeds=rng.integers(-(2**63), 2**63 - 1, n),
        positions=rng.integers(0, 2**40, n),
        num_logprobs=-1,
    )
    base.update(kw)
    return SamplingTensors.build(**base, device="cpu")


CASES = {
    "greedy": dict(temperature=[0.0] * 6),
    "temperature": dict(temperature=[0.0, 1.0, 0.5, 2.0, 0.7, 1.3]),
    "top_k": dict(top_k=[0, 1, 5, 40, 300, 0]),
    "top_k_top_p": dict(top_k=[10, 50, 50, 200, 0, 3], top_p=[0.9, 0.5, 1.0, 0.95, 1.0, 0.2]),
    "min_p": dict(min_p=[0.0, 0.05, 0.2, 0.5, 0.9, 0.01], temperature=[1.0, 0.5, 1.0, 2.0, 1.0, 0.0]),
    "top_k_min_p": dict(top_k=[20, 0, 5, 0, 100, 0], min_p=[0.1, 0.3, 0.0, 0.0, 0.2, 0.0]),
    "logprobs": dict(num_logprobs=5, temperature=[0.0, 1.0, 1.0, 0.5, 0.0, 2.0], top_k=[0, 0, 7, 0, 0, 30]),
    "logprobs_only_sampled": dict(num_logprobs=0),
    "top_p_alone": dict(top_p=[0.9, 1.0, 0.5, 0.99, 1.0, 0.7]),  # whole rows gathered
    "wide_top_k": dict(top_k=[700, 0, 0, 0, 0, 0]),  # wider than a slice: whole rows
    "wide_logprobs": dict(num_logprobs=600, temperature=[0.0] * 6),
}


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_sharded_draw_equals_the_whole_rows(groups, size, case):
    rng = np.random.default_rng(abs(hash((case, size))) % 2**32)
    n, vocab_size = 6, 1000  # three ranks: slices of 384, 384 and 232 columns (then padding)
    logits = torch.from_numpy(rng.normal(size=(n, vocab_size)).astype(np.float32) * 3)
    st = settings(rng, n, **CASES[case])
    want = Sampler("torch")(logits, st)
    for got in sharded_outputs(groups[size], logits, st):
        assert torch.equal(got.token_ids, want.token_ids), (got.token_ids, want.token_ids)
        if want.logprobs is None:
            assert got.logprobs is None
            continue
        torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-5)
        torch.testing.assert_close(got.top_logprobs, want.top_logprobs, rtol=0, atol=1e-5)
        assert torch.equal(got.top_ids, want.top_ids)


@pytest.mark.parametrize("size", [2, 3])
def test_ties_across_slices_take_the_smaller_index(groups, size):
    rng = np.random.default_rng(7)
    n, vocab_size = 5, 1000
    logits = torch.from_numpy(rng.normal(size=(n, vocab_size)).astype(np.float32))
    # Row 0: the max in every slice (the first wins); row 1: in the last two only; row 2: +0.0
    # and -0.0 as the max (equal for argmax: the first wins); row 3: a top-k cut on a value
    # that repeats across slices; row 4: everything -inf but one slice's padding.
    logits[0, [10, 500, 990]] = 9.0
    logits[1, [400, 800]] = 9.0
    logits[2] = -1.0
    logits[2, 700] = -0.0
    logits[2, 900] = 0.0
    logits[3, [5, 450, 801, 802]] = 4.0
    logits[4] = float("-inf")
    st = settings(rng, n, temperature=[0.0, 0.0, 0.0, 1.0, 0.0], top_k=[0, 0, 0, 3, 0])
    want = Sampler("torch")(logits, st)
    assert want.token_ids[:3].tolist() == [10, 400, 700] and want.token_ids[4] == 0
    for got in sharded_outputs(groups[size], logits, st):
        assert torch.equal(got.token_ids, want.token_ids)


def test_packed_keys_order_as_argmax():
    values = torch.tensor([-float("inf"), -3.5, -0.0, 0.0, 1e-30, 2.0, float("inf"), float("nan")])
    tokens = torch.arange(values.numel()) * 3
    keys = pack_draw_keys(values, tokens)
    order = torch.argsort(keys)
    assert order.tolist() == [0, 1, 3, 2, 4, 5, 6, 7]  # +0.0 and -0.0 are equal: the smaller token wins
    assert torch.equal(unpack_draw_tokens(keys), tokens)
    back = unpack_draw_values(keys)
    assert torch.equal(back[:7], values[:7] + 0.0) and torch.isnan(back[7])
    # Equal values: the smaller token's key is the larger.
    same = pack_draw_keys(torch.tensor([1.5, 1.5]), torch.tensor([4, 9]))
    assert same[0] > same[1]


@pytest.mark.parametrize("size", [2, 3])
def test_whole_rows_come_back_in_vocabulary_order(groups, size):
    rng = np.random.default_rng(3)
    logits = torch.from_numpy(rng.normal(size=(4, 1000)).astype(np.float32))

    def rank(r, group):
        vocab = VocabShard(1000, r, size)
        return ShardedSampler(group, vocab, "torch").all_gather_rows(slices(logits, vocab))

    for rows in run_ranks(groups[size], rank):
        assert torch.equal(rows, logits)


def test_vocab_slices_cover_the_vocabulary_once():
    for vocab_size in (1, 63, 64, 509, 1000, 128256, 151936):
        for size in (1, 2, 3, 4, 8):
            shards = [VocabShard(vocab_size, r, size) for r in range(size)]
            assert sum(s.valid for s in shards) == vocab_size
            assert all(s.local * size == s.padded >= vocab_size for s in shards)
            if size > 1:
                assert all(s.local % 64 == 0 for s in shards)  # whole bitmask words, twice over
            else:
                assert shards[0].local == vocab_size
    assert VocabShard(128256, 1, 2).padded == 128256  # Llama 3's vocabulary needs no padding


@pytest.mark.parametrize("size", [2, 3])
def test_prompt_logprob_rows_from_slices_equal_the_whole_rows(groups, size):
    """Prompt logprobs over slices: the logsumexp combined from each slice's (max, sum of exp),
    the target's logit from its slice, the rank summed over slices (ties counted), the top k
    merged; against log_softmax of the whole rows."""
    rng = np.random.default_rng(11)
    rows, vocab_size, k = 7, 1000, 4
    logits = torch.from_numpy(rng.normal(size=(rows, vocab_size)).astype(np.float32) * 2)
    logits[0, [3, 600, 999]] = 20.0  # the target tied with tokens of other slices
    targets = torch.tensor([600, 0, 999, 383, 384, 767, 768])  # slice edges of 2 and 3 ranks

    def rank(r, group):
        vocab = VocabShard(vocab_size, r, size)
        return ShardedSampler(group, vocab, "torch").logprob_rows(slices(logits, vocab), targets, k)

    lsm = torch.log_softmax(logits, dim=-1)
    want_target = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
    want_rank = (logits >= want_target.unsqueeze(1)).sum(dim=1)
    want_top = logits.topk(k, dim=-1)
    for log_norm, ranks, target, top_values, top_ids in run_ranks(groups[size], rank):
        assert torch.equal(target, want_target) and torch.equal(ranks, want_rank)
        assert ranks[0] == 3
        torch.testing.assert_close(target - log_norm, lsm.gather(1, targets.unsqueeze(1)).squeeze(1), rtol=0, atol=1e-5)
        assert torch.equal(top_values, want_top.values)
        assert torch.equal(top_ids[1:], want_top.indices[1:])  # (row 0's tie: the smaller ids first)
        assert top_ids[0, :3].tolist() == [3, 600, 999]
