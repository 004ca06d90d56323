"""Sampler: greedy, seeded Gumbel-max draws, top-k / top-p / min-p filters, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.kernels.gumbel_sampling import gumbel_noise, uniform_noise
from strata.services.worker.sampling.sampler import Sampler, SamplingTensors, keep_threshold


def sampling_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The logits a sampled row draws from: logits / T, filtered tokens at -inf (softmax of a
    row is its sampling distribution); greedy rows come back raw."""
    logits = logits.float()
    scaled = logits * st.inv_temperature.unsqueeze(1)
    threshold = keep_threshold(logits, st)
    if threshold is not None:
        scaled = scaled.masked_fill(logits < threshold.unsqueeze(1), float("-inf"))
    return scaled


def build(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None, num_logprobs=-1, device="cpu"):
    """SamplingTensors for n rows; scalars broadcast, sequences are taken per row."""

    def per_row(value, dtype):
        return np.broadcast_to(np.asarray(value, dtype=dtype), (n,)).copy()

    seeds = np.arange(n) + 1000 if seeds is None else seeds
    positions = np.arange(n) + 7 if positions is None else positions
    return SamplingTensors.build(
        temperature=per_row(temperature, np.float32),
        top_k=per_row(top_k, np.int64),
        top_p=per_row(top_p, np.float32),
        min_p=per_row(min_p, np.float32),
        seeds=per_row(seeds, np.int64),
        positions=per_row(positions, np.int64),
        num_logprobs=num_logprobs,
        device=device,
    )


def random_logits(n, vocab, seed=0, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=gen) * scale


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ----------------------------------------------------------------------------- greedy


def test_greedy_equals_argmax_and_ignores_filters():
    logits = random_logits(32, 300)
    # Tiny temperatures are greedy too; filters on greedy rows must not change the argmax.
    st = build(32, temperature=np.where(np.arange(32) % 2 == 0, 0.0, 1e-7), top_k=3, top_p=0.2)
    out = Sampler()(logits, st)
    assert st.all_greedy
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_ids is None


def test_greedy_rows_mixed_with_sampled_rows():
    n, vocab = 64, 500
    logits = random_logits(n, vocab, scale=0.5)  # flat enough that samples leave the argmax
    temperature = np.where(np.arange(n) % 3 == 0, 0.0, 1.0)
    st = build(n, temperature=temperature)
    tokens = Sampler()(logits, st).token_ids
    greedy = torch.from_numpy(temperature == 0)
    assert torch.equal(tokens[greedy], logits.argmax(dim=-1)[greedy])
    assert (tokens[~greedy] != logits.argmax(dim=-1)[~greedy]).sum() > 20
    # Sampled rows draw the same tokens as in an all-sampled batch.
    all_sampled = Sampler()(logits, build(n, temperature=1.0)).token_ids
    assert torch.equal(tokens[~greedy], all_sampled[~greedy])


# ----------------------------------------------------------------------------- determinism


def test_seeded_row_is_independent_of_batch_order_and_repeats():
    vocab = 400
    logits = random_logits(24, vocab, seed=1, scale=0.7)
    rng = np.random.default_rng(0)
    settings = dict(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.3], 24),
        top_k=rng.choice([0, 5, 50], 24),
        top_p=rng.choice([1.0, 0.9, 0.5], 24),
        min_p=rng.choice([0.0, 0.02], 24),
        seeds=rng.integers(-(2**63), 2**63 - 1, 24),
        positions=rng.integers(0, 5000, 24),
    )
    sampler = Sampler()
    batch = sampler(logits, build(24, **settings)).token_ids
    assert torch.equal(batch, sampler(logits, build(24, **settings)).token_ids)

    perm = rng.permutation(24)
    shuffled = sampler(logits[perm], build(24, **{k: v[perm] for k, v in settings.items()})).token_ids
    assert torch.equal(shuffled, batch[perm])

    for row in (0, 5, 17):
        alone = sampler(logits[row : row + 1], build(1, **{k: v[row : row + 1] for k, v in settings.items()}))
        assert alone.token_ids.item() == batch[row].item()


def test_different_seeds_or_positions_give_different_draws():
    vocab, n = 1000, 200
    logits = torch.zeros(n, vocab)  # uniform: every token equally likely
    by_seed = Sampler()(logits, build(n, seeds=np.arange(n), positions=5)).token_ids
    by_position = Sampler()(logits, build(n, seeds=42, positions=np.arange(n))).token_ids
    # 200 uniform draws over 1000 tokens give about 181 distinct values.
    assert len(set(by_seed.tolist())) > 160
    assert len(set(by_position.tolist())) > 160
    base = gumbel_noise(torch.tensor(3), torch.tensor(9), vocab)
    assert not torch.equal(base, gumbel_noise(torch.tensor(4), torch.tensor(9), vocab))
    assert not torch.equal(base, gumbel_noise(torch.tensor(3), torch.tensor(10), vocab))
    assert not torch.equal(base, gumbel_noise(torch.tensor(3), torch.tensor(9), vocab, salt=1))


def test_sampled_token_is_gumbel_argmax_of_public_noise():
    n, vocab = 16, 256
    logits = random_logits(n, vocab, seed=2)
    seeds, positions = np.arange(n) * 7919 - 40, np.arange(n) * 3 + 11
    temperature = np.linspace(0.3, 1.5, n)
    tokens = Sampler()(logits, build(n, temperature=temperature, seeds=seeds, positions=positions)).token_ids
    noise = gumbel_noise(torch.from_numpy(seeds), torch.from_numpy(positions), vocab)
    inv_t = (1.0 / torch.from_numpy(temperature.astype(np.float32))).unsqueeze(1)
    assert torch.equal(tokens, (logits * inv_t + noise).argmax(dim=-1))


def test_unsigned_seed_and_its_int64_bits_draw_the_same():
    logits = torch.zeros(3, 5000)
    unsigned = np.array([2**64 - 1, 2**63, 12345], dtype=np.uint64)
    as_bits = unsigned.view(np.int64)
    a = Sampler()(
        logits,
        SamplingTensors.build([1.0] * 3, [0] * 3, [1.0] * 3, [0.0] * 3, [int(s) for s in unsigned], [4] * 3, -1, "cpu"),
    )
    b = Sampler()(logits, build(3, seeds=as_bits, positions=4))
    assert torch.equal(a.token_ids, b.token_ids)


def test_uniform_noise_is_a_pure_function_in_the_open_interval():
    seeds = torch.arange(20000, dtype=torch.int64)
    u = uniform_noise(seeds, torch.full_like(seeds, 3), salt=5)
    assert u.dtype == torch.float32 and u.shape == (20000,)
    assert bool((u > 0).all() and (u < 1).all())
    assert abs(u.mean().item() - 0.5) < 0.01
    assert torch.equal(u[100:110], uniform_noise(seeds[100:110], torch.full((10,), 3), salt=5))
    assert not torch.equal(u, uniform_noise(seeds, torch.full_like(seeds, 3), salt=6))
    assert not torch.equal(u, uniform_noise(seeds, torch.full_like(seeds, 4), salt=5))


def test_noise_is_pinned_so_seeded_outputs_survive_restarts_and_upgrades():
    # Changing the hash changes every seeded completion: do it only on purpose.
    seeds = torch.tensor([0, 1, -1, 2**62])
    positions = torch.tensor([0, 5, 1000, 2**33])
    draws = gumbel_noise(seeds, positions, 50000).argmax(dim=-1)
    assert draws.tolist() == [38620, 29110, 17611, 49502]
    u = uniform_noise(seeds, positions, salt=3) * 2**24
    assert u.tolist() == [1595468, 3344241, 3482486, 15252821]


# ----------------------------------------------------------------------------- distributions

# Chi-square critical values at p = 1e-4 (a correct sampler fails 1 run in 10,000).
CHI2_CRIT_1E4 = {5: 25.74, 3: 21.11, 2: 18.42, 1: 15.14}


@pytest.mark.parametrize("vary", ["seed", "position"])
def test_empirical_distribution_matches_tempered_softmax(vary):
    draws, temperature = 40000, 0.7
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    logits = base.expand(draws, -1).contiguous()
    if vary == "seed":
        st = build(draws, temperature=temperature, seeds=np.arange(draws), positions=17)
    else:
        st = build(draws, temperature=temperature, seeds=987654321, positions=np.arange(draws))
    tokens = Sampler()(logits, st).token_ids
    counts = np.bincount(tokens.numpy(), minlength=6)
    probs = torch.softmax(base.double() / temperature, dim=0).numpy()
    assert chi_square(counts, probs) < CHI2_CRIT_1E4[5]
    assert 0.5 * np.abs(counts / draws - probs).sum() < 0.01  # total variation


@pytest.mark.parametrize(
    "filters, kept",
    [
        (dict(top_k=3), [0, 1, 2]),
        # softmax(base / 0.7) = .700 .168 .082 .040 .0096 .0006: .700 + .168 >= 0.75 keeps two.
        (dict(top_p=0.75), [0, 1]),
        # p >= 0.05 * p_max = .035 keeps four.
        (dict(min_p=0.05), [0, 1, 2, 3]),
        (dict(top_k=4, top_p=0.9), [0, 1, 2]),
    ],
)
def test_filtered_distribution_is_renormalised_over_kept_tokens(filters, kept):
    draws, temperature = 30000, 0.7
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    logits = base.expand(draws, -1).contiguous()
    st = build(draws, temperature=temperature, seeds=np.arange(draws) * 31 + 5, positions=3, **filters)
    tokens = Sampler()(logits, st).token_ids
    counts = np.bincount(tokens.numpy(), minlength=6)
    assert set(np.nonzero(counts)[0].tolist()) == set(kept)
    probs = torch.softmax(base.double()[kept] / temperature, dim=0).numpy()
    assert chi_square(counts[kept], probs) < CHI2_CRIT_1E4[len(kept) - 1]


# ----------------------------------------------------------------------------- filter sets


def reference_kept(row: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The kept set of one row by the definitions, one token at a time, in float64."""
    vocab = row.shape[0]
    order = np.argsort(-row, kind="stable")
    keep = np.zeros(vocab, dtype=bool)
    k = top_k if 0 < top_k < vocab else vocab
    keep[order[:k]] = True
    if top_p < 1:
        scaled = np.where(keep, row / temperature, -np.inf)
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        mass = 0.0
        for rank, token in enumerate(order[:k]):
            if rank > 0 and mass >= top_p:  # the smallest prefix reaching top_p
                keep[token] = False
            mass += probs[token]
    if min_p > 0:
        probs = np.exp((row - row.max()) / temperature)
        keep &= probs >= min_p * probs.max()
    return keep


FILTER_BATCHES = {
    # Each batch takes a different path through keep_threshold.
    "top_k_only": dict(top_k=[1, 2, 7, 40, 0, 5000]),
    "top_p_full_sort": dict(top_p=[0.3, 0.6, 0.9, 0.99, 1.0], top_k=[0, 0, 10, 0, 0]),
    "top_p_within_top_k": dict(top_p=[0.3, 0.6, 0.9, 0.99, 1.0], top_k=[5, 50, 10, 200, 0]),
    "min_p_only": dict(min_p=[0.01, 0.1, 0.5, 1.0, 0.0]),
    "all": dict(top_k=[0, 20, 3, 0, 100], top_p=[0.8, 0.95, 1.0, 1.0, 0.5], min_p=[0.05, 0.0, 0.2, 0.3, 0.01]),
}


@pytest.mark.parametrize("name", sorted(FILTER_BATCHES))
def test_filters_keep_the_reference_set_and_never_sample_outside_it(name):
    n, vocab = 60, 300
    rng = np.random.default_rng(sum(map(ord, name)))
    settings = {key: np.resize(np.asarray(values), n) for key, values in FILTER_BATCHES[name].items()}
    temperature = rng.choice([0.4, 1.0, 1.7], n)
    logits = random_logits(n, vocab, seed=3, scale=1.5)
    st = build(n, temperature=temperature, **settings)

    kept = sampling_logits(logits, st) > float("-inf")
    for i in range(n):
        expected = reference_kept(
            logits[i].double().numpy(),
            temperature[i],
            int(settings.get("top_k", np.zeros(n))[i]),
            float(settings.get("top_p", np.ones(n))[i]),
            float(settings.get("min_p", np.zeros(n))[i]),
        )
        assert np.array_equal(kept[i].numpy(), expected), f"row {i}"
    # Filtered batches differ from unfiltered ones somewhere.
    assert (~kept).any()

    sampler = Sampler()
    for trial in range(20):
        st = build(n, temperature=temperature, seeds=np.arange(n) + 1000 * trial, **settings)
        tokens = sampler(logits, st).token_ids
        assert bool(kept.gather(1, tokens.unsqueeze(1)).all())


def test_keep_threshold_is_none_without_filters():
    st = build(4, temperature=1.0)
    assert keep_threshold(random_logits(4, 10), st) is None
    logits = random_logits(4, 10)
    assert torch.equal(sampling_logits(logits, build(4, temperature=2.0)), logits / 2)


# ----------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("num_logprobs", [0, 5])
def test_logprobs_are_those_of_the_raw_distribution(num_logprobs):
    n, vocab = 12, 700
    logits = random_logits(n, vocab, seed=4)
    st = build(n, temperature=np.where(np.arange(n) < 4, 0.0, 0.8), top_k=20, num_logprobs=num_logprobs)
    out = Sampler()(logits, st)
    log_softmax = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(
        out.logprobs, log_softmax.gather(1, out.token_ids.unsqueeze(1)).squeeze(1), rtol=0, atol=1e-5
    )
    expected = torch.topk(log_softmax, num_logprobs, dim=-1)
    assert out.top_ids.shape == (n, num_logprobs)
    assert torch.equal(out.top_ids, expected.indices)
    torch.testing.assert_close(out.top_logprobs, expected.values, rtol=0, atol=1e-5)


def test_build_rejects_invalid_settings():
    with pytest.raises(ValueError, match="top_p"):
        build(2, top_p=0.0)
    with pytest.raises(ValueError, match="min_p"):
        build(2, min_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        build(2, temperature=-1.0)
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.zeros(3, 10), build(2))


# ----------------------------------------------------------------------------- triton kernel

# The kernel against the torch sampler under Triton's CPU interpreter: tests/test_sampler_kernel.py.


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_draws_equal_cpu_draws_without_host_syncs():
    from strata.kernels.gumbel_sampling import _DOMAIN_GUMBEL, _element_hash, _row_keys

    n, vocab = 64, 32000
    rng = np.random.default_rng(1)
    logits = random_logits(n, vocab, seed=5)
    settings = dict(
        temperature=rng.choice([0.0, 0.6, 1.0], n),
        top_k=rng.choice([0, 0, 50], n),
        top_p=rng.choice([1.0, 1.0, 0.9], n),
        min_p=rng.choice([0.0, 0.05], n),
        seeds=rng.integers(-(2**63), 2**63 - 1, n),
        positions=rng.integers(0, 10**6, n),
        num_logprobs=3,
    )
    cpu = Sampler()(logits, build(n, **settings))
    st = build(n, device="cuda", **settings)
    # The integer part of the noise is bit-identical across devices.
    bits = {}
    for device in ("cpu", "cuda"):
        keys = _row_keys(st.seeds.to(device), st.positions.to(device), 0, _DOMAIN_GUMBEL)
        index = torch.arange(vocab, device=device)
        bits[device] = _element_hash(keys[0].unsqueeze(1), keys[1].unsqueeze(1), index).cpu()
    assert torch.equal(bits["cpu"], bits["cuda"])
    logits_cuda = logits.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = {backend: Sampler(backend)(logits_cuda, st) for backend in ("torch", "triton")}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for out in outs.values():
        assert torch.equal(out.token_ids.cpu(), cpu.token_ids)
        assert torch.equal(out.top_ids.cpu(), cpu.top_ids)
        torch.testing.assert_close(out.logprobs.cpu(), cpu.logprobs, rtol=0, atol=1e-5)


# ----------------------------------------------------------------- per-sequence settings


def test_sequence_table_derives_the_graph_draw_settings_as_prepare_does():
    """The decode graphs draw from settings the worker derives once per sequence; they must be
    bit-identical to what SamplingTensors.prepare derives per step, around the greedy cut too."""
    import itertools

    from strata.services.worker.step.sequence_table import SequenceTable
    from strata.v1 import engine_pb2

    table = SequenceTable(4, 1)
    temperatures = [0.0, 1e-6, 9.99999e-6, 1e-5, 1.00001e-5, 0.3, 0.7, 1.0, 1.3, 7.0]
    for seq_id, (t, k, p, m, lp) in enumerate(itertools.product(temperatures, [0, 5], [1.0, 0.9], [0.0, 0.1], [-1, 0])):
        opts = engine_pb2.SamplingOptions(temperature=t, top_k=k, top_p=p, min_p=m, logprobs=lp)
        table.add(engine_pb2.NewSequence(seq_id=seq_id, sampling=opts))
        row = table.rows[seq_id]
        arrays, flags = SamplingTensors.prepare([opts.temperature], [k], [opts.top_p], [opts.min_p], [0], [0], lp)
        assert table.inv_temperature[row].tobytes() == arrays["inv_temperature"][0].tobytes(), t
        assert bool(table.greedy[row]) == bool(arrays["greedy"][0]), t
        filtered = flags["any_top_k"] or flags["any_top_p"] or flags["any_min_p"]
        assert bool(table.unfiltered[row]) == (lp < 0 and not filtered), (t, k, p, m, lp)
        table.release(seq_id)
