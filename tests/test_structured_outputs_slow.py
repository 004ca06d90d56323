"""Structured outputs on the real default model (SmolLM2-135M-Instruct) through the official
openai client: sampled (temperature 1) outputs under a strict JSON schema, a regex and a choice
all parse and validate, and a named tool call's arguments validate against the tool's schema.
Slow: run with `pytest -m slow tests/test_structured_outputs_slow.py -s` (prints the rates)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.cluster import running_cluster

MODEL = Path.home() / ".cache" / "strata" / "SmolLM2-135M-Instruct"
N = 50
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
    "additionalProperties": False,
}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{2}-[0-9]{4}"
CHOICES = ["red", "green", "blue", "yellow"]


@pytest.mark.slow
def test_openai_client_structured_outputs_validate():
    import jsonschema
    import openai

    if not (MODEL / "config.json").exists():
        pytest.skip("the default model is not built (strata build-model smollm2-135m)")
    with running_cluster(MODEL, 1, "--block-size", "16") as (cluster, _):
        client = openai.OpenAI(base_url=cluster.http_address + "/v1", api_key="none")
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "Describe a user of our website as JSON."}]

        def chat(i, **kw):
            return client.chat.completions.create(
                model=model, messages=messages, temperature=1.0, seed=i, max_tokens=200, **kw
            ).choices[0]

        fmt = {"type": "json_schema", "json_schema": {"name": "user", "schema": SCHEMA, "strict": True}}
        with ThreadPoolExecutor(16) as pool:
            json_out = list(pool.map(lambda i: chat(i, response_format=fmt), range(N)))
            regex_out = list(pool.map(lambda i: chat(i, extra_body={"structured_outputs": {"regex": REGEX}}), range(N)))
            choice_out = list(pool.map(lambda i: chat(i, extra_body={"guided_choice": CHOICES}), range(N)))
            tool = {"type": "function", "function": {"name": "create_user", "parameters": SCHEMA}}
            named = {"type": "function", "function": {"name": "create_user"}}
            tool_out = list(pool.map(lambda i: chat(i, tools=[tool], tool_choice=named), range(N)))

        def valid_json(text):
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
                return True
            except (json.JSONDecodeError, jsonschema.ValidationError):
                return False

        json_ok = sum(valid_json(c.message.content) for c in json_out)
        regex_ok = sum(bool(re.fullmatch(REGEX, c.message.content)) for c in regex_out)
        choice_ok = sum(c.message.content in CHOICES for c in choice_out)
        tool_ok = sum(
            c.finish_reason == "tool_calls"
            and c.message.tool_calls[0].function.name == "create_user"
            and valid_json(c.message.tool_calls[0].function.arguments)
            for c in tool_out
        )
        print(
            f"\njson schema {json_ok}/{N}, regex {regex_ok}/{N}, choice {choice_ok}/{N}, named tool call {tool_ok}/{N}"
        )
        print("examples:", json_out[0].message.content, regex_out[0].message.content, choice_out[0].message.content)
        assert (json_ok, regex_ok, choice_ok, tool_ok) == (N, N, N, N)
