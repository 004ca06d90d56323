"""The scheduler's micro-batches over P pipeline stages (services/scheduler/micro_batches.py), pure
Scheduler against fake stages, milliseconds each:

- how many micro-batches run follows the load (1, P, P + 1), and shrinks only with hysteresis;
- every request gets the tokens a sequential run gives it, through arrivals, finishes, chunked
  prompts, preemption, rebalancing and shrinking; nothing is in two plans in flight for the same
  tokens, a request's decodes never ride two micro-batches' plans at once, no micro-batch seats
  more than max_num_seqs, and every block ends free;
- the prefill quota keeps the plans of a round about equal in tokens;
- a micro-batch that drains early takes requests from the others.

(One stage plans as it always did: test_scheduler_policy.py; micro-batches with decode lookahead
and chunks that follow each other: test_pipelined_decode.py; through real clusters at 2 and 3
stages: test_e2e_greedy.py, test_pipelined_decode.py, test_recovery.py.)
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from strata.protocol import PLACEHOLDER_TOKEN
from strata.services.scheduler import micro_batches
from strata.services.scheduler.block_manager import cdiv
from strata.services.scheduler.micro_batches import MIGRATING, PREFILLING
from strata.services.scheduler.plan_codec import plan_to_proto
from strata.services.scheduler.request import Request
from strata.services.scheduler.scheduler import Scheduler
from strata.v1 import engine_pb2

VOCAB = 50


def _next_token(seed: int, context: list[int]) -> int:
    return hash((seed, *context[-6:], len(context))) % VOCAB


def _reference(req: Request, max_model_len: int) -> list[int]:
    tokens, out = list(req.prompt_token_ids), []
    while len(out) < min(req.max_tokens, max_model_len - len(req.prompt_token_ids)):
        token = _next_token(req.sampling.seed, tokens)
        tokens.append(token)
        out.append(token)
        if token in req.eos_token_ids and len(out) > req.min_tokens:
            break
    return out


def _request(i: int, prompt_len: int, max_tokens: int, eos: bool = False, parent: int | None = None) -> Request:
    """Request r{i}; with `parent`, an n > 1 sibling: the prompt of r{parent}, its own seed."""
    rng = random.Random(i if parent is None else parent)
    return Request(
        f"r{i}",
        [rng.randrange(VOCAB) for _ in range(prompt_len)],
        engine_pb2.SamplingOptions(seed=i),
        max_tokens=max_tokens,
        eos_token_ids=frozenset({7}) if eos else frozenset(),
        parent_id="" if parent is None else f"g{parent}",
    )


class FakeStages:
    """P stages that run plans in step order, as workers do, from what goes on the wire
    (plan_to_proto: repeated plans are only that): block tables and contexts kept from the plans'
    deltas alone, a lookahead's placeholder filled with the sequence's last sampled token (stage 0
    gets it from the last stage), a token drawn from the context read."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.tables: dict[int, list[int]] = {}
        self.context: dict[int, list[int]] = {}
        self.last_sampled: dict[int, int] = {}

    def execute(self, plan) -> dict[int, list[int]]:
        msg = plan_to_proto(plan)
        for seq_id in msg.released_seq_ids:
            self.tables.pop(seq_id, None)
            self.context.pop(seq_id, None)
        for new in msg.new_sequences:
            assert new.seq_id not in self.tables
            self.tables[new.seq_id] = []
        requests = {s.seq_id: s.request for s in plan.seqs}
        sampled = {}
        inputs, appended = iter(msg.input_token_ids), iter(msg.table_append_ids)
        for i, seq_id in enumerate(msg.seq_ids):
            req, table = requests[seq_id], self.tables[seq_id]
            num_computed, num_scheduled = msg.num_computed[i], msg.num_scheduled[i]
            del table[msg.table_keep[i] :]
            table.extend(next(appended) for _ in range(msg.table_append_counts[i]))
            # Every slot written has its block; a repeated plan's blocks may come ahead of them.
            assert len(table) >= cdiv(num_computed + num_scheduled, self.sched.block_size)
            assert table == req.block_ids[: len(table)], "a table the scheduler does not hold"
            if seq_id in self.context:
                known = self.context[seq_id]
                assert len(known) >= num_computed, "a step ran before the tokens it extends"
            else:  # its first step: a cached prefix (computed for others) holds its own tokens
                known = (req.prompt_token_ids + req.output_token_ids)[:num_computed]
            step_inputs = [next(inputs) for _ in range(num_scheduled)]
            step_inputs = [self.last_sampled[seq_id] if t == PLACEHOLDER_TOKEN else t for t in step_inputs]
            context = known[:num_computed] + step_inputs
            self.context[seq_id] = context
            if msg.sample[i]:
                token = _next_token(req.sampling.seed, context)
                self.last_sampled[seq_id] = token
                sampled[seq_id] = [token]
        return sampled


class PipelineDriver:
    """Engine's loop for P stages: up to max(2 x micro-batches, P + 1) plans in flight, results in
    step order; arrivals over time; checks every plan against the plans in flight."""

    def __init__(self, sched: Scheduler, stages: int, seed: int = 0):
        self.sched, self.stages = sched, stages
        self.fake = FakeStages(sched)
        self.in_flight: deque = deque()
        self.max_in_flight = max(2 * sched.num_micro_batches, stages + 1)
        self.outputs: dict[str, list[int]] = {}
        self.rng = random.Random(seed)
        self.active_seen: list[int] = []
        self.plans = []
        self.entries: dict[int, dict[int, tuple[int, int, bool]]] = {}  # step: seq_id: what the wire says

    def _wire(self, plan) -> dict[int, tuple[int, int, bool]]:
        if plan.step_id not in self.entries:
            self.entries[plan.step_id] = _wire_entries(plan)
        return self.entries[plan.step_id]

    def run(self, arrivals: list[Request], arrival_rate: float = 1.0, max_steps: int = 200_000, on_step=None):
        pending = list(arrivals)
        for _ in range(max_steps):
            while pending and self.rng.random() < arrival_rate:
                self.sched.add_request(pending.pop(0))
            if not (pending or self.sched.unfinished_request_ids() or self.in_flight):
                return
            plan = self.sched.schedule() if len(self.in_flight) < self.max_in_flight else None
            if plan is not None:
                self._check(plan)
                self.plans.append(plan)
                self.in_flight.append((plan, self.fake.execute(plan)))
                self.active_seen.append(self.sched.active_micro_batches)
            elif self.in_flight:
                done, sampled = self.in_flight.popleft()
                for upd in self.sched.update(done, sampled):
                    self.outputs.setdefault(upd.request.request_id, []).extend(upd.new_token_ids)
            # Every sequence counted in flight is in a plan in flight or a repeat committed to.
            assert self.sched.num_in_flight == sum(r.in_flight for r in self.sched._requests.values())
            if on_step:
                on_step(self)
        raise AssertionError("did not finish")

    def _check(self, plan):
        sched = self.sched
        assert plan.num_tokens == sum(s.num_scheduled for s in plan.seqs) <= sched.max_num_batched_tokens
        assert plan.micro_batch < sched.active_micro_batches
        assert all(n <= sched.max_num_seqs for n in sched.micro_batch_seqs), "a micro-batch past its seats"
        assert len(sched.running) <= sched.active_micro_batches * sched.max_num_seqs
        wire = self._wire(plan)
        for s in plan.seqs:
            req = s.request
            num_computed, _, sample = wire[s.seq_id]
            if sample and not plan.repeat:  # a sampling entry rides its home micro-batch's plan
                assert req.micro_batch == plan.micro_batch, (req.request_id, req.micro_batch, plan.micro_batch)
            # Nothing twice in flight: this entry starts where the request's latest entry in
            # flight ended, and every decode in flight belongs to one micro-batch.
            earlier = [(p, self._wire(p)[s.seq_id]) for p, _ in self.in_flight if s.seq_id in self._wire(p)]
            if earlier:
                last = earlier[-1][1]
                assert num_computed == last[0] + last[1], "tokens computed twice"
                homes = {p.micro_batch for p, e in earlier if e[2]} | ({plan.micro_batch} if sample else set())
                assert len(homes) <= 1, f"{req.request_id} decodes in two micro-batches at once"

    def assert_done(self, requests, max_model_len):
        sched = self.sched
        for req in requests:
            assert self.outputs.get(req.request_id, []) == _reference(req, max_model_len), req.request_id
        bm = sched.block_manager
        assert bm.num_free_blocks == bm.num_blocks and sched.num_in_flight == 0
        assert sched.micro_batch_seqs == [0] * sched.num_micro_batches
        assert not sched.prefilling and not sched._migrating and not sched.running


def _wire_entries(plan) -> dict[int, tuple[int, int, bool]]:
    """{seq_id: (num_computed, num_scheduled, sample)} of the plan as workers get it."""
    msg = plan_to_proto(plan)
    return {i: (c, n, s) for i, c, n, s in zip(msg.seq_ids, msg.num_computed, msg.num_scheduled, msg.sample)}


def _scheduler(stages=2, micro_batches_=3, **kw) -> Scheduler:
    defaults = dict(
        num_blocks=4000,
        block_size=4,
        max_model_len=512,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        decode_lookahead=stages,
        num_micro_batches=micro_batches_,
        micro_batch_min_seqs=4,
        pipeline_stages=stages,
    )
    return Scheduler(**{**defaults, **kw})


def _stats(sched) -> engine_pb2.SchedulerStats:
    stats = engine_pb2.SchedulerStats()
    sched.fill_stats(stats)
    return stats


# ---------------------------------------------------------------------------- how many


@pytest.mark.parametrize(
    "full,demand,expected",
    [(3, 1, 1), (3, 7, 1), (3, 8, 2), (3, 32, 2), (3, 33, 3), (3, 500, 3), (2, 33, 2), (2, 7, 1), (5, 49, 4)],
)
def test_the_count_wanted_follows_the_load(full, demand, expected):
    """P = 2, 16 seats each, 4 sequences at least: one micro-batch below P x 4; P while P of them
    seat the load; more (up to the most allowed) only for seats. On one shared GPU the most is P."""
    assert _scheduler(micro_batches_=full)._wanted_micro_batches(demand) == expected


def test_the_count_grows_at_once_and_shrinks_only_after_it_held(monkeypatch):
    sched = _scheduler()
    requests = [_request(i, 5, 10_000) for i in range(40)]
    for req in requests:
        sched.add_request(req)
    plan = sched.schedule()
    assert sched.active_micro_batches == 3 and plan.micro_batch == 0  # 40 > 2 x 16 seats
    for req in requests[8:]:  # 8 left: P micro-batches of 4 each
        sched.abort(req.request_id)
    counts = []
    for _ in range(micro_batches.SHRINK_AFTER_PLANS + 1):
        sched.schedule()
        counts.append(sched.active_micro_batches)
        for mb in range(3):
            sched.micro_batch_plans[mb] = 0  # (results left out: only the count matters here)
    assert counts[: micro_batches.SHRINK_AFTER_PLANS - 1] == [3] * (micro_batches.SHRINK_AFTER_PLANS - 1)
    assert counts[-1] == 2


# ---------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("repeats", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_blocks", [4000, 120])
def test_every_request_gets_its_tokens_through_growth_drain_and_shrink(seed, num_blocks, repeats):
    """Mixed prompts (chunked past the budget) and outputs, stops, n > 1 siblings sharing their
    prompt's blocks, arrivals over time, aborts while in flight; 120 blocks of 4 tokens also
    preempt. The count rises to P + 1, falls to P and to one as the load drains. With repeats,
    steady micro-batches commit to 4 plans at once (repeats.py)."""
    rng = random.Random(seed)
    sched = _scheduler(num_blocks=num_blocks, max_model_len=256, decode_repeats=repeats)
    requests = []
    for i in range(90):
        first = 1000 * seed + 10 * i
        prompt_len, siblings = rng.randint(1, 150), 3 if i % 10 == 0 else 1
        for j in range(siblings):
            parent = first if siblings > 1 else None
            requests.append(_request(first + j, prompt_len, rng.randint(1, 60), eos=i % 3 == 0, parent=parent))
    driver = PipelineDriver(sched, stages=2, seed=seed)
    aborted = set()

    def abort_some(d):
        if rng.random() < 0.003 and sched.running:
            req = rng.choice(sched.running)
            aborted.add(req.request_id)
            sched.abort(req.request_id)

    driver.run(requests, arrival_rate=0.3, on_step=abort_some)
    driver.assert_done([r for r in requests if r.request_id not in aborted], 256)
    stats = _stats(sched)
    assert set(driver.active_seen) == {1, 2, 3}
    assert stats.micro_batch_rounds > 0 and stats.prefill_tokens_computed > 0
    assert (stats.repeated_plans > 0) == (repeats > 1)
    if num_blocks == 120:
        assert stats.preemptions > 0


def _steady_workload(seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [_request(i, rng.randint(1, 30), rng.randint(5, 80), eos=i % 4 == 0) for i in range(60)]


@pytest.mark.parametrize("seed", [0, 1])
def test_repeats_dropped_unsent_give_back_their_tokens(seed):
    """A micro-batch that stops being active drops the repeats it has not sent (_cancel_repeats):
    its members' state moves back, and every request still gets its tokens. Dropped here
    whenever a micro-batch has two or more repeats left, the hardest case."""
    sched = _scheduler(decode_repeats=4)
    driver = PipelineDriver(sched, stages=2, seed=seed)
    dropped = []

    def drop(d):
        for mb, rep in enumerate(sched._repeats):
            if rep is not None and rep.left >= 2:
                dropped.append(rep.left)
                sched._cancel_repeats(mb)

    requests = _steady_workload(seed)
    driver.run(requests, arrival_rate=1.0, on_step=drop)
    driver.assert_done(requests, 512)
    assert dropped and _stats(sched).repeated_plans > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_a_reset_with_repeats_committed_resumes_every_request(seed):
    """A lost stage while repeats are committed: reset_kv drops them with everything else, fresh
    stages start empty, and every request resumes by recompute to the tokens it would have had."""
    sched = _scheduler(decode_repeats=4)
    driver = PipelineDriver(sched, stages=2, seed=seed)
    resets = []

    def lose_a_stage(d):
        if not resets and any(rep is not None and rep.left >= 2 for rep in sched._repeats):
            resets.append(sched.num_in_flight)
            d.in_flight.clear()  # the plans in flight are lost with the stage
            sched.reset_kv(sched.block_manager.num_blocks)
            d.fake = FakeStages(sched)

    requests = _steady_workload(seed)
    driver.run(requests, arrival_rate=1.0, on_step=lose_a_stage)
    driver.assert_done(requests, 512)
    assert resets and _stats(sched).repeated_plans > 0


def test_a_request_arriving_during_repeats_is_admitted_at_the_next_turn():
    """Repeats committed for the lone micro-batch are dropped when a request arrives: the
    micro-batch's next plan admits it instead of sending a repeat."""
    sched = _scheduler(decode_repeats=4)
    driver = PipelineDriver(sched, stages=2)
    late = _request(99, 6, 10)
    arrived = []

    def arrive(d):
        if not arrived and sched._repeats[0] is not None and sched._repeats[0].left >= 2:
            arrived.append(len(d.plans))
            sched.add_request(late)

    requests = [_request(i, 5, 40) for i in range(3)]
    driver.run(requests, on_step=arrive)
    driver.assert_done(requests + [late], 512)
    after = driver.plans[arrived[0] :]
    admitting = next(i for i, p in enumerate(after) if late in p.new_requests)
    assert not any(p.repeat for p in after[: admitting + 1])


def test_repeats_run_while_requests_wait_for_seats():
    """More requests than seats: while every seat is taken, steady micro-batches repeat their plans
    (the waiting wait for a finish either way); a freed seat drops them and the next plan admits."""
    sched = _scheduler(decode_repeats=4)  # 3 micro-batches of 16 seats
    driver = PipelineDriver(sched, stages=2)
    seen = []

    def watch(d):
        if sched.waiting and any(rep is not None for rep in sched._repeats):
            seen.append(len(sched.waiting))

    requests = [_request(i, 4, 30) for i in range(120)]
    driver.run(requests, on_step=watch)
    driver.assert_done(requests, 512)
    assert seen and _stats(sched).repeated_plans > 0


def test_a_micro_batch_that_drains_early_takes_requests_from_the_others():
    """Three micro-batches of 16; the first one's requests end after 2 tokens, the others' run
    long: its seats stay empty (nothing waits), so the others' latest arrivals move to it, each
    once its plans in flight are back; none loses or repeats a token."""
    sched = _scheduler(max_num_batched_tokens=1024)
    requests = [_request(i, 8, 2 if i < 16 else 120) for i in range(48)]
    driver = PipelineDriver(sched, stages=2)
    seen = []
    driver.run(requests, arrival_rate=1.0, on_step=lambda d: seen.append(list(sched.micro_batch_seqs)))
    driver.assert_done(requests, 512)
    assert [16, 16, 16] in seen  # admitted evenly
    stats = _stats(sched)
    assert stats.micro_batch_migrations >= 8
    # After the first micro-batch drained, the running ones were shared out again.
    drained = seen.index(next(c for c in seen if c[0] == 0))
    assert any(c[0] >= 8 and sum(c) == 32 for c in seen[drained:]), seen[drained : drained + 50]


def test_a_request_moves_only_once_its_plans_are_back():
    sched = _scheduler()
    for i in range(48):
        sched.add_request(_request(i, 4, 50))
    driver = PipelineDriver(sched, stages=2)
    for _ in range(30):  # every micro-batch decoding, plans in flight
        plan = sched.schedule() if len(driver.in_flight) < driver.max_in_flight else None
        if plan is not None:
            driver.in_flight.append((plan, driver.fake.execute(plan)))
        else:
            done, sampled = driver.in_flight.popleft()
            sched.update(done, sampled)
    mover = sched.micro_batch_members[2][-1]
    assert mover.in_flight
    for req in list(sched.micro_batch_members[0]):
        sched.abort(req.request_id)
    plan = sched.schedule()  # the rebalance takes the latest arrivals of micro-batches 1 and 2
    assert mover.micro_batch == MIGRATING and all(s.request is not mover for s in plan.seqs)
    while mover.in_flight:
        done, sampled = driver.in_flight.popleft()
        sched.update(done, sampled)
    sched.schedule()
    assert mover.micro_batch == 0 and mover in sched.micro_batch_members[0]


# ---------------------------------------------------------------------------- balance


def _heaviest_plans(quota: bool, monkeypatch) -> tuple[int, int]:
    """(90th, 95th percentile) of plan tokens over a run with a queue of 300-1,200 token prompts
    beside decodes, budget 2,048."""
    if not quota:
        monkeypatch.setattr(Scheduler, "_prefill_quota", lambda self, budget: budget)
    sched = _scheduler(max_num_batched_tokens=2048, max_model_len=1300, num_blocks=20_000)
    driver = PipelineDriver(sched, stages=2)
    rng = random.Random(2)
    requests = [_request(i, rng.randint(300, 1200), rng.randint(20, 60)) for i in range(160)]
    driver.run(requests, arrival_rate=0.5)
    driver.assert_done(requests, sched.max_model_len)
    tokens = sorted(p.num_tokens for p in driver.plans)
    return tokens[len(tokens) * 9 // 10], tokens[len(tokens) * 19 // 20]


def test_the_prefill_quota_spreads_each_prompt_over_a_rounds_plans(monkeypatch):
    """Whichever plan admits a prompt would carry all of it (and the pipeline's round would wait
    on that plan); with the quota its chunks ride the round's m plans, so the heaviest plans
    carry far fewer tokens. (The quota's floor scaled to this budget, an eighth of the offline
    one.)"""
    monkeypatch.setattr(micro_batches, "MIN_PREFILL_QUOTA", 32)
    with_quota = _heaviest_plans(True, monkeypatch)
    without = _heaviest_plans(False, monkeypatch)
    assert with_quota[0] < 0.8 * without[0] and with_quota[1] < 0.8 * without[1], (with_quota, without)


def test_prefill_chunks_ride_any_plan_and_the_final_one_its_homes():
    """A long prompt's chunks spread over every micro-batch's plans (a quota each), in order,
    while only its final chunk, which samples, needs a seat."""
    sched = _scheduler(max_num_batched_tokens=512, max_model_len=2048, num_blocks=8000)
    for i in range(40):  # three micro-batches decoding
        sched.add_request(_request(i, 4, 500))
    driver = PipelineDriver(sched, stages=2)
    for _ in range(40):
        plan = sched.schedule() if len(driver.in_flight) < driver.max_in_flight else None
        if plan is not None:
            driver.in_flight.append((plan, driver.fake.execute(plan)))
        else:
            sched.update(*driver.in_flight.popleft())
    assert sched.active_micro_batches == 3
    long = _request(99, 1500, 3)
    sched.add_request(long)
    rides = []
    for _ in range(200):
        plan = sched.schedule() if len(driver.in_flight) < driver.max_in_flight else None
        if plan is not None:
            driver._check(plan)
            driver.in_flight.append((plan, driver.fake.execute(plan)))
            rides += [(plan.micro_batch, s.num_scheduled, s.sample) for s in plan.seqs if s.request is long]
        else:
            sched.update(*driver.in_flight.popleft())
        if long.output_token_ids:
            break
    assert sum(n for _, n, _ in rides) == 1500 and len({mb for mb, _, _ in rides}) == 3
    assert [sample for _, _, sample in rides] == [False] * (len(rides) - 1) + [True]
    assert max(n for _, n, _ in rides) <= 512 and long.micro_batch not in (PREFILLING, MIGRATING)


# ---------------------------------------------------------------------------- the workers' cache


def test_the_cache_of_p_stages_holds_every_micro_batchs_sequences():
    """A CPU worker caps its blocks at what the sequences that may run at once can use: one
    micro-batch's with one stage, P + 1 micro-batches' with P stages (each stage holds 1/P of
    the layers, so the same memory holds P times the blocks)."""
    from types import SimpleNamespace

    import torch

    from strata.services.worker.main import num_kv_blocks_for

    config = SimpleNamespace(num_key_value_heads=2, head_dim=8)
    blocks = {}
    for stages in (1, 2, 3):
        args = SimpleNamespace(
            num_kv_blocks=0, block_size=16, max_num_seqs=8, num_stages=stages, kv_cache_memory_gb=1.0
        )
        blocks[stages] = num_kv_blocks_for(args, config, 2, 160, torch.device("cpu"), torch.float32)
    assert blocks == {1: 8 * 10, 2: 3 * 8 * 10, 3: 4 * 8 * 10}
