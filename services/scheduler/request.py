"""One (child) generation request as the scheduler tracks it: settings, tokens and KV state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)

    @property
    def finish_reason(self) -> str | None:
        """"stop", "length" or "abort" once finished, else None."""
        return self.value if self.is_finished else None


@dataclass(eq=False)  # identity semantics: requests live in sets, deques and dicts
class Request:
    request_id: str
    prompt_token_ids: list[int]
    # Sampling options, sent to the workers once per admitted sequence.
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    logprobs: int = -1  # -1: none; k >= 0: the sampled token's logprob + top k
    # Stop conditions, applied by the scheduler.
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    parent_id: str = ""  # children of one n > 1 request share it (and the prompt)
    arrival: int = -1  # set by Scheduler.add_request: FCFS order and preemption victim order

    # ---- state the scheduler owns
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is written by plans issued so far
    seq_id: int | None = None  # worker-side id of the current admission; None when not admitted
    block_ids: list[int] = field(default_factory=list)  # block table (scheduler's view)
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the cache at first admission
    stop_reason: int | None = None  # the stop token id that ended it, if any
    # Speculative tokens proposed for the next step (set by a proposer, consumed by schedule()).
    draft_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0

    # ---- bookkeeping shared by the scheduler and the block manager
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_hashed_blocks: int = 0  # leading table entries already offered to the prefix cache
    num_synced_blocks: int = 0  # leading table entries the workers already hold
    in_flight: int = 0  # plans whose result has not come back that include it (2 with lookahead)
    pending_sample: bool = False  # its latest plan samples exactly one token for it
    last_scheduled_step: int = -1
    num_computed_at_step_start: int = 0  # num_computed_tokens before its latest scheduled step
    last_copy_step: int = -1  # latest step that copied one of its blocks on write
    # Derived once by Scheduler.add_request, read every step instead of recomputed:
    max_output_tokens: int = 0  # min(max_tokens, max_model_len - prompt tokens)
    stop_check_ids: frozenset[int] = frozenset()  # tokens that may stop it: eos (unless ignored) and stop ids

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.stop_token_ids = frozenset(self.stop_token_ids)
        self.eos_token_ids = frozenset(self.eos_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole sequence."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason
