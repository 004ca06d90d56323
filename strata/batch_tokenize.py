"""`strata batch`'s prompts tokenized by the gateway, and the check of a local --tokenizer.

The gateway's Tokenize path is the one Generate uses, so ids it returns are exactly the served
model's: prefix groups found over them are the prefixes the scheduler sees. Prompts go in
TokenizeBatch calls of at most CHUNK_PROMPTS prompts or CHUNK_BYTES bytes, IN_FLIGHT calls at
once, so a 100k-line file costs a few hundred calls and the gateway tokenizes while the next
chunk travels.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import grpc

from strata.prompt_tokens import PromptInput, to_proto
from strata.v1 import generate_pb2

CHUNK_PROMPTS = 512
CHUNK_BYTES = 2 << 20
IN_FLIGHT = 4
# Refusals that may come from one prompt of a chunk (too large a message): the chunk is split.
_SPLIT_ON = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)

# Probes a local --tokenizer must tokenize as the gateway does: plain text, text the tokenizer
# has to fall back on bytes or whitespace for, a special token's spelling, and a conversation
# through the chat template.
PROBES = (
    PromptInput(text="The capital of France is"),
    PromptInput(text="  Unicode: café, naïve, 東京, 🙂\n\ttabs, numbers 12345 and 3.14159"),
    PromptInput(text="<|begin_of_text|><|im_start|>user</s>"),
    PromptInput(
        messages=(
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Name three rivers.\nOne per line."},
        )
    ),
)


class TokenizerMismatch(RuntimeError):
    """A local tokenizer that does not tokenize as the gateway's model does."""


class GatewayTokenizer:
    """Tokenize for read_items: each prompt's ids from the gateway, or the message refusing it."""

    def __init__(self, stub, metadata=None, timeout: float = 600.0):
        self.stub = stub
        self.metadata = metadata
        self.timeout = timeout

    def __call__(self, prompts: list[PromptInput]) -> list[list[int] | str]:
        out: list[list[int] | str] = []
        calls: deque = deque()
        for chunk in _chunks([to_proto(p) for p in prompts]):
            calls.append((chunk, self._send(chunk)))
            if len(calls) >= IN_FLIGHT:
                out.extend(self._results(*calls.popleft()))
        while calls:
            out.extend(self._results(*calls.popleft()))
        return out

    def _send(self, chunk: list[generate_pb2.TokenizeRequest]):
        request = generate_pb2.TokenizeBatchRequest(requests=chunk)
        return self.stub.TokenizeBatch.future(request, timeout=self.timeout, metadata=self.metadata)

    def _results(self, chunk: list[generate_pb2.TokenizeRequest], call) -> list[list[int] | str]:
        try:
            response = call.result()
        except grpc.RpcError as e:
            if e.code() not in _SPLIT_ON:
                raise
            if len(chunk) == 1:
                return [f"{e.code().name}: {e.details()}"]
            half = len(chunk) // 2
            return self._results(chunk[:half], self._send(chunk[:half])) + self._results(
                chunk[half:], self._send(chunk[half:])
            )
        return [r.error.message if r.HasField("error") else list(r.response.tokens) for r in response.results]


def _chunks(requests: list[generate_pb2.TokenizeRequest]) -> Iterator[list[generate_pb2.TokenizeRequest]]:
    chunk, size = [], 0
    for request in requests:
        bytes_ = request.ByteSize()
        if chunk and (len(chunk) == CHUNK_PROMPTS or size + bytes_ > CHUNK_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(request)
        size += bytes_
    if chunk:
        yield chunk


def check_tokenizer(local, remote, local_name: str, model_name: str) -> None:
    """Raises TokenizerMismatch unless the local tokenizer gives the gateway's ids for every
    probe (or both refuse it: a chat neither can format)."""
    for probe, mine, theirs in zip(PROBES, local(list(PROBES)), remote(list(PROBES))):
        if isinstance(mine, str) and isinstance(theirs, str):
            continue
        if mine != theirs:
            what = "the chat" if probe.is_chat else repr(probe.text)
            raise TokenizerMismatch(
                f"--tokenizer {local_name} does not tokenize as the gateway's model {model_name!r}: "
                f"{what} gives {_show(mine)} here and {_show(theirs)} there. Drop --tokenizer to "
                "tokenize through the gateway, or give the served model's tokenizer"
            )


def _show(ids: list[int] | str) -> str:
    if isinstance(ids, str):
        return f"an error ({ids})"
    return f"{ids[:8]}{'...' if len(ids) > 8 else ''} ({len(ids)} tokens)"
