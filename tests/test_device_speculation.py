"""Speculation with prompt lookup on the last stage's device (issue 31), in process on CPU: the
real scheduler and the real worker ModelRunner (float32, eager), driven as the engine drives them
with up to three plans in flight, so that verify steps go out before the previous result and the
worker moves them back by the drafts rejected since. Every request must get exactly the tokens of
plain decoding: greedy, seeded, top-k and top-p sampling, n > 1 siblings sharing a prompt.

Through real clusters (1 and 2 stages, preemption, stops, n > 1): test_speculative_e2e.py; the
kernels: test_spec_kernels.py. Also here: the cost model and each request's k."""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from strata.services.scheduler.plan_codec import plan_to_proto, split_proposals, split_result, split_rounds
from strata.services.scheduler.request import Request
from strata.services.scheduler.scheduler import Scheduler
from strata.services.scheduler.speculation.adaptive_k import AdaptiveK, expected_tokens
from strata.services.scheduler.speculation.config import SpeculativeConfig
from strata.services.scheduler.speculation.cost_model import CostModel
from strata.services.scheduler.speculation.request_state import SpecState
from strata.v1 import engine_pb2
from tests.tiny_models import cpu_runner

BLOCKS, BLOCK, MAX_LEN = 600, 4, 160


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    from strata.services.worker.model.weights import load_shard
    from tests.tiny_models import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("m"), seed=3)
    return load_shard(model, 0, 1, torch.float32, "cpu")


def _runner(shard, k: int = 0):
    return cpu_runner(
        *shard,
        num_blocks=BLOCKS,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        max_num_seqs=48,
        num_speculative_tokens=k,
        speculative_max_batch=48,
        ngram_on_device=(1, 3) if k else None,
    )


def _requests(seed: int, n: int) -> list[Request]:
    """Prompts that repeat a few tokens (prompt lookup finds them), every sampling kind, and
    n > 1 siblings (parent_id, seed + i) sharing a prompt."""
    rng = random.Random(seed)
    base = [rng.randrange(5, 60) for _ in range(6)]
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.9, seed=7),
        dict(temperature=0.8, top_k=20, seed=8),
        dict(temperature=1.0, top_p=0.8, seed=9),
    ]
    out = []
    for i in range(n):
        prompt = (base * 3)[: rng.randint(4, 18)] + [rng.randrange(5, 60) for _ in range(rng.randint(0, 3))]
        kind = dict(kinds[i % len(kinds)])
        kind.setdefault("top_p", 1.0)
        kind["seed"] = kind.get("seed", 0) + i
        out.append(
            Request(
                f"r{i}",
                prompt,
                engine_pb2.SamplingOptions(logprobs=-1, **kind),
                max_tokens=rng.randint(5, 60),
                ignore_eos=True,
            )
        )
    parent_prompt = base * 2 + [3]
    for j in range(3):  # n = 3 children of one sampled request
        sampling = engine_pb2.SamplingOptions(temperature=0.8, top_p=1.0, seed=50 + j, logprobs=-1)
        out.append(Request(f"{j}_p", parent_prompt, sampling, max_tokens=40, ignore_eos=True, parent_id="p"))
    return out


def _drive(runner, sched: Scheduler, requests: list[Request], in_flight: int):
    """The engine loop: up to in_flight plans launched, the oldest result applied next."""
    for req in requests:
        sched.add_request(req)
    queue, plans = deque(), []
    while sched.unfinished_request_ids() or queue:
        if len(queue) < in_flight:
            plan = sched.schedule()
            if plan is not None:
                plans.append(plan)
                queue.append((plan, runner.execute(plan_to_proto(plan))))
                continue
        plan, pending = queue.popleft()
        result = pending.finish()
        assert not result.error, result.error
        sampled, _ = split_result(result)
        proposals = split_proposals(result) if sched.spec is not None else None
        sched.update(plan, sampled, proposals, split_rounds(result) if plan.verify_rounds > 1 else None)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and sched.num_in_flight == 0
    return {r.request_id: list(r.output_token_ids) for r in requests}, plans


def _scheduler(in_flight: int, spec: SpeculativeConfig | None):
    return Scheduler(
        num_blocks=BLOCKS,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        max_num_seqs=16,
        max_num_batched_tokens=96,
        decode_lookahead=in_flight - 1,
        speculation=spec,
    )


@pytest.mark.parametrize("in_flight", [1, 3])
def test_device_proposals_give_the_plain_tokens(shard, in_flight):
    want, _ = _drive(_runner(shard), _scheduler(in_flight, None), _requests(1, 10), in_flight)
    spec = SpeculativeConfig("ngram", 4, 1, 3, max_batch=48, proposer="device")
    sched = _scheduler(in_flight, spec)
    got, plans = _drive(_runner(shard, 4), sched, _requests(1, 10), in_flight)
    assert got == want
    stats = engine_pb2.SchedulerStats()
    sched.fill_stats(stats)
    assert stats.spec_decode_accepted_tokens > 0 and stats.spec_decode_draft_tokens > stats.spec_decode_accepted_tokens
    device_verifies = [s for p in plans for s in p.seqs if s.num_draft]
    assert device_verifies and all(s.input_token_ids[-1] < 0 for s in device_verifies)  # drafts never on the host
    if in_flight > 1:  # verify steps launched before the previous result, moved back on the device
        assert any(p.rejected_drafts for p in plans)


def test_no_proposals_while_the_cost_model_keeps_speculation_off(shard, monkeypatch):
    """Plain steps of a speculating cluster cost what plain steps cost: while speculation is
    off, the last stage is not asked to look up drafts (a kernel and a read-back per step)."""
    want, _ = _drive(_runner(shard), _scheduler(3, None), _requests(2, 6), 3)
    monkeypatch.setattr(CostModel, "speculate", lambda self, batch, expected: False)
    spec = SpeculativeConfig("ngram", 4, 1, 3, max_batch=48, proposer="device")
    got, plans = _drive(_runner(shard, 4), _scheduler(3, spec), _requests(2, 6), 3)
    assert got == want
    assert not any(s.propose or s.num_draft for p in plans for s in p.seqs)


def test_history_on_the_device_follows_plain_steps_between_verifications(shard, monkeypatch):
    """Plain steps of a speculating cluster write their tokens into the device's history
    without the commit kernel (DeviceSpeculation's plain path): with speculation turned on and
    off every few steps, each live request's history there is its prompt and output so far,
    so lookups after a plain stretch see every token."""
    check_history_follows_plain_steps(_runner(shard, 4), monkeypatch)


def check_history_follows_plain_steps(runner, monkeypatch) -> None:
    """Drives runner (k = 4) with speculation on and off every five steps and checks each live
    request's device history after every step (also run on a GPU, whose decode graphs record
    plain steps' tokens themselves)."""
    choices = iter(range(10**6))
    monkeypatch.setattr(CostModel, "speculate", lambda self, batch, expected: (next(choices) // 5) % 2 == 0)
    spec = SpeculativeConfig("ngram", 4, 1, 3, max_batch=48, proposer="device")
    sched, requests = _scheduler(1, spec), _requests(3, 6)
    for req in requests:
        sched.add_request(req)
    checked, kinds = 0, set()
    while sched.unfinished_request_ids():
        plan = sched.schedule()
        kinds.add(
            "verify"
            if any(s.num_draft for s in plan.seqs)
            else "propose"
            if any(s.propose for s in plan.seqs)
            else "plain"
        )
        result = runner.execute(plan_to_proto(plan)).finish()
        sampled, _ = split_result(result)
        sched.update(plan, sampled, split_proposals(result))
        history, hist_len = runner.spec.history.cpu(), runner.spec.hist_len.cpu()
        for req in requests:
            if req.seq_id is None or req.seq_id not in runner.table.rows or req.status.is_finished:
                continue
            row = runner.table.rows[req.seq_id]
            tokens = req.prompt_token_ids + req.output_token_ids
            assert int(hist_len[row]) == len(tokens)
            assert history[row, : len(tokens)].tolist() == tokens
            checked += 1
    assert checked > 20 and kinds == {"verify", "propose", "plain"}


def test_lookahead_verification_matches_waiting_for_each_result(shard):
    """The same workload, drafts on the device both ways: with 3 plans in flight (verify steps
    launched ahead, moved back on the device) and with 1 (every plan exact)."""
    spec = SpeculativeConfig("ngram", 3, 1, 3, max_batch=48, proposer="device", adaptive=False)
    ahead, _ = _drive(_runner(shard, 3), _scheduler(3, spec), _requests(5, 8), 3)
    exact, _ = _drive(_runner(shard, 3), _scheduler(1, spec), _requests(5, 8), 1)
    assert ahead == exact


def test_cost_model_measures_both_ways_then_picks_the_faster():
    costs = CostModel()
    assert costs.speculate(16, 2.0)  # no GPU timing at all: speculation stays on
    costs.observe(16, 5, 0.004)
    assert not costs.speculate(16, 2.0)  # the decode time at this batch is unknown: measure it
    costs.observe(16, 1, 0.002)
    assert costs.speculate(16, 2.5)  # 2.5 tokens x 2 ms beats 4 ms
    # A change of mind holds for HOLD choices, and takes a clear margin (each change costs a bubble).
    choices = [costs.speculate(16, 1.5) for _ in range(CostModel.HOLD)]  # 1.5 x 2 ms does not
    assert choices[0] and not choices[-1]
    assert not costs.speculate(16, 2.05)  # within the margin of even: no change back
    # Another bucket follows the nearest one measured (16: plain) for HOLD choices, then
    # measures what it lacks.
    costs.observe(64, 1, 0.003)
    follows = [costs.speculate(64, 3.0) for _ in range(CostModel.HOLD + 1)]
    assert not any(follows[:-1]) and follows[-1]  # then a verify step
    costs.observe(64, 5, 0.012)
    assert not costs.speculate(64, 3.0)  # 3 x 3 ms loses to 12 ms
    assert costs.verify_cost(16) == pytest.approx((0.0, (0.004 / 0.002 - 1) / 4))


def test_cost_model_explores_the_other_option_less_often_while_the_choice_stands():
    costs = CostModel()
    costs.observe(1, 1, 0.001)
    costs.observe(1, 5, 0.002)
    # 1.5 tokens expected from a 2 ms verify step against 1 ms plain steps: plain decoding wins
    choices = [costs.speculate(1, 1.5) for _ in range(CostModel.REFRESH * 7 + 4 * CostModel.WINDOW)]
    explored = [i for i, c in enumerate(choices) if c]  # plain from the start: these explore
    # Windows of WINDOW verify steps after REFRESH, then 2 REFRESH, then 4 REFRESH choices.
    starts = [i for i in explored if not choices[i - 1]]
    assert starts[0] == CostModel.REFRESH - 1
    assert len(explored) == CostModel.WINDOW * len(starts) and len(starts) == 3
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == [2 * CostModel.REFRESH + CostModel.WINDOW, 4 * CostModel.REFRESH + CostModel.WINDOW]


def test_cost_model_times_windows_of_steps_from_result_to_result():
    """A step's own time counts from its send when that came after the previous result (a verify
    step that waited for it), which leaves out the host's part in between: verify steps whose
    results come 2.3 ms apart each look 1.4 ms long. Against plain steps of 0.84 ms, 1.94 tokens
    per verify step lose (1.94 x 0.84 < 2.3), though 1.4 ms would seem to win (the H200's open set
    kept speculating at 0.78x). Windows of steps, result to result, see the 2.3 ms."""
    costs, now = CostModel(), 100.0
    for _ in range(2 * CostModel.WINDOW):  # plain steps, one result every 0.84 ms
        now += 0.00084
        costs.observe(1, 1, 0.00084, now)
    for i in range(4 * CostModel.WINDOW):  # verify steps: sent 0.9 ms after a result, 1.4 ms to run
        now += 0.0023
        costs.observe(1, 5, 0.0014, now, tokens=2 if i % 2 else 1)
    assert costs.times[(1, 5)] == pytest.approx(0.0023, rel=0.05)
    assert costs.times[(1, 1)] == pytest.approx(0.00084, rel=0.05)
    assert costs.tokens[1] == pytest.approx(1.5)  # delivered (the log reports it)
    assert not costs.speculate(1, 1.94)
    # The lookup set's 4 tokens a verify step do pay (after the current choice's hold).
    assert [costs.speculate(1, 4.0) for _ in range(CostModel.HOLD + 1)][-1]


def test_cost_model_counts_steps_of_a_kind_though_others_come_between():
    """Requests whose k fell to 0 decode plainly beside others' verify steps: plans alternate
    between the two kinds, and each kind's windows still fill (before, a window restarted at
    every change of kind, and neither was ever measured again)."""
    costs, now = CostModel(), 100.0
    for i in range(4 * CostModel.WINDOW):
        verifies = i % 2 == 1
        now += 0.0024 if verifies else 0.0012
        costs.observe(16, 5 if verifies else 1, 0.001, now, tokens=24 if verifies else 16)
    assert costs.step[(16, False)] == pytest.approx(0.0012, rel=0.05)  # (the first: its own time)
    assert costs.step[(16, True)] == pytest.approx(0.002)  # at most twice the step's own time
    assert costs.tokens[16] == pytest.approx(1.5)
    assert not costs.speculate(16, 1.5)  # 1.5 x 1.2 ms < 2 ms
    assert [costs.speculate(16, 2.0) for _ in range(CostModel.HOLD + 1)][-1]  # 2 x 1.2 ms > 2 ms


def test_cost_model_leaves_out_steps_that_waited_for_the_previous_result():
    """A plain step after a verify step waits for its result (the change of kind's bubble): its
    time is a round trip, not what plain decoding costs once pipelined."""
    costs, now = CostModel(), 100.0
    for i in range(4 * CostModel.WINDOW):
        bubble = i % 4 == 3
        now += 0.0016 if bubble else 0.001
        costs.observe(1, 1, 0.0016 if bubble else 0.001, now, pipelined=not bubble)
    assert costs.step[(1, False)] == pytest.approx(0.001)


def test_verify_cost_has_a_fixed_part_and_k_follows_it():
    """At batch 1 a verify step cost about twice a decode step whatever its k (SmolLM2 on the
    H200: the decode chain serves one-token steps only): a cost per position alone (from the
    longest query, 1.77 / 0.75 ms over 8 more positions) made k = 8 look dear, and k stayed at
    3 or 4 on the lookup set, where 8 emits more for about the same step."""
    costs = CostModel()
    costs.observe(1, 1, 0.00075)
    for q, t in ((3, 0.00172), (5, 0.00174), (9, 0.00177)):
        costs.observe(1, q, t, tokens=2)
    fixed, per_position = costs.verify_cost(1)
    assert fixed == pytest.approx(1.27, abs=0.02) and per_position == pytest.approx(0.013, abs=0.005)
    adaptive, req = AdaptiveK(8), Request("r", [1, 2, 3], engine_pb2.SamplingOptions(), max_tokens=500)
    req.spec = SpecState(k=8)
    for _ in range(6):  # 7 of 8 drafts accepted each time
        adaptive.record(req, 8, 8, 7, costs.verify_cost(1))
    assert req.spec.k == 8
    low = Request("s", [1, 2, 3], engine_pb2.SamplingOptions(), max_tokens=500)
    low.spec = SpecState(k=8)
    for _ in range(6):  # the open set's acceptance: a verify step would not pay for its fixed part
        adaptive.record(low, 8, 8, 0, costs.verify_cost(1))
    assert low.spec.k == 0


def test_verify_cost_is_fitted_once_per_window_and_follows_the_next():
    """Every verifying request asks for the verify cost after every verify step: the fit is kept
    until the next window of steps is recorded (16 fits a step cost the scheduler 0.48 ms)."""
    costs = CostModel()
    costs.observe(1, 1, 0.00075)
    for q, t in ((3, 0.00172), (9, 0.00177)):
        costs.observe(1, q, t, tokens=2)
    first = costs.verify_cost(1)
    fits = []
    real = costs._fit_verify_cost
    costs._fit_verify_cost = lambda b: fits.append(b) or real(b)
    assert [costs.verify_cost(1) for _ in range(16)] == [first] * 16 and fits == []
    costs.observe(1, 5, 0.00300, tokens=2)  # a new window: the line moves
    assert costs.verify_cost(1) != first and fits == [1]


def test_adaptive_k_stops_at_the_drafts_found():
    """A larger k than the lookup found only costs more: the same k as trying every k."""
    req = Request("r", [1, 2, 3], engine_pb2.SamplingOptions(), max_tokens=500)
    req.spec = SpecState(k=8)
    AdaptiveK(8).record(req, 8, 2, 2, (0.1, 0.05))  # 2 found, both accepted
    assert req.spec.k == 2


def test_k_follows_acceptance_and_drafting_stops_when_it_never_pays():
    adaptive = AdaptiveK(4)
    req = Request("r", [1, 2, 3], engine_pb2.SamplingOptions(), max_tokens=500)
    req.spec = SpecState(k=4)
    for _ in range(5):  # every draft accepted
        adaptive.record(req, 4, 4, 4, cost=(0.0, 0.05))
    assert req.spec.k == 4
    adaptive.record(req, 4, 4, 1, cost=(0.0, 0.05))  # one miss after a good run changes little
    assert req.spec.k == 4
    short = Request("s", [1, 2, 3], engine_pb2.SamplingOptions(), max_tokens=500)
    short.spec = SpecState(k=4)
    for _ in range(6):  # the lookup finds one draft each time, always right: more slots are waste
        adaptive.record(short, short.spec.k, 1, 1, cost=(0.0, 0.2))
    assert short.spec.k in (1, 2) and short.spec.expected < 2.5  # (two emitted per step)
    other = Request("o", [1, 2, 3], engine_pb2.SamplingOptions(), max_tokens=500)
    other.spec = SpecState(k=4)
    ks = []
    for _ in range(8):  # the first draft is wrong every time, and a verify position costs 30%
        adaptive.record(other, 4, 4, 0, cost=(0.0, 0.3))
        ks.append(other.spec.k)
    assert ks[0] == 1 and ks[-1] == 0  # fewer drafts first, then none
    assert other.spec.retry_at == AdaptiveK.MIN_BACKOFF  # for 16 tokens, then it tries again
    adaptive.resume(other.spec)
    assert other.spec.k == 2
    adaptive.resume(req.spec)
    assert req.spec.k == 2
    assert expected_tokens(0.5, 2) == pytest.approx(1.75) and expected_tokens(1.0, 4) == 5


def test_verify_steps_that_carry_their_drafts_are_timed_and_speculation_turns_off_where_it_loses():
    """A draft model's verify step waits for the previous result and for its drafts: never
    pipelined, it was never timed once plain steps had pipelined, so the cost model kept
    choosing to verify (the bucket "not measured yet") while drafts accepted nothing (the dummy
    8B with a 1B draft: 0.37x). Timed, a 12 ms verify step against 5.3 ms decodes loses."""
    from types import SimpleNamespace

    from strata.services.scheduler.speculation.proposals import Speculation

    spec = Speculation(SpeculativeConfig(method="draft", num_speculative_tokens=4))
    now = 100.0
    decode = SimpleNamespace(seqs=[None], max_query=1, verifies=False, verify_rounds=1)
    verify = SimpleNamespace(seqs=[None], max_query=5, verifies=True, verify_rounds=1)
    for i in range(6 * CostModel.WINDOW):
        verifies = i % 2 == 1
        now += 0.012 if verifies else 0.0053
        spec.observe(verify if verifies else decode, 0.007 if verifies else 0.0053, now, 1, pipelined=not verifies)
    assert spec.costs.step[(1, True)] == pytest.approx(0.012, rel=0.2)
    choices = [spec.costs.speculate(1, 1.3) for _ in range(CostModel.HOLD + 1)]
    assert not choices[-1]  # 1.3 tokens x 5.3 ms < 12 ms


def _unfiltered_requests(seed: int, n: int) -> list[Request]:
    """_requests' prompts, drawn without top-k or top-p (greedy and seeded): the draws that
    several verify rounds per step serve."""
    out = _requests(seed, n)
    for req in out:
        req.sampling.top_k, req.sampling.top_p = 0, 1.0
    return out


@pytest.mark.parametrize("in_flight", [1, 3])
def test_verify_rounds_give_the_plain_tokens(shard, in_flight):
    """Several verify rounds per step (the last stage verifies, proposes and verifies again,
    moving each sequence on itself; one sequence may sit out rounds the others run): the tokens
    of plain decoding, every slot the rounds did not fill rolled back, and each round's
    acceptance counted."""
    want, _ = _drive(_runner(shard), _scheduler(in_flight, None), _unfiltered_requests(7, 8), in_flight)
    spec = SpeculativeConfig(
        "ngram", 3, 1, 3, max_batch=48, proposer="device", adaptive=False, rounds=3, rounds_max_batch=16
    )
    sched = _scheduler(in_flight, spec)
    got, plans = _drive(_runner(shard, 3), sched, _unfiltered_requests(7, 8), in_flight)
    assert got == want
    multi = [p for p in plans if p.verify_rounds > 1]
    assert multi and any(s.rounds > 1 for p in multi for s in p.seqs)
    if in_flight > 1:
        assert any(p.rejected_drafts for p in multi)  # rounds launched ahead, moved back first
    assert any(len({s.rounds for s in p.seqs if s.sample}) > 1 for p in multi)  # some sat out rounds
    stats = engine_pb2.SchedulerStats()
    sched.fill_stats(stats)
    rounds_run = sum(s.rounds for p in plans for s in p.seqs if s.num_draft)
    assert 0 < stats.spec_decode_drafts <= rounds_run  # counted per round that had drafts found
    assert stats.spec_decode_accepted_tokens > 0


def test_verify_rounds_only_for_small_batches_of_unfiltered_decodes(shard):
    """A plan runs several rounds only while at most rounds_max_batch requests run, none waits
    and every one draws unfiltered: a top-p request keeps every plan it shares at one round, and
    a batch above the limit runs one round each."""

    def requests():
        out = _unfiltered_requests(8, 4)
        out[1].sampling.top_p = 0.9  # (r1 samples at temperature 0.9: greedy r0 would draw unfiltered)
        return out

    spec = SpeculativeConfig(
        "ngram", 3, 1, 3, max_batch=48, proposer="device", adaptive=False, rounds=3, rounds_max_batch=16
    )
    want, _ = _drive(_runner(shard), _scheduler(3, None), requests(), 3)
    got, plans = _drive(_runner(shard, 3), _scheduler(3, spec), requests(), 3)
    assert got == want
    shared = [p for p in plans if any(s.request.request_id == "r1" for s in p.seqs)]
    assert shared and all(p.verify_rounds == 1 for p in shared)
    small = SpeculativeConfig(
        "ngram", 3, 1, 3, max_batch=48, proposer="device", adaptive=False, rounds=3, rounds_max_batch=2
    )
    _, plans = _drive(_runner(shard, 3), _scheduler(3, small), _unfiltered_requests(9, 6), 3)
    above = [p for p in plans if len(p.seqs) > 2]
    assert above and all(p.verify_rounds == 1 for p in above)
