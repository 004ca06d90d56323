"""Pipelined decode over P stages (issue 29, part 2): the last stage hands its sampled tokens to
stage 0, which resolves decode lookaheads' placeholders from them, and the scheduler runs
micro-batches whose next plans go out before results come back.

- TokenIntake: tokens applied in step order at the rows of each step's sampling sequences; a step
  waits (with a deadline) only for the step its placeholders need; a closed link fails the wait.
- The token link itself over gloo (on stage 0's step thread) and over gRPC, both ends in one process.
- The scheduler with micro-batches, against a fake pipeline that executes plans in step order
  and resolves placeholders as stage 0 does: every request gets its reference tokens, plans in
  flight reach P + 1, a small load stays in one micro-batch, a large one spreads over all.
- Through real clusters: prefix groups and n > 1 on 2 stages as on one, lookahead on 2 stages.
  (Greedy equal to HF through 2 and 3 stages: test_e2e_greedy.py and test_stage_transport.py;
  seeded sampling and n > 1: test_stage_transport.py; ngram and draft speculation on 2 stages:
  test_speculative_e2e.py; a lost stage: test_recovery.py. All run with pipelined decode on.)
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from strata.protocol import PLACEHOLDER_TOKEN
from strata.services.scheduler.plan_codec import plan_to_proto
from strata.services.scheduler.request import Request
from strata.services.scheduler.scheduler import Scheduler
from strata.services.worker.transport.stage_transport import StepFailed
from strata.services.worker.transport.token_handoff import TokenIntake, TokenOutlet
from strata.services.worker.transport.token_link_ends import open_token_receiver, open_token_sender
from strata.stage_links import DISTRIBUTED, GRPC
from strata.v1 import engine_pb2, generate_pb2
from tests.cluster import collect, running_cluster, scheduler_stats, tiny_llama_dir, worker_calls

# ------------------------------------------------------------------ stage 0's intake


def _inputs(input_ids, token_rows, sample_rows):
    input_ids = np.asarray(input_ids, dtype=np.int64)
    return SimpleNamespace(
        input_ids=input_ids,
        token_rows=np.asarray(token_rows, dtype=np.int64),
        has_placeholders=bool((input_ids == PLACEHOLDER_TOKEN).any()),
        sample_rows=np.asarray(sample_rows, dtype=np.int64),
        sample_seq_ids=list(range(len(sample_rows))),
        verify=None,
    )


def test_the_intake_applies_tokens_in_step_order_and_waits_only_for_what_a_step_needs():
    last = torch.zeros(8, dtype=torch.long)
    intake = TokenIntake(last, timeout=5.0)
    intake.before_step(1, _inputs([5, 6, 7], [0, 0, 1], [0, 1]))  # rows 0 and 1 sample
    intake.before_step(2, _inputs([8, 9], [2, 3], [2, 3]))  # another micro-batch: rows 2, 3
    # Step 3 decodes row 0 and 1 ahead of their tokens: it needs step 1's, not step 2's.
    waited = threading.Event()

    def step3():
        intake.before_step(3, _inputs([PLACEHOLDER_TOKEN, PLACEHOLDER_TOKEN], [0, 1], [0, 1]))
        waited.set()

    t = threading.Thread(target=step3)
    t.start()
    time.sleep(0.2)
    assert not waited.is_set()  # step 1's tokens have not come
    intake.apply(1, torch.tensor([11, 12]))
    t.join(5)
    assert waited.is_set() and last[:2].tolist() == [11, 12] and intake.waits == 1
    intake.apply(2, torch.tensor([21, 22]))
    intake.apply(3, None)  # step 3 failed on the last stage: its rows keep their tokens
    assert last[:4].tolist() == [11, 12, 21, 22]
    # A row released and reused: the old sequence's late tokens are overwritten by the new one's
    # before any step that needs them (they come in step order).
    intake.before_step(4, _inputs([3], [0], [0]))
    intake.before_step(5, _inputs([4], [1], [1]))
    intake.apply(4, torch.tensor([40]))
    intake.apply(5, torch.tensor([50]))
    intake.before_step(6, _inputs([PLACEHOLDER_TOKEN, PLACEHOLDER_TOKEN], [0, 1], []))  # both applied: no wait
    assert last[:2].tolist() == [40, 50] and intake.waits == 1


def test_an_intake_wait_has_a_deadline_and_a_closed_link_fails_it_at_once():
    intake = TokenIntake(torch.zeros(4, dtype=torch.long), timeout=0.3)
    intake.before_step(1, _inputs([5], [0], [0]))
    start = time.monotonic()
    with pytest.raises(StepFailed, match="did not reach stage 0"):
        intake.before_step(2, _inputs([PLACEHOLDER_TOKEN], [0], [0]))
    assert time.monotonic() - start < 3
    closer = threading.Timer(0.1, intake.close)
    closer.start()
    intake2 = intake
    intake2.timeout = 30.0
    start = time.monotonic()
    with pytest.raises(StepFailed, match="token link closed"):
        intake2.before_step(3, _inputs([PLACEHOLDER_TOKEN], [0], [0]))
    assert time.monotonic() - start < 5


def test_the_outlet_hands_each_sampling_rows_token_through_a_graphs_staged_rows_or_its_own():
    """A decode graph's staged token rows stand in for the upload only where they are exactly
    the sampling rows; a step where some token does not sample (a prefill chunk) uploads its own."""
    sent = []
    sender = SimpleNamespace(send=lambda step, tokens: sent.append((step, tokens.tolist())))
    last = torch.arange(100, 116)
    outlet = TokenOutlet(last)
    decode = _inputs([1, 1, 1], [4, 9, 2], [4, 9, 2])
    decode.source_rows = None
    outlet.before_step(1, decode, torch.tensor([4, 9, 2]))
    outlet.hand(1, sender)
    chunk = _inputs([1, 1, 1], [4, 4, 7], [4, 7])  # row 4's chunk ends mid-prompt: only its last token samples
    chunk.source_rows = None
    outlet.before_step(2, chunk, torch.tensor([4, 4, 7]))
    outlet.hand(2, sender)
    drafts = _inputs([1, 1], [3, 5], [3, 5])  # tokens read from draft slots: rows differ from the staged ones
    drafts.source_rows = np.array([14, 15])
    outlet.before_step(3, drafts, torch.tensor([14, 15]))
    outlet.hand(3, sender)
    assert sent == [(1, [104, 109, 102]), (2, [104, 107]), (3, [103, 105])]


def test_the_outlet_hands_a_decode_graphs_own_tokens_only_on_its_staged_rows():
    """A decode graph that drew every token hands those tokens (no gather); where the rows are
    not the staged ones, or the draw was for another step, the gather from last_sampled stands."""
    sent = []
    sender = SimpleNamespace(send=lambda step, tokens: sent.append((step, tokens)))
    last = torch.arange(100, 116)
    outlet = TokenOutlet(last)
    decode = _inputs([1, 1, 1], [4, 9, 2], [4, 9, 2])
    decode.source_rows = None
    drawn = torch.tensor([7, 8, 9])
    outlet.before_step(1, decode, torch.tensor([4, 9, 2]))
    outlet.drawn(drawn)
    outlet.hand(1, sender)
    assert sent[-1][1] is drawn
    chunk = _inputs([1, 1, 1], [4, 4, 7], [4, 7])  # not every token samples: the rows are uploaded
    chunk.source_rows = None
    outlet.before_step(2, chunk, torch.tensor([4, 4, 7]))
    outlet.drawn(torch.tensor([1, 2, 3]))
    outlet.hand(2, sender)
    assert sent[-1][1].tolist() == [104, 107]
    outlet.before_step(3, decode, torch.tensor([4, 9, 2]))  # a step drawn eagerly: no drawn()
    outlet.hand(3, sender)
    assert sent[-1][1].tolist() == [104, 109, 102]


# ------------------------------------------------------------------ the link, both ends in one process


def _token_link(kind, emit):
    stage0 = torch.zeros(16, dtype=torch.long)
    intake = TokenIntake(stage0, timeout=20.0)
    request = engine_pb2.TokenLinkRequest(
        session=3, transport=kind, peer_address="127.0.0.1:1", transport_timeout_seconds=20.0
    )
    receiver = open_token_receiver(request, intake, max_tokens=16, vocab_size=100, slots=3)
    request.link.CopyFrom(receiver.link())
    request.send = True
    sender = open_token_sender(request, emit, device="cpu")
    return stage0, intake, receiver, sender


def _hand_steps(intake, sender, last):
    """Stage 0 launches steps 1 and 2 (rows 3, 5 and 7 sample), the last stage samples them and
    hands their tokens; step 3 fails on the last stage."""
    outlet = TokenOutlet(last)
    for step, rows, tokens in ((1, [3, 5], [42, 43]), (2, [7], [99])):
        h = _inputs([1] * len(rows), rows, rows)
        intake.before_step(step, h)
        outlet.before_step(step, h)
        last[rows] = torch.tensor(tokens)
        outlet.hand(step, sender)
    sender.send_error(3, "stage 1: boom")


def test_a_grpc_token_link_hands_each_steps_tokens_to_their_rows():
    async def main():
        loop = asyncio.get_running_loop()
        messages: asyncio.Queue = asyncio.Queue()
        stage0, intake, receiver, sender = _token_link(
            GRPC, lambda m: loop.call_soon_threadsafe(messages.put_nowait, m)
        )
        try:
            _hand_steps(intake, sender, torch.zeros(16, dtype=torch.long))
            for step in range(3):
                msg = await asyncio.wait_for(messages.get(), 30)
                assert msg.session == 3 and not msg.via_transport
                assert msg.step_id == step + 1  # in step order, the error behind the tokens
                receiver.deliver_tokens(msg)
            assert intake.applied == 3
            assert stage0[[3, 5, 7]].tolist() == [42, 43, 99]
            assert sender.bytes_sent == 3 * 8
        finally:
            sender.close()
            receiver.close()

    asyncio.run(main())


def test_a_gloo_token_link_hands_each_steps_tokens_to_their_rows_on_stage_0s_step_thread():
    """No message on the HandTokens stream: stage 0's step thread takes the announcements itself,
    before its next step, and waits for those its placeholders need."""
    emitted = []
    stage0, intake, receiver, sender = _token_link(DISTRIBUTED, emitted.append)
    try:
        _hand_steps(intake, sender, torch.zeros(16, dtype=torch.long))
        # Step 4 decodes rows 3 and 7 ahead of their tokens: it needs step 2's (3 failed).
        intake.before_step(4, _inputs([PLACEHOLDER_TOKEN, PLACEHOLDER_TOKEN], [3, 7], [3, 7]))
        assert intake.applied >= 2 and stage0[[3, 5, 7]].tolist() == [42, 43, 99]
        intake.before_step(5, _inputs([1], [9], []))  # what else arrived (step 3's error) is applied
        assert intake.applied == 3 and emitted == [] and sender.bytes_sent == 3 * 8
        sender.close()  # the last stage is gone: stage 0's wait fails at once
        start = time.monotonic()
        with pytest.raises(StepFailed, match="gone|closed"):
            intake.before_step(6, _inputs([PLACEHOLDER_TOKEN], [3], [3]))
        assert time.monotonic() - start < 5
    finally:
        sender.close()
        receiver.close()


# ------------------------------------------------------------------ the scheduler's micro-batches

VOCAB = 50


def _next_token(context: list[int]) -> int:
    return (sum(t * (i + 1) for i, t in enumerate(context[-5:])) + len(context)) % VOCAB


def _reference(req: Request, max_model_len: int) -> list[int]:
    tokens, out = list(req.prompt_token_ids), []
    limit = min(req.max_tokens, max_model_len - len(tokens))
    while len(out) < limit:
        t = _next_token(tokens)
        tokens.append(t)
        out.append(t)
        if t in req.eos_token_ids and len(out) - 1 >= req.min_tokens:  # min_tokens before a stop
            break
    return out


class FakePipeline:
    """Executes each plan when it is sent (stages run plans in step order) as stage 0 and the
    last stage would, from what goes on the wire (plan_to_proto: repeated plans are only that): a
    placeholder is the sequence's last sampled token."""

    def __init__(self):
        self.context: dict[int, list[int]] = {}
        self.last_sampled: dict[int, int] = {}

    def execute(self, plan) -> dict[int, list[int]]:
        msg = plan_to_proto(plan)
        for seq_id in msg.released_seq_ids:
            self.context.pop(seq_id, None)
        requests = {s.seq_id: s.request for s in plan.seqs}
        inputs = iter(msg.input_token_ids)
        sampled = {}
        for seq_id, num_computed, num_scheduled, sample in zip(
            msg.seq_ids, msg.num_computed, msg.num_scheduled, msg.sample
        ):
            req = requests[seq_id]
            known = self.context.get(seq_id) or (req.prompt_token_ids + req.output_token_ids)
            assert len(known) >= num_computed, "a step ran before the tokens it extends"
            step_inputs = [next(inputs) for _ in range(num_scheduled)]
            ctx = known[:num_computed] + [
                self.last_sampled[seq_id] if t == PLACEHOLDER_TOKEN else t for t in step_inputs
            ]
            self.context[seq_id] = ctx
            if sample:
                token = _next_token(ctx)
                self.last_sampled[seq_id] = token
                sampled[seq_id] = [token]
        return sampled


def _drive(sched: Scheduler, requests: list[Request], max_in_flight: int, seed: int):
    rng = random.Random(seed)
    pipe, in_flight, outputs = FakePipeline(), deque(), {}
    pending = list(requests)
    most_in_flight = 0
    micro_batches_used = set()
    for _ in range(100_000):
        while pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        if not (pending or sched.unfinished_request_ids() or in_flight):
            break
        plan = sched.schedule() if len(in_flight) < max_in_flight else None
        if plan is not None:
            # (a preempted request recomputing its output samples nothing: it has no micro-batch yet)
            decoding = {
                s.request.micro_batch for s in plan.seqs if s.sample and s.num_computed >= s.request.num_prompt_tokens
            }
            assert len(decoding) <= 1, "a plan's decodes come from one micro-batch"
            micro_batches_used |= decoding
            in_flight.append((plan, pipe.execute(plan)))
            most_in_flight = max(most_in_flight, len(in_flight))
            continue
        if not in_flight:
            continue  # requests not arrived yet
        done, sampled = in_flight.popleft()
        for upd in sched.update(done, sampled):
            outputs.setdefault(upd.request.request_id, []).extend(upd.new_token_ids)
    else:
        raise AssertionError("did not finish")
    return outputs, most_in_flight, micro_batches_used


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("num_blocks", [30, 400])
def test_micro_batches_with_lookahead_give_every_request_its_tokens(seed, num_blocks):
    """P = 2: three micro-batches, lookahead 2, up to 6 plans in flight; requests with stop
    tokens, min_tokens, max_model_len, chunked prompts, and (30 blocks) preemption."""
    rng = random.Random(seed)
    max_model_len = 64
    sched = Scheduler(
        num_blocks=num_blocks,
        block_size=4,
        max_model_len=max_model_len,
        max_num_seqs=8,
        max_num_batched_tokens=24,
        decode_lookahead=2,
        num_micro_batches=3,
        micro_batch_min_seqs=3,
    )
    requests = [
        Request(
            f"r{i}",
            [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))],
            max_tokens=rng.randint(1, 30),
            min_tokens=rng.randint(0, 3),
            eos_token_ids=frozenset({rng.randrange(VOCAB)}),
            sampling=engine_pb2.SamplingOptions(),
        )
        for i in range(40)
    ]
    reference = {r.request_id: _reference(r, max_model_len) for r in requests}
    outputs, most_in_flight, used = _drive(sched, requests, max_in_flight=6, seed=seed)
    assert outputs == reference
    stats = engine_pb2.SchedulerStats()
    sched.fill_stats(stats)
    assert stats.lookahead_decodes > 0 and most_in_flight >= 3 and used == {0, 1, 2}
    assert stats.used_kv_blocks == 0 and sched.micro_batch_seqs == [0, 0, 0]
    if num_blocks == 30:
        assert stats.preemptions > 0


def test_a_small_batch_stays_in_one_micro_batch_with_p_plus_one_plans_in_flight():
    sched = Scheduler(
        num_blocks=200, block_size=4, max_model_len=64, decode_lookahead=2, num_micro_batches=3, micro_batch_min_seqs=32
    )
    for i in range(4):
        sched.add_request(Request(f"r{i}", [1, 2, 3 + i], max_tokens=10, sampling=engine_pb2.SamplingOptions()))
    plans = [sched.schedule() for _ in range(4)]
    assert plans[3] is None  # the lone micro-batch: its first plan and two lookaheads (P + 1 = 3)
    assert [len(p.seqs) for p in plans[:3]] == [4, 4, 4]
    assert all(s.input_token_ids == [PLACEHOLDER_TOKEN] for p in plans[1:3] for s in p.seqs)
    assert sched.micro_batch_seqs == [4, 0, 0]


def test_a_lone_micro_batch_of_staggered_arrivals_stays_one_cohort_with_six_plans_allowed():
    """The engine allows 2 plans per micro-batch (6 at P = 2); a micro-batch takes at most P + 1,
    so requests that arrived at different steps still decode together, every step holding all
    of them (two alternating cohorts would read the weights twice per token)."""
    sched = Scheduler(
        num_blocks=400,
        block_size=4,
        max_model_len=128,
        decode_lookahead=2,
        num_micro_batches=3,
        micro_batch_min_seqs=32,
    )
    pipe, in_flight, sizes = FakePipeline(), deque(), []
    arrivals = [Request(f"r{i}", [1, 2, 3 + i], max_tokens=40, sampling=engine_pb2.SamplingOptions()) for i in range(8)]
    for _ in range(200):
        if arrivals:  # one arrival per scheduling round
            sched.add_request(arrivals.pop(0))
        while len(in_flight) < 6 and (plan := sched.schedule()) is not None:
            assert plan.micro_batch == 0
            sizes.append(len(plan.seqs))
            in_flight.append((plan, pipe.execute(plan)))
        if not in_flight:
            break
        sched.update(*in_flight.popleft())
    assert not sched.unfinished_request_ids()
    assert max(sched.micro_batch_plans) == 0
    # Rises as they arrive, holds all 8, falls as they finish: never two alternating cohorts.
    peak = sizes.index(8)
    assert sizes[: peak + 1] == sorted(sizes[: peak + 1]) and sizes[peak:] == sorted(sizes[peak:], reverse=True), sizes
    assert sizes.count(8) >= 25, sizes


@pytest.mark.parametrize(
    "uuids,expected",
    [(("GPU-a", "GPU-a"), 2), (("GPU-a", "GPU-b"), 4), (("", ""), 4)],
    ids=["one-shared-gpu", "a-gpu-each", "cpu-stages"],
)
def test_stages_sharing_one_gpu_run_p_micro_batches_else_p_plus_two(uuids, expected):
    from strata.services.scheduler.engine import Engine
    from strata.services.scheduler.engine_config import SchedulerConfig
    from strata.services.scheduler.pipeline import Pipeline, StageHandle

    pipeline = Pipeline(["s0:1", "s1:1"])
    pipeline.stages = [
        StageHandle(
            f"s{i}:1",
            None,
            None,
            engine_pb2.WorkerDescription(
                device="cuda:0" if u else "cpu", location=engine_pb2.WorkerLocation(device_uuid=u)
            ),
        )
        for i, u in enumerate(uuids)
    ]
    pipeline.token_transport = engine_pb2.STAGE_TRANSPORT_IPC
    engine = Engine(pipeline, SchedulerConfig())
    assert engine.pipelined and engine.num_micro_batches == expected
    assert Engine(pipeline, SchedulerConfig(pipeline_micro_batches=4)).num_micro_batches == 4


def test_a_long_prompts_chunks_follow_each_other_without_waiting_for_results():
    sched = Scheduler(
        num_blocks=200,
        block_size=4,
        max_model_len=128,
        max_num_batched_tokens=16,
        decode_lookahead=2,
        num_micro_batches=3,
    )
    sched.add_request(Request("long", list(range(1, 41)), max_tokens=4, sampling=engine_pb2.SamplingOptions()))
    plans = [sched.schedule() for _ in range(4)]
    assert [p.seqs[0].num_scheduled for p in plans[:3]] == [16, 16, 8]  # no result came back
    assert [p.seqs[0].sample for p in plans[:3]] == [False, False, True]
    assert plans[3] is None  # in P + 1 plans already
    sched.update(plans[0], {})
    assert sched.schedule() is None  # a lookahead counts on every plan in flight sampling a token
    sched.update(plans[1], {})
    (lookahead,) = sched.schedule().seqs  # then the first decode, ahead of the prompt's token
    assert lookahead.input_token_ids == [PLACEHOLDER_TOKEN] and lookahead.num_computed == 40


# ------------------------------------------------------------------ through real clusters


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, seed=17)


def _groups(vocab):
    rng = random.Random(4)
    groups = []
    for g, size in enumerate((4, 2, 6)):
        prefix = [rng.randrange(3, vocab) for _ in range(rng.randint(9, 20))]
        members = [
            generate_pb2.GenerateRequest(
                request_id=f"g{g}m{m}",
                params=generate_pb2.SamplingParams(
                    max_tokens=8,
                    ignore_eos=True,
                    output_kind=generate_pb2.DELTA,
                    temperature=0.8 * (m % 2),
                    seed=g * 10 + m,
                ),
                prompt_token_ids=generate_pb2.TokenIds(ids=[rng.randrange(3, vocab) for _ in range(rng.randint(1, 5))]),
            )
            for m in range(size)
        ]
        groups.append(generate_pb2.PrefixGroup(prefix_token_ids=generate_pb2.TokenIds(ids=prefix), members=members))
    return groups


def _workload(cluster, client):
    import grpc

    from strata.v1 import generate_pb2_grpc

    groups = _groups(client.model_info().vocab_size)
    outputs = {}
    with grpc.insecure_channel(cluster.gateway_address) as channel:
        for r in generate_pb2_grpc.GatewayStub(channel).GenerateGroups(iter(groups), timeout=120):
            assert not r.HasField("error"), r.error
            for o in r.response.outputs:
                outputs.setdefault(r.response.request_id, []).extend(o.token_ids)
    # n > 1, seeded, with a long prompt (chunked) beside them.
    outputs["n3"] = collect(
        client.generate(
            list(range(5, 90)),
            n=3,
            max_tokens=12,
            temperature=0.9,
            seed=5,
            ignore_eos=True,
            output_kind=generate_pb2.DELTA,
            timeout=120,
        )
    )

    # Plain sampled requests at once, nothing else running: a steady micro-batch whose plans
    # go out as repeats on two stages (services/scheduler/repeats.py).
    def plain(i):
        return collect(
            client.generate(
                list(range(3 + i, 12 + 2 * i)),
                max_tokens=20 + 3 * i,
                temperature=0.9,
                seed=100 + i,
                ignore_eos=True,
                output_kind=generate_pb2.DELTA,
                timeout=120,
            )
        )

    with ThreadPoolExecutor(6) as pool:
        for i, out in enumerate(pool.map(plain, range(6))):
            outputs[f"plain{i}"] = out
    return outputs


def test_prefix_groups_and_n_on_two_pipelined_stages_equal_one_stage(model_dir):
    with running_cluster(model_dir, 1, "--max-num-batched-tokens", "32") as (cluster, client):
        alone = _workload(cluster, client)
    with running_cluster(model_dir, 2, "--max-num-batched-tokens", "32") as (cluster, client):
        piped = _workload(cluster, client)
        stats = scheduler_stats(cluster)
        # A second of no requests, then one more: the stages' timelines leave the wait for
        # clients out of their idle time (StepPlan.after_idle); it is no pipeline bubble.
        time.sleep(1.0)
        collect(client.generate([5, 6, 7], max_tokens=3, ignore_eos=True, timeout=60))
        timelines = worker_calls(cluster, "GetStats", engine_pb2.WorkerStatsRequest())
    assert piped == alone
    assert stats.pipeline_stages == 2 and stats.lookahead_decodes > 0 and stats.used_kv_blocks == 0
    assert stats.repeated_plans > 0  # the real workers took repeats (a table ahead, placeholders)
    assert stats.host_seconds > 0  # the scheduler's own time on results and plans is counted
    # The loop waits for results only while plans are in flight: never longer than their round trips.
    waits = stats.wait_at_limit_seconds + stats.wait_below_limit_seconds
    assert 0 < waits < stats.plan_round_trip_seconds
    assert all(t.timed_steps > stats.steps and t.idle_seconds < 0.5 for t in timelines), timelines


def test_a_plan_is_serialized_once_for_every_stage():
    """Pipeline.post queues the same bytes for each stage's Steps stream (the raw-bytes call), not
    the message for each stream to serialize again, and each stage's writer writes them in order."""
    from strata.services.scheduler.pipeline import Pipeline, StageHandle

    writes = []

    class Call:
        async def write(self, data):
            writes.append(data)

    async def run(plans):
        pipeline = Pipeline(["s0:1", "s1:1", "s2:1"])
        pipeline.stages = [StageHandle(f"s{i}:1", None, None, engine_pb2.WorkerDescription(), Call()) for i in range(3)]
        for plan in plans:
            pipeline.post(plan)
        while len(writes) < 3 * len(plans):
            await asyncio.sleep(0)
        assert not any(s.outbox for s in pipeline.stages)

    plan = engine_pb2.StepPlan(step_id=7, seq_ids=[1, 2], num_computed=[3, 4], num_scheduled=[1, 1])
    asyncio.run(run([plan, engine_pb2.StepPlan(step_id=8)]))
    firsts = [w for w in writes if engine_pb2.StepPlan.FromString(w).step_id == 7]
    assert len(firsts) == 3 and all(w is firsts[0] for w in firsts)
    assert engine_pb2.StepPlan.FromString(firsts[0]) == plan
    assert [engine_pb2.StepPlan.FromString(w).step_id for w in writes[::3]] == [7, 8]  # in order
