"""What an OpenAI response shows of its prompt, in vLLM's shapes: /v1/completions' several prompts
in one request, `echo` (the prompt's text, and its logprobs when `logprobs` is set, lead each
choice), and `prompt_logprobs` (each prompt token's logprob, rank and top alternatives).

openai_format parses the rest of a body and builds the rest of a response; the HTTP front and
`strata batch` share both.

- `prompt` may hold several prompts (a list of strings, or of token id lists), as OpenAI's API
  takes them: each runs as its own request; choice i of prompt p is choice p * n + i, and usage
  is summed.
- `echo` with `logprobs` asks the prompt logprobs with the same top k (unless `prompt_logprobs`
  says otherwise). `max_tokens` 0 is allowed with `echo`: one token is generated (the engine
  always samples after a prompt) and left out of the choice, its usage and its logprobs.
- A prompt's first token has no logprob: `null` in both shapes. A logprob of -inf is -9999.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from strata.prompt_logprobs import PromptPosition
from strata.prompt_tokens import PromptInput

# A -inf logprob as JSON (which has no infinity), as vLLM writes it.
NEG_INF_LOGPROB = -9999.0


class BadField(ValueError):
    """A request field Strata refuses; `field` names it (OpenAI's error `param`)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


def _token_ids(value) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def completion_prompts(body: dict, most: int, special: bool | None = None) -> list[PromptInput | list[int]]:
    """/v1/completions' prompt: a string, token ids, or several prompts (a list of strings, or of
    token id lists), at most `most` of them. special: the body's add_special_tokens."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return [PromptInput(text=prompt, add_special_tokens=special)]
    if _token_ids(prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) and p for p in prompt):
            prompts = [PromptInput(text=p, add_special_tokens=special) for p in prompt]
        elif all(_token_ids(p) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            prompts = None
        if prompts is not None:
            if len(prompts) > most:
                raise BadField("prompt", f"holds {len(prompts)} prompts; at most {most} (--max-completion-prompts)")
            return prompts
    raise BadField(
        "prompt", "must be a non-empty string, a list of token ids, or a list of them (non-empty strings or id lists)"
    )


@dataclass(frozen=True)
class Echo:
    """A completion's echo."""

    logprobs: bool  # the prompt's logprob entries lead the choice's logprobs (`logprobs` is set)
    drop_output: bool  # max_tokens 0: the token generated is not returned


def echo_of(body: dict, chat: bool) -> Echo | None:
    """The body's echo (completions only: a chat's `echo` is refused by openai_format)."""
    if chat or body.get("echo") is None:
        return None
    if not isinstance(body["echo"], bool):
        raise BadField("echo", f"must be true or false, got {body['echo']!r}")
    if not body["echo"]:
        return None
    return Echo(logprobs=body.get("logprobs") is not None, drop_output=body.get("max_tokens") == 0)


def logprob(value: float) -> float:
    return NEG_INF_LOGPROB if value == -math.inf else value


def prompt_logprobs_body(entries, token_text) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token (None for the first) {id: {logprob, rank,
    decoded_token}} of the token itself and its position's top k (ranked 1..k)."""
    out: list[dict | None] = [None]
    if token_text is None:  # (no tokenizer at hand: `strata batch --address` alone)
        token_text = _no_text
    for e in entries[1:]:
        position = {
            str(e.token_id): {"logprob": logprob(e.logprob), "rank": e.rank, "decoded_token": token_text(e.token_id)}
        }
        for rank, t in enumerate(e.top, 1):
            position[str(t.token_id)] = {
                "logprob": logprob(t.logprob),
                "rank": rank,
                "decoded_token": token_text(t.token_id),
            }
        out.append(position)
    return out


def _no_text(token_id: int) -> None:
    return None


def echo_logprobs_body(entries, token_text) -> dict:
    """The prompt's part of a completion's logprobs (the parallel lists), its first token's
    entries null. A position's top_logprobs holds the token and its top k (a text several of them
    decode to keeps the highest logprob, so the position's best is always there)."""
    tokens, token_logprobs, tops = [], [], []
    for i, e in enumerate(entries):
        tokens.append(token_text(e.token_id))
        if i == 0:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(logprob(e.logprob))
        top = {tokens[-1]: logprob(e.logprob)}
        for t in e.top:
            text, value = token_text(t.token_id), logprob(t.logprob)
            top[text] = max(value, top.get(text, value))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets(tokens)}


def offsets(tokens: list[str], start: int = 0) -> list[int]:
    out = []
    for text in tokens:
        out.append(start)
        start += len(text)
    return out


@dataclass
class PromptView:
    """What one prompt's choices show of it: its echo and its prompt logprobs."""

    text: str  # the prompt's text (a token id prompt's decoded)
    echo: Echo | None = None
    index_offset: int = 0  # its first choice's index (prompt index x n)
    entries: list[PromptPosition] | None = None  # from its first response

    def completion_choice(self, choice: dict, token_text, first: bool = True) -> dict:
        """A /v1/completions choice, whole or a stream's chunk of it, indexed among every
        prompt's; its first (or only) chunk with the prompt's part: the echo before its text and
        logprobs, prompt_logprobs beside them."""
        choice["index"] += self.index_offset
        echo = self.echo
        if echo is not None and echo.drop_output:  # max_tokens 0: nothing generated shows
            choice["text"], choice["logprobs"], choice["stop_reason"] = "", None, None
            choice["finish_reason"] = "length" if choice["finish_reason"] else None
        if not first:
            return choice
        if echo is not None:
            choice["text"] = self.text + choice["text"]
            if echo.logprobs and self.entries is not None and token_text is not None:
                prompt = echo_logprobs_body(self.entries, token_text)
                generated = choice["logprobs"]
                if generated is not None:
                    base = sum(len(t) for t in prompt["tokens"])
                    for key in ("tokens", "token_logprobs", "top_logprobs"):
                        prompt[key] += generated[key]
                    prompt["text_offset"] += [x + base for x in generated["text_offset"]]
                choice["logprobs"] = prompt
        if self.entries:
            choice["prompt_logprobs"] = prompt_logprobs_body(self.entries, token_text)
        return choice

    def usage(self, usage: dict) -> dict:
        """The body's usage without the tokens an echo of max_tokens 0 left out."""
        if self.echo is not None and self.echo.drop_output:
            usage["completion_tokens"] = 0
            usage["total_tokens"] = usage["prompt_tokens"]
        return usage


def merge_bodies(bodies: list[dict]) -> dict:
    """One /v1/completions body from each prompt's (choices already indexed): usage summed."""
    if len(bodies) == 1:
        return bodies[0]
    merged = dict(bodies[0])
    merged["choices"] = [c for b in bodies for c in b["choices"]]
    merged["usage"] = merge_usage([b["usage"] for b in bodies])
    return merged


def merge_usage(usages: list[dict]) -> dict:
    if len(usages) == 1:
        return usages[0]
    usage = {k: sum(u[k] for u in usages) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    usage["prompt_tokens_details"] = {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)}
    return usage
