from google.protobuf import descriptor_pb2 as _descriptor_pb2
from strata.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConstraintKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONSTRAINT_KIND_NONE: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_JSON_SCHEMA: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_JSON_OBJECT: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_REGEX: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_GRAMMAR: _ClassVar[ConstraintKind]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class StageTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STAGE_TRANSPORT_UNSPECIFIED: _ClassVar[StageTransport]
    STAGE_TRANSPORT_GRPC: _ClassVar[StageTransport]
    STAGE_TRANSPORT_IPC: _ClassVar[StageTransport]
    STAGE_TRANSPORT_DISTRIBUTED: _ClassVar[StageTransport]
CONSTRAINT_KIND_NONE: ConstraintKind
CONSTRAINT_KIND_JSON_SCHEMA: ConstraintKind
CONSTRAINT_KIND_JSON_OBJECT: ConstraintKind
CONSTRAINT_KIND_REGEX: ConstraintKind
CONSTRAINT_KIND_GRAMMAR: ConstraintKind
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
STAGE_TRANSPORT_UNSPECIFIED: StageTransport
STAGE_TRANSPORT_GRPC: StageTransport
STAGE_TRANSPORT_IPC: StageTransport
STAGE_TRANSPORT_DISTRIBUTED: StageTransport
METRIC_FIELD_NUMBER: _ClassVar[int]
metric: _descriptor.FieldDescriptor

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "min_p", "seed", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias_token_ids", "logit_bias_values", "bad_words", "allowed_token_ids", "constraint_kind", "constraint", "prompt_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_KIND_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logit_bias_values: _containers.RepeatedScalarFieldContainer[float]
    bad_words: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenIds]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    constraint_kind: ConstraintKind
    constraint: str
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias_token_ids: _Optional[_Iterable[int]] = ..., logit_bias_values: _Optional[_Iterable[float]] = ..., bad_words: _Optional[_Iterable[_Union[_generate_pb2.TokenIds, _Mapping]]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., constraint_kind: _Optional[_Union[ConstraintKind, str]] = ..., constraint: _Optional[str] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class StopCriteria(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "stop_token_ids", "eos_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class EngineRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "stop", "parent_id", "final_only", "shared_prefix_len", "group_size", "resume_output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    FINAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    SHARED_PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESUME_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingOptions
    stop: StopCriteria
    parent_id: str
    final_only: bool
    shared_prefix_len: int
    group_size: int
    resume_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., stop: _Optional[_Union[StopCriteria, _Mapping]] = ..., parent_id: _Optional[str] = ..., final_only: _Optional[bool] = ..., shared_prefix_len: _Optional[int] = ..., group_size: _Optional[int] = ..., resume_output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EngineOutput(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "stop_token_id", "prompt_tokens", "cached_prompt_tokens", "queue_seconds", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    finish_reason: FinishReason
    stop_token_id: int
    prompt_tokens: int
    cached_prompt_tokens: int
    queue_seconds: float
    prompt_logprobs: PromptLogprobRows
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobRows, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("submit", "cancel")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    submit: _containers.RepeatedCompositeFieldContainer[EngineRequest]
    cancel: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, submit: _Optional[_Iterable[_Union[EngineRequest, _Mapping]]] = ..., cancel: _Optional[_Iterable[str]] = ...) -> None: ...

class SessionOutputs(_message.Message):
    __slots__ = ("outputs", "failures")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[EngineOutput]
    failures: _containers.RepeatedCompositeFieldContainer[SessionFailure]
    def __init__(self, outputs: _Optional[_Iterable[_Union[EngineOutput, _Mapping]]] = ..., failures: _Optional[_Iterable[_Union[SessionFailure, _Mapping]]] = ...) -> None: ...

class SessionFailure(_message.Message):
    __slots__ = ("request_id", "code", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class PromptLogprobRows(_message.Message):
    __slots__ = ("num_top", "logprobs", "ranks", "top_token_ids", "top_logprobs")
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    num_top: int
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, num_top: _Optional[int] = ..., logprobs: _Optional[_Iterable[float]] = ..., ranks: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricSpec(_message.Message):
    __slots__ = ("help", "counter", "name", "label")
    HELP_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    help: str
    counter: bool
    name: str
    label: str
    def __init__(self, help: _Optional[str] = ..., counter: _Optional[bool] = ..., name: _Optional[str] = ..., label: _Optional[str] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_kv_blocks", "free_kv_blocks", "cached_kv_blocks", "used_kv_blocks", "peak_used_kv_blocks", "running", "waiting", "prefix_cache_queries", "prefix_cache_hits", "prefill_tokens_computed", "decode_tokens_computed", "steps", "preemptions", "finished_requests", "gpu_idle_fraction", "pipeline_stages", "lookahead_decodes", "busy_seconds", "worker_gpu_busy_seconds", "worker_gpu_idle_seconds", "worker_timed_steps", "worker_launch_seconds", "spec_decode_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens", "spec_decode_accepted_per_position", "spec_decode_acceptance_rate", "spec_decode_verify_steps", "host_seconds", "spec_decode_verify_rounds", "spec_decode_linked_proposals", "spec_decode_failed_proposals", "prompt_logprob_positions", "waiting_tokens", "running_tokens", "resumed_requests", "micro_batches", "micro_batch_migrations", "micro_batch_rounds", "micro_batch_token_spread", "repeated_plans", "plan_round_trip_seconds", "wait_at_limit_seconds", "wait_below_limit_seconds")
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PEAK_USED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    GPU_IDLE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_STAGES_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_DECODES_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_GPU_BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_GPU_IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKER_TIMED_STEPS_FIELD_NUMBER: _ClassVar[int]
    WORKER_LAUNCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_VERIFY_STEPS_FIELD_NUMBER: _ClassVar[int]
    HOST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_VERIFY_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_LINKED_PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_FAILED_PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MICRO_BATCH_TOKEN_SPREAD_FIELD_NUMBER: _ClassVar[int]
    REPEATED_PLANS_FIELD_NUMBER: _ClassVar[int]
    PLAN_ROUND_TRIP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_AT_LIMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_BELOW_LIMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    free_kv_blocks: int
    cached_kv_blocks: int
    used_kv_blocks: int
    peak_used_kv_blocks: int
    running: int
    waiting: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefill_tokens_computed: int
    decode_tokens_computed: int
    steps: int
    preemptions: int
    finished_requests: int
    gpu_idle_fraction: float
    pipeline_stages: int
    lookahead_decodes: int
    busy_seconds: float
    worker_gpu_busy_seconds: float
    worker_gpu_idle_seconds: float
    worker_timed_steps: int
    worker_launch_seconds: float
    spec_decode_drafts: int
    spec_decode_draft_tokens: int
    spec_decode_accepted_tokens: int
    spec_decode_accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    spec_decode_acceptance_rate: float
    spec_decode_verify_steps: int
    host_seconds: float
    spec_decode_verify_rounds: int
    spec_decode_linked_proposals: int
    spec_decode_failed_proposals: int
    prompt_logprob_positions: int
    waiting_tokens: int
    running_tokens: int
    resumed_requests: int
    micro_batches: int
    micro_batch_migrations: int
    micro_batch_rounds: int
    micro_batch_token_spread: float
    repeated_plans: int
    plan_round_trip_seconds: float
    wait_at_limit_seconds: float
    wait_below_limit_seconds: float
    def __init__(self, num_kv_blocks: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., cached_kv_blocks: _Optional[int] = ..., used_kv_blocks: _Optional[int] = ..., peak_used_kv_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefill_tokens_computed: _Optional[int] = ..., decode_tokens_computed: _Optional[int] = ..., steps: _Optional[int] = ..., preemptions: _Optional[int] = ..., finished_requests: _Optional[int] = ..., gpu_idle_fraction: _Optional[float] = ..., pipeline_stages: _Optional[int] = ..., lookahead_decodes: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., worker_gpu_busy_seconds: _Optional[float] = ..., worker_gpu_idle_seconds: _Optional[float] = ..., worker_timed_steps: _Optional[int] = ..., worker_launch_seconds: _Optional[float] = ..., spec_decode_drafts: _Optional[int] = ..., spec_decode_draft_tokens: _Optional[int] = ..., spec_decode_accepted_tokens: _Optional[int] = ..., spec_decode_accepted_per_position: _Optional[_Iterable[int]] = ..., spec_decode_acceptance_rate: _Optional[float] = ..., spec_decode_verify_steps: _Optional[int] = ..., host_seconds: _Optional[float] = ..., spec_decode_verify_rounds: _Optional[int] = ..., spec_decode_linked_proposals: _Optional[int] = ..., spec_decode_failed_proposals: _Optional[int] = ..., prompt_logprob_positions: _Optional[int] = ..., waiting_tokens: _Optional[int] = ..., running_tokens: _Optional[int] = ..., resumed_requests: _Optional[int] = ..., micro_batches: _Optional[int] = ..., micro_batch_migrations: _Optional[int] = ..., micro_batch_rounds: _Optional[int] = ..., micro_batch_token_spread: _Optional[float] = ..., repeated_plans: _Optional[int] = ..., plan_round_trip_seconds: _Optional[float] = ..., wait_at_limit_seconds: _Optional[float] = ..., wait_below_limit_seconds: _Optional[float] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerDescription(_message.Message):
    __slots__ = ("stage_index", "num_stages", "layer_start", "layer_end", "num_kv_blocks", "block_size", "model", "device", "model_fingerprint", "draft", "location", "previous_stage_transport", "next_stage_transport", "tensor_parallel_size", "tensor_parallel_rank", "tensor_parallel_peers", "tensor_parallel_plan_port")
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_STAGES_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    LOCATION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_STAGE_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NEXT_STAGE_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_PEERS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_PLAN_PORT_FIELD_NUMBER: _ClassVar[int]
    stage_index: int
    num_stages: int
    layer_start: int
    layer_end: int
    num_kv_blocks: int
    block_size: int
    model: _generate_pb2.ModelInfo
    device: str
    model_fingerprint: str
    draft: bool
    location: WorkerLocation
    previous_stage_transport: StageTransport
    next_stage_transport: StageTransport
    tensor_parallel_size: int
    tensor_parallel_rank: int
    tensor_parallel_peers: _containers.RepeatedScalarFieldContainer[str]
    tensor_parallel_plan_port: int
    def __init__(self, stage_index: _Optional[int] = ..., num_stages: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., model: _Optional[_Union[_generate_pb2.ModelInfo, _Mapping]] = ..., device: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., draft: _Optional[bool] = ..., location: _Optional[_Union[WorkerLocation, _Mapping]] = ..., previous_stage_transport: _Optional[_Union[StageTransport, str]] = ..., next_stage_transport: _Optional[_Union[StageTransport, str]] = ..., tensor_parallel_size: _Optional[int] = ..., tensor_parallel_rank: _Optional[int] = ..., tensor_parallel_peers: _Optional[_Iterable[str]] = ..., tensor_parallel_plan_port: _Optional[int] = ...) -> None: ...

class WorkerLocation(_message.Message):
    __slots__ = ("hostname", "boot_id", "ipc_namespace", "device_uuid", "visible_device_uuids", "mps")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    IPC_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    VISIBLE_DEVICE_UUIDS_FIELD_NUMBER: _ClassVar[int]
    MPS_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    boot_id: str
    ipc_namespace: str
    device_uuid: str
    visible_device_uuids: _containers.RepeatedScalarFieldContainer[str]
    mps: bool
    def __init__(self, hostname: _Optional[str] = ..., boot_id: _Optional[str] = ..., ipc_namespace: _Optional[str] = ..., device_uuid: _Optional[str] = ..., visible_device_uuids: _Optional[_Iterable[str]] = ..., mps: _Optional[bool] = ...) -> None: ...

class InitCacheRequest(_message.Message):
    __slots__ = ("num_kv_blocks", "next_stage_address", "session", "previous_stage_transport", "previous_stage_address", "next_stage_link", "transport_timeout_seconds")
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_STAGE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_STAGE_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_STAGE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NEXT_STAGE_LINK_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_kv_blocks: int
    next_stage_address: str
    session: int
    previous_stage_transport: StageTransport
    previous_stage_address: str
    next_stage_link: StageLink
    transport_timeout_seconds: float
    def __init__(self, num_kv_blocks: _Optional[int] = ..., next_stage_address: _Optional[str] = ..., session: _Optional[int] = ..., previous_stage_transport: _Optional[_Union[StageTransport, str]] = ..., previous_stage_address: _Optional[str] = ..., next_stage_link: _Optional[_Union[StageLink, _Mapping]] = ..., transport_timeout_seconds: _Optional[float] = ...) -> None: ...

class InitCacheReply(_message.Message):
    __slots__ = ("previous_stage_link",)
    PREVIOUS_STAGE_LINK_FIELD_NUMBER: _ClassVar[int]
    previous_stage_link: StageLink
    def __init__(self, previous_stage_link: _Optional[_Union[StageLink, _Mapping]] = ...) -> None: ...

class StageLink(_message.Message):
    __slots__ = ("transport", "session", "rendezvous_address", "backend", "ring", "slots", "slot_elements", "dtype", "device_uuid", "ready_events", "consumed_events", "doorbell_path", "host_ring_path", "parts", "slot_words_path", "doorbell_port", "doorbell_secret", "rank_links", "worker_address")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RING_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    READY_EVENTS_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_EVENTS_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_PATH_FIELD_NUMBER: _ClassVar[int]
    HOST_RING_PATH_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_WORDS_PATH_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_PORT_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_SECRET_FIELD_NUMBER: _ClassVar[int]
    RANK_LINKS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    transport: StageTransport
    session: int
    rendezvous_address: str
    backend: str
    ring: CudaIpcMemory
    slots: int
    slot_elements: int
    dtype: str
    device_uuid: str
    ready_events: _containers.RepeatedScalarFieldContainer[bytes]
    consumed_events: _containers.RepeatedScalarFieldContainer[bytes]
    doorbell_path: str
    host_ring_path: str
    parts: int
    slot_words_path: str
    doorbell_port: int
    doorbell_secret: bytes
    rank_links: _containers.RepeatedCompositeFieldContainer[StageLink]
    worker_address: str
    def __init__(self, transport: _Optional[_Union[StageTransport, str]] = ..., session: _Optional[int] = ..., rendezvous_address: _Optional[str] = ..., backend: _Optional[str] = ..., ring: _Optional[_Union[CudaIpcMemory, _Mapping]] = ..., slots: _Optional[int] = ..., slot_elements: _Optional[int] = ..., dtype: _Optional[str] = ..., device_uuid: _Optional[str] = ..., ready_events: _Optional[_Iterable[bytes]] = ..., consumed_events: _Optional[_Iterable[bytes]] = ..., doorbell_path: _Optional[str] = ..., host_ring_path: _Optional[str] = ..., parts: _Optional[int] = ..., slot_words_path: _Optional[str] = ..., doorbell_port: _Optional[int] = ..., doorbell_secret: _Optional[bytes] = ..., rank_links: _Optional[_Iterable[_Union[StageLink, _Mapping]]] = ..., worker_address: _Optional[str] = ...) -> None: ...

class CudaIpcMemory(_message.Message):
    __slots__ = ("device", "handle", "size_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device: int
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device: _Optional[int] = ..., handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "sampling", "num_prompt_tokens", "history_start", "history_token_ids", "prefix_token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_START_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    sampling: SamplingOptions
    num_prompt_tokens: int
    history_start: int
    history_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefix_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., history_start: _Optional[int] = ..., history_token_ids: _Optional[_Iterable[int]] = ..., prefix_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "new_sequences", "released_seq_ids", "seq_ids", "num_computed", "num_scheduled", "input_token_ids", "table_keep", "table_append_counts", "table_append_ids", "sample", "num_draft_tokens", "copy_src_blocks", "copy_dst_blocks", "propose_tokens", "shared_kv_run", "shared_kv_run_lens", "propose_drafts", "rejected_drafts", "after_idle", "verify_rounds", "linked_drafts", "prompt_logprob_offsets", "prompt_logprob_counts", "prompt_logprob_token_ids")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RELEASED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    INPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TABLE_KEEP_FIELD_NUMBER: _ClassVar[int]
    TABLE_APPEND_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TABLE_APPEND_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COPY_SRC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COPY_DST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SHARED_KV_RUN_FIELD_NUMBER: _ClassVar[int]
    SHARED_KV_RUN_LENS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    AFTER_IDLE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LINKED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    released_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled: _containers.RepeatedScalarFieldContainer[int]
    input_token_ids: _containers.RepeatedScalarFieldContainer[int]
    table_keep: _containers.RepeatedScalarFieldContainer[int]
    table_append_counts: _containers.RepeatedScalarFieldContainer[int]
    table_append_ids: _containers.RepeatedScalarFieldContainer[int]
    sample: _containers.RepeatedScalarFieldContainer[bool]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    copy_src_blocks: _containers.RepeatedScalarFieldContainer[int]
    copy_dst_blocks: _containers.RepeatedScalarFieldContainer[int]
    propose_tokens: int
    shared_kv_run: _containers.RepeatedScalarFieldContainer[int]
    shared_kv_run_lens: _containers.RepeatedScalarFieldContainer[int]
    propose_drafts: _containers.RepeatedScalarFieldContainer[int]
    rejected_drafts: _containers.RepeatedScalarFieldContainer[int]
    after_idle: bool
    verify_rounds: _containers.RepeatedScalarFieldContainer[int]
    linked_drafts: bool
    prompt_logprob_offsets: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprob_counts: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprob_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step_id: _Optional[int] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., released_seq_ids: _Optional[_Iterable[int]] = ..., seq_ids: _Optional[_Iterable[int]] = ..., num_computed: _Optional[_Iterable[int]] = ..., num_scheduled: _Optional[_Iterable[int]] = ..., input_token_ids: _Optional[_Iterable[int]] = ..., table_keep: _Optional[_Iterable[int]] = ..., table_append_counts: _Optional[_Iterable[int]] = ..., table_append_ids: _Optional[_Iterable[int]] = ..., sample: _Optional[_Iterable[bool]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., copy_src_blocks: _Optional[_Iterable[int]] = ..., copy_dst_blocks: _Optional[_Iterable[int]] = ..., propose_tokens: _Optional[int] = ..., shared_kv_run: _Optional[_Iterable[int]] = ..., shared_kv_run_lens: _Optional[_Iterable[int]] = ..., propose_drafts: _Optional[_Iterable[int]] = ..., rejected_drafts: _Optional[_Iterable[int]] = ..., after_idle: _Optional[bool] = ..., verify_rounds: _Optional[_Iterable[int]] = ..., linked_drafts: _Optional[bool] = ..., prompt_logprob_offsets: _Optional[_Iterable[int]] = ..., prompt_logprob_counts: _Optional[_Iterable[int]] = ..., prompt_logprob_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "seq_ids", "num_tokens", "token_ids", "logprobs", "num_top", "top_token_ids", "top_logprobs", "execute_seconds", "error", "gpu_seconds", "gpu_idle_seconds", "launch_seconds", "num_proposed", "proposed_token_ids", "peer_lost", "round_num_tokens", "round_num_proposed", "prompt_logprobs", "prompt_logprob_ranks", "prompt_top_token_ids", "prompt_top_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    GPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GPU_IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PEER_LOST_FIELD_NUMBER: _ClassVar[int]
    ROUND_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUND_NUM_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROB_RANKS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    num_top: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    execute_seconds: float
    error: str
    gpu_seconds: float
    gpu_idle_seconds: float
    launch_seconds: float
    num_proposed: _containers.RepeatedScalarFieldContainer[int]
    proposed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    peer_lost: bool
    round_num_tokens: _containers.RepeatedScalarFieldContainer[int]
    round_num_proposed: _containers.RepeatedScalarFieldContainer[int]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_logprob_ranks: _containers.RepeatedScalarFieldContainer[int]
    prompt_top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, step_id: _Optional[int] = ..., seq_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., num_top: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., execute_seconds: _Optional[float] = ..., error: _Optional[str] = ..., gpu_seconds: _Optional[float] = ..., gpu_idle_seconds: _Optional[float] = ..., launch_seconds: _Optional[float] = ..., num_proposed: _Optional[_Iterable[int]] = ..., proposed_token_ids: _Optional[_Iterable[int]] = ..., peer_lost: _Optional[bool] = ..., round_num_tokens: _Optional[_Iterable[int]] = ..., round_num_proposed: _Optional[_Iterable[int]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_logprob_ranks: _Optional[_Iterable[int]] = ..., prompt_top_token_ids: _Optional[_Iterable[int]] = ..., prompt_top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Activations(_message.Message):
    __slots__ = ("step_id", "hidden", "residual", "error", "session", "via_transport", "slot")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    VIA_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    hidden: Tensor
    residual: Tensor
    error: str
    session: int
    via_transport: bool
    slot: int
    def __init__(self, step_id: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., residual: _Optional[_Union[Tensor, _Mapping]] = ..., error: _Optional[str] = ..., session: _Optional[int] = ..., via_transport: _Optional[bool] = ..., slot: _Optional[int] = ...) -> None: ...

class ForwardAck(_message.Message):
    __slots__ = ("step_id", "slot")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    slot: int
    def __init__(self, step_id: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class TokenLinkRequest(_message.Message):
    __slots__ = ("session", "transport", "send", "peer_address", "link", "transport_timeout_seconds", "drafts")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SEND_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    session: int
    transport: StageTransport
    send: bool
    peer_address: str
    link: StageLink
    transport_timeout_seconds: float
    drafts: bool
    def __init__(self, session: _Optional[int] = ..., transport: _Optional[_Union[StageTransport, str]] = ..., send: _Optional[bool] = ..., peer_address: _Optional[str] = ..., link: _Optional[_Union[StageLink, _Mapping]] = ..., transport_timeout_seconds: _Optional[float] = ..., drafts: _Optional[bool] = ...) -> None: ...

class TokenLinkReply(_message.Message):
    __slots__ = ("link",)
    LINK_FIELD_NUMBER: _ClassVar[int]
    link: StageLink
    def __init__(self, link: _Optional[_Union[StageLink, _Mapping]] = ...) -> None: ...

class SampledTokens(_message.Message):
    __slots__ = ("step_id", "session", "tokens", "via_transport", "slot", "error")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    VIA_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    session: int
    tokens: Tensor
    via_transport: bool
    slot: int
    error: str
    def __init__(self, step_id: _Optional[int] = ..., session: _Optional[int] = ..., tokens: _Optional[_Union[Tensor, _Mapping]] = ..., via_transport: _Optional[bool] = ..., slot: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class TokenCredit(_message.Message):
    __slots__ = ("session", "step_id", "slot", "hello")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    session: int
    step_id: int
    slot: int
    hello: bool
    def __init__(self, session: _Optional[int] = ..., step_id: _Optional[int] = ..., slot: _Optional[int] = ..., hello: _Optional[bool] = ...) -> None: ...

class WorkerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("stage_index", "steps", "busy_seconds", "idle_seconds", "timed_steps", "launch_seconds", "input_wait_seconds", "token_wait_seconds", "token_waits", "activation_steps_sent", "activation_bytes_sent", "activation_send_seconds", "token_steps_sent", "token_bytes_sent", "token_send_seconds", "step_thread_cpu_seconds", "process_cpu_seconds", "gpu_wait_seconds", "gpu_waits")
    STAGE_INDEX_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIMED_STEPS_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INPUT_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_WAITS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_STEPS_SENT_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STEPS_SENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_THREAD_CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROCESS_CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GPU_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GPU_WAITS_FIELD_NUMBER: _ClassVar[int]
    stage_index: int
    steps: int
    busy_seconds: float
    idle_seconds: float
    timed_steps: int
    launch_seconds: float
    input_wait_seconds: float
    token_wait_seconds: float
    token_waits: int
    activation_steps_sent: int
    activation_bytes_sent: int
    activation_send_seconds: float
    token_steps_sent: int
    token_bytes_sent: int
    token_send_seconds: float
    step_thread_cpu_seconds: float
    process_cpu_seconds: float
    gpu_wait_seconds: float
    gpu_waits: int
    def __init__(self, stage_index: _Optional[int] = ..., steps: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., idle_seconds: _Optional[float] = ..., timed_steps: _Optional[int] = ..., launch_seconds: _Optional[float] = ..., input_wait_seconds: _Optional[float] = ..., token_wait_seconds: _Optional[float] = ..., token_waits: _Optional[int] = ..., activation_steps_sent: _Optional[int] = ..., activation_bytes_sent: _Optional[int] = ..., activation_send_seconds: _Optional[float] = ..., token_steps_sent: _Optional[int] = ..., token_bytes_sent: _Optional[int] = ..., token_send_seconds: _Optional[float] = ..., step_thread_cpu_seconds: _Optional[float] = ..., process_cpu_seconds: _Optional[float] = ..., gpu_wait_seconds: _Optional[float] = ..., gpu_waits: _Optional[int] = ...) -> None: ...
