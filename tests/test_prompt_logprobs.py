"""Prompt logprobs in process (issue 52): the last stage's rows against HF transformers' log-softmax
on the same weights, the scheduler's asking, gathering and delivery of the rows (chunked prefill,
the prefix cache, preemption, n > 1 siblings), and the gateway's merge that answers them first.
End to end through a cluster: tests/test_prompt_logprobs_e2e.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.prompt_logprobs import Alternative, PromptPosition, positions
from strata.services.gateway.fanout import RequestOutputState, prompt_logprobs_message
from strata.services.gateway.validation import InvalidRequest, validate_request
from strata.services.scheduler import prompt_logprobs as scheduler_rows
from strata.services.scheduler.plan_codec import plan_to_proto
from strata.services.scheduler.request import Request
from strata.services.scheduler.scheduler import Scheduler
from strata.services.worker.step.sequence_table import PlanError
from strata.v1 import engine_pb2, generate_pb2
from tests.tiny_models import cpu_runner

TOLERANCE = 1e-4


# ------------------------------------------------------------------------------ the last stage


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(shard, config, HF model) of one tiny random llama."""
    from strata.services.worker.model.weights import load_shard
    from tests.tiny_models import build_tiny_model, write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("m"), seed=3)
    shard, config = load_shard(path, 0, 1, torch.float32, "cpu")
    return shard, config, build_tiny_model(seed=3)


def _sampling(prompt_logprobs=None):
    return engine_pb2.SamplingOptions(top_p=1.0, seed=1, logprobs=-1, prompt_logprobs=prompt_logprobs)


def _hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    """HF's log_softmax at every prompt position: row p for prompt token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check_rows(want: torch.Tensor, prompt: list[int], lps, ranks, top_ids, k: int, first: int = 0) -> None:
    """Rows for positions first, first + 1, ... against HF: logprob, rank (tokens at least as
    likely), top k ids (the tiny model's logits have no ties)."""
    for i, (lp, rank) in enumerate(zip(lps, ranks)):
        p = first + i
        row = want[p]
        target = prompt[p + 1]
        assert abs(lp - row[target].item()) <= TOLERANCE, (p, lp, row[target].item())
        assert rank == int((row >= row[target]).sum())
        assert list(top_ids[i * k : (i + 1) * k]) == row.topk(k).indices.tolist()


def test_rows_equal_hf_log_softmax_in_one_step_and_in_chunks(tiny):
    """One sequence asks for its whole prompt at once, a second one in three chunks (rows from an
    offset into the first chunk, then all, then the last chunk's rows beside its sampling), and a
    third in the same steps asks nothing: each row equals HF's, and nothing is computed for the
    third."""
    shard, config, hf = tiny
    runner = cpu_runner(shard, config)
    whole, chunked, silent = list(range(5, 19)), list(range(40, 61)), [7, 8, 9, 10, 11, 12]
    k = 3
    plan = engine_pb2.StepPlan(
        step_id=1,
        new_sequences=[
            engine_pb2.NewSequence(seq_id=1, sampling=_sampling(k)),
            engine_pb2.NewSequence(seq_id=2, sampling=_sampling(0)),
            engine_pb2.NewSequence(seq_id=3, sampling=_sampling()),
        ],
        seq_ids=[1, 2, 3],
        num_computed=[0, 0, 0],
        num_scheduled=[len(whole), 8, len(silent)],
        input_token_ids=whole + chunked[:8] + silent,
        table_keep=[0, 0, 0],
        table_append_counts=[4, 6, 2],
        table_append_ids=list(range(12)),
        sample=[True, False, True],
        prompt_logprob_offsets=[0, 2, 0],
        prompt_logprob_counts=[len(whole) - 1, 6, 0],
        prompt_logprob_token_ids=whole[1:] + chunked[3:9],
    )
    result = runner.execute(plan).finish()
    rows = len(whole) - 1
    assert len(result.prompt_logprobs) == rows + 6 and len(result.prompt_top_token_ids) == rows * k
    _check_rows(
        _hf_logprobs(hf, whole),
        whole,
        result.prompt_logprobs[:rows],
        result.prompt_logprob_ranks,
        result.prompt_top_token_ids,
        k,
    )
    want = _hf_logprobs(hf, chunked)
    _check_rows(want, chunked, result.prompt_logprobs[rows:], result.prompt_logprob_ranks[rows:], (), 0, first=2)
    # Later chunks: the middle one asks every position, the last one its rows before the sampled one.
    for step, (start, end) in enumerate([(8, 16), (16, 21)], 2):
        count = min(end, len(chunked) - 1) - start
        plan = engine_pb2.StepPlan(
            step_id=step,
            seq_ids=[2],
            num_computed=[start],
            num_scheduled=[end - start],
            input_token_ids=chunked[start:end],
            table_keep=[step * 2 - 2],
            table_append_counts=[2],
            table_append_ids=[10 + step * 2, 11 + step * 2],
            sample=[end == len(chunked)],
            prompt_logprob_offsets=[0],
            prompt_logprob_counts=[count],
            prompt_logprob_token_ids=chunked[start + 1 : start + 1 + count],
        )
        result = runner.execute(plan).finish()
        _check_rows(want, chunked, result.prompt_logprobs, result.prompt_logprob_ranks, (), 0, first=start)
    # A plan that asks for nothing computes none.
    assert (
        not runner.execute(
            engine_pb2.StepPlan(
                step_id=4,
                seq_ids=[3],
                num_computed=[6],
                num_scheduled=[1],
                input_token_ids=[13],
                table_keep=[2],
                table_append_counts=[0],
                sample=[True],
            )
        )
        .finish()
        .prompt_logprobs
    )


def test_the_prompt_token_and_its_top_entry_are_the_same_float(tiny):
    """A client calls a position greedy when the prompt token's logprob equals its position's top
    one (lm-eval's is_greedy): the two must be bit-identical where the token is the top one."""
    shard, config, hf = tiny
    runner = cpu_runner(shard, config)
    prompt = [5, 6, 7, 8, 9, 10]
    want = _hf_logprobs(hf, prompt)
    greedy = [prompt[0]] + [int(want[p].argmax()) for p in range(len(prompt) - 1)]  # each token the top one
    plan = engine_pb2.StepPlan(
        step_id=1,
        new_sequences=[engine_pb2.NewSequence(seq_id=1, sampling=_sampling(2))],
        seq_ids=[1],
        num_computed=[0],
        num_scheduled=[len(prompt)],
        input_token_ids=prompt,
        table_keep=[0],
        table_append_counts=[2],
        table_append_ids=[0, 1],
        sample=[True],
        prompt_logprob_offsets=[0],
        prompt_logprob_counts=[len(prompt) - 1],
        prompt_logprob_token_ids=greedy[1:],
    )
    result = runner.execute(plan).finish()
    assert list(result.prompt_logprob_ranks) == [1] * (len(prompt) - 1)
    assert list(result.prompt_logprobs) == list(result.prompt_top_logprobs[::2])  # exactly


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(prompt_logprob_counts=[5]), "one entry per sequence"),
        (dict(prompt_logprob_offsets=[3], prompt_logprob_counts=[4, 0]), "past a sequence's scheduled tokens"),
        (dict(prompt_logprob_counts=[0, 2], prompt_logprob_token_ids=[1, 2]), "do not ask"),
        (dict(prompt_logprob_token_ids=[1, 2]), "holds 2 ids for 3 rows"),
        (dict(prompt_logprob_token_ids=[1, 2, 10**6]), "must be in"),
    ],
)
def test_a_plan_asking_rows_it_cannot_have_is_refused(tiny, change, message):
    shard, config, _ = tiny
    runner = cpu_runner(shard, config)
    fields = dict(
        step_id=1,
        new_sequences=[
            engine_pb2.NewSequence(seq_id=1, sampling=_sampling(1)),
            engine_pb2.NewSequence(seq_id=2, sampling=_sampling()),
        ],
        seq_ids=[1, 2],
        num_computed=[0, 0],
        num_scheduled=[5, 3],
        input_token_ids=[5, 6, 7, 8, 9, 5, 6, 7],
        table_keep=[0, 0],
        table_append_counts=[2, 1],
        table_append_ids=[0, 1, 2],
        sample=[True, True],
        prompt_logprob_offsets=[0, 0],
        prompt_logprob_counts=[3, 0],
        prompt_logprob_token_ids=[6, 7, 8],
    )
    fields.update(change)
    if len(fields["prompt_logprob_offsets"]) != len(fields["prompt_logprob_counts"]):
        fields["prompt_logprob_offsets"] = fields["prompt_logprob_offsets"] + [0]
    with pytest.raises(PlanError, match=message):
        runner.execute(engine_pb2.StepPlan(**fields))


# ------------------------------------------------------------------------------ the scheduler


def _request(request_id, prompt, prompt_logprobs=None, **kw):
    sampling = engine_pb2.SamplingOptions(
        temperature=0.0, top_p=1.0, seed=1, logprobs=-1, prompt_logprobs=prompt_logprobs
    )
    return Request(request_id, prompt, sampling, max_tokens=kw.pop("max_tokens", 2), **kw)


def _fake_row(position: int, k: int) -> tuple[float, int, list[int], list[float]]:
    """A row the fake last stage answers for a position (any function of it would do)."""
    return -0.5 - position, position + 1, [position + j for j in range(k)], [-0.1 * (j + 1) for j in range(k)]


def _run_step(sched: Scheduler, token: int = 3):
    """Schedules a plan, answers it as the last stage would (rows from _fake_row), and applies the
    result as the engine does: (plan message, {request_id: (new tokens, rows taken for its first
    output)})."""
    plan = sched.schedule()
    msg = plan_to_proto(plan)
    result = engine_pb2.StepResult(step_id=plan.step_id)
    for s, offset, count in zip(
        plan.seqs, msg.prompt_logprob_offsets or [0] * len(plan.seqs), msg.prompt_logprob_counts or [0] * len(plan.seqs)
    ):
        k = s.request.prompt_logprobs.num_top if count else 0
        for p in range(s.num_computed + offset, s.num_computed + offset + count):
            lp, rank, ids, tops = _fake_row(p, k)
            result.prompt_logprobs.append(lp)
            result.prompt_logprob_ranks.append(rank)
            result.prompt_top_token_ids.extend(ids)
            result.prompt_top_logprobs.extend(tops)
    if plan.asks_prompt_logprobs:
        sched.counters.prompt_logprob_positions += scheduler_rows.receive(plan, result)
    sampled = {s.seq_id: [token] for s in plan.seqs if s.sample}
    out = {}
    for upd in sched.update(plan, sampled):
        req = upd.request
        out[req.request_id] = (upd.new_token_ids, req.prompt_logprobs.take() if req.prompt_logprobs else None)
    return msg, out


def _check_delivered(rows: engine_pb2.PromptLogprobRows, prompt_len: int, k: int) -> None:
    assert rows.num_top == k and len(rows.logprobs) == prompt_len - 1
    for p in range(prompt_len - 1):
        lp, rank, ids, tops = _fake_row(p, k)
        assert (rows.logprobs[p], rows.ranks[p]) == (pytest.approx(lp), rank)
        assert list(rows.top_token_ids[p * k : (p + 1) * k]) == ids


def test_chunked_prefill_asks_every_position_once_and_the_first_output_takes_them():
    sched = Scheduler(num_blocks=64, block_size=4, max_model_len=128, max_num_batched_tokens=8)
    prompt = list(range(10, 31))  # 21 tokens: chunks of 8, 8, 5
    sched.add_request(_request("a", prompt, prompt_logprobs=2))
    sched.add_request(_request("b", list(range(50, 55))))  # asks nothing, shares the steps
    asked = []
    delivered = None
    while delivered is None:
        msg, out = _run_step(sched)
        asked += [
            (off, count)
            for off, count, sid in zip(msg.prompt_logprob_offsets, msg.prompt_logprob_counts, msg.seq_ids)
            if count
        ]
        assert "a" not in out or out["a"][1] is not None  # no token of "a" before its rows
        delivered = out.get("a", (None, None))[1]
    assert sum(count for _, count in asked) == len(prompt) - 1  # every position once
    _check_delivered(delivered, len(prompt), 2)
    _, out = _run_step(sched)
    assert out["a"][1] is None  # once
    assert sched.counters.prompt_logprob_positions == len(prompt) - 1


def test_an_asking_request_computes_its_cached_prompt_and_the_cache_serves_others():
    sched = Scheduler(num_blocks=64, block_size=4, max_model_len=128)
    prompt = list(range(10, 27))
    sched.add_request(_request("first", prompt))
    while "first" not in _run_step(sched)[1]:
        pass
    sched.add_request(_request("asker", prompt, prompt_logprobs=0))
    sched.add_request(_request("plain", prompt))
    msg, out = _run_step(sched)
    computed = dict(zip(msg.seq_ids, msg.num_computed))
    asker, plain = (sched._requests[r] for r in ("asker", "plain"))
    assert computed[asker.seq_id] == 0 and asker.num_cached_prompt_tokens == 0  # the whole prompt
    assert computed[plain.seq_id] == 16 and plain.num_cached_prompt_tokens == 16  # the cache's four blocks
    _check_delivered(out["asker"][1], len(prompt), 0)


def test_a_preempted_asker_asks_only_for_the_rows_it_lacks():
    sched = Scheduler(num_blocks=64, block_size=4, max_model_len=128, max_num_batched_tokens=6)
    prompt = list(range(10, 31))
    req = _request("a", prompt, prompt_logprobs=1)
    sched.add_request(req)
    _run_step(sched)
    _run_step(sched)  # rows of positions 0..11 received
    assert req.prompt_logprobs.received == 12
    sched._preempt(req)
    msg, _ = _run_step(sched)  # re-admitted: reads the cache below position 12 (three blocks)
    assert list(msg.num_computed) == [12] and list(msg.prompt_logprob_offsets) == [0]
    delivered = None
    while delivered is None:
        delivered = _run_step(sched)[1].get("a", (None, None))[1]
    _check_delivered(delivered, len(prompt), 1)


def test_rows_already_received_are_dropped():
    state = scheduler_rows.PromptLogprobState(num_top=1, num_rows=4)
    state.receive(0, [-1.0, -2.0], [1, 2], [7, 8], [-0.5, -0.6])
    state.receive(1, [-9.0, -3.0], [9, 3], [9, 9], [-0.9, -0.7])  # position 1 again: ignored
    assert state.logprobs == [-1.0, -2.0, -3.0] and state.top_token_ids == [7, 8, 9]
    with pytest.raises(ValueError, match="from position 5"):
        state.receive(5, [-1.0], [1], [1], [-1.0])  # a gap
    assert state.take() is None  # not complete
    state.receive(3, [-4.0], [4], [10], [-0.8])
    assert list(state.take().logprobs) == [-1.0, -2.0, -3.0, -4.0] and state.take() is None


def test_an_asking_sibling_does_not_wait_for_the_others_prompt():
    """n > 1: the asking child computes its prompt itself (it may not read another's blocks), so
    it never holds for a sibling computing it; the siblings still share its blocks."""
    sched = Scheduler(num_blocks=64, block_size=4, max_model_len=128, max_num_batched_tokens=64)
    prompt = list(range(10, 27))
    sched.add_request(_request("1_r", prompt, parent_id="r"))
    sched.add_request(_request("0_r", prompt, prompt_logprobs=3, parent_id="r"))
    msg, out = _run_step(sched)
    assert len(msg.seq_ids) == 2 and list(msg.num_computed) == [0, 0]
    _check_delivered(out["0_r"][1], len(prompt), 3)


# ------------------------------------------------------------------------------ the gateway


def _rows(prompt_len: int, k: int) -> engine_pb2.PromptLogprobRows:
    rows = engine_pb2.PromptLogprobRows(num_top=k)
    for p in range(prompt_len - 1):
        lp, rank, ids, tops = _fake_row(p, k)
        rows.logprobs.append(lp)
        rows.ranks.append(rank)
        rows.top_token_ids.extend(ids)
        rows.top_logprobs.extend(tops)
    return rows


def test_the_public_message_reads_as_the_first_token_alone_then_each_row():
    prompt = [11, 12, 13, 14]
    entries = positions(prompt_logprobs_message(prompt, _rows(4, 2)))
    assert [e.token_id for e in entries] == prompt
    assert entries[0].logprob is None and entries[0].rank == 0 and not entries[0].top
    for p, e in enumerate(entries[1:]):
        lp, rank, ids, tops = _fake_row(p, 2)
        assert (e.logprob, e.rank, [t.token_id for t in e.top]) == (pytest.approx(lp), rank, ids)


@pytest.mark.parametrize("kind", [generate_pb2.DELTA, generate_pb2.CUMULATIVE, generate_pb2.FINAL_ONLY])
def test_the_first_response_carries_the_prompt_logprobs_whatever_came_before(kind):
    """Child 1 makes progress before child 0 (the asker) brings the list: nothing goes out until
    then, and the first response holds the list and everything so far."""
    entries = generate_pb2.PromptLogprobs(token_ids=[5, 6], num_top=0, logprobs=[-1.0], ranks=[2])
    state = RequestOutputState("r", 2, kind, False, prompt_tokens=2, want_prompt_logprobs=True)
    assert state.update(1, "a", [3]) is None
    first = state.prompt_logprobs_ready(entries)
    responses = [
        first,
        state.update(0, "b", [4]),
        state.update(1, "c", [5], finish_reason="length"),
        state.update(0, "d", [6], finish_reason="stop"),
    ]
    sent = [r for r in responses if r is not None]
    assert sent[0].prompt_logprobs == entries
    assert all(not r.HasField("prompt_logprobs") for r in sent[1:])
    if kind == generate_pb2.FINAL_ONLY:
        assert len(sent) == 1 and [o.text for o in sent[0].outputs] == ["bd", "ac"]
    else:
        assert sent[0].outputs[-1].text == "a"  # child 1's progress, whole, with the list
    if kind == generate_pb2.DELTA:
        texts = {}
        for r in sent:
            for o in r.outputs:
                texts[o.index] = texts.get(o.index, "") + o.text
        assert texts == {0: "bd", 1: "ac"}


def _generate_request(**params):
    return generate_pb2.GenerateRequest(
        prompt_token_ids=generate_pb2.TokenIds(ids=[1, 2, 3]), params=generate_pb2.SamplingParams(**params)
    )


def test_prompt_logprobs_are_validated_and_asked_by_one_child():
    from strata.services.gateway.fanout import child_requests

    with pytest.raises(InvalidRequest) as e:
        validate_request(_generate_request(prompt_logprobs=21), [1, 2, 3], vocab_size=100, max_model_len=64)
    assert e.value.field == "params.prompt_logprobs" and "at most 20" in str(e.value)
    params = validate_request(_generate_request(prompt_logprobs=20, n=3), [1, 2, 3], vocab_size=100, max_model_len=64)
    children = child_requests("r", params, [1, 2, 3])
    assert [c.sampling.HasField("prompt_logprobs") for c in children] == [True, False, False]
    assert children[0].sampling.prompt_logprobs == 20
    plain = validate_request(_generate_request(), [1, 2, 3], vocab_size=100, max_model_len=64)
    assert not child_requests("r", plain, [1, 2, 3])[0].sampling.HasField("prompt_logprobs")


def test_the_response_size_bound_holds_and_refuses_past_the_limit():
    from strata.services.gateway import response_size

    prompt_len, k = 50, 20
    rows = prompt_len - 1
    widest_message = generate_pb2.PromptLogprobs(  # negative ids and the top ranks: the widest varints
        token_ids=[-1] * prompt_len,
        num_top=k,
        logprobs=[-1e-30] * rows,
        ranks=[2**32 - 1] * rows,
        top_token_ids=[-(2**31)] * (rows * k),
        top_logprobs=[-3.3e-30] * (rows * k),
    )
    widest = generate_pb2.GenerateResponse(prompt_logprobs=widest_message).ByteSize()
    assert widest <= response_size.proto_bytes(prompt_len, k) < 1.5 * widest
    response_size.check(widest, widest, "params.prompt_logprobs")
    with pytest.raises(InvalidRequest, match="max-response-bytes") as e:
        response_size.check(widest + 1, widest, "params.prompt_logprobs")
    assert e.value.field == "params.prompt_logprobs"


def test_float_equality_of_rows_survives_the_wire():
    """The worker's float32 rows, through StepResult, the scheduler's PromptLogprobRows and the
    public PromptLogprobs, stay the same floats (lm-eval compares them with ==)."""
    value = float(np.float32(-0.123456789))
    result = engine_pb2.StepResult(prompt_logprobs=[value], prompt_top_logprobs=[value])
    rows = engine_pb2.PromptLogprobRows(
        num_top=1,
        logprobs=result.prompt_logprobs,
        ranks=[1],
        top_token_ids=[2],
        top_logprobs=result.prompt_top_logprobs,
    )
    entry = positions(prompt_logprobs_message([1, 2], rows))[1]
    assert entry.logprob == entry.top[0].logprob == value


def test_every_internal_boundary_checks_the_count():
    from strata.sampling_rules import SamplingRuleError, check_sampling_options

    check_sampling_options(engine_pb2.SamplingOptions(top_p=1.0, logprobs=-1, prompt_logprobs=20))
    with pytest.raises(SamplingRuleError, match="sampling.prompt_logprobs must be at most 20"):
        check_sampling_options(engine_pb2.SamplingOptions(top_p=1.0, logprobs=-1, prompt_logprobs=21))


def test_the_json_bound_holds_for_vllms_shapes(tmp_path_factory):
    """The HTTP bound (response_size.json_bytes) against real bodies of the widest floats and ranks
    and the vocabulary's longest token texts."""
    import json

    from strata.default_model import build_tiny_tokenizer
    from strata.openai_prompts import echo_logprobs_body, prompt_logprobs_body
    from strata.services.gateway import response_size

    texts = response_size.TokenTexts(build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=384))
    longest = sorted(range(len(texts.texts)), key=texts.json_size)[-30:]
    rng = np.random.default_rng(0)
    prompt = rng.choice(longest, 40).tolist()
    k = 20

    def widest() -> float:
        return float(np.float32(-rng.uniform(1e-5, 9e-5)))  # e.g. -1.2345678629267216e-05

    entries = [PromptPosition(prompt[0], None, 0, ())] + [
        PromptPosition(t, widest(), 10**9, tuple(Alternative(longest[j], widest()) for j in range(k)))
        for t in prompt[1:]
    ]
    listed = len(json.dumps(prompt_logprobs_body(entries, texts)))
    echoed = len(json.dumps(echo_logprobs_body(entries, texts))) + sum(texts.json_size(t) for t in prompt)
    assert listed <= response_size.json_bytes(prompt, texts, k, echo=False, echo_logprobs=False)
    assert listed + echoed <= response_size.json_bytes(prompt, texts, k, echo=True, echo_logprobs=True)
