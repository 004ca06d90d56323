"""What the engine delivers to each Submit stream (services/scheduler/engine.py, output_stream.py),
results applied by the fused path (one token each) and by the general one (logprobs): a DELTA
stream gets every token once, in order; a FINAL_ONLY stream one message with the request's tokens
(not those it was resumed with), also when it is aborted part-way. Pure engine and scheduler, a
fake last stage."""

from __future__ import annotations

import asyncio
import random

from strata.services.scheduler.engine import Engine
from strata.services.scheduler.engine_config import SchedulerConfig
from strata.services.scheduler.request import Request
from strata.services.scheduler.scheduler import Scheduler
from strata.v1 import engine_pb2


class _NoPipeline:
    num_stages = 1


def _result(plan, rng: random.Random) -> engine_pb2.StepResult:
    """One random token a sampling sequence; logprobs for all where one asks (as the last stage
    sends them), so those steps take the general path."""
    seqs = [s for s in plan.seqs if s.sample]
    logprobs = any(s.request.sampling.logprobs >= 0 for s in seqs)
    result = engine_pb2.StepResult(
        step_id=plan.step_id,
        seq_ids=[s.seq_id for s in seqs],
        num_tokens=[1] * len(seqs),
        token_ids=[rng.randrange(3, 500) for _ in seqs],
    )
    if logprobs:
        result.logprobs.extend([-0.5] * len(seqs))
    return result


def _request(i: int, max_tokens: int, resumed: list[int] = (), logprobs: int = -1) -> Request:
    return Request(
        f"r{i}",
        list(range(10 + i, 30 + i)),
        engine_pb2.SamplingOptions(seed=i, logprobs=logprobs),
        max_tokens=max_tokens,
        ignore_eos=True,
        output_token_ids=list(resumed),
    )


async def _run(requests, final_only, abort_at=None):
    engine = Engine(_NoPipeline(), SchedulerConfig())
    engine.scheduler = Scheduler(num_blocks=400, block_size=4, max_model_len=256, decode_lookahead=2)
    engine._ready.set()
    streams = {r.request_id: await engine.submit(r, final_only=final_only[r.request_id]) for r in requests}
    received = {r.request_id: [] for r in requests}

    async def read(rid):
        while True:
            out = await streams[rid].next()
            received[rid].append(out)
            if out.finish_reason:
                return

    readers = [asyncio.create_task(read(r.request_id)) for r in requests]
    rng = random.Random(0)
    step = 0
    while engine.streams:
        plan = engine.scheduler.schedule()
        engine.in_flight.append(plan)
        engine._deadlines.append(0.0)
        engine._finish_step(_result(plan, rng))
        step += 1
        if abort_at is not None and step == abort_at[1]:
            engine.abort(abort_at[0])
        await asyncio.sleep(0)
    await asyncio.gather(*readers)
    return received


def test_final_only_streams_send_the_requests_tokens_once_and_delta_streams_every_token():
    requests = [_request(0, 12), _request(1, 9, resumed=[7, 8, 9]), _request(2, 15), _request(3, 6, logprobs=0)]
    final_only = {"r0": True, "r1": True, "r2": False, "r3": True}
    received = asyncio.run(_run(requests, final_only))
    for req in requests:
        outs = received[req.request_id]
        tokens = [t for o in outs for t in o.token_ids]
        first = 3 if req.request_id == "r1" else 0  # a resumed request's earlier tokens went out elsewhere
        assert tokens == req.output_token_ids[first:], req.request_id
        assert len(req.output_token_ids) == req.max_tokens
        assert outs[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        if final_only[req.request_id]:
            assert len(outs) == 1, req.request_id
    assert len(received["r2"]) > 1  # (DELTA: as they come)
    # Steps with logprobs (general path) and, once r3 is done, without (fused): one a token.
    assert len(received["r3"][0].logprobs) == len(received["r3"][0].token_ids)


def test_an_aborted_final_only_stream_gets_the_tokens_so_far():
    requests = [_request(0, 40), _request(1, 40)]
    received = asyncio.run(_run(requests, {"r0": True, "r1": True}, abort_at=("r0", 6)))
    out = received["r0"][-1]
    assert out.finish_reason == engine_pb2.FINISH_REASON_ABORT
    assert 0 < len(out.token_ids) < 40 and list(out.token_ids) == requests[0].output_token_ids


def test_the_loops_waits_for_results_are_split_by_the_limit_of_plans_in_flight():
    """SchedulerStats says where plans wait: a wait for a result with the plans in flight at the
    engine's limit (more in flight would have sent more) counts apart from one below it, and each
    plan's round trip runs from its send to its result's turn."""
    import time

    from strata.services.scheduler.plan import StepPlan

    async def waits(in_flight: int) -> list[float]:
        engine = Engine(_NoPipeline(), SchedulerConfig(max_plans_in_flight=2))
        for step in range(in_flight):
            plan = StepPlan(step, [], [], [], [])
            plan.sent_at = time.monotonic()
            engine.in_flight.append(plan)
            engine._deadlines.append(30.0)
        asyncio.get_running_loop().call_later(0.05, engine._wake.set)  # a result comes
        await engine._wait_for_results()
        return engine._result_waits

    at_limit, below = asyncio.run(waits(2)), asyncio.run(waits(1))
    assert at_limit[0] >= 0.04 and at_limit[1] == 0.0
    assert below[0] == 0.0 and below[1] >= 0.04

    engine = Engine(_NoPipeline(), SchedulerConfig())
    engine.scheduler = Scheduler(num_blocks=400, block_size=4, max_model_len=256, decode_lookahead=2)
    engine.scheduler.add_request(_request(0, max_tokens=4))
    plan = engine.scheduler.schedule()
    plan.sent_at = time.monotonic() - 0.2
    engine.in_flight.append(plan)
    engine._deadlines.append(30.0)
    engine._finish_step(_result(plan, random.Random(0)))
    stats = engine.stats()
    assert 0.2 <= stats.plan_round_trip_seconds < 5.0
    assert stats.wait_at_limit_seconds == stats.wait_below_limit_seconds == 0.0
