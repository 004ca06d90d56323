"""`strata`: serve a local cluster, run one service, generate from a running gateway, benchmark.

Every service flag can also come from an environment variable (shown in --help), so the same
command works in containers.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys


def _env(name: str, default=None, cast=str):
    value = os.environ.get(name)
    return cast(value) if value not in (None, "") else default


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def _add(p: argparse.ArgumentParser, flag: str, env: str, default, help: str, type=str, **kw):
    p.add_argument(flag, default=_env(env, default, type), type=type, help=f"{help} [env {env}]", **kw)


def _model_flags(p):
    _add(p, "--model", "STRATA_MODEL", None,
         "HF model directory (config.json, *.safetensors, tokenizer files), or 'dummy:llama-3.2-1b' / "
         "'dummy:llama-3-8b' for random weights of that shape; unset: the embedded default model")


def _batch_flags(p):
    """Shared by workers (they size buffers and CUDA graphs by them) and the scheduler."""
    _add(p, "--max-num-seqs", "STRATA_MAX_NUM_SEQS", 256, "most sequences running at once", type=int)
    _add(p, "--max-num-batched-tokens", "STRATA_MAX_NUM_BATCHED_TOKENS", 2048,
         "token budget of one step (prefill chunks + decodes)", type=int)


def _worker_flags(p):
    _add(p, "--device", "STRATA_DEVICE", "auto", "cpu, cuda, cuda:N, or auto (cuda when available)")
    _add(p, "--dtype", "STRATA_DTYPE", "auto", "float32, bfloat16, float16, or auto (bfloat16 on GPU, float32 on CPU)")
    _add(p, "--block-size", "STRATA_BLOCK_SIZE", 16, "tokens per KV cache block", type=int)
    _add(p, "--max-model-len", "STRATA_MAX_MODEL_LEN", 0,
         "longest sequence (prompt + output); 0: the model's max_position_embeddings", type=int)
    _add(p, "--gpu-memory-utilization", "STRATA_GPU_MEMORY_UTILIZATION", 0.9,
         "share of GPU memory this worker may use (weights, activations, KV cache)", type=float)
    _add(p, "--kv-cache-memory-gb", "STRATA_KV_CACHE_MEMORY_GB", 1.0, "KV cache size on CPU, in GiB", type=float)
    _add(p, "--num-kv-blocks", "STRATA_NUM_KV_BLOCKS", 0, "force this many KV blocks (0: size from memory)", type=int)
    _batch_flags(p)
    p.add_argument("--enforce-eager", action="store_true", default=_env("STRATA_ENFORCE_EAGER", False, _bool),
                   help="never capture CUDA graphs [env STRATA_ENFORCE_EAGER]")
    _add(p, "--profile-output", "STRATA_PROFILE_OUTPUT", None,
         "write a torch.profiler table of the GPU work of steps 200-299 to this file (diagnostics)")


def _scheduler_flags(p):
    _batch_flags(p)
    _add(p, "--max-plans-in-flight", "STRATA_MAX_PLANS_IN_FLIGHT", 0,
         "plans executing at once (0: 3 with one stage, else the number of pipeline stages); with one "
         "stage the plans after the first are decode lookaheads of its requests", type=int)
    _add(p, "--max-kv-blocks", "STRATA_MAX_KV_BLOCKS", 0, "cap on KV blocks used (0: what the workers offer)", type=int)
    p.add_argument("--no-prefix-caching", action="store_true",
                   default=_env("STRATA_NO_PREFIX_CACHING", False, _bool),
                   help="disable the automatic prefix cache [env STRATA_NO_PREFIX_CACHING]")
    _add(p, "--metrics-port", "STRATA_METRICS_PORT", 0, "serve Prometheus metrics on this port (0: off)", type=int)


def _bool(v: str) -> bool:
    return v.lower() in ("1", "true", "yes", "on")


def _gateway_flags(p):
    _add(p, "--api-key", "STRATA_API_KEY", None, "require 'authorization: Bearer KEY' metadata on every call")
    _add(p, "--tls-cert", "STRATA_TLS_CERT", None, "PEM certificate chain: serve TLS")
    _add(p, "--tls-key", "STRATA_TLS_KEY", None, "PEM private key for --tls-cert")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description=__doc__, formatter_class=_Formatter)
    parser.add_argument("--log-level", default=_env("STRATA_LOG_LEVEL", "INFO"), help="logging level [env STRATA_LOG_LEVEL]")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", formatter_class=_Formatter,
                       help="start scheduler, workers and gateway on this host as separate processes",
                       description="Starts the scheduler, one worker per pipeline stage and the gateway as separate "
                                   "processes, waits until all are healthy, prints the gateway address, and stops "
                                   "them all on Ctrl-C.")
    _model_flags(p)
    _add(p, "--pipeline-stages", "STRATA_PIPELINE_STAGES", 1, "number of pipeline stages (one worker process each)", type=int)
    _add(p, "--host", "STRATA_HOST", "127.0.0.1", "gateway bind address")
    _add(p, "--port", "STRATA_PORT", 50051, "gateway port", type=int)
    _worker_flags(p)
    p.add_argument("--max-plans-in-flight", type=int, default=0, help="see `strata scheduler --help`")
    p.add_argument("--metrics-port", type=int, default=0, help="scheduler Prometheus port (0: off)")
    _gateway_flags(p)

    p = sub.add_parser("gateway", formatter_class=_Formatter, help="run the public gateway service")
    _model_flags(p)
    _add(p, "--host", "STRATA_HOST", "0.0.0.0", "bind address")
    _add(p, "--port", "STRATA_PORT", 50051, "port", type=int)
    _add(p, "--scheduler-address", "STRATA_SCHEDULER_ADDRESS", "127.0.0.1:50052", "scheduler host:port")
    _gateway_flags(p)

    p = sub.add_parser("scheduler", formatter_class=_Formatter, help="run the scheduler service")
    _add(p, "--host", "STRATA_HOST", "0.0.0.0", "bind address")
    _add(p, "--port", "STRATA_PORT", 50052, "port", type=int)
    _add(p, "--workers", "STRATA_WORKERS", "127.0.0.1:50061",
         "comma-separated worker addresses, in pipeline-stage order")
    _scheduler_flags(p)

    p = sub.add_parser("worker", formatter_class=_Formatter, help="run one pipeline-stage worker")
    _model_flags(p)
    _add(p, "--host", "STRATA_HOST", "0.0.0.0", "bind address")
    _add(p, "--port", "STRATA_PORT", 50061, "port", type=int)
    _add(p, "--stage-index", "STRATA_STAGE_INDEX", 0, "this worker's pipeline stage (0-based)", type=int)
    _add(p, "--num-stages", "STRATA_NUM_STAGES", 1, "number of pipeline stages", type=int)
    _add(p, "--seed", "STRATA_SEED", 0, "seed of dummy weights", type=int)
    _worker_flags(p)

    p = sub.add_parser("generate", formatter_class=_Formatter, help="stream a completion from a running gateway")
    p.add_argument("prompt", help="prompt text")
    _add(p, "--address", "STRATA_ADDRESS", "127.0.0.1:50051", "gateway host:port")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (0: greedy; unset: 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("-n", type=int, default=1, help="number of completions")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    _add(p, "--api-key", "STRATA_API_KEY", None, "bearer token, when the gateway requires one")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of the call, in seconds")

    p = sub.add_parser("health", formatter_class=_Formatter,
                       help="exit 0 when the gRPC health service at ADDRESS answers SERVING")
    p.add_argument("address", help="host:port")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")

    p = sub.add_parser("build-default-model", formatter_class=_Formatter,
                       help="write the embedded default model (tiny Llama + BPE tokenizer) to a directory")
    p.add_argument("--output", default=None, help="target directory (default: the cache directory)")

    from strata.bench_cli import add_bench_parser
    add_bench_parser(sub, _Formatter)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "serve":
        from strata.launcher import serve
        return serve(args)
    if args.command == "gateway":
        from services.gateway.main import run
        return run(args)
    if args.command == "scheduler":
        from services.scheduler.main import run
        return run(args)
    if args.command == "worker":
        from services.worker.main import run
        return run(args)
    if args.command == "generate":
        from strata.client import generate_cli
        return generate_cli(args)
    if args.command == "health":
        from strata.grpc_util import check_health
        return 0 if check_health(args.address, args.timeout) else 1
    if args.command == "build-default-model":
        from pathlib import Path

        from strata.default_model import build_default_model, ensure_default_model
        print(build_default_model(Path(args.output)) if args.output else ensure_default_model())
        return 0
    if args.command == "bench":
        from strata.bench_cli import run_bench
        return run_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
