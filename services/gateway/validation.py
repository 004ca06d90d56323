"""Check a public GenerateRequest and resolve its defaults, once, for the whole system.

Everything a client can get wrong is caught here, before anything reaches the scheduler, and
reported as InvalidRequest naming the offending field (the servicer turns it into
INVALID_ARGUMENT). The result, ValidatedParams, is what the gateway works from; it builds the
internal messages the scheduler and the workers read (SamplingOptions, StopCriteria).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from strata import constraints, sampling_rules
from strata.flags import DEFAULTS
from strata.protocol import MAX_LOGPROBS
from strata.v1 import engine_pb2, generate_pb2

# The public API's defaults (as vLLM's SamplingParams), defined here only.
DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
_OUTPUT_KINDS = frozenset(generate_pb2.OutputKind.values())


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, each a `strata gateway` flag: rejected with a clear
    INVALID_ARGUMENT before it costs much (a prompt's length is checked before it is tokenized)."""

    max_prompt_chars: int = 0  # 0: 32 characters per token of the model's context
    max_stop_strings: int = 32
    max_stop_length: int = 1024
    # The largest response message the prompt's part may make (prompt logprobs, an echoed prompt),
    # estimated before the request is admitted (response_size.py).
    max_response_bytes: int = DEFAULTS["max_response_bytes"]
    max_completion_prompts: int = DEFAULTS["max_completion_prompts"]  # prompts in one /v1/completions request

    def prompt_chars(self, max_model_len: int) -> int:
        return self.max_prompt_chars or 32 * max_model_len


class InvalidRequest(ValueError):
    """A client error; `field` is the request field at fault (e.g. "params.top_p")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class ValidatedParams:
    """SamplingParams with every default resolved; what the gateway works from."""

    n: int
    temperature: float  # 0.0: greedy
    top_p: float  # 1.0: off
    top_k: int  # 0: off
    min_p: float  # 0.0: off
    seed: int | None  # the user's seed; children get seed + i
    max_tokens: int
    min_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None  # None: no logprobs; k: the sampled token's plus the top k
    output_kind: int  # generate_pb2.OutputKind value
    skip_special_tokens: bool
    # Penalties, biases and the constraint, as SamplingOptions carries them (off by default).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias clamped to [-100, 100])
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences
    allowed_token_ids: tuple[int, ...] = ()
    constraint_kind: int = 0  # engine_pb2.ConstraintKind
    constraint: str = ""
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob and the top k

    def sampling_options(self, seed: int, prompt_logprobs: bool = True) -> engine_pb2.SamplingOptions:
        """What the last stage needs to sample one child (seed: the child's own). prompt_logprobs:
        this child computes the prompt logprobs asked (one child of n does, for all of them)."""
        asks = prompt_logprobs and self.prompt_logprobs is not None
        return engine_pb2.SamplingOptions(
            prompt_logprobs=self.prompt_logprobs if asks else None,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            seed=seed,
            logprobs=-1 if self.logprobs is None else self.logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=0.0 if self.repetition_penalty == 1 else self.repetition_penalty,
            logit_bias_token_ids=[t for t, _ in self.logit_bias],
            logit_bias_values=[b for _, b in self.logit_bias],
            bad_words=[generate_pb2.TokenIds(ids=w) for w in self.bad_words],
            allowed_token_ids=self.allowed_token_ids,
            constraint_kind=self.constraint_kind,
            constraint=self.constraint,
        )

    def stop_criteria(self, eos_token_ids: Sequence[int]) -> engine_pb2.StopCriteria:
        """When the scheduler ends a child (stop strings stay with the gateway)."""
        return engine_pb2.StopCriteria(
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids,
            eos_token_ids=eos_token_ids,
            ignore_eos=self.ignore_eos,
        )


def _sampling_rule(check, value, field: str, **kw) -> None:
    """One of the sampling rules every boundary shares (strata.sampling_rules), on a public field."""
    try:
        check(value, field, **kw)
    except sampling_rules.SamplingRuleError as e:
        raise InvalidRequest(e.field, e.message) from None


def _check_token_ids(field: str, ids: Sequence[int], vocab_size: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        bad = next(i for i in ids if not 0 <= i < vocab_size)
        raise InvalidRequest(field, f"{field} must be in [0, {vocab_size}), got {bad}")


def _check_prompt(req: generate_pb2.GenerateRequest, prompt_token_ids: Sequence[int], vocab_size: int) -> str:
    """Validate the prompt; return the name of the field it came in."""
    which = req.WhichOneof("prompt_input")
    field = "prompt_token_ids" if which == "prompt_token_ids" else "prompt"
    if which is None:
        raise InvalidRequest("prompt", "prompt or prompt_token_ids is required")
    if (which == "prompt" and not req.prompt) or not prompt_token_ids:
        raise InvalidRequest(field, f"{field} must not be empty")
    _check_token_ids(field, prompt_token_ids, vocab_size)
    return field


def _resolve_max_tokens(
    params: generate_pb2.SamplingParams, prompt_field: str, prompt_len: int, max_model_len: int
) -> int:
    room = max_model_len - prompt_len
    if room < 1:
        raise InvalidRequest(
            prompt_field,
            f"{prompt_field} is {prompt_len} tokens; the model's context is {max_model_len} "
            "tokens and at least one must remain for the output",
        )
    if not params.HasField("max_tokens"):
        # An unset max_tokens is a default, not a demand: shrink it to fit (and grow it to
        # honour min_tokens) instead of failing.
        return min(max(DEFAULT_MAX_TOKENS, params.min_tokens), room)
    if params.max_tokens == 0:
        raise InvalidRequest("params.max_tokens", "params.max_tokens must be at least 1, got 0")
    if params.max_tokens > room:
        raise InvalidRequest(
            "params.max_tokens",
            f"params.max_tokens is {params.max_tokens} but the prompt is {prompt_len} tokens "
            f"and the model's context is {max_model_len} tokens (at most {room} may be asked)",
        )
    return params.max_tokens


def validate_request(
    req: generate_pb2.GenerateRequest,
    prompt_token_ids: Sequence[int],
    *,
    vocab_size: int,
    max_model_len: int,
    max_n: int = 256,
    max_logprobs: int = MAX_LOGPROBS,
    max_stop_strings: int = 32,
    max_stop_length: int = 1024,
    encode: Callable[[str], list[int]] | None = None,
) -> ValidatedParams:
    """Check `req` (whose prompt tokenizes to `prompt_token_ids`) and resolve its defaults.
    encode: text -> token ids without special tokens (the tokenizer's), for bad_words.

    Raises InvalidRequest naming the first bad field.
    """
    prompt_field = _check_prompt(req, prompt_token_ids, vocab_size)
    p = req.params

    temperature = p.temperature if p.HasField("temperature") else DEFAULT_TEMPERATURE
    _sampling_rule(sampling_rules.check_temperature, temperature, "params.temperature")
    if sampling_rules.is_greedy(temperature):
        temperature = 0.0

    top_p = p.top_p if p.HasField("top_p") else DEFAULT_TOP_P
    _sampling_rule(sampling_rules.check_top_p, top_p, "params.top_p")
    _sampling_rule(sampling_rules.check_top_k, p.top_k, "params.top_k", allow_minus_one=True)
    _sampling_rule(sampling_rules.check_min_p, p.min_p, "params.min_p")

    n = p.n or 1
    if n > max_n:
        raise InvalidRequest("params.n", f"params.n must be at most {max_n}, got {n}")

    max_tokens = _resolve_max_tokens(p, prompt_field, len(prompt_token_ids), max_model_len)
    if p.min_tokens > max_tokens:
        raise InvalidRequest(
            "params.min_tokens",
            f"params.min_tokens ({p.min_tokens}) must not exceed max_tokens ({max_tokens})",
        )

    logprobs = p.logprobs if p.HasField("logprobs") else None
    if logprobs is not None:
        _sampling_rule(sampling_rules.check_logprobs, logprobs, "params.logprobs", most=max_logprobs)
    prompt_logprobs = p.prompt_logprobs if p.HasField("prompt_logprobs") else None
    if prompt_logprobs is not None:
        _sampling_rule(sampling_rules.check_logprobs, prompt_logprobs, "params.prompt_logprobs", most=max_logprobs)

    if any(s == "" for s in p.stop):
        raise InvalidRequest("params.stop", "params.stop must not contain empty strings")
    if len(p.stop) > max_stop_strings:
        raise InvalidRequest("params.stop", f"params.stop holds {len(p.stop)} strings; at most {max_stop_strings}")
    if any(len(s) > max_stop_length for s in p.stop):
        raise InvalidRequest("params.stop", f"params.stop strings must be at most {max_stop_length} characters")
    if len(p.stop_token_ids) > max_stop_strings:
        raise InvalidRequest("params.stop_token_ids", f"params.stop_token_ids holds at most {max_stop_strings} ids")
    _check_token_ids("params.stop_token_ids", p.stop_token_ids, vocab_size)

    if p.output_kind not in _OUTPUT_KINDS:
        raise InvalidRequest(
            "params.output_kind",
            f"params.output_kind must be CUMULATIVE, DELTA or FINAL_ONLY, got {p.output_kind}",
        )

    controls = _sampling_controls(p, vocab_size, encode)
    return ValidatedParams(
        n=n,
        temperature=temperature,
        top_p=top_p,
        top_k=max(p.top_k, 0),
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=max_tokens,
        min_tokens=p.min_tokens,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=logprobs,
        output_kind=p.output_kind,
        skip_special_tokens=p.skip_special_tokens,
        prompt_logprobs=prompt_logprobs,
        **controls,
    )


def bad_words_token_ids(words: Sequence[str], encode: Callable[[str], list[int]]) -> list[list[int]]:
    """Each bad word's token sequences, as vLLM tokenizes them: the word as written (stripped of
    leading spaces) and, when that tokenizes to a new first token of the same length, with one
    leading space (a word in the middle of a text)."""
    out = []
    for word in words:
        plain = encode(word.lstrip())
        if plain:
            out.append(plain)
        spaced = encode(" " + word.lstrip())
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


def _sampling_controls(p: generate_pb2.SamplingParams, vocab_size: int, encode) -> dict:
    """Penalties, biases and the constraint of public params, checked (ValidatedParams' fields)."""
    out: dict = {}
    _sampling_rule(sampling_rules.check_penalty, p.presence_penalty, "params.presence_penalty")
    _sampling_rule(sampling_rules.check_penalty, p.frequency_penalty, "params.frequency_penalty")
    out["presence_penalty"], out["frequency_penalty"] = p.presence_penalty, p.frequency_penalty
    if p.HasField("repetition_penalty"):
        _sampling_rule(sampling_rules.check_repetition_penalty, p.repetition_penalty, "params.repetition_penalty")
        out["repetition_penalty"] = p.repetition_penalty
    if p.logit_bias:
        items = sorted(p.logit_bias.items())
        _sampling_rule(
            sampling_rules.check_token_ids, [t for t, _ in items], "params.logit_bias", vocab_size=vocab_size
        )
        _sampling_rule(sampling_rules.check_logit_bias, [b for _, b in items], "params.logit_bias")
        limit = sampling_rules.MAX_LOGIT_BIAS
        out["logit_bias"] = tuple((t, min(max(b, -limit), limit)) for t, b in items)
    if p.allowed_token_ids:
        _sampling_rule(
            sampling_rules.check_token_ids, p.allowed_token_ids, "params.allowed_token_ids", vocab_size=vocab_size
        )
        out["allowed_token_ids"] = tuple(sorted(set(p.allowed_token_ids)))
    if p.bad_words:
        if encode is None:
            raise InvalidRequest("params.bad_words", "params.bad_words needs the gateway's tokenizer")
        if len(p.bad_words) > 256 or any(not w.strip() or len(w) > 1024 for w in p.bad_words):
            raise InvalidRequest("params.bad_words", "params.bad_words: at most 256 non-blank words of 1024 characters")
        out["bad_words"] = tuple(tuple(ids) for ids in bad_words_token_ids(p.bad_words, encode))
    which = p.WhichOneof("constraint")
    if which is not None:
        field_name = f"params.{which}"
        if which == "choice":
            _sampling_rule(constraints.check_choices, list(p.choice.choices), field_name)
            kind, text = engine_pb2.CONSTRAINT_KIND_GRAMMAR, constraints.choice_grammar(p.choice.choices)
        elif which == "json_object":
            if not p.json_object:
                raise InvalidRequest(field_name, f"{field_name} must be true when set")
            kind, text = engine_pb2.CONSTRAINT_KIND_JSON_OBJECT, ""
        else:
            kind = {
                "json_schema": engine_pb2.CONSTRAINT_KIND_JSON_SCHEMA,
                "regex": engine_pb2.CONSTRAINT_KIND_REGEX,
                "grammar": engine_pb2.CONSTRAINT_KIND_GRAMMAR,
            }[which]
            text = getattr(p, which)
        try:  # parsing is cheap (the worker compiles it against the tokenizer)
            constraints.grammar(kind, text, field_name)
        except sampling_rules.SamplingRuleError as e:
            raise InvalidRequest(e.field, e.message) from None
        out["constraint_kind"], out["constraint"] = kind, text
    return out


def top_level_field_size(raw: bytes, field_number: int) -> int:
    """The size in bytes of length-delimited field `field_number` (its last occurrence) of a
    serialized message, read from the wire format without parsing the message; 0 when absent.
    Walks only the top-level fields: a handful, each skipped by its length."""
    size, i, n = 0, 0, len(raw)
    try:
        while i < n:
            tag, i = _varint(raw, i)
            wire_type = tag & 7
            if wire_type == 0:
                _, i = _varint(raw, i)
            elif wire_type == 1:
                i += 8
            elif wire_type == 5:
                i += 4
            elif wire_type == 2:
                length, i = _varint(raw, i)
                if tag >> 3 == field_number:
                    size = length
                i += length
            else:
                return size  # groups (wire types 3, 4) or garbage: the parser will judge
    except IndexError:
        pass  # truncated: the parser will refuse it
    return size


def _varint(raw: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80 or shift > 63:
            return value, i
        shift += 7
