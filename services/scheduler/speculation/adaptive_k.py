"""Each request's k (drafts per verify step) from its acceptance so far, and the tokens a verify
step of k drafts is expected to emit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from strata.services.scheduler.speculation.request_state import SpecState

if TYPE_CHECKING:
    from strata.services.scheduler.request import Request


def expected_tokens(alpha: float, k: float) -> float:
    """Tokens one verification of k drafts emits when each draft is accepted with probability
    alpha once those before it were (a geometric run, plus the target's own token)."""
    if alpha >= 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


class AdaptiveK:
    """Each request's k, from its drafts so far.

    A proposal's drafts are accepted left to right until the first miss, so a request's record
    is a run of accepted drafts and (unless all were) one miss per verify step: alpha, the chance
    that a draft is accepted once the ones before it were, is accepted / (accepted + missed),
    over decayed counts (recent steps weigh more) with a prior of 2 / 3. A proposal also holds
    only the drafts the lookup found (`found`, decayed, one more where it filled every slot: it
    may have found more). Verifying k slots then emits expected_tokens(alpha, min(k, found)),
    and k maximises that per unit of the step's cost, (1 + f + c k) decode steps: f the fixed
    part of a verify step's extra cost and c one more position's (the cost model's, at the
    current batch: at batch 1 a verify step costs about the same whatever its k, where the
    weights' read dominates; at batch 64 its cost grows with k). Where no k beats a plain decode (alpha
    too low, or nothing found), k is 0: the request proposes nothing for `backoff` tokens (16,
    doubling while it keeps failing), then tries again."""

    DECAY = 0.8
    PRIOR_ACCEPTED, PRIOR_MISSED = 2.0, 1.0
    MIN_BACKOFF, MAX_BACKOFF = 16, 512

    def __init__(self, k: int, all_or_nothing: bool = False) -> None:
        self.k = k
        self.all_or_nothing = all_or_nothing  # a draft model proposes k tokens or none

    def alpha(self, spec: SpecState) -> float:
        return (spec.accepted + self.PRIOR_ACCEPTED) / (
            spec.accepted + spec.missed + self.PRIOR_ACCEPTED + self.PRIOR_MISSED
        )

    def record(self, req: Request, num_draft: int, valid: int, accepted: int, cost: tuple[float, float]) -> None:
        spec = req.spec
        spec.accepted = spec.accepted * self.DECAY + accepted
        spec.missed = spec.missed * self.DECAY + (1 if accepted < valid else 0)
        seen = valid + (1 if valid == num_draft else 0)
        spec.found = seen if spec.found < 0 else spec.found * self.DECAY + seen * (1 - self.DECAY)
        alpha = self.alpha(spec)
        fixed, c = cost
        c = max(c, 1e-3)
        candidates = (self.k,) if self.all_or_nothing else range(1, self.k + 1)
        best_k, best, best_tokens = 0, 1.0, 1.0
        for k in candidates:
            tokens = expected_tokens(alpha, min(k, spec.found))
            value = tokens / (1 + fixed + c * k)
            if value > best * 1.02:
                best_k, best, best_tokens = k, value, tokens
            if k >= spec.found:
                break  # a larger k finds no more drafts: it only costs more
        spec.expected = best_tokens
        if best_k == 0 and spec.k > 0:
            spec.backoff = min(max(2 * spec.backoff, self.MIN_BACKOFF), self.MAX_BACKOFF)
            spec.retry_at = len(req.output_token_ids) + spec.backoff
        elif best_k > 0 and alpha > 0.5:
            spec.backoff = 0
        spec.k = best_k

    def resume(self, spec: SpecState) -> None:
        """Its backoff is over: it proposes again, from the prior."""
        spec.accepted = spec.missed = 0.0
        spec.found = -1.0
        spec.k = self.k if self.all_or_nothing else max(1, self.k // 2)
        spec.expected = expected_tokens(self.alpha(spec), spec.k)
