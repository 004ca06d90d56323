"""Merge the outputs of a request's n children into public GenerateResponse messages.

Output kinds:
- CUMULATIVE: each response holds every output (all n) whole so far.
- DELTA: each response holds only the outputs that advanced, and only their new part; an
  output that finishes appears once more with its finish_reason even when nothing is new.
- FINAL_ONLY: a single response, once every child has finished.

Whatever the kind, the text of each index concatenated over the DELTA responses equals the
FINAL_ONLY text, which equals the last CUMULATIVE response's.

Usage: prompt_tokens counts the prompt once; completion_tokens sums the children's tokens;
cached_prompt_tokens is the largest count any child found in the prefix cache. The children
share one prompt, so this is the parent's cached prompt, reported once as vLLM does, whether
the first child or a later one (after its siblings filled the cache) found it.
Every response carries usage so far, not just the last.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from strata.v1 import generate_pb2

ABORT = "abort"


@dataclass
class _ChildOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[generate_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: str = ""
    cached_prompt_tokens: int = 0

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)


class RequestOutputState:
    """The merged outputs of one public request, fed one child update at a time."""

    def __init__(
        self,
        request_id: str,
        n: int,
        output_kind: int,
        want_logprobs: bool,
        prompt_tokens: int,
    ):
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        if output_kind not in generate_pb2.OutputKind.values():
            raise ValueError(f"unknown output kind {output_kind}")
        self.request_id = request_id
        self.output_kind = output_kind
        self.want_logprobs = want_logprobs
        self.prompt_tokens = prompt_tokens
        self._children = [_ChildOutput(i) for i in range(n)]
        self._num_unfinished = n

    @property
    def n(self) -> int:
        return len(self._children)

    @property
    def finished(self) -> bool:
        return self._num_unfinished == 0

    def child_finished(self, index: int) -> bool:
        return self._children[index].finished

    def update(
        self,
        index: int,
        new_text: str = "",
        new_token_ids: Sequence[int] = (),
        new_logprobs: Sequence[generate_pb2.TokenLogprob] = (),
        finish_reason: str = "",
        stop_reason: str = "",
        cached_prompt_tokens: int = 0,
    ) -> generate_pb2.GenerateResponse | None:
        """Record child `index`'s progress; return the response to send now, if any.

        Updates to a child that already finished (late outputs after a stop string, say) are
        ignored.
        """
        child = self._children[index]
        if child.finished:
            return None
        child.cached_prompt_tokens = max(child.cached_prompt_tokens, cached_prompt_tokens)
        if not (new_text or new_token_ids or finish_reason):
            return None
        child.text += new_text
        child.token_ids.extend(new_token_ids)
        if self.want_logprobs:
            child.logprobs.extend(new_logprobs)
        if finish_reason:
            self._finish(child, finish_reason, stop_reason)
        delta = self._completion(
            child, new_text, new_token_ids, new_logprobs if self.want_logprobs else ()
        )
        return self._respond([delta])

    def finish_all_aborted(self) -> generate_pb2.GenerateResponse | None:
        """Finish every running child with "abort" (client gone, scheduler failure, ...).

        Returns the closing response, or None when every child had already finished.
        """
        aborted = [child for child in self._children if not child.finished]
        if not aborted:
            return None
        for child in aborted:
            self._finish(child, ABORT, "")
        return self._respond([self._completion(child, "", (), ()) for child in aborted])

    def snapshot(self) -> generate_pb2.GenerateResponse:
        """Every output whole so far, whatever the output kind."""
        return self._response([self._whole(child) for child in self._children])

    def usage(self) -> generate_pb2.Usage:
        return generate_pb2.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=sum(len(child.token_ids) for child in self._children),
            cached_prompt_tokens=max(child.cached_prompt_tokens for child in self._children),
        )

    def _finish(self, child: _ChildOutput, finish_reason: str, stop_reason: str) -> None:
        child.finish_reason = finish_reason
        child.stop_reason = stop_reason
        self._num_unfinished -= 1

    def _respond(
        self, deltas: list[generate_pb2.CompletionOutput]
    ) -> generate_pb2.GenerateResponse | None:
        if self.output_kind == generate_pb2.DELTA:
            return self._response(deltas)
        if self.output_kind == generate_pb2.FINAL_ONLY and not self.finished:
            return None
        return self.snapshot()

    def _response(
        self, outputs: list[generate_pb2.CompletionOutput]
    ) -> generate_pb2.GenerateResponse:
        return generate_pb2.GenerateResponse(
            request_id=self.request_id,
            outputs=outputs,
            finished=self.finished,
            usage=self.usage(),
        )

    def _whole(self, child: _ChildOutput) -> generate_pb2.CompletionOutput:
        return self._completion(child, child.text, child.token_ids, child.logprobs)

    @staticmethod
    def _completion(
        child: _ChildOutput,
        text: str,
        token_ids: Sequence[int],
        logprobs: Sequence[generate_pb2.TokenLogprob],
    ) -> generate_pb2.CompletionOutput:
        return generate_pb2.CompletionOutput(
            index=child.index,
            text=text,
            token_ids=token_ids,
            finish_reason=child.finish_reason,
            logprobs=logprobs,
            stop_reason=child.stop_reason,
        )
