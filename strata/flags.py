"""Command-line flags shared by the CLI and the benchmarks: each service's flags, defined once.

Every service flag can also come from an environment variable (shown in --help), so the same
command works in containers. `strata.cli` builds the whole `strata` command from these;
`strata.bench` builds the service arguments of the clusters it starts with `service_args`,
without importing the CLI.
"""

from __future__ import annotations

import argparse
import os


def env(name: str, default=None, cast=str):
    value = os.environ.get(name)
    return cast(value) if value not in (None, "") else default


def disabled(switch: str) -> bool:
    """Whether an A/B kernel switch (STRATA_DISABLE_PDL, STRATA_DISABLE_DECODE_CHAIN,
    STRATA_DISABLE_FUSED_DECODE_ATTENTION) is set: any value but "" and "0"."""
    return os.environ.get(switch, "") not in ("", "0")


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def add_flag(p: argparse.ArgumentParser, flag: str, env_var: str, default, help: str, type=str, **kw):
    """A flag whose default comes from env_var when that is set."""
    p.add_argument(flag, default=env(env_var, default, type), type=type, help=f"{help} [env {env_var}]", **kw)


def _cluster_token_flag(p):
    add_flag(
        p,
        "--cluster-token",
        "STRATA_CLUSTER_TOKEN",
        None,
        "token every internal RPC carries and every internal service requires ('authorization: Bearer TOKEN'); "
        "strata serve generates one for the processes it starts",
    )


def _model_flags(p):
    add_flag(
        p,
        "--model",
        "STRATA_MODEL",
        None,
        "HF model directory (config.json, *.safetensors, tokenizer files), or 'dummy:llama-3.2-1b' / "
        "'dummy:llama-3-8b' for random weights of that shape; unset: the embedded default model",
    )


def _batch_flags(p):
    """Shared by workers (they size buffers and CUDA graphs by them) and the scheduler."""
    add_flag(p, "--max-num-seqs", "STRATA_MAX_NUM_SEQS", 256, "most sequences running at once", type=int)
    add_flag(
        p,
        "--max-num-batched-tokens",
        "STRATA_MAX_NUM_BATCHED_TOKENS",
        2048,
        "token budget of one step (prefill chunks + decodes)",
        type=int,
    )


def _worker_flags(p):
    add_flag(p, "--device", "STRATA_DEVICE", "auto", "cpu, cuda, cuda:N, or auto (cuda when available)")
    add_flag(
        p, "--dtype", "STRATA_DTYPE", "auto", "float32, bfloat16, float16, or auto (bfloat16 on GPU, float32 on CPU)"
    )
    add_flag(p, "--block-size", "STRATA_BLOCK_SIZE", 16, "tokens per KV cache block", type=int)
    add_flag(
        p,
        "--max-model-len",
        "STRATA_MAX_MODEL_LEN",
        0,
        "longest sequence (prompt + output); 0: the model's max_position_embeddings",
        type=int,
    )
    add_flag(
        p,
        "--gpu-memory-utilization",
        "STRATA_GPU_MEMORY_UTILIZATION",
        0.9,
        "share of GPU memory this worker may use (weights, activations, KV cache)",
        type=float,
    )
    add_flag(p, "--kv-cache-memory-gb", "STRATA_KV_CACHE_MEMORY_GB", 1.0, "KV cache size on CPU, in GiB", type=float)
    add_flag(
        p, "--num-kv-blocks", "STRATA_NUM_KV_BLOCKS", 0, "force this many KV blocks (0: size from memory)", type=int
    )
    _batch_flags(p)
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        default=env("STRATA_ENFORCE_EAGER", False, _bool),
        help="never capture CUDA graphs [env STRATA_ENFORCE_EAGER]",
    )
    add_flag(
        p,
        "--piecewise-graph-max-tokens",
        "STRATA_PIECEWISE_GRAPH_MAX_TOKENS",
        2048,
        "steps that no decode graph serves (prefill chunks beside decodes) replay piecewise CUDA graphs, "
        "attention launched between them, up to this many tokens (capped by --max-num-batched-tokens); "
        "larger steps, which keep the GPU busy anyway, run eagerly; 0: always eagerly",
        type=int,
    )
    add_flag(
        p,
        "--profile-output",
        "STRATA_PROFILE_OUTPUT",
        None,
        "write a torch.profiler table of the GPU work of --profile-steps to this file (diagnostics)",
    )
    add_flag(
        p,
        "--profile-steps",
        "STRATA_PROFILE_STEPS",
        "200:100",
        "FIRST:COUNT, the window of steps --profile-output profiles (counted from the worker's start)",
    )


def _scheduler_flags(p):
    _batch_flags(p)
    _engine_flags(p)
    add_flag(
        p,
        "--draft-worker",
        "STRATA_DRAFT_WORKER",
        None,
        "host:port of the draft worker (`strata worker --role draft`), with --speculative-method draft",
    )


# The scheduler's own flags, which `strata serve` forwards to the scheduler it starts.
ENGINE_FLAGS = (
    "max_plans_in_flight",
    "max_kv_blocks",
    "no_prefix_caching",
    "disable_cascade_attn",
    "metrics_port",
    "stage_recovery_timeout",
    "step_timeout",
)


def _engine_flags(p):
    """The scheduler's engine, on `strata scheduler` and `strata serve` (ENGINE_FLAGS)."""
    add_flag(
        p,
        "--max-plans-in-flight",
        "STRATA_MAX_PLANS_IN_FLIGHT",
        0,
        "plans executing at once (0: 3 with one stage, else the number of pipeline stages); with one "
        "stage the plans after the first are decode lookaheads of its requests",
        type=int,
    )
    add_flag(
        p, "--max-kv-blocks", "STRATA_MAX_KV_BLOCKS", 0, "cap on KV blocks used (0: what the workers offer)", type=int
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        default=env("STRATA_NO_PREFIX_CACHING", False, _bool),
        help="disable the automatic prefix cache [env STRATA_NO_PREFIX_CACHING]",
    )
    p.add_argument(
        "--disable-cascade-attn",
        action="store_true",
        default=env("STRATA_DISABLE_CASCADE_ATTN", False, _bool),
        help="never send shared-prefix groups to the workers, so decode attention reads a shared prefix "
        "once per sequence (vLLM's flag; comparisons) [env STRATA_DISABLE_CASCADE_ATTN]",
    )
    add_flag(p, "--metrics-port", "STRATA_METRICS_PORT", 0, "serve Prometheus metrics on this port (0: off)", type=int)
    add_flag(
        p,
        "--stage-recovery-timeout",
        "STRATA_STAGE_RECOVERY_TIMEOUT",
        60.0,
        "seconds requests wait for a lost pipeline stage to come back (the same address, or a replacement) "
        "before they fail with UNAVAILABLE; until then they pause and resume by recompute",
        type=float,
    )
    add_flag(
        p,
        "--step-timeout",
        "STRATA_STEP_TIMEOUT",
        30.0,
        "seconds a step of --max-num-batched-tokens tokens may take before its stage counts as hung (and lost); "
        "smaller steps get a proportional share, at least a tenth, and every step at least 4x the slowest "
        "of the last 64",
        type=float,
    )
    _speculative_flags(p)


def _speculative_flags(p):
    """Shared by `serve` and the scheduler: who proposes drafts and how many."""
    add_flag(
        p,
        "--speculative-method",
        "STRATA_SPECULATIVE_METHOD",
        None,
        "speculative decoding: 'ngram' (prompt lookup in the scheduler) or 'draft' (a draft model's "
        "worker); unset: off. Either way every request gets the tokens it would get without it",
        choices=["ngram", "draft"],
    )
    add_flag(
        p,
        "--num-speculative-tokens",
        "STRATA_NUM_SPECULATIVE_TOKENS",
        4,
        "draft tokens proposed per step and sequence (k; the target verifies k + 1 positions)",
        type=int,
    )
    add_flag(p, "--ngram-min", "STRATA_NGRAM_MIN", 1, "shortest suffix the n-gram proposer matches", type=int)
    add_flag(p, "--ngram-max", "STRATA_NGRAM_MAX", 4, "longest suffix the n-gram proposer matches", type=int)
    add_flag(
        p,
        "--speculative-max-batch",
        "STRATA_SPECULATIVE_MAX_BATCH",
        32,
        "running requests above which steps decode without drafts (verifying costs more than it "
        "gains on large batches)",
        type=int,
    )


def _draft_model_flags(p):
    add_flag(
        p,
        "--draft-num-layers",
        "STRATA_DRAFT_NUM_LAYERS",
        0,
        "a draft model made of the target's first N layers plus its final norm and lm_head "
        "(with --role draft, or --speculative-method draft without --draft-model); 0: not used",
        type=int,
    )


def _bool(v: str) -> bool:
    return v.lower() in ("1", "true", "yes", "on")


# The gateway's own flags, which `strata serve` forwards to the gateway it starts.
GATEWAY_FLAGS = (
    "tokenizer",
    "served_model_name",
    "api_key",
    "tls_cert",
    "tls_key",
    "max_request_bytes",
    "max_prompt_chars",
    "max_stop_strings",
    "max_stop_length",
)


def _gateway_flags(p):
    add_flag(
        p,
        "--tokenizer",
        "STRATA_TOKENIZER",
        None,
        "HF tokenizer directory the gateway uses (as vLLM's --tokenizer); unset: the model directory's, "
        "or with a dummy model the embedded default model's",
    )
    add_flag(
        p,
        "--served-model-name",
        "STRATA_SERVED_MODEL_NAME",
        None,
        "the model's name on both APIs (ModelInfo.model_name, /v1/models, OpenAI's model field); "
        "unset: the model directory's name",
    )
    add_flag(
        p,
        "--max-request-bytes",
        "STRATA_MAX_REQUEST_BYTES",
        16 << 20,
        "largest gRPC request message the gateway takes, in bytes (larger: RESOURCE_EXHAUSTED)",
        type=int,
    )
    add_flag(
        p,
        "--max-prompt-chars",
        "STRATA_MAX_PROMPT_CHARS",
        0,
        "longest prompt text, checked before it is tokenized (0: 32 characters per token of the model's context)",
        type=int,
    )
    add_flag(
        p,
        "--max-stop-strings",
        "STRATA_MAX_STOP_STRINGS",
        32,
        "most stop strings (and stop token ids) per request",
        type=int,
    )
    add_flag(p, "--max-stop-length", "STRATA_MAX_STOP_LENGTH", 1024, "longest stop string, in characters", type=int)
    add_flag(
        p,
        "--http-port",
        "STRATA_HTTP_PORT",
        8000,
        "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /health, "
        "/metrics) on the gateway's host; 0: off",
        type=int,
    )
    add_flag(p, "--api-key", "STRATA_API_KEY", None, "require 'authorization: Bearer KEY' metadata on every call")
    add_flag(p, "--tls-cert", "STRATA_TLS_CERT", None, "PEM certificate chain: serve TLS")
    add_flag(p, "--tls-key", "STRATA_TLS_KEY", None, "PEM private key for --tls-cert")


def add_service_parsers(sub, formatter_class=Formatter) -> None:
    """Registers `serve`, `gateway`, `scheduler` and `worker` on a subparsers object."""
    p = sub.add_parser(
        "serve",
        formatter_class=formatter_class,
        help="start scheduler, workers and gateway on this host as separate processes",
        description="Starts the scheduler, one worker per pipeline stage and the gateway as separate "
        "processes, waits until all are healthy, prints the gateway address, and stops "
        "them all on Ctrl-C.",
    )
    _model_flags(p)
    add_flag(
        p,
        "--pipeline-stages",
        "STRATA_PIPELINE_STAGES",
        1,
        "number of pipeline stages (one worker process each)",
        type=int,
    )
    add_flag(p, "--host", "STRATA_HOST", "127.0.0.1", "gateway bind address")
    add_flag(p, "--port", "STRATA_PORT", 50051, "gateway port", type=int)
    _worker_flags(p)
    _engine_flags(p)
    add_flag(
        p,
        "--draft-model",
        "STRATA_DRAFT_MODEL",
        None,
        "HF model directory of a smaller model with the target's tokenizer, served by a draft worker "
        "(implies --speculative-method draft)",
    )
    _draft_model_flags(p)
    _gateway_flags(p)

    p = sub.add_parser("gateway", formatter_class=formatter_class, help="run the public gateway service")
    _model_flags(p)
    add_flag(p, "--host", "STRATA_HOST", "0.0.0.0", "bind address")
    add_flag(p, "--port", "STRATA_PORT", 50051, "port", type=int)
    add_flag(p, "--scheduler-address", "STRATA_SCHEDULER_ADDRESS", "127.0.0.1:50052", "scheduler host:port")
    _cluster_token_flag(p)
    _gateway_flags(p)

    p = sub.add_parser("scheduler", formatter_class=formatter_class, help="run the scheduler service")
    add_flag(p, "--host", "STRATA_HOST", "0.0.0.0", "bind address")
    add_flag(p, "--port", "STRATA_PORT", 50052, "port", type=int)
    add_flag(
        p, "--workers", "STRATA_WORKERS", "127.0.0.1:50061", "comma-separated worker addresses, in pipeline-stage order"
    )
    _cluster_token_flag(p)
    _scheduler_flags(p)

    p = sub.add_parser("worker", formatter_class=formatter_class, help="run one pipeline-stage worker")
    _model_flags(p)
    add_flag(p, "--host", "STRATA_HOST", "0.0.0.0", "bind address")
    add_flag(p, "--port", "STRATA_PORT", 50061, "port", type=int)
    add_flag(p, "--stage-index", "STRATA_STAGE_INDEX", 0, "this worker's pipeline stage (0-based)", type=int)
    _cluster_token_flag(p)
    add_flag(p, "--num-stages", "STRATA_NUM_STAGES", 1, "number of pipeline stages", type=int)
    add_flag(p, "--seed", "STRATA_SEED", 0, "seed of dummy weights", type=int)
    add_flag(
        p,
        "--role",
        "STRATA_ROLE",
        "target",
        "'target': a stage of the served model; 'draft': the whole draft model of speculative decoding, "
        "proposing k tokens per call",
        choices=["target", "draft"],
    )
    _draft_model_flags(p)
    _worker_flags(p)
    _speculative_flags(p)  # sizes the verification (or, on a draft worker, decode) graphs


def service_args(argv: list[str]) -> argparse.Namespace:
    """Parses `serve|gateway|scheduler|worker ...` arguments, as `strata` would."""
    parser = argparse.ArgumentParser(prog="strata")
    add_service_parsers(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)
