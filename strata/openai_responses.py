"""OpenAI's API shapes over Strata's, the response side: finished GenerateResponses to OpenAI's
response bodies, DELTA responses to streamed chunks, with logprobs, usage and what a request
shows of its prompt (openai_prompts.PromptView: echo, prompt_logprobs). The request side is
openai_format.py; both serve `strata batch` and the HTTP API."""

from __future__ import annotations

import time
import uuid

from strata.openai_prompts import PromptView, prompt_logprobs_body
from strata.prompt_logprobs import positions
from strata.v1 import generate_pb2


def logprobs_body(output: generate_pb2.CompletionOutput, chat: bool, token_text) -> dict | None:
    """An output's logprobs in OpenAI's shape (completions: parallel lists; chat: per-token
    objects with bytes); token_text(id) -> the token as text. None when none were asked."""
    if not output.logprobs:
        return None
    if chat:

        def entry(token_id: int, logprob: float) -> dict:
            text = token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]}
                for lp in output.logprobs
            ]
        }
    tokens = [token_text(lp.token_id) for lp in output.logprobs]
    offsets, offset = [], 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in output.logprobs],
        "top_logprobs": [{token_text(t.token_id): t.logprob for t in lp.top} for lp in output.logprobs],
        "text_offset": offsets,
    }


def _stop_reason(out: generate_pb2.CompletionOutput):
    stop = out.WhichOneof("stop_reason")
    return getattr(out, stop) if stop else None  # vLLM's extra field


def usage_body(usage: generate_pb2.Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens},
    }


def response_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def _choice(out: generate_pb2.CompletionOutput, logprobs: dict | None) -> dict:
    """The fields a choice has in a response and in a chunk alike."""
    return {
        "index": out.index,
        "finish_reason": out.finish_reason or None,
        "stop_reason": _stop_reason(out),
        "logprobs": logprobs,
    }


def response_body(
    response: generate_pb2.GenerateResponse, chat: bool, model: str, token_text=None, view: PromptView | None = None
) -> dict:
    """The OpenAI response object of a finished (FINAL_ONLY or last CUMULATIVE) response; view:
    what it shows of its prompt (openai_prompts: echo, prompt_logprobs, its choices' indices)."""
    view = view or PromptView("")
    if response.HasField("prompt_logprobs"):
        view.entries = positions(response.prompt_logprobs)
    choices = []
    for out in response.outputs:
        choice = _choice(out, logprobs_body(out, chat, token_text) if token_text else None)
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
            view.completion_choice(choice, token_text)
        choices.append(choice)
    body = {
        "id": response_id(chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": view.usage(usage_body(response.usage)),
    }
    if chat and view.entries:
        body["prompt_logprobs"] = prompt_logprobs_body(view.entries, token_text)
    return body


def chunk_body(
    response: generate_pb2.GenerateResponse,
    chat: bool,
    model: str,
    rid: str,
    created: int,
    started: set[int],
    token_text,
    view: PromptView | None = None,
) -> dict:
    """A streamed chunk of a DELTA response: each advanced output's new text (chat: as a delta,
    the first one opening the assistant's turn; `started` holds the indices that began); view:
    what it shows of its prompt (a completion choice's first chunk: the echo, prompt_logprobs;
    a chat's first chunk: prompt_logprobs)."""
    view = view or PromptView("")
    first_response = response.HasField("prompt_logprobs")
    if first_response:
        view.entries = positions(response.prompt_logprobs)
    choices = []
    for out in response.outputs:
        choice = _choice(out, logprobs_body(out, chat, token_text))
        if chat:
            delta = {"content": out.text}
            if out.index not in started:
                delta["role"] = "assistant"
            choice["delta"] = delta
        else:
            choice["text"] = out.text
            view.completion_choice(choice, token_text, first=out.index not in started)
        started.add(out.index)
        choices.append(choice)
    chunk = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if chat and first_response:
        chunk["prompt_logprobs"] = prompt_logprobs_body(view.entries, token_text)
    return chunk
