"""Speculative proposals by prompt lookup (n-gram matching), where the token ids are: the scheduler.

The request's last n tokens (n from ngram_max down to ngram_min) are looked up in its prompt plus
output; at the latest earlier occurrence, the k tokens that followed it become the drafts. Text
that repeats or edits a passage of its context (code edits, quotes, extraction) is proposed well.

Each request's tokens live in a numpy buffer that grows as tokens arrive, and the lookup narrows
candidate positions with vectorised comparisons (one per n-gram element), so there is no loop
over the context's tokens.
"""

from __future__ import annotations

import numpy as np

from strata.services.scheduler.request import Request


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, ngram_min: int = 1, ngram_max: int = 4):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError("need 1 <= ngram_min <= ngram_max")
        if num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        self.k = num_speculative_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._tokens: dict[Request, tuple[np.ndarray, int]] = {}  # buffer, tokens filled

    def propose(self, req: Request, max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) drafts to follow req's tokens; [] when nothing matches."""
        tokens = self._token_array(req)
        return propose_from(tokens, min(self.k, max_tokens), self.ngram_min, self.ngram_max)

    def forget(self, req: Request) -> None:
        self._tokens.pop(req, None)

    def _token_array(self, req: Request) -> np.ndarray:
        """req's prompt + output as int32, appending only what arrived since the last call."""
        buffer, filled = self._tokens.get(req, (None, 0))
        num_prompt, out = len(req.prompt_token_ids), req.output_token_ids
        total = num_prompt + len(out)
        if buffer is None or buffer.shape[0] < total:
            grown = np.empty(max(2 * total, 64), dtype=np.int32)
            if buffer is None:
                grown[:num_prompt] = req.prompt_token_ids
                filled = num_prompt
            else:
                grown[:filled] = buffer[:filled]
            buffer = grown
        if filled < total:
            buffer[filled:total] = out[filled - num_prompt :]
        self._tokens[req] = (buffer, total)
        return buffer[:total]


def propose_from(tokens: np.ndarray, k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """The k tokens after the latest earlier occurrence of the longest matching suffix of
    `tokens` (of ngram_max down to ngram_min tokens); fewer when the match is near the end."""
    length = tokens.shape[0]
    if k <= 0:
        return []
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = tokens[length - n :]
        # Start positions of earlier occurrences: [i, i + n) with i + n < length, so at least
        # one token follows each and the suffix itself is excluded.
        candidates = np.flatnonzero(tokens[: length - n] == suffix[0])
        for j in range(1, n):
            if candidates.size == 0:
                break
            candidates = candidates[tokens[candidates + j] == suffix[j]]
        if candidates.size:
            start = int(candidates[-1]) + n
            return tokens[start : start + k].tolist()
    return []
