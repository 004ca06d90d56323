"""Tool calls on /v1/chat/completions: `tools` with `tool_choice` "required" or a named function.

The output is constrained to JSON (a structured-output JSON schema, as vLLM does): a named
function's parameters schema, or for "required" an array of {name, parameters} objects, each an
anyOf over the tools. The finished text becomes OpenAI's `tool_calls` (id, type "function",
function {name, arguments as a JSON string}) with finish_reason "tool_calls"; streamed, the calls
come as tool_call deltas as they are generated: a named call's arguments are the output itself,
and a "required" array is scanned as it grows (RequiredCallScanner): each element's call opens
once its name is complete, then its `parameters` text streams as the call's arguments. tool_choice "auto" needs a tool-call parser per model family,
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
    scanners: dict[int, RequiredCallScanner] = field(default_factory=dict)  # per output index ("required")

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
            else:
                scanner = self.scanners.setdefault(index, RequiredCallScanner())
                calls = scanner.feed(piece)
                if calls:
                    delta["tool_calls"] = calls
                if choice["finish_reason"] and scanner.call < 0:
                    delta["content"] = texts[index]  # cut before any call began: the text as it is
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


class _Strings:
    """Whether a character of JSON text is inside a string literal (its quotes included)."""

    def __init__(self) -> None:
        self.inside = self.escape = False

    def step(self, ch: str) -> bool:
        if self.inside:
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.inside = False
            return True
        if ch == '"':
            self.inside = True
            return True
        return False


class RequiredCallScanner:
    """Streams a "required" tool-call array as it is generated: [{"name": ..., "parameters": ...},
    ...] (the grammar fixes that shape; keys in either order, any JSON whitespace). feed(text)
    returns OpenAI's tool_call deltas for what the new text completes: a call's opening delta
    (index, id, type, function.name, the arguments so far) once its name string is complete, then
    pieces of its `parameters` value's text as arguments (parameters read before the name wait
    for it). A small JSON scanner: nesting depth, strings, the keys of the array's objects."""

    def __init__(self) -> None:
        self.strings = _Strings()
        self.depth = 0  # 1 inside the array, 2 inside a call's object
        self.token: list[str] | None = None  # a depth-2 string being read (a key, or the name)
        self.expect_key = False
        self.key: str | None = None  # the depth-2 key read, until its ':'
        self.value: str | None = None  # "name" or "parameters" while its value is read
        self.value_depth = 0  # nesting inside the parameters value
        self.value_started = False  # its first character came (whitespace before it is dropped)
        self.call = -1  # the current element's index
        self.opened = False  # its opening delta went out
        self.pending: list[str] = []  # its arguments, not yet sent

    def feed(self, text: str) -> list[dict]:
        out: list[dict] = []
        for ch in text:
            if self.value == "parameters" and not self._parameters_over(ch):
                if self.value_started or not ch.isspace():  # the value's text, from its first character
                    self.value_started = True
                    self.pending.append(ch)
                continue
            if self.strings.step(ch):
                self._string_char(ch, out)
                continue
            if ch in "[{":
                self.depth += 1
                if self.depth == 2:  # a new call
                    self.call, self.opened, self.pending, self.expect_key = self.call + 1, False, [], True
            elif ch in "]}":
                self.depth -= 1
            elif ch == "," and self.depth == 2:
                self.expect_key = True
            elif ch == ":" and self.depth == 2 and self.key is not None:
                self.value, self.key, self.value_depth, self.value_started = self.key, None, 0, False
        if self.opened and self.pending:
            out.append({"index": self.call, "function": {"arguments": "".join(self.pending)}})
            self.pending = []
        return out

    def _parameters_over(self, ch: str) -> bool:
        """Whether ch is past the parameters value: a ',' or '}' of the call's object."""
        if self.strings.step(ch):
            return False
        if ch in "[{":
            self.value_depth += 1
        elif ch in "]}" and self.value_depth:
            self.value_depth -= 1
        elif ch in ",}" and not self.value_depth:
            self.value = None
            while self.pending and self.pending[-1].isspace():
                self.pending.pop()
            return True
        return False

    def _string_char(self, ch: str, out: list[dict]) -> None:
        if self.depth != 2:
            return
        if self.token is None:  # the opening quote
            self.token = []
            return
        if self.strings.inside:
            self.token.append(ch)
            return
        text, self.token = "".join(self.token), None  # the closing quote
        if self.expect_key:
            self.key, self.expect_key = text, False
        elif self.value == "name":
            self.value = None
            out.append(
                {
                    "index": self.call,
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": json.loads(f'"{text}"'), "arguments": "".join(self.pending)},
                }
            )
            self.opened, self.pending = True, []
