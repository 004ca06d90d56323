"""`strata serve` with no arguments serves the embedded default; `strata generate` streams text."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from strata.grpc_util import check_health
from strata.launcher import free_port


def test_help_explains_every_command():
    out = subprocess.run([sys.executable, "-m", "strata.cli", "--help"], capture_output=True, text=True, check=True)
    for cmd in ("serve", "gateway", "scheduler", "worker", "generate", "health", "build-model", "batch"):
        assert cmd in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "strata.cli", "worker", "--help"], capture_output=True, text=True, check=True
    )
    assert "STRATA_STAGE_INDEX" in out.stdout and "--num-kv-blocks" in out.stdout


def test_benchmarks_default_step_budgets():
    """The throughput benchmark's own budget must win over the common flag's default."""
    from strata.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["bench", "throughput"]).max_num_batched_tokens == 16384
    assert parse(["bench", "throughput", "--max-num-batched-tokens", "4096"]).max_num_batched_tokens == 4096
    assert parse(["bench", "latency"]).max_num_batched_tokens == 2048


def test_serve_default_then_generate():
    """The README's two commands: `strata serve` serves the default model (SmolLM2-135M-Instruct,
    built into the cache from PyPI on first use) and `strata generate` gets English from it."""
    port, http_port = free_port(), free_port()
    # The documented command: no arguments but the ports (tests must not take the default ones).
    serve = subprocess.Popen(
        [sys.executable, "-m", "strata.cli", "serve", "--port", str(port), "--http-port", str(http_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600  # a first run downloads and converts the model
        while not check_health(f"127.0.0.1:{port}", timeout=1.0):
            assert serve.poll() is None, serve.stdout.read()
            assert time.monotonic() < deadline, "strata serve did not become healthy"
            time.sleep(0.5)
        gen = subprocess.run(
            [
                sys.executable,
                "-m",
                "strata.cli",
                "generate",
                "The capital of France is",
                "--address",
                f"127.0.0.1:{port}",
                "--temperature",
                "0",
                "--max-tokens",
                "8",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert gen.returncode == 0, gen.stderr
        assert "Paris" in gen.stdout, gen.stdout
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
            raise
    assert serve.returncode == 0


def test_gateway_tokenizer_flag_serves_a_dummy_model(tmp_path):
    """--tokenizer (vLLM's flag) gives a gateway in front of dummy weights the tokenizer to use;
    without it a dummy preset is refused with a message that names the flag."""
    import pytest

    from strata.default_model import write_tiny_tokenizer
    from strata.services.gateway.main import load_tokenizer

    write_tiny_tokenizer(tmp_path / "tok", 300, "the quick brown fox jumps over the lazy dog\n" * 20)
    tokenizer, name = load_tokenizer("dummy:llama-3.2-1b", str(tmp_path / "tok"))
    assert tokenizer.decode(tokenizer("the lazy fox", add_special_tokens=False).input_ids) == "the lazy fox"
    assert name == "dummy:llama-3.2-1b"
    with pytest.raises(SystemExit, match="--tokenizer"):
        load_tokenizer("dummy:llama-3.2-1b")


def test_serve_forwards_profiling_to_each_stage_worker():
    """`strata serve --profile-output` reaches the workers (one file per stage), with its window."""
    from strata.cli import build_parser
    from strata.launcher import worker_argv

    args = build_parser().parse_args(
        [
            "serve",
            "--profile-output",
            "/tmp/p.txt",
            "--profile-steps",
            "5:3",
            "--pipeline-stages",
            "2",
            "--device",
            "cpu",
        ]
    )
    argv = worker_argv(args, 1, 50061, "m")
    assert argv[argv.index("--profile-output") + 1] == "/tmp/p.txt.stage1"
    assert argv[argv.index("--profile-steps") + 1] == "5:3"
    assert "--profile-output" not in worker_argv(build_parser().parse_args(["serve"]), 0, 50061, "m")


def test_profile_window_as_a_chrome_trace(tmp_path):
    """A --profile-output whose name holds .json gets a Chrome trace of the window: the CPU ops
    and the Python calls of the thread that runs the steps (the worker's step thread), and a
    second cluster's worker never overwrites the first's file."""
    import json
    import threading

    import torch

    from strata.services.worker.diagnostics.profiling import StepProfiler

    def steps(out) -> list[dict]:
        profiler = StepProfiler(str(out), first=1, count=2)

        def run():
            for _ in range(4):
                profiler.step_launched()
                torch.ones(64, 64) @ torch.ones(64, 64)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        return json.loads(profiler.output.read_text())["traceEvents"]

    out = tmp_path / "trace.json.stage1"
    events = steps(out)
    assert any("aten::mm" in e.get("name", "") for e in events if e.get("cat") == "cpu_op")
    assert any(e.get("cat") == "python_function" and "test_cli.py" in e["name"] for e in events)
    again = steps(out)  # the same path: written beside the first (a pid suffix)
    assert again and json.loads(out.read_text())["traceEvents"] == events


def test_prefix_groups_bench_runs_the_ways_asked_for():
    import pytest

    from strata.bench.prefix_groups import selected_ways

    assert selected_ways("cache,groups") == ("cache", "groups")
    assert selected_ways("cache-no-cascade, no-cache") == ("cache, no cascade", "no cache")
    with pytest.raises(SystemExit, match="unknown cached"):
        selected_ways("groups,cached")


def test_prefix_groups_bench_orders_the_one_by_one_requests():
    from strata.bench.prefix_groups import request_order

    prompts = [[g, m] for g in range(4) for m in range(8)]
    assert request_order(prompts, "grouped", 0) == prompts
    shuffled = request_order(prompts, "shuffled", 0)
    assert sorted(shuffled) == prompts and shuffled != prompts
    assert shuffled == request_order(prompts, "shuffled", 0)  # seeded: both runs of a way send alike
    assert shuffled != request_order(prompts, "shuffled", 1)


def test_speculative_bench_runs_the_prompt_sets_asked_for():
    import argparse

    import pytest

    from strata.bench_cli import add_bench_parser

    parser = argparse.ArgumentParser(prog="strata")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    assert parser.parse_args(["bench", "speculative"]).sets == ["lookup", "open"]
    assert parser.parse_args(["bench", "speculative", "--sets", "open"]).sets == ["open"]
    with pytest.raises(SystemExit):  # an unknown set is refused before any cluster starts
        parser.parse_args(["bench", "speculative", "--sets", "open,closed"])
