"""A request resumed from a lost replica (EngineRequest.resume_output_token_ids): the scheduler
admits it as a preempted request and it ends with the output an uninterrupted run gives. Pure
scheduler, the fake workers of tests/test_scheduler_policy.py."""

from __future__ import annotations

import random

import pytest

from strata.services.scheduler.request import Request as SchedulerRequest
from strata.services.scheduler.scheduler import Scheduler
from strata.services.scheduler.server import request_from_proto
from strata.v1 import engine_pb2, generate_pb2
from tests.test_scheduler_policy import (
    VOCAB,
    Driver,
    assert_all_blocks_free,
    make_requests,
    reference_output,
    stats_of,
)

MAX_MODEL_LEN = 128


def scheduler(**kw) -> Scheduler:
    return Scheduler(num_blocks=200, block_size=4, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=48, **kw)


def resumed_copy(req: SchedulerRequest, output: list[int]) -> SchedulerRequest:
    """The request as the gateway resubmits it elsewhere: its own fields, the output so far."""
    return SchedulerRequest(
        req.request_id,
        req.prompt_token_ids,
        req.sampling,
        max_tokens=req.max_tokens,
        min_tokens=req.min_tokens,
        stop_token_ids=req.stop_token_ids,
        eos_token_ids=req.eos_token_ids,
        parent_id=req.parent_id,
        output_token_ids=list(output),
    )


@pytest.mark.parametrize("pipeline", [1, 3])
def test_resumed_requests_finish_with_the_uninterrupted_output(pipeline):
    rng = random.Random(5)
    requests = make_requests(rng, 10, max_prompt=30, max_tokens=40, eos_token_ids={7}, stop_token_ids={11})
    for r in requests[:4]:  # a family: n > 1 siblings sharing their prompt
        r.parent_id, r.prompt_token_ids = "family", list(requests[0].prompt_token_ids)
    for r in requests[::3]:
        r.min_tokens = 5
    lost = scheduler(max_num_seqs=4)  # some wait: they resume with nothing streamed
    for r in requests:
        lost.add_request(r)
    driver = Driver(lost, pipeline=pipeline)
    for _ in range(25):  # part-way: some finished, some mid-prompt, most mid-output
        driver.step()
    streamed = {r.request_id: list(driver.outputs.get(r.request_id, [])) for r in requests}
    unfinished = [r for r in requests if r.request_id not in driver.finish]
    assert any(streamed[r.request_id] for r in unfinished) and any(not streamed[r.request_id] for r in unfinished)

    resumed = [resumed_copy(r, streamed[r.request_id]) for r in unfinished]
    replica = scheduler()
    for r in resumed:
        replica.add_request(r)
    assert stats_of(replica).resumed_requests == sum(1 for r in resumed if r.output_token_ids)
    assert stats_of(replica).waiting_tokens == sum(r.num_tokens for r in resumed)
    driver = Driver(replica, pipeline=pipeline)
    driver.outputs = {r.request_id: list(r.output_token_ids) for r in resumed}
    driver.run()
    for r in resumed:
        out, reason = reference_output(r, MAX_MODEL_LEN)
        assert r.output_token_ids == out and driver.finish[r.request_id] == reason, r.request_id
    assert_all_blocks_free(replica, driver.workers)


def test_running_tokens_count_prompt_and_output():
    sched = scheduler()
    req = make_requests(random.Random(1), 1, max_prompt=10, max_tokens=20)[0]
    req = resumed_copy(req, [3] * min(5, req.max_tokens - 1))
    sched.add_request(req)
    Driver(sched).step()
    stats = stats_of(sched)
    assert stats.running_tokens == req.num_tokens and stats.waiting_tokens == 0


def test_resumed_output_must_leave_a_token_to_generate():
    sched = scheduler()
    req = make_requests(random.Random(2), 1, max_prompt=10, max_tokens=6)[0]
    with pytest.raises(ValueError, match="none to generate"):
        sched.add_request(resumed_copy(req, [1] * req.max_tokens))
    sched.add_request(resumed_copy(req, [1] * (req.max_tokens - 1)))  # one to go: fine


def test_the_scheduler_checks_resumed_tokens_at_its_boundary():
    info = generate_pb2.ModelInfo(vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN)
    sampling = engine_pb2.SamplingOptions(temperature=1.0, top_p=1.0, logprobs=-1)
    msg = engine_pb2.EngineRequest(request_id="r", prompt_token_ids=[1, 2, 3], sampling=sampling)
    msg.stop.max_tokens = 4
    msg.resume_output_token_ids[:] = [5, 6, 7]
    assert request_from_proto(msg, info).output_token_ids == [5, 6, 7]
    msg.resume_output_token_ids[:] = [5, 6, VOCAB]
    with pytest.raises(ValueError, match="resume_output_token_ids must be in"):
        request_from_proto(msg, info)
    msg.resume_output_token_ids[:] = [5, 6, 7, 8]
    with pytest.raises(ValueError, match="fewer than stop.max_tokens"):
        request_from_proto(msg, info)
