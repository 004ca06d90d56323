"""OpenAI's API shapes over Strata's, the request side: bodies of /v1/completions,
/v1/chat/completions and /tokenize to SamplingParams and prompts (prompt_tokens.PromptInput).
The response side, GenerateResponses to OpenAI's bodies and chunks, is openai_responses.py.

Shared by every front that speaks OpenAI's format (`strata batch`'s batch files, the HTTP API, and
the gRPC chat form of Tokenize), so chat messages and their content parts are parsed here only.
Fields follow OpenAI's API plus vLLM's extras (top_k, min_p, min_tokens, ignore_eos,
stop_token_ids, add_special_tokens, add_generation_prompt); a bad field raises BadField naming it.
"""

from __future__ import annotations

import json

from strata.openai_prompts import BadField, completion_prompts
from strata.prompt_tokens import PromptInput, token_ids
from strata.v1 import generate_pb2

__all__ = ["BadField"]  # (defined beside the prompt's shapes, raised by both)

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
# What both endpoints accept beyond the prompt, and the SamplingParams field each sets.
_NUMBERS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "min_tokens": "min_tokens",
    "n": "n",
}


# Every request field /v1/completions and /v1/chat/completions (and `strata batch` lines) read,
# in one place: anything else, OpenAI's or vLLM's, is refused with 400 naming it, never ignored.
ACCEPTED_FIELDS = frozenset(
    {
        "model", "stream", "stream_options", "n", "seed", "max_tokens", "min_tokens",
        "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos", "logprobs",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "bad_words",
        "allowed_token_ids", "response_format", "structured_outputs", "guided_json", "guided_regex",
        "guided_choice", "guided_grammar", "add_special_tokens", "skip_special_tokens", "prompt_logprobs",
    }
)  # fmt: skip
COMPLETIONS_FIELDS = frozenset({"prompt", "echo"})
CHAT_FIELDS = frozenset(
    {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "add_generation_prompt",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    }
)
# Accepted and without effect, as OpenAI's own API treats them.
IGNORED_FIELDS = frozenset({"user", "metadata", "store"})
# Fields Strata does not implement, accepted only at the value that asks for nothing.
NO_OP_VALUES = {"echo": False, "best_of": 1, "use_beam_search": False, "include_stop_str_in_output": False}


def check_fields(body: dict, chat: bool) -> None:
    """Refuses a field Strata does not implement (null counts as absent)."""
    own = CHAT_FIELDS if chat else COMPLETIONS_FIELDS
    for name, value in body.items():
        if name in ACCEPTED_FIELDS or name in own or name in IGNORED_FIELDS or value is None:
            continue
        if name in NO_OP_VALUES and value == NO_OP_VALUES[name] and type(value) is type(NO_OP_VALUES[name]):
            continue
        raise BadField(name, f"is not supported by this server ({'chat completions' if chat else 'completions'})")


def sampling_params(body: dict, chat: bool, output_kind: int = generate_pb2.FINAL_ONLY) -> generate_pb2.SamplingParams:
    """SamplingParams of a request body; unset fields keep the gateway's defaults (OpenAI's:
    temperature 1, top_p 1, max_tokens 16)."""
    check_fields(body, chat)
    params = generate_pb2.SamplingParams(output_kind=output_kind)
    for name, field in _NUMBERS.items():
        if body.get(name) is not None:
            value = body[name]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise BadField(name, f"must be a number, got {value!r}")
            if field in ("top_k", "seed", "min_tokens", "n") and value != int(value):
                raise BadField(name, f"must be an integer, got {value!r}")
            if field == "n" and value < 1:
                raise BadField(name, f"must be at least 1, got {value!r}")
            if field in ("seed", "min_tokens") and value < 0:
                raise BadField(name, f"must be >= 0, got {value!r}")
            setattr(params, field, int(value) if field in ("top_k", "seed", "min_tokens", "n") else float(value))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        echo = not chat and body.get("echo") is True  # max_tokens 0: the prompt's echo alone
        least = 0 if echo else 1
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < least:
            rule = "an integer >= 0 (0 with echo only)" if not chat else "a positive integer"
            raise BadField("max_tokens", f"must be {rule}, got {max_tokens!r}")
        params.max_tokens = max(max_tokens, 1)  # (echo's one token is left out of the response)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise BadField("stop", "must be a string or a list of strings")
        params.stop.extend(stops)
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise BadField("stop_token_ids", "must be a list of integers")
        params.stop_token_ids.extend(ids)
    if body.get("ignore_eos") is not None:
        params.ignore_eos = bool(body["ignore_eos"])
    logprobs = _logprobs(body, chat)
    if logprobs is not None:
        params.logprobs = logprobs
    prompt_logprobs = body.get("prompt_logprobs")
    if prompt_logprobs is not None:
        if isinstance(prompt_logprobs, bool) or not isinstance(prompt_logprobs, int) or prompt_logprobs < 0:
            raise BadField("prompt_logprobs", f"must be an integer >= 0, got {prompt_logprobs!r}")
        params.prompt_logprobs = prompt_logprobs
    elif logprobs is not None and not chat and body.get("echo") is True:
        params.prompt_logprobs = logprobs  # the echoed prompt's logprobs, as vLLM's echo
    if body.get("skip_special_tokens") is not None:
        params.skip_special_tokens = _bool(body, "skip_special_tokens")
    _penalties(body, params)
    structured_output(body, params)
    return params


def _bool(body: dict, name: str) -> bool:
    if not isinstance(body[name], bool):
        raise BadField(name, f"must be true or false, got {body[name]!r}")
    return body[name]


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadField(name, f"must be a number, got {value!r}")
    return float(value)


def _int_list(body: dict, name: str) -> list[int] | None:
    ids = body.get(name)
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise BadField(name, "must be a list of integers")
    if any(not -(2**31) <= i < 2**31 for i in ids):
        raise BadField(name, "token ids must be in the vocabulary")
    return ids


def _penalties(body: dict, params: generate_pb2.SamplingParams) -> None:
    """vLLM's names: presence_penalty, frequency_penalty, repetition_penalty, logit_bias (token
    id, as a string key as OpenAI sends it, -> bias), bad_words, allowed_token_ids."""
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _number(body, name)
        if value is not None:
            setattr(params, name, value)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise BadField("logit_bias", "must be an object of token id -> bias")
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise BadField("logit_bias", f"keys must be token ids, got {key!r}") from None
            if not 0 <= token < 2**31:
                raise BadField("logit_bias", f"token ids must be in the vocabulary, got {key!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
                raise BadField("logit_bias", f"biases must be numbers, got {value!r} for {key!r}")
            params.logit_bias[token] = float(value)
    words = body.get("bad_words")
    if words is not None:
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise BadField("bad_words", "must be a list of strings")
        params.bad_words.extend(words)
    allowed = _int_list(body, "allowed_token_ids")
    if allowed is not None:
        if not allowed:
            raise BadField("allowed_token_ids", "must not be empty")
        params.allowed_token_ids.extend(allowed)


def _schema_text(value, field: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, bool)):
        return json.dumps(value)
    raise BadField(field, "must be a JSON schema (an object, or its JSON text)")


def structured_output(body: dict, params: generate_pb2.SamplingParams) -> None:
    """The constraint of OpenAI's response_format (json_object; json_schema with its schema),
    vLLM's structured_outputs {json, regex, choice, grammar} and its older guided_json,
    guided_regex, guided_choice and guided_grammar; at most one of them."""
    found: list[tuple[str, str, object]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_object":
            found.append(("response_format", "json_object", True))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise BadField("response_format.json_schema", "must be an object with a schema")
            found.append(
                (
                    "response_format.json_schema.schema",
                    "json_schema",
                    _schema_text(spec["schema"], "response_format.json_schema.schema"),
                )
            )
        elif kind != "text":
            raise BadField("response_format.type", f"must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    so = body.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise BadField("structured_outputs", "must be an object")
        for key, value in so.items():
            if value is None:
                continue
            if key not in ("json", "regex", "choice", "grammar", "json_object"):
                raise BadField(f"structured_outputs.{key}", "is not supported by this server")
            found.append((f"structured_outputs.{key}", key, value))
    for key in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if body.get(key) is not None:
            found.append((key, key.removeprefix("guided_"), body[key]))
    if not found:
        return
    if len(found) > 1:
        raise BadField(found[1][0], f"only one constraint may be given ({found[0][0]} is set)")
    field, kind, value = found[0]
    if kind in ("json", "json_schema"):
        params.json_schema = _schema_text(value, field)
    elif kind == "json_object":
        if value is not True:
            raise BadField(field, "must be true")
        params.json_object = True
    elif kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise BadField(field, "must be a list of strings")
        params.choice.SetInParent()
        params.choice.choices.extend(value)
    else:
        if not isinstance(value, str):
            raise BadField(field, "must be a string")
        setattr(params, kind, value)


def _logprobs(body: dict, chat: bool) -> int | None:
    """Completions: logprobs = k top tokens; chat: logprobs true plus top_logprobs = k."""
    if chat:
        if not body.get("logprobs"):
            return None
        top = body.get("top_logprobs", 0)
        if isinstance(top, bool) or not isinstance(top, int) or top < 0:
            raise BadField("top_logprobs", f"must be an integer >= 0, got {top!r}")
        return top
    value = body.get("logprobs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadField("logprobs", f"must be an integer >= 0, got {value!r}")
    return value


def prompt_input(body: dict, chat: bool) -> PromptInput | list[int]:
    """What a request body asks to be tokenized (a completion's prompt text, or chat messages),
    or a completion's prompt given as token ids. vLLM's add_special_tokens and
    add_generation_prompt apply as on its endpoints."""
    special = _optional_bool(body, "add_special_tokens")
    if chat:
        generation_prompt = _optional_bool(body, "add_generation_prompt")
        return PromptInput(
            messages=chat_messages(body.get("messages")),
            add_special_tokens=special,
            add_generation_prompt=True if generation_prompt is None else generation_prompt,
            tools_json=tools_json(body.get("tools")),
        )
    prompts = completion_prompts(body, 2**31, special)
    if len(prompts) > 1:  # (the HTTP front takes several: completion_inputs)
        raise BadField("prompt", f"holds {len(prompts)} prompts; a batch line takes one (give each a line)")
    return prompts[0]


def completion_inputs(body: dict, most: int) -> list[PromptInput | list[int]]:
    """/v1/completions' prompts (openai_prompts.completion_prompts: one or several), with the
    body's add_special_tokens."""
    return completion_prompts(body, most, _optional_bool(body, "add_special_tokens"))


def tokenize_input(body: dict) -> PromptInput:
    """A /tokenize body: {"prompt"} or {"messages"} (vLLM's two request shapes)."""
    if "messages" in body:
        return prompt_input(body, chat=True)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise BadField("prompt", "must be a non-empty string (or give messages)")
    return prompt_input(body, chat=False)


def tools_json(tools, field: str = "tools") -> str:
    """A chat's tools for its template: a list of objects, as JSON ("" for none). What each tool
    must hold for a tool call is checked where tool_choice is read (services/gateway/tools.py)."""
    if tools is None:
        return ""
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadField(field, "must be a list of {type: function, function: {name, parameters}} objects")
    return json.dumps(tools) if tools else ""


def _optional_bool(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise BadField(name, f"must be true or false, got {value!r}")
    return value


def chat_messages(messages, field: str = "messages") -> tuple[dict, ...]:
    """OpenAI's chat messages as the chat template reads them: {"role", "content"}, each content
    a string or a list of text parts joined as vLLM joins them."""
    if not isinstance(messages, list) or not messages:
        raise BadField(field, "must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]:
            raise BadField(f"{field}[{i}]", "must be an object with a non-empty string role")
        out.append({"role": message["role"], "content": content_text(message.get("content"), f"{field}[{i}].content")})
    return tuple(out)


def content_text(content, field: str) -> str:
    """A message's content: a string, or a list of content parts of which Strata serves the text
    parts ({"type": "text", "text": ...}), joined with "\n" as vLLM does for chat templates that
    take string content. Any other part (image_url, input_audio, file, ...) is refused, naming
    its type."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadField(field, "must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise BadField(f"{field}[{i}].type", "each content part must be an object with a string type")
        if kind != "text":
            raise BadField(f"{field}[{i}].type", f"content parts of type {kind!r} are not supported; only 'text'")
        if not isinstance(part.get("text"), str):
            raise BadField(f"{field}[{i}].text", "a text part's text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def prompt_from_proto(request: generate_pb2.TokenizeRequest) -> PromptInput:
    """A TokenizeRequest's prompt; its chat goes through the same message parsing as JSON's."""
    special = request.add_special_tokens if request.HasField("add_special_tokens") else None
    which = request.WhichOneof("input")
    if which == "prompt":
        if not request.prompt:
            raise BadField("prompt", "must not be empty")
        return PromptInput(text=request.prompt, add_special_tokens=special)
    if which != "chat":
        raise BadField("prompt", "prompt or chat is required")
    chat = request.chat
    messages = []
    for i, m in enumerate(chat.messages):
        if m.content and m.content_parts:
            raise BadField(f"chat.messages[{i}]", "set content or content_parts, not both")
        content = m.content
        if m.content_parts:
            parts = [{"type": p.type, "text": p.text} for p in m.content_parts]
            content = content_text(parts, f"chat.messages[{i}].content_parts")
        messages.append({"role": m.role, "content": content})
    tools = None
    if chat.tools_json:
        try:
            tools = json.loads(chat.tools_json)
        except ValueError as e:
            raise BadField("chat.tools_json", f"is not JSON: {e}") from None
    return PromptInput(
        messages=chat_messages(messages, "chat.messages"),
        add_special_tokens=special,
        add_generation_prompt=chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True,
        tools_json=tools_json(tools, "chat.tools_json"),
    )


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Chat messages through the tokenizer's chat template, the assistant's turn opened, as
    /v1/chat/completions tokenizes them."""
    return token_ids(tokenizer, PromptInput(messages=chat_messages(messages)))
