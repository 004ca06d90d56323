"""One (child) generation request as the scheduler tracks it: what to sample, when to stop, and
its tokens and KV state.

The gateway resolved every default before the request got here (EngineRequest): the sampling
options travel to the workers as they came, and the stop criteria are plain fields the engine loop
reads without touching a message.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from strata.services.scheduler.block_manager import BlockTable
from strata.v1 import engine_pb2

if TYPE_CHECKING:
    from strata.services.scheduler.prefix_sharing import SharingState
    from strata.services.scheduler.prompt_logprobs import PromptLogprobState
    from strata.services.scheduler.speculation.request_state import SpecState


class RequestStatus(enum.Enum):
    # Finished statuses are valued by their engine_pb2.FinishReason; the others never clash with one.
    WAITING = -2
    RUNNING = -1
    FINISHED_STOPPED = engine_pb2.FINISH_REASON_STOP
    FINISHED_LENGTH = engine_pb2.FINISH_REASON_LENGTH
    FINISHED_ABORTED = engine_pb2.FINISH_REASON_ABORT

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)

    @property
    def finish_reason(self) -> int:
        """The engine_pb2.FinishReason: FINISH_REASON_UNSPECIFIED while not finished."""
        return self.value if self.is_finished else engine_pb2.FINISH_REASON_UNSPECIFIED


@dataclass(eq=False)  # identity semantics: requests live in sets, deques and dicts
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: engine_pb2.SamplingOptions  # forwarded to the workers unchanged
    # Stop criteria (EngineRequest.stop), applied by the scheduler.
    max_tokens: int
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    parent_id: str = ""  # requests sharing a prefix (n > 1 children, a prefix group's members)
    shared_prefix_len: int = 0  # with parent_id: prompt tokens shared with the others (0: all but the last)
    group_size: int = 0  # a prefix group's member count (0: not a prefix group)
    arrival: int = -1  # set by Scheduler.add_request: FCFS order and preemption victim order
    arrival_time: float = 0.0  # time.monotonic() at add_request
    queue_seconds: float = 0.0  # arrival to first admission

    # ---- state the scheduler owns
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is written by plans issued so far
    seq_id: int | None = None  # worker-side id of the current admission; None when not admitted
    num_cached_prompt_tokens: int = 0  # prompt tokens found in the cache at first admission
    stop_token_id: int | None = None  # the stop_token_ids entry that ended it, if any
    num_preemptions: int = 0
    num_synced_blocks: int = 0  # leading block-table entries the workers already hold
    in_flight: int = 0  # plans whose result has not come back that include it (2 with lookahead)
    # Pipelined decode: the micro-batch whose plans it runs in (micro_batches.py: PREFILLING while
    # its prompt is unfinished, MIGRATING between two).
    micro_batch: int = 0
    pending_sample: bool = False  # its latest plan samples exactly one token for it
    last_scheduled_step: int = -1
    num_computed_at_step_start: int = 0  # num_computed_tokens before its latest scheduled step
    last_copy_step: int = -1  # latest step that copied one of its blocks on write
    # Derived once by Scheduler.add_request, read every step instead of recomputed:
    max_output_tokens: int = 0  # min(max_tokens, max_model_len - prompt tokens)
    stop_check_ids: frozenset[int] = frozenset()  # tokens that may stop it: eos (unless ignored) and stop ids

    # ---- owned by the block manager (the scheduler only reads it)
    blocks: BlockTable = field(default_factory=BlockTable)

    # ---- each feature's state, in an object of that feature, set by Scheduler.add_request
    spec: SpecState | None = None  # speculation.py: drafts, the draft worker's view of it
    sharing: SharingState | None = None  # prefix_sharing.py: blocks shared and reserved
    prompt_logprobs: PromptLogprobState | None = None  # prompt_logprobs.py: rows asked and received (None: not asked)

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.stop_token_ids = frozenset(self.stop_token_ids)
        self.eos_token_ids = frozenset(self.eos_token_ids)

    @classmethod
    def from_proto(cls, msg: engine_pb2.EngineRequest) -> Request:
        stop = msg.stop
        return cls(
            request_id=msg.request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            sampling=msg.sampling,
            max_tokens=stop.max_tokens,
            min_tokens=stop.min_tokens,
            stop_token_ids=frozenset(stop.stop_token_ids),
            eos_token_ids=frozenset(stop.eos_token_ids),
            ignore_eos=stop.ignore_eos,
            parent_id=msg.parent_id,
            shared_prefix_len=msg.shared_prefix_len,
            group_size=msg.group_size,
            # Tokens produced on a lost replica (data parallelism): admitted as after a preemption.
            output_token_ids=list(msg.resume_output_token_ids),
        )

    @property
    def block_ids(self) -> list[int]:
        return self.blocks.block_ids

    @property
    def shared_len(self) -> int:
        """Prompt tokens shared with the requests of the same parent_id."""
        return self.shared_prefix_len or len(self.prompt_token_ids) - 1

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

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
    def finish_reason(self) -> int:
        return self.status.finish_reason


def arrival_of(req: Request) -> int:
    """The running list's sort key: requests keep their arrival order (preemption victims come
    from its end)."""
    return req.arrival
