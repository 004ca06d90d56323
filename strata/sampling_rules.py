"""What a valid set of sampling options is, and how the last stage reads a temperature: each rule
written once, for every boundary that checks it.

The gateway checks the public SamplingParams (fields `params.*`), the scheduler and each worker
the internal SamplingOptions (`sampling.*`) they are sent, the sampler its per-row arrays. They
all call the functions here, so a value one boundary accepts, the next accepts too. Each check
takes a Python number or a numpy array (every element must pass) and raises SamplingRuleError
naming the field; each boundary turns that into its own error (INVALID_ARGUMENT, PlanError, ...).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from strata.protocol import GREEDY_TEMPERATURE, MAX_LOGPROBS

if TYPE_CHECKING:
    from strata.v1 import engine_pb2


class SamplingRuleError(ValueError):
    """A sampling option out of its range; `field` is its name as the boundary calls it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def fmt_float(value: float) -> str:
    # Proto floats are float32: print 1.1, not 1.100000023841858.
    return f"{value:.7g}"


def _fail(ok, field: str, value, rule: str, fmt=fmt_float) -> None:
    """Raises unless ok (a boolean array, or a numpy bool: all true); names the first bad value.
    The checks call it only when ok is not the Python True a valid scalar gives."""
    if ok is not False and bool(np.all(ok)):
        return
    if isinstance(ok, np.ndarray) and ok.ndim:
        value = np.asarray(value).reshape(-1)[np.argmin(ok.reshape(-1))]
    raise SamplingRuleError(field, f"{field} {rule}, got {fmt(value)}")


# Each rule is written with operators that numpy arrays and Python numbers share: abs(x) < inf is
# "finite" (NaN compares false), and & joins two comparisons element by element.


def check_temperature(temperature, field: str = "temperature") -> None:
    ok = (abs(temperature) < math.inf) & (temperature >= 0)
    if ok is not True:
        _fail(ok, field, temperature, "must be finite and >= 0")


def check_top_p(top_p, field: str = "top_p") -> None:
    ok = (top_p > 0) & (top_p <= 1)  # NaN fails too
    if ok is not True:
        _fail(ok, field, top_p, "must be in (0, 1]")


def check_min_p(min_p, field: str = "min_p") -> None:
    ok = (min_p >= 0) & (min_p <= 1)
    if ok is not True:
        _fail(ok, field, min_p, "must be in [0, 1]")


def check_top_k(top_k, field: str = "top_k", allow_minus_one: bool = False) -> None:
    """0 is off; the public API also takes -1 for off (vLLM's spelling), which the gateway
    resolves to 0 before anything internal sees it."""
    lowest = -1 if allow_minus_one else 0
    ok = top_k >= lowest
    if ok is not True:
        _fail(ok, field, top_k, f"must be {'-1, ' if allow_minus_one else ''}0 (off) or positive", fmt=int)


def check_logprobs(logprobs, field: str = "logprobs", most: int = MAX_LOGPROBS) -> None:
    """Top logprobs per token: at most `most`; internally -1 means none (the public field is
    unset instead)."""
    ok = logprobs <= most
    if ok is not True:
        _fail(ok, field, logprobs, f"must be at most {most}", fmt=int)
    ok = logprobs >= -1
    if ok is not True:
        _fail(ok, field, logprobs, "must be -1 (none) or more", fmt=int)


def check_sampling_options(s: engine_pb2.SamplingOptions, prefix: str = "sampling.") -> None:
    """Every rule on an internal SamplingOptions message (what the scheduler and workers receive)."""
    check_temperature(s.temperature, prefix + "temperature")
    check_top_p(s.top_p, prefix + "top_p")
    check_min_p(s.min_p, prefix + "min_p")
    check_top_k(s.top_k, prefix + "top_k")
    check_logprobs(s.logprobs, prefix + "logprobs")


def is_greedy(temperature):
    """Temperatures below GREEDY_TEMPERATURE sample greedily (a float, or an array of them)."""
    return temperature < GREEDY_TEMPERATURE


def greedy_and_inverse_temperature(temperature):
    """(greedy, 1 / T) of float32 temperatures, 1 / T = 1 where greedy: the factor the last stage
    scales logits by, in float32 wherever it is derived. An array gives arrays; a numpy float32
    (one sequence's admission, where numpy's array calls would cost several times the
    arithmetic) gives a bool and a float32."""
    if not isinstance(temperature, np.ndarray):
        greedy = bool(is_greedy(temperature))
        return greedy, np.float32(1.0) / (np.float32(1.0) if greedy else temperature)
    temperature = temperature.astype(np.float32, copy=False)
    greedy = is_greedy(temperature)
    return greedy, np.float32(1.0) / np.where(greedy, np.float32(1.0), temperature)
