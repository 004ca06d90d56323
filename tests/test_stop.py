"""check_stop, the scheduler's stop rules as one pure function, against a plain reading of them."""

import random

from strata.services.scheduler.request import Request, RequestStatus
from strata.services.scheduler.stop import check_stop
from strata.v1 import engine_pb2


def reference(req, num_output, tokens):
    """The documented rules, token by token: min_tokens before any stop, eos unless ignore_eos,
    stop_token_ids (reported), then the length; tokens after the end are dropped."""
    for i, token in enumerate(tokens):
        stop_allowed = num_output + i >= req.min_tokens
        if stop_allowed and not req.ignore_eos and token in req.eos_token_ids:
            return i + 1, RequestStatus.FINISHED_STOPPED, None
        if stop_allowed and token in req.stop_token_ids:
            return i + 1, RequestStatus.FINISHED_STOPPED, token
        if num_output + i + 1 >= req.max_output_tokens:
            return i + 1, RequestStatus.FINISHED_LENGTH, None
    return len(tokens), None, None


def test_check_stop_follows_the_rules_and_changes_nothing():
    rng = random.Random(0)
    outcomes = set()
    for _ in range(5000):
        req = Request(
            "r",
            [1, 2, 3],
            engine_pb2.SamplingOptions(),
            max_tokens=rng.randint(1, 8),
            min_tokens=rng.randint(0, 3),
            stop_token_ids=rng.choice([[], [4], [4, 5]]),
            eos_token_ids=rng.choice([[], [0]]),
            ignore_eos=rng.random() < 0.3,
        )
        req.max_output_tokens = req.max_tokens
        num_output = rng.randint(0, req.max_tokens - 1)
        tokens = [rng.randrange(7) for _ in range(rng.randint(1, 4))]
        before = (list(tokens), req.status, req.stop_token_id)
        got = check_stop(req, num_output, tokens)
        assert got == reference(req, num_output, tokens), (req, num_output, tokens)
        assert (tokens, req.status, req.stop_token_id) == before
        outcomes.add((got[1], got[2] is not None, got[0] < len(tokens)))
    # Every kind of ending was seen, with and without tokens dropped after it.
    assert (None, False, False) in outcomes
    assert (RequestStatus.FINISHED_STOPPED, True, True) in outcomes
    assert (RequestStatus.FINISHED_STOPPED, False, True) in outcomes
    assert (RequestStatus.FINISHED_LENGTH, False, False) in outcomes
