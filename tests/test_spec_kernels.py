"""Speculation's device kernels (kernels/ngram_lookup.py, kernels/spec_decode.py): the torch
references against plain Python (the scheduler's own prompt lookup, a verification loop), and the
Triton kernels against the references under Triton's CPU interpreter."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.triton_interpreter import can_run_interpreted_here, interpreter_active, rerun_under_interpreter

K = 4
NGRAM = (1, 3)


def _history(rng: random.Random, rows: int, width: int, vocab: int):
    """Random rows of few distinct tokens (so that suffixes repeat), random lengths."""
    history = torch.zeros(rows + 1, width, dtype=torch.int32)
    lengths = []
    for r in range(rows):
        n = rng.randint(0, width)
        history[r, :n] = torch.tensor([rng.randrange(vocab) for _ in range(n)], dtype=torch.int32)
        lengths.append(n)
    return history, torch.tensor(lengths + [0], dtype=torch.int64)


def _propose(use_triton, history, hist_len, rows, num, enabled=None):
    from strata.kernels.ngram_lookup import ngram_propose

    n, base = rows.shape[0], history.shape[0]
    out = torch.full((base + base * K,), -7, dtype=torch.int64)
    valid = torch.full((base,), -1, dtype=torch.int32)
    packed = torch.zeros(n, 2 + K, dtype=torch.int64)
    ngram_propose(
        history, hist_len, rows, num, out, base, valid, packed, *NGRAM, K, use_triton=use_triton, enabled=enabled
    )
    return out, valid, packed


def _lookup_python(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The device rule by brute force: the longest matching suffix; among its earlier
    occurrences the latest that k tokens follow, else the latest."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        ends = [e for e in range(n - 1, len(tokens) - 1) if tokens[e - n + 1 : e + 1] == tokens[len(tokens) - n :]]
        if ends:
            full = [e for e in ends if e + k <= len(tokens) - 1]
            e = (full or ends)[-1]
            return tokens[e + 1 : e + 1 + k]
    return []


def test_reference_lookup_equals_a_plain_search():
    from strata.services.scheduler.speculation.ngram_proposer import propose_from

    rng = random.Random(0)
    history, hist_len = _history(rng, 40, 30, 4)
    rows = torch.tensor(rng.sample(range(40), 25))
    num = torch.tensor([rng.randint(0, K) for _ in range(25)])
    out, valid, packed = _propose(False, history, hist_len, rows, num)
    base = history.shape[0]
    differs = 0
    for i, (row, k) in enumerate(zip(rows.tolist(), num.tolist())):
        tokens = history[row, : hist_len[row]].tolist()
        expected = _lookup_python(tokens, k, *NGRAM)
        assert int(valid[row]) == len(expected) == int(packed[i, 1])
        got = out[base + row * K : base + row * K + K].tolist()
        assert got[: len(expected)] == expected and all(t == 0 for t in got[len(expected) :])
        assert packed[i, 2:].tolist() == got
        scheduler = propose_from(np.array(tokens, dtype=np.int32), k, *NGRAM)
        differs += scheduler != expected
        if scheduler != expected:  # only where the scheduler's latest match is too near the end
            assert len(scheduler) < k and len(expected) > len(scheduler)
    assert propose_from(np.array([5, 6, 5, 6, 5, 6], dtype=np.int32), 3, 1, 2) == [5, 6]  # the scheduler's
    assert _lookup_python([5, 6, 5, 6, 5, 6], 3, 1, 2) == [5, 6, 5]  # the device's: k tokens follow


def _verify_python(draws, first, d, valid, drafts):
    """Accepted drafts, as the host's accepted_rows counts them (valid bounds the real ones)."""
    a = 0
    while a < min(d, valid) and draws[first + a] == drafts[a]:
        a += 1
    return a


def _commit_case(seed: int):
    from strata.kernels.spec_decode import DEVICE, DRAFTS, FIRST_ROW, FIRST_TOKEN, HOST, KNOWN, POS, PROPOSE, ROW

    rng = random.Random(seed)
    rows_total, width = 12, 64
    base = rows_total + 1
    last_sampled = torch.zeros(base + base * K, dtype=torch.int64)
    last_sampled[base:] = torch.randint(0, 6, (base * K,), generator=torch.Generator().manual_seed(seed))
    num_valid = torch.tensor([rng.randint(0, K) for _ in range(base)], dtype=torch.int32)
    rejected = torch.tensor([rng.randint(0, 5) for _ in range(base)], dtype=torch.int64)
    history = torch.randint(0, 6, (base, width), dtype=torch.int32, generator=torch.Generator().manual_seed(seed + 1))
    hist_len = torch.zeros(base, dtype=torch.int64)
    seqs = rng.sample(range(rows_total), 8)
    meta = torch.full((len(seqs), HOST + K), -1, dtype=torch.int64)
    draws, first = [], 0
    for i, row in enumerate(seqs):
        d = rng.choice([-1, 0, 1, 2, K])  # -1: samples nothing
        meta[i, ROW], meta[i, DRAFTS] = row, d
        meta[i, FIRST_ROW], meta[i, FIRST_TOKEN] = first, first
        meta[i, POS] = rng.randint(20, 40)
        meta[i, KNOWN] = rng.choice([-1, int(rejected[row]), max(0, int(rejected[row]) - 2)])
        meta[i, DEVICE] = rng.randint(0, 1)
        meta[i, PROPOSE] = 0
        meta[i, HOST : HOST + K] = torch.randint(0, 6, (K,), generator=torch.Generator().manual_seed(seed + i))
        if d >= 0:
            draws += [rng.randrange(6) for _ in range(d + 1)]
            first += d + 1
    return dict(
        draws=torch.tensor(draws, dtype=torch.int64),
        meta=meta,
        rejected=rejected,
        num_valid=num_valid,
        last_sampled=last_sampled,
        base=base,
        history=history,
        hist_len=hist_len,
    )


def _run_commit(case, use_triton, enabled=None):
    from strata.kernels.spec_decode import commit

    c = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    packed = torch.zeros(c["meta"].shape[0], 2 + K, dtype=torch.int64)
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
        use_triton=use_triton,
        enabled=enabled,
    )
    return c, packed


def _gates_hold(use_triton: bool) -> None:
    """A graph's commit and proposal gated by a device scalar: 0 leaves every buffer as it was,
    1 does exactly what the ungated call does."""
    case = _commit_case(0)
    want, want_packed = _run_commit(case, use_triton)
    on, on_packed = _run_commit(case, use_triton, enabled=torch.ones(1, dtype=torch.int64))
    off, off_packed = _run_commit(case, use_triton, enabled=torch.zeros(1, dtype=torch.int64))
    assert torch.equal(on_packed, want_packed) and not off_packed.any()
    for name in ("last_sampled", "rejected", "history", "hist_len"):
        assert torch.equal(on[name], want[name]) and torch.equal(off[name], case[name]), name
    rng = random.Random(2)
    history, hist_len = _history(rng, 10, 40, 3)
    rows, num = torch.tensor(rng.sample(range(10), 8)), torch.full((8,), K)
    untouched = _propose(use_triton, history, hist_len, rows[:0], num[:0])
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            _propose(use_triton, history, hist_len, rows, num, torch.ones(1, dtype=torch.int64)),
            _propose(use_triton, history, hist_len, rows, num),
        )
    )
    off = _propose(use_triton, history, hist_len, rows, num, torch.zeros(1, dtype=torch.int64))
    assert torch.equal(off[0], untouched[0]) and torch.equal(off[1], untouched[1]) and not off[2].any()


def test_reference_gates_leave_a_graph_step_alone():
    _gates_hold(False)


@pytest.mark.parametrize("seed", range(5))
def test_reference_commit_verifies_and_writes_what_a_loop_does(seed):
    from strata.kernels.spec_decode import DEVICE, DRAFTS, FIRST_ROW, HOST, KNOWN, POS, ROW

    case = _commit_case(seed)
    got, packed = _run_commit(case, False)
    base = case["base"]
    for i, m in enumerate(case["meta"].tolist()):
        row, d = m[ROW], m[DRAFTS]
        if d < 0:
            assert packed[i, 0] == 0 and got["hist_len"][row] == 0
            continue
        shift = case["rejected"][row].item() - m[KNOWN] if m[KNOWN] >= 0 else 0
        if m[DEVICE]:
            drafts = case["last_sampled"][base + row * K : base + row * K + K].tolist()
            valid = min(int(case["num_valid"][row]), d)
        else:
            drafts, valid = m[HOST : HOST + K], d
        draws = case["draws"].tolist()
        a = _verify_python(draws, m[FIRST_ROW], d, valid, drafts)
        assert packed[i, 0] == a + 1
        assert got["last_sampled"][row] == draws[m[FIRST_ROW] + a]
        assert got["rejected"][row] == case["rejected"][row] + d - a
        pos = m[POS] - shift
        assert got["hist_len"][row] == pos + a + 1
        assert got["history"][row, pos : pos + a + 1].tolist() == draws[m[FIRST_ROW] : m[FIRST_ROW] + a + 1]


def test_reference_shift_moves_positions_slots_and_lengths():
    from strata.kernels.spec_decode import HOST, KNOWN, ROW, shift_positions_in_graph

    q, bs, block = 3, 4, 4
    meta = torch.full((bs, HOST + K), -1, dtype=torch.int64)
    meta[:, ROW] = torch.tensor([0, 1, 2, 5])
    meta[:, KNOWN] = torch.tensor([3, -1, 0, -1])  # row 0 moves back 2, row 2 moves back 1
    rejected = torch.tensor([5, 9, 1, 0, 0, 0])
    positions = torch.tensor([10, 11, 12, 20, 21, 22, 7, 8, 9, 0, 0, 0])
    sample_positions = positions + 1
    tables = torch.arange(bs * 8, dtype=torch.int32).view(bs, 8)
    slots = torch.tensor([tables[t // q, p // block] * block + p % block for t, p in enumerate(positions.tolist())])
    slots[9:] = -1
    seq_lens = torch.tensor([13, 23, 10, 0], dtype=torch.int32)
    shift_positions_in_graph(meta, rejected, positions, sample_positions, slots, seq_lens, tables, q, block, False)
    assert positions.tolist() == [8, 9, 10, 20, 21, 22, 6, 7, 8, 0, 0, 0]
    assert sample_positions.tolist() == [p + 1 for p in positions.tolist()]
    assert seq_lens.tolist() == [11, 23, 9, 0]
    expected = [int(tables[t // q, p // block]) * block + p % block for t, p in enumerate(positions.tolist())]
    assert slots.tolist() == expected[:9] + [-1, -1, -1]


if not interpreter_active() or not can_run_interpreted_here(
    "strata.kernels.ngram_lookup", "strata.kernels.spec_decode"
):

    @pytest.mark.triton_interpreter(seconds=1)  # its tests' time under the interpreter
    def test_spec_kernels_under_triton_interpreter():
        pytest.importorskip("triton")
        rerun_under_interpreter(__file__, timeout=300)

else:

    def test_triton_lookup_equals_reference():
        rng = random.Random(1)
        for _ in range(3):
            history, hist_len = _history(rng, 10, 40, 3)
            rows = torch.tensor(rng.sample(range(10), 8))
            num = torch.tensor([rng.randint(0, K) for _ in range(8)])
            want = _propose(False, history, hist_len, rows, num)
            got = _propose(True, history, hist_len, rows, num)
            for a, b in zip(want, got):
                assert torch.equal(a, b)

    @pytest.mark.parametrize("seed", range(3))
    def test_triton_commit_equals_reference(seed):
        case = _commit_case(seed)
        want, want_packed = _run_commit(case, False)
        got, got_packed = _run_commit(case, True)
        assert torch.equal(want_packed, got_packed)
        for name in ("last_sampled", "rejected", "history", "hist_len"):
            assert torch.equal(want[name], got[name]), name

    def test_triton_gates_leave_a_graph_step_alone():
        _gates_hold(True)

    def test_triton_shift_equals_reference():
        from strata.kernels.spec_decode import HOST, KNOWN, ROW, shift_positions_in_graph

        q, bs, block = 2, 5, 4
        meta = torch.full((bs, HOST + K), -1, dtype=torch.int64)
        meta[:, ROW] = torch.tensor([0, 1, 2, 3, 6])
        meta[:, KNOWN] = torch.tensor([1, -1, 0, 2, -1])
        rejected = torch.tensor([4, 0, 3, 2, 0, 0, 0])
        tables = torch.arange(bs * 8, dtype=torch.int32).view(bs, 8)

        def inputs():
            positions = torch.tensor([9, 10, 14, 15, 5, 6, 17, 18, 0, 0])
            slots = torch.arange(10, dtype=torch.int64) + 3
            slots[8:] = -1
            return positions, positions + 1, slots, torch.tensor([11, 16, 7, 19, 0], dtype=torch.int32)

        want, got = inputs(), inputs()
        shift_positions_in_graph(meta, rejected, *want, tables, q, block, False)
        shift_positions_in_graph(meta, rejected, *got, tables, q, block, True)
        for a, b in zip(want, got):
            assert torch.equal(a, b)
        assert np.array_equal(want[0].numpy(), [6, 7, 14, 15, 2, 3, 17, 18, 0, 0])
