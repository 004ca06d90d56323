"""Tensor parallelism in process: the real scheduler's plans run on one ModelRunner (T = 1) and on
two rank runners of one stage (thread ranks over gloo, tests/tp_threads.py), driven as the engine
drives them with plans in flight. Every request gets the same tokens at T = 2 as at T = 1 (float32):
greedy, seeded top-k / top-p / min-p, penalties and biases, bad words and allowed tokens, a JSON
schema, n = 4 siblings, a prefix group (cascade attention), logprobs, and speculation with prompt
lookup on the device. Through real clusters: tests/test_tensor_parallel_e2e.py."""

from __future__ import annotations

import gc
import random
from collections import deque

import pytest
import torch

from strata.services.scheduler import prompt_logprobs
from strata.services.scheduler.plan_codec import plan_to_proto, split_proposals, split_result, split_rounds
from strata.services.scheduler.request import Request
from strata.services.scheduler.scheduler import Scheduler
from strata.services.scheduler.speculation.config import SpeculativeConfig
from strata.v1 import engine_pb2, generate_pb2
from tests.tiny_models import cpu_runner
from tests.tp_threads import form_groups, run_on_threads

BLOCKS, BLOCK, MAX_LEN = 400, 4, 128


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from strata.default_model import build_tiny_tokenizer
    from tests.tiny_models import write_tiny_model

    tok = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=384)
    return write_tiny_model(tmp_path_factory.mktemp("qwen2"), arch="qwen2", seed=5, tokenizer=tok)


@pytest.fixture(scope="module")
def groups():
    made = [form_groups(2) for _ in range(2)]  # one group per speculation setting's runners
    yield made
    made.clear()
    gc.collect()  # gloo's groups go before the interpreter's exit, which they would abort


def _runner(model, group=None, k: int = 0):
    from strata.services.worker.model.weights import load_shard

    shard, config = load_shard(model, 0, 1, torch.float32, "cpu", tp=group)
    return cpu_runner(
        shard,
        config,
        num_blocks=BLOCKS,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        max_num_seqs=64,
        num_speculative_tokens=k,
        speculative_max_batch=64,
        ngram_on_device=(1, 3) if k else None,
        tokenizer_dir=str(model),
        tp=group,
    )


SCHEMA = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


def _requests(seed: int) -> list[Request]:
    rng = random.Random(seed)
    base = [rng.randrange(5, 300) for _ in range(5)]
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.9),
        dict(temperature=0.8, top_k=20),
        dict(temperature=1.0, top_p=0.8),  # whole rows gathered
        dict(temperature=1.1, top_k=30, top_p=0.7),
        dict(temperature=0.7, min_p=0.1),
        dict(temperature=0.9, presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3),
        dict(temperature=0.0, logit_bias_token_ids=[7, 8], logit_bias_values=[5.0, -100.0]),
        dict(temperature=0.9, bad_words=[generate_pb2.TokenIds(ids=[9]), generate_pb2.TokenIds(ids=[11, 12])]),
        dict(temperature=0.9, allowed_token_ids=list(range(20, 120))),
        dict(temperature=0.0, logprobs=3),
        dict(temperature=1.0, top_k=5, logprobs=2),
        dict(temperature=0.8, constraint_kind=engine_pb2.CONSTRAINT_KIND_JSON_SCHEMA, constraint=SCHEMA),
        dict(temperature=0.0, prompt_logprobs=3),
        dict(temperature=0.9, prompt_logprobs=0, logprobs=1),
    ]
    out = []
    for i, kind in enumerate(kinds):
        kind = {"top_p": 1.0, "logprobs": -1, **kind, "seed": 100 + i}
        prompt = (base * 3)[: rng.randint(4, 14)] + [rng.randrange(5, 300) for _ in range(rng.randint(0, 3))]
        out.append(Request(f"r{i}", prompt, engine_pb2.SamplingOptions(**kind), max_tokens=24, ignore_eos=True))
    siblings = base * 2 + [3]
    for j in range(4):  # n = 4 children of one sampled request
        sampling = engine_pb2.SamplingOptions(temperature=0.8, top_p=1.0, seed=50 + j, logprobs=-1)
        out.append(Request(f"{j}_p", siblings, sampling, max_tokens=20, ignore_eos=True, parent_id="p"))
    shared = [rng.randrange(5, 300) for _ in range(12)]
    for j in range(3):  # a prefix group: its shared prefix computed once, read by cascade attention
        prompt = shared + [rng.randrange(5, 300) for _ in range(2 + j)]
        sampling = engine_pb2.SamplingOptions(temperature=0.0 if j else 0.9, top_p=1.0, seed=70 + j, logprobs=-1)
        out.append(
            Request(
                f"g{j}",
                prompt,
                sampling,
                max_tokens=16,
                ignore_eos=True,
                parent_id="g",
                shared_prefix_len=12,
                group_size=3,
            )
        )
    return out


def _drive(runners, sched: Scheduler, requests: list[Request], in_flight: int):
    """The engine loop: up to in_flight plans launched on every rank at once (their collectives
    pair up), rank 0's result applied in order."""
    for req in requests:
        sched.add_request(req)
    queue = deque()
    logprobs = {}
    while sched.unfinished_request_ids() or queue:
        if len(queue) < in_flight:
            plan = sched.schedule()
            if plan is not None:
                msg = plan_to_proto(plan)
                pending = run_on_threads([lambda r=r: r.execute(msg) for r in runners])
                queue.append((plan, pending[0]))
                continue
        plan, pending = queue.popleft()
        result = pending.finish()
        assert not result.error, result.error
        if plan.asks_prompt_logprobs:
            prompt_logprobs.receive(plan, result)
        sampled, lp = split_result(result)
        for seq in plan.seqs:
            if seq.seq_id in lp:
                logprobs.setdefault(seq.request.request_id, []).extend(lp[seq.seq_id])
        proposals = split_proposals(result) if sched.spec is not None else None
        sched.update(plan, sampled, proposals, split_rounds(result) if plan.verify_rounds > 1 else None)
    bm = sched.block_manager
    assert bm.num_free_blocks == bm.num_blocks and sched.num_in_flight == 0
    for r in requests:  # the prompt's rows, as the request's first output carries them
        if r.prompt_logprobs is not None:
            rows = r.prompt_logprobs
            assert rows.complete
            entries = [(t, lp, []) for t, lp in zip(rows.ranks, rows.logprobs)]
            logprobs[f"{r.request_id} prompt"] = entries + [
                (t, lp, []) for t, lp in zip(rows.top_token_ids, rows.top_logprobs)
            ]
    return {r.request_id: list(r.output_token_ids) for r in requests}, logprobs


def _scheduler(in_flight: int, spec=None) -> Scheduler:
    return Scheduler(
        num_blocks=BLOCKS,
        block_size=BLOCK,
        max_model_len=MAX_LEN,
        max_num_seqs=32,
        max_num_batched_tokens=64,
        decode_lookahead=in_flight - 1,
        speculation=spec,
    )


def _flat(entries):
    """(token or rank, logprob, top entries) of TokenLogprobs, or such tuples as they are."""
    return [
        e if isinstance(e, tuple) else (e.token_id, e.logprob, [(t.token_id, t.logprob) for t in e.top])
        for e in entries
    ]


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "device-ngram"])
def test_two_ranks_give_the_tokens_of_one(model, groups, speculate):
    k = 3 if speculate else 0
    spec = SpeculativeConfig("ngram", k, 1, 3, max_batch=64, proposer="device") if speculate else None
    want, want_lp = _drive([_runner(model, k=k)], _scheduler(3, spec), _requests(1), 3)
    ranks = groups[int(speculate)]
    runners = run_on_threads([lambda g=g: _runner(model, g, k) for g in ranks])
    got, got_lp = _drive(runners, _scheduler(3, spec), _requests(1), 3)
    assert got == want
    assert got_lp.keys() == want_lp.keys() and want_lp
    for rid in want_lp:
        for a, b in zip(_flat(got_lp[rid]), _flat(want_lp[rid]), strict=True):
            assert a[0] == b[0] and abs(a[1] - b[1]) < 1e-5
            assert [t for t, _ in a[2]] == [t for t, _ in b[2]]
            assert all(abs(x - y) < 1e-5 for (_, x), (_, y) in zip(a[2], b[2]))
