"""Structured-output constraints (JSON schema, any JSON object, regex, choice, EBNF grammar): what
a valid one is, and how it becomes an xgrammar grammar. Shared by the gateway, which checks a
request's constraint before anything runs (parsing it into an xgrammar Grammar is cheap and
catches every malformed one), and the last stage's worker, which compiles it against the
model's tokenizer (services/worker/sampling/grammar.py).

Limits keep a hostile constraint cheap to refuse: its size, a JSON schema's nesting depth, a
regex's repetition counts, a choice list's length.
"""

from __future__ import annotations

import functools
import json
import re

from strata.sampling_rules import SamplingRuleError
from strata.v1 import engine_pb2

MAX_CONSTRAINT_CHARS = 64 * 1024
MAX_SCHEMA_DEPTH = 48
MAX_REPEAT = 1000  # largest {m,n} count in a regex
MAX_CHOICES = 1024
MAX_PARSED = 256  # distinct constraints whose parsed grammar a process keeps

KIND_NAMES = {
    engine_pb2.CONSTRAINT_KIND_JSON_SCHEMA: "json_schema",
    engine_pb2.CONSTRAINT_KIND_JSON_OBJECT: "json_object",
    engine_pb2.CONSTRAINT_KIND_REGEX: "regex",
    engine_pb2.CONSTRAINT_KIND_GRAMMAR: "grammar",
}
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def _depth(value, limit: int) -> int:
    """Nesting depth of a parsed JSON value, walked iteratively (no recursion on hostile input)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > limit:
            return d
        deepest = max(deepest, d)
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return deepest


def choice_grammar(choices) -> str:
    """An EBNF grammar whose only sentences are the choices (as vLLM turns a choice list into a
    grammar); each string is written as a JSON string literal, whose escapes xgrammar reads."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_choices(choices, field: str) -> None:
    if not choices:
        raise SamplingRuleError(field, f"{field} must hold at least one string")
    if len(choices) > MAX_CHOICES:
        raise SamplingRuleError(field, f"{field} holds {len(choices)} strings; at most {MAX_CHOICES}")
    if any(not isinstance(c, str) or not c for c in choices):
        raise SamplingRuleError(field, f"{field} must hold non-empty strings")
    if sum(len(c) for c in choices) > MAX_CONSTRAINT_CHARS:
        raise SamplingRuleError(field, f"{field} is longer than {MAX_CONSTRAINT_CHARS} characters in all")


def grammar(kind: int, text: str, field: str = "constraint"):
    """The xgrammar Grammar of a constraint (kind: engine_pb2.ConstraintKind); raises
    SamplingRuleError naming `field` for a constraint that is too large or does not parse.
    Each process parses a distinct constraint once (the gateway checking requests, the last
    stage compiling them): a batch whose requests share a schema pays one parse."""
    import xgrammar as xgr

    if kind == engine_pb2.CONSTRAINT_KIND_JSON_OBJECT:
        return xgr.Grammar.builtin_json_grammar()
    if kind not in KIND_NAMES:
        raise SamplingRuleError(field, f"{field}: unknown constraint kind {kind}")
    if not text:
        raise SamplingRuleError(field, f"{field} must not be empty")
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise SamplingRuleError(field, f"{field} has {len(text):,} characters; at most {MAX_CONSTRAINT_CHARS:,}")
    try:
        return _parse(kind, text)
    except _Refused as refused:
        raise SamplingRuleError(field, field + refused.rule) from None


class _Refused(Exception):
    """A constraint that does not parse; rule: what follows the field's name in the message.
    Raised, so that only parsed grammars are kept (a refusal is parsed again: it may have been
    the process's own transient failure)."""

    def __init__(self, rule: str):
        super().__init__(rule)
        self.rule = rule


@functools.lru_cache(maxsize=MAX_PARSED)
def _parse(kind: int, text: str):
    """The Grammar of a constraint that passed the size checks; raises _Refused."""
    import xgrammar as xgr

    try:
        if kind == engine_pb2.CONSTRAINT_KIND_JSON_SCHEMA:
            try:
                schema = json.loads(text)
            except (json.JSONDecodeError, RecursionError) as e:
                raise _Refused(f" is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise _Refused(" must be a JSON schema object")
            if _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
                raise _Refused(f" nests deeper than {MAX_SCHEMA_DEPTH} levels")
            return xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True)
        if kind == engine_pb2.CONSTRAINT_KIND_REGEX:
            for m in _REPEAT.finditer(text):
                if any(g and int(g) > MAX_REPEAT for g in m.groups()):
                    raise _Refused(f" repeats more than {MAX_REPEAT} times ({m.group(0)})")
            return xgr.Grammar.from_regex(text)
        return xgr.Grammar.from_ebnf(text)
    except _Refused:
        raise
    except Exception as e:  # xgrammar's parse errors (RuntimeError, InvalidJSONError, ...)
        message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        message = re.sub(r"^\[[0-9:]+\] \S+: ", "", message)  # drop xgrammar's time and source line
        raise _Refused(f" is not a valid {KIND_NAMES[kind]}: {message[:300]}") from None
