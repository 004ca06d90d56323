"""What a valid set of sampling options is, and how the last stage reads a temperature: each rule
written once, for every boundary that checks it.

Each process checks a request's options once, where they enter it: the gateway the public
SamplingParams a client sends (fields `params.*`, rule by rule in services/gateway/validation.py),
the scheduler the internal SamplingOptions on Submit and each worker the same at plan intake, in
its sequence table (both with check_sampling_options, `sampling.*`). The sampler's SamplingTensors
checks the per-row arrays it is built from, its own inputs. They all call the functions here, so
a value one boundary accepts, the next accepts too. Each check takes a Python number or a numpy
array (every element must pass) and raises SamplingRuleError naming the field; each boundary
turns that into its own error (INVALID_ARGUMENT, PlanError, ...).
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


MAX_LOGIT_BIAS = 100.0  # biases are clamped to [-100, 100], as OpenAI's and vLLM's
MAX_BIASED_TOKENS = 1024  # logit_bias entries, allowed_token_ids, bad words' tokens: each at most this many


def check_penalty(value, field: str) -> None:
    """presence_penalty and frequency_penalty: in [-2, 2] (OpenAI's and vLLM's range)."""
    ok = (value >= -2) & (value <= 2)
    if ok is not True:
        _fail(ok, field, value, "must be in [-2, 2]")


def check_repetition_penalty(value, field: str, allow_zero: bool = False) -> None:
    """> 0 (1 is off); internally 0 means unset (off) too."""
    ok = (abs(value) < math.inf) & ((value > 0) | (allow_zero & (value == 0)))
    if ok is not True:
        _fail(ok, field, value, "must be finite and > 0")


def check_logit_bias(values, field: str) -> None:
    """Finite numbers (each is then clamped to [-100, 100])."""
    values = np.asarray(values, dtype=np.float64)
    ok = abs(values) < math.inf
    if not bool(np.all(ok)):
        _fail(ok, field, values, "values must be finite numbers")


def check_token_ids(ids, field: str, vocab_size: int | None = None, most: int = MAX_BIASED_TOKENS) -> None:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size > most:
        raise SamplingRuleError(field, f"{field} holds {ids.size} token ids; at most {most}")
    upper = vocab_size if vocab_size is not None else 2**31
    ok = (ids >= 0) & (ids < upper)
    if ids.size and not bool(np.all(ok)):
        rule = f"must be token ids in [0, {vocab_size})" if vocab_size is not None else "must be >= 0"
        _fail(ok, field, ids, rule, fmt=int)


def uses_penalties(s: engine_pb2.SamplingOptions) -> bool:
    """Whether a sequence's sampling reads per-sequence token counts or biases its logits."""
    return bool(
        s.presence_penalty
        or s.frequency_penalty
        or (s.repetition_penalty and s.repetition_penalty != 1)
        or s.logit_bias_token_ids
        or s.bad_words
        or s.allowed_token_ids
    )


def history_needed(s: engine_pb2.SamplingOptions) -> tuple[bool, bool]:
    """(whether the last stage needs a sequence's earlier tokens at admission, whether the prompt's
    too): counts for the penalties, the output for a constraint's matcher and bad words."""
    needs = uses_penalties(s) or s.constraint_kind != 0
    return needs, bool(s.repetition_penalty and s.repetition_penalty != 1)


def check_sampling_options(
    s: engine_pb2.SamplingOptions, prefix: str = "sampling.", vocab_size: int | None = None
) -> None:
    """Every rule on an internal SamplingOptions message (what the scheduler and workers receive)."""
    check_temperature(s.temperature, prefix + "temperature")
    check_top_p(s.top_p, prefix + "top_p")
    check_min_p(s.min_p, prefix + "min_p")
    check_top_k(s.top_k, prefix + "top_k")
    check_logprobs(s.logprobs, prefix + "logprobs")
    if s.HasField("prompt_logprobs"):
        check_logprobs(s.prompt_logprobs, prefix + "prompt_logprobs")
    if not uses_penalties(s) and not s.constraint_kind:
        return
    check_penalty(s.presence_penalty, prefix + "presence_penalty")
    check_penalty(s.frequency_penalty, prefix + "frequency_penalty")
    check_repetition_penalty(s.repetition_penalty, prefix + "repetition_penalty", allow_zero=True)
    if len(s.logit_bias_token_ids) != len(s.logit_bias_values):
        raise SamplingRuleError(prefix + "logit_bias_values", f"{prefix}logit_bias_values needs one value per token id")
    check_token_ids(s.logit_bias_token_ids, prefix + "logit_bias_token_ids", vocab_size)
    if len(set(s.logit_bias_token_ids)) != len(s.logit_bias_token_ids):
        raise SamplingRuleError(prefix + "logit_bias_token_ids", f"{prefix}logit_bias_token_ids must be distinct")
    check_logit_bias(list(s.logit_bias_values), prefix + "logit_bias_values")
    ok = np.abs(np.asarray(s.logit_bias_values, dtype=np.float64)) <= MAX_LOGIT_BIAS
    if not bool(np.all(ok)):
        _fail(
            ok,
            prefix + "logit_bias_values",
            list(s.logit_bias_values),
            f"must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
        )
    check_token_ids(s.allowed_token_ids, prefix + "allowed_token_ids", vocab_size)
    if len(s.bad_words) > MAX_BIASED_TOKENS or any(not w.ids for w in s.bad_words):
        raise SamplingRuleError(
            prefix + "bad_words", f"{prefix}bad_words: at most {MAX_BIASED_TOKENS} non-empty token sequences"
        )
    check_token_ids(
        [t for w in s.bad_words for t in w.ids], prefix + "bad_words", vocab_size, most=16 * MAX_BIASED_TOKENS
    )
    if s.constraint_kind not in (0, 1, 2, 3, 4):
        raise SamplingRuleError(prefix + "constraint_kind", f"{prefix}constraint_kind {s.constraint_kind} is unknown")


def is_greedy(temperature):
    """Temperatures below GREEDY_TEMPERATURE sample greedily (a float, or an array of them)."""
    return temperature < GREEDY_TEMPERATURE


def draws_unfiltered(s: engine_pb2.SamplingOptions, greedy: bool | None = None) -> bool:
    """Whether a sequence's draw takes the temperature-scaled logits as they are: no logprobs,
    and greedy or no top-k, top-p or min-p filter (penalties and grammars aside). The last stage
    then draws it inside its step graphs; several verify rounds per step need that."""
    if greedy is None:
        greedy = bool(is_greedy(np.float32(s.temperature)))
    return s.logprobs < 0 and (greedy or (s.top_k <= 0 and s.top_p >= 1 and s.min_p <= 0))


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
