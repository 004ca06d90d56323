"""When a request stops: one pure function, check_stop, as in vLLM V1 (v1/core/sched/utils.py).

The rules, per sampled token in order: a stop needs min_tokens output tokens before the token;
an eos token stops unless ignore_eos; a stop_token_ids entry stops (and is reported); reaching
max_output_tokens (max_tokens, or max_model_len less the prompt) ends it by length. Tokens after
the one that ends a request are dropped (a verify step samples several, a lookahead may have
computed past a stop).

The scheduler's steady state takes a shortcut that gives the same answer: one sampled token not
in req.stop_check_ids can only end its request by length (Scheduler._append_tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strata.services.scheduler.request import RequestStatus

if TYPE_CHECKING:
    from strata.services.scheduler.request import Request


def check_stop(req: Request, num_output: int, tokens: list[int]) -> tuple[int, RequestStatus | None, int | None]:
    """For `tokens` sampled after req's first num_output output tokens: (how many of them it
    keeps, the status they end it with or None while it runs on, the stop_token_ids entry that
    ended it or None). Reads req's stop criteria only; changes nothing."""
    # Runs for every sequence of every step that takes the general path: plain locals, no properties.
    can_stop_eos = not req.ignore_eos and req.eos_token_ids
    stop_ids, min_tokens, max_out = req.stop_token_ids, req.min_tokens, req.max_output_tokens
    for i, token in enumerate(tokens):
        before = num_output + i
        if before >= min_tokens:  # min_tokens come out before any stop
            if can_stop_eos and token in can_stop_eos:
                return i + 1, RequestStatus.FINISHED_STOPPED, None
            if stop_ids and token in stop_ids:
                return i + 1, RequestStatus.FINISHED_STOPPED, token
        if before + 1 >= max_out:
            return i + 1, RequestStatus.FINISHED_LENGTH, None
    return len(tokens), None, None
