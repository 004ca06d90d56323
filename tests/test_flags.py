"""One table of flags (strata.flags): every command's defaults come from it, and the argv that
`strata serve` and the benchmarks build for the services they start parses back to the
settings they were built from."""

from __future__ import annotations

import argparse

from strata.bench import common
from strata.bench.cluster_flags import bench_settings
from strata.cli import build_parser
from strata.flags import DEFAULTS, FLAGS, argv_for, service_args
from strata.launcher import draft_worker_argv, speculation_argv, worker_argv


def test_every_service_flag_defaults_to_the_table(monkeypatch):
    for name in FLAGS:
        monkeypatch.delenv(FLAGS[name].env_var, raising=False)
    for command in ("serve", "gateway", "scheduler", "worker"):
        args = vars(service_args([command]))
        for name, value in args.items():
            if name in ("command", "host", "port"):
                continue  # bind address and port differ by command
            assert value == DEFAULTS[name], (command, name)
    bench = vars(build_parser().parse_args(["bench", "latency"]))
    shared = set(bench) & set(DEFAULTS) - {"scheduler_address"}  # the bench's: of a running cluster, if any
    assert {"max_num_batched_tokens", "max_num_seqs", "block_size", "ngram_min", "seed"} <= shared
    assert all(bench[name] == DEFAULTS[name] for name in shared)


def test_argv_for_round_trips_settings():
    settings = argparse.Namespace(
        max_num_seqs=7, enforce_eager=True, no_prefix_caching=False, profile_output=None, device="cpu"
    )
    argv = argv_for(settings, ("max_num_seqs", "enforce_eager", "no_prefix_caching", "profile_output", "device"))
    assert argv == ["--max-num-seqs", "7", "--enforce-eager", "--device", "cpu"]
    assert argv_for({"max_num_seqs": 7}, ("max_num_seqs", "dtype")) == ["--max-num-seqs", "7"]  # absent: nothing


def test_serve_argv_reaches_every_worker_as_given():
    serve = build_parser().parse_args(
        "serve --device cpu --block-size 32 --max-num-seqs 9 --max-num-batched-tokens 512 --enforce-eager "
        "--kv-cache-memory-gb 0.5 --piecewise-graph-max-tokens 64 --speculative-method draft "
        "--draft-num-layers 2 --num-speculative-tokens 3".split()
    )
    worker = service_args(worker_argv(serve, 0, 50061, "m"))
    for name in ("device", "block_size", "max_num_seqs", "max_num_batched_tokens", "enforce_eager"):
        assert getattr(worker, name) == getattr(serve, name), name
    assert (worker.kv_cache_memory_gb, worker.piecewise_graph_max_tokens) == (0.5, 64)
    assert (worker.speculative_method, worker.num_speculative_tokens, worker.role) == ("draft", 3, "target")
    draft = service_args(draft_worker_argv(serve, 50062, "m"))
    assert (draft.role, draft.draft_num_layers, draft.num_stages) == ("draft", 2, 1)
    assert draft.gpu_memory_utilization == serve.gpu_memory_utilization * 0.2
    scheduler = speculation_argv(serve, "127.0.0.1:1")
    assert scheduler[-2:] == ["--draft-worker", "127.0.0.1:1"]


def test_a_benchmark_cluster_is_serve_with_the_benchmarks_flags():
    args = build_parser().parse_args(["bench", "throughput", "--device", "cpu", "--enforce-eager"])
    serve = service_args(common.serve_argv(args, None))
    assert serve.max_num_batched_tokens == 16384 and serve.enforce_eager and serve.device == "cpu"
    assert serve.speculative_method is None and serve.draft_model is None
    # A draft model without a method does not turn speculation on.
    plain = common.with_overrides(args, draft_model="/draft")
    assert service_args(common.serve_argv(plain, None)).draft_model is None


def test_bench_settings_are_the_common_flags():
    args = bench_settings(model="dummy:llama-3.2-1b", max_num_batched_tokens=4096)
    assert (args.model, args.max_num_batched_tokens, args.block_size) == ("dummy:llama-3.2-1b", 4096, 16)
    assert args.pipeline_stages == DEFAULTS["pipeline_stages"]


def test_stages_on_one_named_gpu_split_its_memory_share():
    serve = build_parser().parse_args("serve --device cuda:1 --pipeline-stages 2 --gpu-memory-utilization 0.8".split())
    for stage in (0, 1):
        worker = service_args(worker_argv(serve, stage, 50061 + stage, "m"))
        assert (worker.device, worker.gpu_memory_utilization) == ("cuda:1", 0.4)
