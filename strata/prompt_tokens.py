"""How a prompt becomes token ids: one path for every front.

A PromptInput is a prompt's text or a chat conversation, with vLLM's tokenization switches.
token_ids() is the only place either is tokenized: Generate, Tokenize, the HTTP front and
`strata batch --tokenizer` all call it, so the ids a client gets from Tokenize are the ids
Generate runs on. Parsing what clients send (OpenAI's JSON, the proto's chat form, content
parts) into a PromptInput is openai_format's job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from jinja2 import TemplateError

from strata.v1 import generate_pb2


@dataclass(frozen=True)
class PromptInput:
    """A prompt's text, or chat messages ({"role", "content": str, ...}, content parts already
    joined). add_special_tokens None means vLLM's default: True for text, False for a chat, whose
    template writes its own special tokens."""

    text: str | None = None
    messages: tuple[dict, ...] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    # A chat's tools, OpenAI's list as JSON: the chat template writes them into the prompt (HF
    # apply_chat_template's `tools`, as vLLM passes them), so the model sees what it may call.
    tools_json: str = ""

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def special_tokens(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return not self.is_chat

    def characters(self) -> int:
        """What the prompt-length limit counts: the text, or every role and content."""
        if self.is_chat:
            return sum(len(m["role"]) + len(m["content"]) for m in self.messages) + len(self.tools_json)
        return len(self.text)


class ChatTemplateError(ValueError):
    """The tokenizer cannot format this chat: it has no template, or the template refuses the
    messages (e.g. roles that do not alternate)."""


def token_ids(tokenizer, prompt: PromptInput) -> list[int]:
    """The prompt's token ids: its text, or its messages through the tokenizer's chat template."""
    if not prompt.is_chat:
        return tokenizer.encode(prompt.text, add_special_tokens=prompt.special_tokens())
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the model's tokenizer has no chat template")
    try:
        text = tokenizer.apply_chat_template(
            list(prompt.messages),
            tools=json.loads(prompt.tools_json) if prompt.tools_json else None,
            add_generation_prompt=prompt.add_generation_prompt,
            tokenize=False,
        )
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
    return tokenizer.encode(text, add_special_tokens=prompt.special_tokens())


def to_proto(prompt: PromptInput) -> generate_pb2.TokenizeRequest:
    """The TokenizeRequest that asks a gateway for this prompt's ids."""
    request = generate_pb2.TokenizeRequest()
    if prompt.is_chat:
        request.chat.add_generation_prompt = prompt.add_generation_prompt
        request.chat.messages.extend(
            generate_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in prompt.messages
        )
        request.chat.tools_json = prompt.tools_json
    else:
        request.prompt = prompt.text
    if prompt.add_special_tokens is not None:
        request.add_special_tokens = prompt.add_special_tokens
    return request
