"""The engine's plan pacing (services/scheduler/plan_pacing.py): when the next plan waits."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from strata.services.scheduler.engine import Engine
from strata.services.scheduler.engine_config import SchedulerConfig
from strata.services.scheduler.plan import ScheduledSeq
from strata.services.scheduler.plan_pacing import MARGIN_SHARE, MAX_MARGIN_SHARE, PlanHold, PlanPacer, prompt_tokens
from strata.services.scheduler.request import Request
from strata.services.scheduler.scheduler import Scheduler
from strata.v1 import engine_pb2


def trained(decode=0.003, per_token=12e-6) -> PlanPacer:
    pacer = PlanPacer()
    pacer.observe(0, 16, decode)  # a decode step of 16 sequences
    pacer.observe(3 * 512, 16, decode + per_token * 3 * 512)  # three prompts of 512 among them
    return pacer


def test_it_learns_a_decode_step_and_a_cost_per_prompt_token():
    pacer = trained()
    assert pacer.decode_seconds == pytest.approx(0.003)
    assert pacer.token_seconds == pytest.approx(12e-6)
    assert pacer.expected(1024, 16) == pytest.approx(0.003 + 1024 * 12e-6)
    assert pacer.expected(10, 16) == pytest.approx(0.003)  # a small chunk among decodes: a decode step


def test_prompt_tokens_are_prefill_chunks_only():
    def seq(scheduled, drafts=0):
        return ScheduledSeq(None, 0, 0, scheduled, [], 0, [], True, num_draft=drafts)

    plan = SimpleNamespace(seqs=[seq(512), seq(1), seq(1), seq(5, drafts=4), seq(10, drafts=4), seq(40)])
    assert prompt_tokens(plan) == 552  # a decode or a verification (drafts, rounds of them) is no prefill


def test_nothing_is_held_before_it_knows_both_costs_or_behind_decode_steps():
    fresh = PlanPacer()
    assert fresh.hold_seconds([(4096, 8)], started=0.0, now=0.0) == 0.0
    decode_only = PlanPacer()
    decode_only.observe(0, 16, 0.003)
    assert decode_only.hold_seconds([(4096, 8)], started=0.0, now=0.0) == 0.0  # no prefill cost known yet
    # Two decode lookaheads in flight leave less than the margin: the third plan goes at once.
    assert trained().hold_seconds([(0, 16), (0, 16)], started=0.0, now=0.0) == 0.0


def test_behind_a_long_prefill_the_next_plan_waits_until_the_margin_is_left():
    pacer = trained()
    queued = [(7 * 512, 8)]  # seven prompts: 3 ms + 43 ms
    total = 0.003 + 7 * 512 * 12e-6
    margin = max(3 * 0.003, MARGIN_SHARE * total)
    assert pacer.hold_seconds(queued, started=10.0, now=10.0) == pytest.approx(total - margin)
    assert pacer.hold_seconds(queued, started=10.0, now=10.0 + total - margin - 0.001) == pytest.approx(0.001)
    assert pacer.hold_seconds(queued, started=10.0, now=10.0 + total) == 0.0


def test_an_idle_gpu_after_a_hold_widens_the_margin_and_steady_holds_narrow_it_again():
    pacer = trained()
    queued = [(7 * 512, 8)]
    before = pacer.hold_seconds(queued, 0.0, 0.0)
    pacer.held_step_idle(0.004)
    assert pacer.margin_share == 2 * MARGIN_SHARE
    assert pacer.hold_seconds(queued, 0.0, 0.0) < before
    for _ in range(4):
        pacer.held_step_idle(0.004)
    # At most three quarters: the first quarter of a long step is still held for, and reported on.
    assert pacer.margin_share == MAX_MARGIN_SHARE
    assert pacer.hold_seconds(queued, 0.0, 0.0) == pytest.approx((1 - MAX_MARGIN_SHARE) * (0.003 + 7 * 512 * 12e-6))
    for _ in range(100):
        pacer.held_step_idle(0.0)
    assert pacer.margin_share == MARGIN_SHARE


def test_a_plan_built_after_a_hold_reports_the_gpus_wait_and_no_other_does():
    async def scenario():
        woken = asyncio.Event()
        hold = PlanHold(woken.set)
        hold.pacer = trained()
        long_step = SimpleNamespace(seqs=[ScheduledSeq(None, 0, 0, 7 * 512, [], 0, [], True)])
        hold.sent(long_step)
        assert not long_step.after_hold and long_step.prompt_tokens == 7 * 512
        assert hold.hold([long_step], started=time.monotonic() - 0.030)  # 16 of 46 ms left: ~4.5 ms past the margin
        after = SimpleNamespace(seqs=[])
        hold.sent(after)
        assert after.after_hold
        await asyncio.wait_for(woken.wait(), 1)
        hold.done(after, 0.003, gpu_idle_seconds=None)  # not timed (or after an idle engine): no verdict
        assert hold.pacer.margin_share == MARGIN_SHARE
        hold.done(after, 0.003, gpu_idle_seconds=0.002)
        assert hold.pacer.margin_share == 2 * MARGIN_SHARE
        hold.done(long_step, 0.046, gpu_idle_seconds=0.002)  # built without a hold: not its fault
        assert hold.pacer.margin_share == 2 * MARGIN_SHARE

    asyncio.run(scenario())


def test_a_backlog_that_fills_the_next_plan_is_never_held_for():
    """Waiting requests that fill the token budget or the free seats: nothing to gather."""
    by_tokens = Scheduler(num_blocks=400, block_size=4, max_model_len=256, max_num_batched_tokens=100)
    for i in range(2):
        by_tokens.add_request(prompt(i))  # 80 tokens: room for more
    assert not by_tokens.waiting_fill_a_plan()
    by_tokens.add_request(prompt(2))  # 120
    assert by_tokens.waiting_fill_a_plan()
    by_seats = Scheduler(num_blocks=400, block_size=4, max_model_len=256, max_num_seqs=2)
    by_seats.add_request(prompt(3))
    assert not by_seats.waiting_fill_a_plan()
    by_seats.add_request(prompt(4))
    assert by_seats.waiting_fill_a_plan()


# ---------------------------------------------------------------- in the engine, over a timed fake stage


class TimedStage:
    """One stage that runs plans in order, each taking DECODE_S plus PROMPT_TOKEN_S a token past
    one a sequence, and records each plan's new prompts (admissions)."""

    DECODE_S, PROMPT_TOKEN_S = 0.004, 0.0004
    num_stages = 1
    draft = draft_transport = token_transport = None

    def __init__(self):
        self.plans: asyncio.Queue = asyncio.Queue()
        self.results: asyncio.Queue = asyncio.Queue()
        self.admitted: list[int] = []  # per plan: sequences whose first chunk it carries
        self.runner = asyncio.create_task(self._run())

    def post(self, msg) -> None:
        plan = self.engine.in_flight[-1]  # (the engine appends a plan there, then posts it)
        self.plans.put_nowait((msg.step_id, plan))

    async def receive(self):
        return await self.results.get()

    def raise_if_failed(self) -> None:
        pass

    async def _run(self):
        while True:
            step_id, plan = await self.plans.get()
            tokens = sum(s.num_scheduled for s in plan.seqs)
            self.admitted.append(sum(1 for s in plan.seqs if s.num_computed == 0))
            await asyncio.sleep(self.DECODE_S + self.PROMPT_TOKEN_S * (tokens - len(plan.seqs)))
            seqs = [s for s in plan.seqs if s.sample]
            self.results.put_nowait(
                engine_pb2.StepResult(
                    step_id=step_id,
                    seq_ids=[s.seq_id for s in seqs],
                    num_tokens=[1] * len(seqs),
                    token_ids=[7] * len(seqs),
                )
            )


def prompt(i: int, length: int = 40) -> Request:
    return Request(
        f"r{i}",
        list(range(10 + i, 10 + i + length)),
        engine_pb2.SamplingOptions(seed=i),
        max_tokens=60,
        ignore_eos=True,
    )


async def arrivals_behind_a_long_prefill(pacing: bool) -> list[int]:
    """Two requests decoding; 7 arrive at once (a ~115 ms prefill step), then 8 more, 2 ms apart,
    while it runs. Returns each plan's admissions from the 7's plan on."""
    stage = TimedStage()
    engine = Engine(stage, SchedulerConfig(plan_pacing=pacing))
    engine.scheduler = Scheduler(num_blocks=2000, block_size=4, max_model_len=256, decode_lookahead=2)
    stage.engine = engine
    engine._ready.set()
    loop = asyncio.create_task(engine._engine_loop())
    try:
        first = engine.add(prompt(0))
        for _ in range(3):  # a few decode steps, then another's prefill: the pacer's estimates
            await first.next()
        second = engine.add(prompt(99))
        await second.next()
        mark = len(stage.admitted)
        for i in range(1, 8):
            engine.add(prompt(i))
        await asyncio.sleep(0.005)
        for i in range(8, 16):
            engine.add(prompt(i))
            await asyncio.sleep(0.002)
        await asyncio.sleep(0.5)
        return [n for n in stage.admitted[mark:] if n]
    finally:
        loop.cancel()
        stage.runner.cancel()


def test_arrivals_during_a_long_prefill_step_share_the_next_plan():
    assert asyncio.run(arrivals_behind_a_long_prefill(pacing=True)) == [7, 8]
    # Without pacing each arrival takes the next free plan slot: several small prefill steps.
    assert len(asyncio.run(arrivals_behind_a_long_prefill(pacing=False))) > 2
