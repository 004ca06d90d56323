"""A prompt's logprobs (generate.proto's PromptLogprobs, flat arrays) read position by position:
for the HTTP fronts' JSON shapes and for clients.

The message keeps parallel arrays because the gateway copies them from the scheduler's rows in a
few calls, where one message per position cost the gateway's event loop more than the GPU spent
on the rows; this module gives callers back the per-position view.
"""

from __future__ import annotations

from typing import NamedTuple

from strata.v1 import generate_pb2


class Alternative(NamedTuple):
    token_id: int
    logprob: float


class PromptPosition(NamedTuple):
    """One prompt token: its logprob and rank given the tokens before it (None and 0 for the
    first, which nothing precedes), and the k most likely tokens there, most likely first."""

    token_id: int
    logprob: float | None
    rank: int
    top: tuple[Alternative, ...]


def positions(msg: generate_pb2.PromptLogprobs) -> list[PromptPosition]:
    """Every prompt position of `msg`, in prompt order."""
    ids, k = list(msg.token_ids), msg.num_top
    if not ids:
        return []
    logprobs, ranks = list(msg.logprobs), list(msg.ranks)
    top_ids, top_lps = list(msg.top_token_ids), list(msg.top_logprobs)
    out = [PromptPosition(ids[0], None, 0, ())]
    for i, lp in enumerate(logprobs[: len(ids) - 1]):
        top = tuple(Alternative(t, v) for t, v in zip(top_ids[i * k : i * k + k], top_lps[i * k : i * k + k]))
        out.append(PromptPosition(ids[i + 1], lp, ranks[i], top))
    return out
