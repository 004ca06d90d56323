"""Tool calls on /v1/chat/completions: `tools` with `tool_choice` "required" or a named function.

The output is constrained to JSON (a structured-output JSON schema, as vLLM does): a named
function's parameters schema, or for "required" an array of {name, parameters} objects, each an
anyOf over the tools. The finished text becomes OpenAI's `tool_calls` (id, type "function",
function {name, arguments as a JSON string}) with finish_reason "tool_calls"; streamed, a named
call's arguments come as tool_call deltas as they are generated, and "required" calls as whole
deltas once the array is complete. tool_choice "auto" needs a tool-call parser per model family,
which Strata does not have: 400, naming tool_choice. "none" means no tools.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from strata.openai_format import BadField
from strata.v1 import generate_pb2

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolCalls:
    """A request's tool-call mode: one named function, or "required" over several."""

    names: list[str]
    named: bool  # tool_choice named one function: the output is its arguments
    ids: dict[int, str] = field(default_factory=dict)  # call id per output index (named)

    def call_id(self, index: int) -> str:
        return self.ids.setdefault(index, f"call_{uuid.uuid4().hex[:24]}")

    def calls(self, index: int, text: str) -> list[dict] | None:
        """The output's tool calls, or None when its text is not a complete call (cut by length)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.named:
            return [_call(self.call_id(index), self.names[0], value)]
        if not isinstance(value, list):
            return None
        out = []
        for item in value:
            if not isinstance(item, dict) or item.get("name") not in self.names:
                return None
            out.append(_call(f"call_{uuid.uuid4().hex[:24]}", item["name"], item.get("parameters", {})))
        return out

    def message(self, body: dict) -> dict:
        """A finished chat.completion body with tool calls in place of the content."""
        for choice in body["choices"]:
            calls = self.calls(choice["index"], choice["message"]["content"])
            if calls is not None:
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": calls}
                if choice["finish_reason"] == "stop":
                    choice["finish_reason"] = "tool_calls"
        return body

    def chunk(self, chunk: dict, texts: dict[int, str]) -> dict:
        """A streamed chunk with tool_call deltas instead of content (texts: each output's text
        so far, updated here)."""
        for choice in chunk["choices"]:
            index, delta = choice["index"], choice["delta"]
            piece = delta.pop("content", "") or ""
            texts[index] = texts.get(index, "") + piece
            if self.named:
                call = {"index": 0, "function": {"arguments": piece}}
                if "role" in delta:  # the first delta names the call
                    call.update(id=self.call_id(index), type="function")
                    call["function"]["name"] = self.names[0]
                delta["tool_calls"] = [call]
            elif choice["finish_reason"]:
                calls = self.calls(index, texts[index]) or []
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                if not calls:
                    delta["content"] = texts[index]
            if choice["finish_reason"] == "stop":
                choice["finish_reason"] = "tool_calls"
        return chunk


def _call(call_id: str, name: str, arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def tool_calls(body: dict, params: generate_pb2.SamplingParams) -> ToolCalls | None:
    """Reads tools and tool_choice; sets params' JSON-schema constraint for a tool call."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise BadField("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise BadField("tools", "must be a non-empty list of {type: function, function: {name, parameters}}")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise BadField(f"tools[{i}]", "must be {type: 'function', function: {name, parameters}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise BadField(f"tools[{i}].function.name", "must be a non-empty string")
        parameters = fn.get("parameters", _EMPTY_PARAMETERS)
        if not isinstance(parameters, dict):
            raise BadField(f"tools[{i}].function.parameters", "must be a JSON schema object")
        functions[name] = parameters
    if choice is None or choice == "auto":
        raise BadField(
            "tool_choice",
            "'auto' (the default with tools) needs a tool-call parser for the model's family, which this "
            "server does not have: use 'required', a named function, or 'none'",
        )
    if choice == "none":
        return None
    if params.WhichOneof("constraint") is not None:
        raise BadField("tool_choice", "a tool call cannot be combined with response_format or structured outputs")
    if choice == "required":
        any_of = [
            {
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
            }
            for name, schema in functions.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": any_of}}
        if body.get("parallel_tool_calls") is False:
            schema["maxItems"] = 1
        params.json_schema = json.dumps(schema)
        return ToolCalls(list(functions), named=False)
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise BadField("tool_choice", "must be 'none', 'auto', 'required' or {type: 'function', function: {name}}")
    if name not in functions:
        raise BadField("tool_choice", f"names {name!r}, which is not among the tools")
    params.json_schema = json.dumps(functions[name])
    return ToolCalls([name], named=True)
