"""What a request's prompt adds to its responses, bounded before it runs (--max-response-bytes):
its prompt logprobs and, over HTTP, an echoed prompt. The sampled part grows with max_tokens and
stays outside the limit, as before.

Checked after tokenizing and before anything is admitted, against an upper bound of the largest
message the prompt's part lands in: over gRPC the first GenerateResponse (its PromptLogprobs
arrays: fixed widths per position); over HTTP the whole body, or the
first chunk of a stream, in vLLM's JSON shapes, where the prompt's own tokens' texts are counted
as they are and each top alternative's as the vocabulary's longest (TokenTexts.json_bound).

TokenTexts also serves the HTTP bodies' token texts: a long prompt's logprobs name hundreds of
thousands of tokens, each decoded once per vocabulary instead of once per mention.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from strata.services.gateway.validation import InvalidRequest

# One position of PromptLogprobs' packed arrays: its token id and rank at their widest varint, its
# logprob; and each top alternative's id and logprob. PROTO_HEADERS: the six fields' tags and lengths.
PROTO_POSITION = 10 + 4 + 5
PROTO_TOP = 10 + 4
PROTO_HEADERS = 6 * (1 + 5) + 6
FLOAT_JSON = 24  # a float32 value as JSON at its longest (-1.2345678901234567e-05)
INT_JSON = 11
# Around one {"<id>": {"logprob": f, "rank": r, "decoded_token": "t"}} entry of vLLM's prompt_logprobs.
_PROMPT_ENTRY_JSON = len('"":{"logprob":,"rank":,"decoded_token":},') + INT_JSON + FLOAT_JSON + INT_JSON
# Around one {"t": f} entry of an echo's top_logprobs, and one position of the four lists.
_TOP_ENTRY_JSON = len(":,") + FLOAT_JSON
_ECHO_POSITION_JSON = len(",,{},,") + FLOAT_JSON + INT_JSON


class TokenTexts:
    """Each token's text alone, as tokenizer.decode([id]) gives it, for the whole vocabulary."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.texts: list[str] = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        # The texts as JSON strings (json.dumps' default escapes everything past ASCII: the widest).
        self.json_sizes = [len(json.dumps(t)) for t in self.texts]
        self.json_bound = max(self.json_sizes, default=2)

    def __call__(self, token_id: int) -> str:
        if 0 <= token_id < len(self.texts):
            return self.texts[token_id]
        return self._tokenizer.decode([token_id])  # a model row past the tokenizer's vocabulary

    def json_size(self, token_id: int) -> int:
        return self.json_sizes[token_id] if 0 <= token_id < len(self.json_sizes) else self.json_bound


def proto_bytes(num_tokens: int, k: int) -> int:
    """The first GenerateResponse's prompt_logprobs of a prompt of num_tokens tokens, top k."""
    return PROTO_HEADERS + num_tokens * (PROTO_POSITION + k * PROTO_TOP)


def json_bytes(prompt: Sequence[int], texts: TokenTexts, k: int | None, echo: bool, echo_logprobs: bool) -> int:
    """One choice's prompt part in vLLM's JSON: prompt_logprobs (k not None: the token and its
    top k per position), an echo's text, and its logprob lists (the token and the top k)."""
    size = 0
    own = sum(texts.json_size(t) for t in prompt) if prompt else 0
    alternatives = len(prompt) * (k or 0) * texts.json_bound
    if k is not None:
        size += own + alternatives + len(prompt) * (k + 1) * _PROMPT_ENTRY_JSON
    if echo:
        size += own
    if echo_logprobs:
        size += 2 * own + alternatives + len(prompt) * (_ECHO_POSITION_JSON + ((k or 0) + 1) * _TOP_ENTRY_JSON)
    return size


def check(size: int, limit: int, field: str) -> None:
    """Refuses a request whose prompt part would pass the limit, naming the field that asked."""
    if size > limit:
        raise InvalidRequest(
            field,
            f"{field}: the prompt's part of the response would take up to {size:,} bytes; at most "
            f"{limit:,} (--max-response-bytes)",
        )
