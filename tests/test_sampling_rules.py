"""The sampling rules (strata.sampling_rules) agree at every boundary that checks them: the
gateway's public SamplingParams, the scheduler's and the worker's internal SamplingOptions and
the sampler's per-row arrays accept and reject the same values, each naming the field."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strata.protocol import MAX_LOGPROBS
from strata.sampling_rules import SamplingRuleError, greedy_and_inverse_temperature
from strata.services.gateway.validation import InvalidRequest, validate_request
from strata.services.scheduler.server import request_from_proto
from strata.services.worker.sampling.sampler import SamplingTensors
from strata.services.worker.step.sequence_table import PlanError, SequenceTable
from strata.v1 import engine_pb2, generate_pb2

GOOD = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, logprobs=-1)
CASES = [  # (field, value, valid)
    ("temperature", 0.0, True),
    ("temperature", 1e-6, True),
    ("temperature", 0.7, True),
    ("temperature", -0.1, False),
    ("temperature", math.nan, False),
    ("temperature", math.inf, False),
    ("top_p", 0.5, True),
    ("top_p", 0.0, False),
    ("top_p", 1.5, False),
    ("top_p", math.nan, False),
    ("min_p", 1.0, True),
    ("min_p", -0.1, False),
    ("min_p", 1.5, False),
    ("min_p", math.nan, False),
    ("top_k", 5, True),
    ("top_k", -2, False),
    ("logprobs", MAX_LOGPROBS, True),
    ("logprobs", MAX_LOGPROBS + 1, False),
]


def _gateway(field, value):
    params = {} if field == "logprobs" and value < 0 else {field: value}
    req = generate_pb2.GenerateRequest(
        prompt_token_ids=generate_pb2.TokenIds(ids=[1, 2]), params=generate_pb2.SamplingParams(**params)
    )
    return validate_request(req, [1, 2], vocab_size=100, max_model_len=64)


def _scheduler(options):
    msg = engine_pb2.EngineRequest(
        request_id="r", prompt_token_ids=[1, 2], sampling=options, stop=engine_pb2.StopCriteria(max_tokens=4)
    )
    return request_from_proto(msg, generate_pb2.ModelInfo(vocab_size=100, max_model_len=64))


def _worker(options):
    SequenceTable(2, 4).add(engine_pb2.NewSequence(seq_id=1, sampling=options))


def _sampler(field, value):
    settings = {**GOOD, field: value}
    SamplingTensors.prepare(
        [settings["temperature"]] * 2,
        [settings["top_k"]] * 2,
        [1.0, settings["top_p"]],
        [0.0, settings["min_p"]],
        [1, 2],
        [0, 0],
        -1,
    )


@pytest.mark.parametrize("field,value,valid", CASES, ids=[f"{f}={v}" for f, v, _ in CASES])
def test_every_boundary_applies_the_same_rule(field, value, valid):
    options = engine_pb2.SamplingOptions(**{**GOOD, field: value})
    boundaries = [
        ("gateway", lambda: _gateway(field, value), InvalidRequest, "params." + field),
        ("scheduler", lambda: _scheduler(options), ValueError, "sampling." + field),
        ("worker", lambda: _worker(options), PlanError, "sampling." + field),
    ]
    if field in ("temperature", "top_p", "min_p"):  # the sampler's arrays carry these three
        boundaries.append(("sampler", lambda: _sampler(field, value), SamplingRuleError, field))
    for name, call, error, named in boundaries:
        if valid:
            call()
        else:
            with pytest.raises(error) as info:
                call()
            assert named in str(info.value), (name, str(info.value))


def test_public_minus_one_top_k_is_off():
    assert _gateway("top_k", -1).top_k == 0
    with pytest.raises(ValueError, match="sampling.top_k"):
        _scheduler(engine_pb2.SamplingOptions(**{**GOOD, "top_k": -1}))


def test_greedy_and_inverse_temperature_agree_for_rows_and_arrays():
    temps = np.array([0.0, 1e-6, 1e-5, 0.3, 1.0, 1.7], dtype=np.float32)
    greedy, inverse = greedy_and_inverse_temperature(temps)
    assert greedy.tolist() == [True, True, False, False, False, False]
    for t, g, inv in zip(temps, greedy, inverse):
        row_greedy, row_inverse = greedy_and_inverse_temperature(t)
        assert row_greedy is bool(g) and row_inverse.dtype == np.float32 and row_inverse == inv
    assert inverse[0] == 1 and inverse[3] == np.float32(1) / np.float32(0.3)
    table = SequenceTable(len(temps), 1)
    for i, t in enumerate(temps):
        table.add(engine_pb2.NewSequence(seq_id=i, sampling=engine_pb2.SamplingOptions(temperature=t, top_p=1.0)))
    arrays, _ = SamplingTensors.prepare(temps, [0] * 6, [1.0] * 6, [0.0] * 6, range(6), [0] * 6, -1)
    rows = table.lookup(list(range(len(temps))))
    assert np.array_equal(table.inv_temperature[rows], arrays["inv_temperature"])
    assert np.array_equal(table.greedy[rows].astype(bool), greedy)
    assert np.array_equal(arrays["greedy"], greedy)


def test_a_constraint_is_parsed_once_per_process():
    """The gateway checks each request's constraint and the last stage compiles it: in either
    process a schema that many requests share is parsed once, and a refused one names the field
    each caller gives."""
    from strata import constraints

    schema = '{"type": "object", "properties": {"parsed_once": {"type": "integer"}}}'
    kind = engine_pb2.CONSTRAINT_KIND_JSON_SCHEMA
    before = constraints._parse.cache_info()
    first = constraints.grammar(kind, schema, "params.json_schema")
    again = constraints.grammar(kind, schema, "constraint")
    after = constraints._parse.cache_info()
    assert again is first
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 1)
    for field in ("params.regex", "structured_outputs.regex"):
        with pytest.raises(SamplingRuleError) as info:
            constraints.grammar(engine_pb2.CONSTRAINT_KIND_REGEX, "a{2000}", field)
        assert info.value.field == field and str(info.value).startswith(field + " repeats more than")
