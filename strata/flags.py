"""Command-line flags shared by the CLI, the launcher and the benchmarks: one table of every
service flag with its default, and the argv that turns settings back into those flags.

Every service flag can also come from an environment variable (shown in --help), so the same
command works in containers. `strata.cli` builds the whole `strata` command from the table
(`add_service_parsers`); `strata serve` (strata.launcher) and the benchmarks build the argv of
the services they start with `argv_for`, and the benchmarks take their cluster flags' defaults
from `DEFAULTS`, so a default is written here only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterable, Mapping


def env(name: str, default=None, cast=str):
    value = os.environ.get(name)
    return cast(value) if value not in (None, "") else default


def _bool(v: str) -> bool:
    return v.lower() in ("1", "true", "yes", "on")


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def add_flag(p: argparse.ArgumentParser, flag: str, env_var: str, default, help: str, type=str, **kw):
    """A flag whose default comes from env_var when that is set."""
    p.add_argument(flag, default=env(env_var, default, type), type=type, help=f"{help} [env {env_var}]", **kw)


@dataclasses.dataclass(frozen=True)
class Flag:
    """One service flag: `--name-with-dashes`, read from env_var when that is set. type bool is
    a switch (store_true)."""

    env_var: str
    default: object
    help: str
    type: type = str
    choices: tuple | None = None


# Every service flag, by its argparse dest, with its default. Commands that share a flag share
# its entry; where one command's default differs (bind address, port), its parser says so.
FLAGS: dict[str, Flag] = {
    # -------------------------------------------------------------- every service
    "host": Flag("STRATA_HOST", "0.0.0.0", "bind address"),
    "port": Flag("STRATA_PORT", 50051, "port", int),
    "cluster_token": Flag(
        "STRATA_CLUSTER_TOKEN",
        None,
        "token every internal RPC carries and every internal service requires ('authorization: Bearer TOKEN'); "
        "strata serve generates one for the processes it starts",
    ),
    "model": Flag(
        "STRATA_MODEL",
        None,
        "HF model directory (config.json, *.safetensors, tokenizer files), or 'dummy:PRESET' for random weights "
        "of a preset's shape (llama-3.2-1b, llama-3-8b, qwen3-8b, qwen3-30b-a3b, gemma-3-12b); unset: the "
        "embedded default model",
    ),
    # -------------------------------------------------------------- `strata serve`
    "pipeline_stages": Flag("STRATA_PIPELINE_STAGES", 1, "number of pipeline stages (one worker process each)", int),
    "tensor_parallel_size": Flag(
        "STRATA_TENSOR_PARALLEL_SIZE",
        1,
        "GPUs (worker processes) per pipeline stage: every layer's heads, MLP and vocabulary are split over "
        "them, with one all-reduce per pair of linears, so a token takes less time; rank 0 of each stage "
        "speaks to the scheduler and relays its plans to the others. strata serve places rank t of stage i of "
        "replica r on GPU (r x stages + i) x size + t (ranks of a stage side by side); the size must divide the "
        "model's attention heads",
        int,
    ),
    "data_parallel_size": Flag(
        "STRATA_DATA_PARALLEL_SIZE",
        1,
        "data-parallel replicas: this many pipelines, each of --pipeline-stages stages with a scheduler of its "
        "own, behind the one gateway, which routes each request by load with prefix affinity and resumes a lost "
        "replica's requests on another; stage i of replica r on GPU r x stages + i (times --tensor-parallel-size, "
        "plus the rank, with tensor parallelism)",
        int,
    ),
    "restart_limit": Flag(
        "STRATA_RESTART_LIMIT",
        5,
        "a worker or scheduler that exits is started again (its replica recovers: requests resume by recompute) "
        "up to this many times a minute, after which the cluster stops; 0: the cluster stops when any service exits",
        int,
    ),
    "mps": Flag(
        "STRATA_MPS",
        False,
        "start an NVIDIA MPS daemon of this cluster's own for its workers: stages that share a GPU then run "
        "side by side, without the GPU switching between their processes at every hand-off (~150 us each)",
        bool,
    ),
    "draft_model": Flag(
        "STRATA_DRAFT_MODEL",
        None,
        "HF model directory of a smaller model with the target's tokenizer, served by a draft worker "
        "(implies --speculative-method draft)",
    ),
    # -------------------------------------------------------------- step size (workers and scheduler)
    "max_num_seqs": Flag(
        "STRATA_MAX_NUM_SEQS",
        256,
        "most sequences in one step's batch: with one stage, most running at once; with P pipeline stages, "
        "per micro-batch, so up to P + 2 times this many run at once (--pipeline-micro-batches), their KV "
        "spread over the P GPUs (each stage holds 1/P of the layers)",
        int,
    ),
    "max_num_batched_tokens": Flag(
        "STRATA_MAX_NUM_BATCHED_TOKENS",
        2048,
        "token budget of one step (prefill chunks + decodes); with P pipeline stages, of each micro-batch's "
        "step, every stage running one step per micro-batch in turn, prompts' chunks shared out evenly "
        "over the steps of a round",
        int,
    ),
    # -------------------------------------------------------------- workers
    "device": Flag("STRATA_DEVICE", "auto", "cpu, cuda, cuda:N, or auto (cuda when available)"),
    "dtype": Flag("STRATA_DTYPE", "auto", "float32, bfloat16, float16, or auto (bfloat16 on GPU, float32 on CPU)"),
    "block_size": Flag("STRATA_BLOCK_SIZE", 16, "tokens per KV cache block", int),
    "max_model_len": Flag(
        "STRATA_MAX_MODEL_LEN", 0, "longest sequence (prompt + output); 0: the model's max_position_embeddings", int
    ),
    "gpu_memory_utilization": Flag(
        "STRATA_GPU_MEMORY_UTILIZATION",
        0.9,
        "share of GPU memory this worker may use (weights, activations, KV cache)",
        float,
    ),
    "kv_cache_memory_gb": Flag("STRATA_KV_CACHE_MEMORY_GB", 1.0, "KV cache size on CPU, in GiB", float),
    "num_kv_blocks": Flag("STRATA_NUM_KV_BLOCKS", 0, "force this many KV blocks (0: size from memory)", int),
    "enforce_eager": Flag("STRATA_ENFORCE_EAGER", False, "never capture CUDA graphs", bool),
    "piecewise_graph_max_tokens": Flag(
        "STRATA_PIECEWISE_GRAPH_MAX_TOKENS",
        2048,
        "steps that no decode graph serves (prefill chunks beside decodes) replay piecewise CUDA graphs, "
        "attention launched between them, up to this many tokens (capped by --max-num-batched-tokens); "
        "larger steps, which keep the GPU busy anyway, run eagerly; 0: always eagerly",
        int,
    ),
    "profile_output": Flag(
        "STRATA_PROFILE_OUTPUT",
        None,
        "write a torch.profiler table of the GPU work of --profile-steps to this file (diagnostics); a name "
        "holding .json gets a Chrome trace of host and GPU instead",
    ),
    "profile_steps": Flag(
        "STRATA_PROFILE_STEPS",
        "200:100",
        "FIRST:COUNT, the window of steps --profile-output profiles (counted from the worker's start)",
    ),
    "gpu_clock_dir": Flag(
        "STRATA_GPU_CLOCK_DIR",
        None,
        "stamp every step of a GPU worker on the GPU's global clock and write the stamps to this directory, "
        "where python -m strata.bench.gpu_clock DIR places the stages' work against each other "
        "(diagnostics; it slows steps)",
    ),
    "stage_index": Flag("STRATA_STAGE_INDEX", 0, "this worker's pipeline stage (0-based)", int),
    "tensor_parallel_rank": Flag(
        "STRATA_TENSOR_PARALLEL_RANK",
        0,
        "with --tensor-parallel-size: this worker's rank in its stage (0-based); rank 0 is the one the "
        "scheduler's --workers names, the others reach it through --tensor-parallel-master",
        int,
    ),
    "tensor_parallel_master": Flag(
        "STRATA_TENSOR_PARALLEL_MASTER",
        None,
        "with --tensor-parallel-size > 1: host:port of the store that rank 0 of this stage hosts (rank 0 "
        "listens there, every rank of the stage names the same), where the ranks find each other and form "
        "their group",
    ),
    "advertise_address": Flag(
        "STRATA_ADVERTISE_ADDRESS",
        None,
        "host:port at which the other ranks of this worker's stage reach its Worker service (unset: this "
        "host's name and --port)",
    ),
    "tensor_parallel_all_reduce": Flag(
        "STRATA_TENSOR_PARALLEL_ALL_REDUCE",
        "ipc",
        "how a tensor-parallel stage on GPUs sums its ranks' partial outputs (on two H200s, us per 8 KiB call: "
        "ipc 1.87, symm-mem 6.59, nccl 20.66; a stage whose ranks cannot all map each other's buffers falls back "
        "to nccl). nccl: NCCL's all-reduce, captured in the CUDA graphs. symm-mem: a one-shot all-reduce through "
        "torch's symmetric memory, without NVLink multicast, for messages up to 512 KiB (a decode step's; larger "
        "ones take NCCL). ipc: Strata's own one-shot, a Triton kernel over buffers the ranks share by CUDA IPC "
        "(up to 8 MiB with two ranks, an 8B model's batch-512 decode rows, and 512 KiB with more; larger ones "
        "take NCCL), launched as a programmatic dependent so that the next layer's weights stream while the ranks"
        " meet; it also takes the draw's maximum, and sums a row-parallel output in the same launch as the "
        "residual add and RMSNorm after it. gloo: every collective through the hosts, eagerly (no CUDA graphs), "
        "so that ranks may share one GPU, which NCCL refuses: slow, for checking a tensor-parallel stage on one "
        "GPU. python -m strata.bench.all_reduce times the GPU ones per message size",
        choices=("nccl", "symm-mem", "ipc", "gloo"),
    ),
    "tensor_parallel_no_collectives": Flag(
        "STRATA_TENSOR_PARALLEL_NO_COLLECTIVES",
        False,
        "benchmarks only: a tensor-parallel stage's ranks skip every collective (all-reduces and gathers), each "
        "going on with its own partial sums: wrong tokens, but a step's time without its communication "
        "(strata bench tensor-parallel times the all-reduce's share of a decode step so)",
        bool,
    ),
    "tensor_parallel_no_early_send": Flag(
        "STRATA_TENSOR_PARALLEL_NO_EARLY_SEND",
        False,
        "benchmarks only (an A/B): with --tensor-parallel-all-reduce ipc, the batch-1 decode chain's o_proj and "
        "down no longer send their rows to the peers as they end; the one-shot's own launch sends them "
        '(kernels/one_shot_all_reduce.py, "Sent early"). Same tokens',
        bool,
    ),
    "collective_timeout": Flag(
        "STRATA_COLLECTIVE_TIMEOUT",
        60.0,
        "with tensor parallelism: the longest a stage's ranks wait for each other (forming their group, "
        "each all-reduce or gather); a rank lost past it fails the step and the stage is rebuilt",
        float,
    ),
    "num_stages": Flag("STRATA_NUM_STAGES", 1, "number of pipeline stages", int),
    "seed": Flag("STRATA_SEED", 0, "seed of dummy weights", int),
    "role": Flag(
        "STRATA_ROLE",
        "target",
        "'target': a stage of the served model; 'draft': the whole draft model of speculative decoding, "
        "proposing k tokens per call",
        choices=("target", "draft"),
    ),
    "draft_num_layers": Flag(
        "STRATA_DRAFT_NUM_LAYERS",
        0,
        "a draft model made of the target's first N layers plus its final norm and lm_head "
        "(with --role draft, or --speculative-method draft without --draft-model); 0: not used",
        int,
    ),
    # -------------------------------------------------------------- the scheduler's engine
    "workers": Flag("STRATA_WORKERS", "127.0.0.1:50061", "comma-separated worker addresses, in pipeline-stage order"),
    "max_plans_in_flight": Flag(
        "STRATA_MAX_PLANS_IN_FLIGHT",
        0,
        "plans executing at once (0: 3 with one stage; with P stages two per micro-batch, at least P + 1, "
        "or P without pipelined decode); the plans after a request's first are decode lookaheads of it",
        int,
    ),
    "no_pipelined_decode": Flag(
        "STRATA_NO_PIPELINED_DECODE",
        False,
        "with several pipeline stages, every decode waits for its input token to come back through the "
        "scheduler (A/B runs); by default the last stage hands sampled tokens to stage 0 and decodes run ahead",
        bool,
    ),
    "no_plan_pacing": Flag(
        "STRATA_NO_PLAN_PACING",
        False,
        "with one stage, build each plan as soon as a slot in flight frees (A/B runs); by default the next plan "
        "waits while those in flight keep the GPU busy for several decode steps more, so requests that arrive "
        "meanwhile share one prefill step instead of one step each",
        bool,
    ),
    "pipeline_micro_batches": Flag(
        "STRATA_PIPELINE_MICRO_BATCHES",
        0,
        "pipelined decode: the most micro-batches of requests, each up to --max-num-seqs sequences, whose plans "
        "follow each other through the stages (0: stages + 2, or stages where they all share one GPU). How many "
        "run follows the load: one while stages x --micro-batch-min-seqs would not fill them, as many as the "
        "stages while they seat the load, more only when it needs more seats. Workers hold max(4, stages + 2) x "
        "--max-num-seqs sequences, so more than that needs a smaller --max-num-seqs",
        int,
    ),
    "micro_batch_min_seqs": Flag(
        "STRATA_MICRO_BATCH_MIN_SEQS",
        32,
        "pipelined decode: the load runs in one micro-batch until it would give each of the stages' "
        "micro-batches at least this many sequences (a small batch's step costs the weights' read whatever "
        "its size, and one micro-batch's chain of lookahead plans keeps the stages as busy)",
        int,
    ),
    "decode_repeats": Flag(
        "STRATA_DECODE_REPEATS",
        4,
        "pipelined decode: a micro-batch whose every sequence decodes in steady state (nothing waiting or "
        "prefilling) commits to this many plans at once, each later one sent as a repeat of the first one "
        "position further, so the scheduler's per-sequence work is paid once for them (1: every plan built "
        "anew)",
        int,
    ),
    "max_kv_blocks": Flag("STRATA_MAX_KV_BLOCKS", 0, "cap on KV blocks used (0: what the workers offer)", int),
    "no_prefix_caching": Flag("STRATA_NO_PREFIX_CACHING", False, "disable the automatic prefix cache", bool),
    "disable_cascade_attn": Flag(
        "STRATA_DISABLE_CASCADE_ATTN",
        False,
        "never send shared-prefix groups to the workers, so decode attention reads a shared prefix "
        "once per sequence (vLLM's flag; comparisons)",
        bool,
    ),
    "metrics_port": Flag("STRATA_METRICS_PORT", 0, "serve Prometheus metrics on this port (0: off)", int),
    "stage_recovery_timeout": Flag(
        "STRATA_STAGE_RECOVERY_TIMEOUT",
        60.0,
        "seconds requests wait for a lost pipeline stage to come back (the same address, or a replacement) "
        "before they fail with UNAVAILABLE; until then they pause and resume by recompute",
        float,
    ),
    "step_timeout": Flag(
        "STRATA_STEP_TIMEOUT",
        30.0,
        "seconds a step of --max-num-batched-tokens tokens may take before its stage counts as hung (and lost); "
        "smaller steps get a proportional share, at least a tenth, and every step at least 4x the slowest "
        "of the last 64",
        float,
    ),
    "stage_transport": Flag(
        "STRATA_STAGE_TRANSPORT",
        "auto",
        "how activations move between pipeline stages: ipc (one host: CUDA IPC between its GPUs, or a ring in "
        "/dev/shm between CPU stages; each step announced on a socket between the stages' step threads), "
        "distributed (torch.distributed send/recv: NCCL on GPUs, gloo on CPUs; each step announced on a TCP "
        "socket between the stages' step threads), grpc (bytes in the Forward "
        "messages, through the hosts; A/B runs), or auto (ipc where both stages share a host and IPC namespace, "
        "else distributed); chosen per link when the pipeline is built, shown in each worker's Describe",
        choices=("auto", "ipc", "distributed", "grpc"),
    ),
    "draft_worker": Flag(
        "STRATA_DRAFT_WORKER",
        None,
        "host:port of the draft worker (`strata worker --role draft`), with --speculative-method draft",
    ),
    # -------------------------------------------------------------- speculative decoding
    "speculative_method": Flag(
        "STRATA_SPECULATIVE_METHOD",
        None,
        "speculative decoding: 'ngram' (prompt lookup, where --ngram-proposer says) or 'draft' (a draft "
        "model's worker); unset: off. Either way every request gets the tokens it would get without it",
        choices=("ngram", "draft"),
    ),
    "num_speculative_tokens": Flag(
        "STRATA_NUM_SPECULATIVE_TOKENS",
        4,
        "draft tokens proposed per step and sequence (k; the target verifies k + 1 positions)",
        int,
    ),
    "ngram_proposer": Flag(
        "STRATA_NGRAM_PROPOSER",
        "device",
        "where prompt lookup runs: 'device' (the last stage, over each sequence's tokens kept there; "
        "with one stage the drafts never leave the GPU and verify steps go out before the previous "
        "result) or 'scheduler' (on the host, before each plan)",
        choices=("device", "scheduler"),
    ),
    "ngram_min": Flag("STRATA_NGRAM_MIN", 1, "shortest suffix the n-gram proposer matches", int),
    "ngram_max": Flag("STRATA_NGRAM_MAX", 4, "longest suffix the n-gram proposer matches", int),
    "speculative_max_batch": Flag(
        "STRATA_SPECULATIVE_MAX_BATCH",
        64,
        "a cap: running requests above which steps decode without drafts (workers capture verification "
        "graphs up to it). Below it each request's k follows its acceptance and a cost model fed with "
        "measured step times decides per step whether verifying pays",
        int,
    ),
    "speculative_rounds": Flag(
        "STRATA_SPECULATIVE_ROUNDS",
        4,
        "verify rounds per step up to --speculative-rounds-max-batch running requests (prompt lookup on "
        "the device, one stage): the last stage verifies, proposes and verifies again that many times "
        "before the host sees a result, so that one plan's host work serves several verify steps where "
        "the host, not the GPU, bounds the step; 1: one round per step",
        int,
    ),
    "speculative_rounds_max_batch": Flag(
        "STRATA_SPECULATIVE_ROUNDS_MAX_BATCH",
        64,
        "running requests up to which steps run --speculative-rounds verify rounds (with none waiting, "
        "every one decoding and drawing without top-k, top-p, min-p or logprobs)",
        int,
    ),
    "draft_proposals": Flag(
        "STRATA_DRAFT_PROPOSALS",
        "link",
        "where a draft model's proposals go (--speculative-method draft): 'link' (with one target stage, "
        "straight from the draft worker to the target's GPU over a draft link on the stage transport, so "
        "the target's plan goes out with the draft worker's and no host waits for the proposal) or "
        "'scheduler' (back to the scheduler, which writes them into the plan; always so with several "
        "stages)",
        choices=("link", "scheduler"),
    ),
    "no_adaptive_speculation": Flag(
        "STRATA_NO_ADAPTIVE_SPECULATION",
        False,
        "propose k drafts for every request at every step up to --speculative-max-batch, without the "
        "per-request k and the cost model",
        bool,
    ),
    # -------------------------------------------------------------- the gateway
    "scheduler_address": Flag(
        "STRATA_SCHEDULER_ADDRESS",
        "127.0.0.1:50052",
        "scheduler host:port; several, comma-separated, put data-parallel replicas (a scheduler and its "
        "pipeline each, on any hosts) behind this gateway",
    ),
    "replica_failover_seconds": Flag(
        "STRATA_REPLICA_FAILOVER_SECONDS",
        5.0,
        "with several replicas: how long a replica may be NOT_SERVING (rebuilding a lost stage, its requests "
        "paused) before its requests resume on another replica, with the tokens they would have had; a replica "
        "whose scheduler is gone loses them at once",
        float,
    ),
    "tokenizer": Flag(
        "STRATA_TOKENIZER",
        None,
        "HF tokenizer directory the gateway uses (as vLLM's --tokenizer); unset: the model directory's, "
        "or with a dummy model the embedded default model's",
    ),
    "served_model_name": Flag(
        "STRATA_SERVED_MODEL_NAME",
        None,
        "the model's name on both APIs (ModelInfo.model_name, /v1/models, OpenAI's model field); "
        "unset: the model directory's name",
    ),
    "max_request_bytes": Flag(
        "STRATA_MAX_REQUEST_BYTES",
        16 << 20,
        "largest gRPC request message the gateway takes, in bytes (larger: RESOURCE_EXHAUSTED)",
        int,
    ),
    "max_response_bytes": Flag(
        "STRATA_MAX_RESPONSE_BYTES",
        16 << 20,
        "largest part of a response a request's prompt may make, in bytes: its prompt logprobs (and an echoed "
        "prompt over HTTP), estimated after tokenizing; a request past it is refused (INVALID_ARGUMENT, 400) "
        "before it runs",
        int,
    ),
    "max_completion_prompts": Flag(
        "STRATA_MAX_COMPLETION_PROMPTS",
        256,
        "most prompts one /v1/completions request may hold (a list of strings or of token id lists)",
        int,
    ),
    "max_prompt_chars": Flag(
        "STRATA_MAX_PROMPT_CHARS",
        0,
        "longest prompt text, checked before it is tokenized (0: 32 characters per token of the model's context)",
        int,
    ),
    "max_stop_strings": Flag("STRATA_MAX_STOP_STRINGS", 32, "most stop strings (and stop token ids) per request", int),
    "max_stop_length": Flag("STRATA_MAX_STOP_LENGTH", 1024, "longest stop string, in characters", int),
    "http_port": Flag(
        "STRATA_HTTP_PORT",
        8000,
        "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/metrics) on the gateway's host; 0: off",
        int,
    ),
    "api_key": Flag("STRATA_API_KEY", None, "require 'authorization: Bearer KEY' metadata on every call"),
    "tls_cert": Flag("STRATA_TLS_CERT", None, "PEM certificate chain: serve TLS"),
    "tls_key": Flag("STRATA_TLS_KEY", None, "PEM private key for --tls-cert"),
}

# Each flag's default as `strata serve` and the services take it (without environment variables).
DEFAULTS: Mapping[str, object] = {name: flag.default for name, flag in FLAGS.items()}

# Offline batches, whose steps pay off large (`strata batch`, and the throughput and prefix-group
# benchmarks): vLLM's offline step budget on GPUs of >= 70 GiB, and room for a whole batch of
# requests at once where the workload asks for it. bench/RESULTS.md has what the budget gains.
OFFLINE_MAX_NUM_BATCHED_TOKENS = 16384
OFFLINE_MAX_NUM_SEQS = 512

# Groups of flags, by dest: which command takes which, and what `strata serve` forwards to each
# service it starts.
BATCH_FLAGS = ("max_num_seqs", "max_num_batched_tokens")  # workers size buffers and graphs by them
WORKER_FLAGS = (
    "device",
    "dtype",
    "block_size",
    "max_model_len",
    "gpu_memory_utilization",
    "kv_cache_memory_gb",
    "num_kv_blocks",
    *BATCH_FLAGS,
    "enforce_eager",
    "piecewise_graph_max_tokens",
    "profile_output",
    "profile_steps",
    "gpu_clock_dir",
    "collective_timeout",
    "tensor_parallel_all_reduce",
    "tensor_parallel_no_collectives",
    "tensor_parallel_no_early_send",
)
# The scheduler's own flags, which `strata serve` forwards to the scheduler it starts.
ENGINE_FLAGS = (
    "max_plans_in_flight",
    "no_pipelined_decode",
    "no_plan_pacing",
    "pipeline_micro_batches",
    "micro_batch_min_seqs",
    "decode_repeats",
    "max_kv_blocks",
    "no_prefix_caching",
    "disable_cascade_attn",
    "metrics_port",
    "stage_recovery_timeout",
    "step_timeout",
    "stage_transport",
)
# Who proposes drafts and how many: `serve` and the scheduler, and the workers (they size their
# verification graphs, or on a draft worker its decode graphs, by them).
SPECULATIVE_FLAGS = (
    "speculative_method",
    "num_speculative_tokens",
    "ngram_proposer",
    "ngram_min",
    "ngram_max",
    "speculative_max_batch",
    "speculative_rounds",
    "speculative_rounds_max_batch",
    "draft_proposals",
    "no_adaptive_speculation",
)
# The gateway's own flags, which `strata serve` forwards to the gateway it starts.
GATEWAY_FLAGS = (
    "tokenizer",
    "served_model_name",
    "api_key",
    "tls_cert",
    "tls_key",
    "max_request_bytes",
    "max_response_bytes",
    "max_completion_prompts",
    "max_prompt_chars",
    "max_stop_strings",
    "max_stop_length",
    "replica_failover_seconds",
)
# In the order --help lists them.
_GATEWAY_HELP_ORDER = (
    "tokenizer",
    "served_model_name",
    "max_request_bytes",
    "max_response_bytes",
    "max_completion_prompts",
    "max_prompt_chars",
    "max_stop_strings",
    "max_stop_length",
    "http_port",
    "api_key",
    "tls_cert",
    "tls_key",
    "replica_failover_seconds",
)


def option(name: str) -> str:
    """The command-line spelling of a flag's dest: max_num_seqs -> --max-num-seqs."""
    return "--" + name.replace("_", "-")


def add_flags(p, names: Iterable[str], **overrides: dict) -> None:
    """Registers the table's flags `names` on p, each defaulting to its environment variable when
    that is set; overrides: {name: {field: value}} for a command whose default or help differs."""
    for name in names:
        flag = dataclasses.replace(FLAGS[name], **overrides.get(name, {}))
        if flag.type is bool:
            p.add_argument(
                option(name),
                action="store_true",
                default=env(flag.env_var, flag.default, _bool),
                help=f"{flag.help} [env {flag.env_var}]",
            )
        else:
            kw = {"choices": list(flag.choices)} if flag.choices else {}
            add_flag(p, option(name), flag.env_var, flag.default, flag.help, type=flag.type, **kw)


def argv_for(settings, names: Iterable[str]) -> list[str]:
    """The flags `names` of a service that reproduce settings (an argparse namespace or a dict):
    `--flag value`, a true switch as `--flag`; a false switch, None, or a name settings lacks
    gives nothing (the service's default)."""
    values = settings if isinstance(settings, Mapping) else vars(settings)
    argv = []
    for name in names:
        value = values.get(name)
        if value is True:
            argv.append(option(name))
        elif value is not False and value is not None:
            argv += [option(name), str(value)]
    return argv


def add_service_parsers(sub, formatter_class=Formatter) -> None:
    """Registers `serve`, `gateway`, `scheduler` and `worker` on a subparsers object."""
    p = sub.add_parser(
        "serve",
        formatter_class=formatter_class,
        help="start scheduler, workers and gateway on this host as separate processes",
        description="Starts the scheduler, one worker per pipeline stage and the gateway as separate "
        "processes (with --data-parallel-size D, D schedulers, each with its workers, behind the gateway), "
        "waits until all are healthy, prints the gateway address, starts a worker or scheduler that exits "
        "again, and stops them all on Ctrl-C.",
    )
    add_flags(
        p,
        (
            "model",
            "pipeline_stages",
            "tensor_parallel_size",
            "data_parallel_size",
            "restart_limit",
            "mps",
            "host",
            "port",
            *WORKER_FLAGS,
            *ENGINE_FLAGS,
            *SPECULATIVE_FLAGS,
        ),
        host={"default": "127.0.0.1", "help": "gateway bind address"},
        port={"help": "gateway port"},
    )
    add_flags(p, ("draft_model", "draft_num_layers", *_GATEWAY_HELP_ORDER))

    p = sub.add_parser("gateway", formatter_class=formatter_class, help="run the public gateway service")
    add_flags(p, ("model", "host", "port", "scheduler_address", "cluster_token", *_GATEWAY_HELP_ORDER))

    p = sub.add_parser("scheduler", formatter_class=formatter_class, help="run the scheduler service")
    add_flags(
        p,
        ("host", "port", "workers", "cluster_token", *BATCH_FLAGS, *ENGINE_FLAGS, *SPECULATIVE_FLAGS, "draft_worker"),
        port={"default": 50052},
    )

    p = sub.add_parser("worker", formatter_class=formatter_class, help="run one pipeline-stage worker")
    add_flags(
        p,
        (
            "model",
            "host",
            "port",
            "stage_index",
            "cluster_token",
            "num_stages",
            "tensor_parallel_size",
            "tensor_parallel_rank",
            "tensor_parallel_master",
            "advertise_address",
            "seed",
            "role",
            "draft_num_layers",
            "tokenizer",  # the last stage's constrained decoding reads it (a dummy model has none)
            *WORKER_FLAGS,
            *SPECULATIVE_FLAGS,  # sizes the verification (or, on a draft worker, decode) graphs
        ),
        port={"default": 50061},
    )


def service_args(argv: list[str]) -> argparse.Namespace:
    """Parses `serve|gateway|scheduler|worker ...` arguments, as `strata` would."""
    parser = argparse.ArgumentParser(prog="strata")
    add_service_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)
