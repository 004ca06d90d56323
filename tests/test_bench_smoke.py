"""`strata bench` end to end on CPU at tiny scale: every command runs through a real cluster and
writes JSON whose numbers add up (tokens counted = tokens requested, positive latencies, ratios)."""

from __future__ import annotations

import argparse
import json
import math
import re

import pytest
from safetensors import safe_open

from strata.bench import common, roofline
from strata.bench.parallel_sampling import peak_block_bound
from strata.bench_cli import add_bench_parser, run_bench
from strata.cli import build_parser
from strata.default_model import ensure_tiny_model
from strata.launcher import start_cluster
from strata.v1 import engine_pb2

PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 16, 8


def parse_bench(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def bench(tmp_path, name: str, *argv: str) -> dict:
    out = tmp_path / f"{name}.json"
    args = parse_bench(
        name,
        "--device",
        "cpu",
        "--no-progress",
        "--warmup-requests",
        "1",
        "--output",
        str(out),
        "--model",
        str(ensure_tiny_model()),
        *argv,
    )
    assert run_bench(args) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def cluster():
    """One running cluster the benchmarks reach with --address (their own-cluster path is the
    throughput test's)."""
    serve_args = build_parser().parse_args(
        common.serve_argv(parse_bench("latency", "--device", "cpu"), str(ensure_tiny_model()))
    )
    running = start_cluster(serve_args, startup_timeout=180)
    try:
        # With --address a benchmark's scheduler calls carry the token the environment names.
        with common.cluster_token_env(running.cluster_token):
            yield ["--address", running.gateway_address, "--scheduler-address", running.scheduler_address]
    finally:
        running.stop()


def assert_environment(result: dict) -> None:
    env = result["environment"]
    assert env["device"] == "cpu" and env["device_name"] and env["commit"] and env["date"][:2] == "20"
    assert result["markdown_row"].startswith("| ") and env["commit"] in result["markdown_row"]


def test_throughput_with_own_cluster_hf_and_roofline(tmp_path):
    r = bench(
        tmp_path,
        "throughput",
        "--num-prompts",
        str(PROMPTS),
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        str(OUTPUT_LEN),
        "--hf-baseline",
        "--roofline-batch",
        "4",
        "--roofline-steps",
        "3",
    )
    assert_environment(r)
    s = r["strata"]
    assert s["failed"] == 0 and s["all_outputs_full_length"]
    assert s["output_tokens"] == PROMPTS * OUTPUT_LEN and s["input_tokens"] == PROMPTS * INPUT_LEN
    assert s["total_tokens_per_s"] == pytest.approx(3 * s["output_tokens_per_s"])
    assert s["requests_per_s"] == pytest.approx(PROMPTS / s["elapsed_s"])
    # Scheduler deltas cover the measured prompts only (the warm-up came before).
    assert s["scheduler"]["prefill_tokens_computed"] == PROMPTS * INPUT_LEN
    assert r["hf"]["output_tokens"] == PROMPTS * OUTPUT_LEN and r["hf"]["output_tokens_per_s"] > 0
    ratios = r["ratios"]
    assert ratios["strata_over_hf_output_tokens_per_s"] == pytest.approx(
        s["output_tokens_per_s"] / r["hf"]["output_tokens_per_s"]
    )
    roof = r["roofline"]
    assert roof["batch"] == 4 and roof["context_len"] == INPUT_LEN + OUTPUT_LEN // 2
    assert roof["floor_s"] > 0 and roof["measured"]["median_s"] > 0
    assert ratios["decode_step_over_floor"] == pytest.approx(roof["measured"]["median_s"] / roof["floor_s"])


def test_latency_against_running_cluster(tmp_path, cluster):
    r = bench(
        tmp_path,
        "latency",
        *cluster,
        "--num-prompts",
        str(PROMPTS),
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        str(OUTPUT_LEN),
        "--request-rate",
        "50",
        "--concurrency",
        "2",
        "--concurrency-num-prompts",
        "4",
        "--bare-steps",
        "3",
    )
    assert_environment(r)
    for phase, num in (("poisson", PROMPTS), ("closed_loop", 4)):
        p = r[phase]
        assert p["failed"] == 0 and p["all_outputs_full_length"] and p["output_tokens"] == num * OUTPUT_LEN
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms"):
            assert 0 < p[key]["p50"] <= p[key]["p99"] <= p[key]["max"], (phase, key)
        assert p["ttft_ms"]["p50"] < p["e2e_latency_ms"]["p50"]
    assert r["bare_step"]["batch"] == 2 and r["bare_step"]["median_s"] > 0
    assert r["ratios"]["itl_p50_over_bare_step"] == pytest.approx(
        r["closed_loop"]["itl_ms"]["p50"] / (r["bare_step"]["median_s"] * 1e3)
    )


def test_parallel_sampling_against_running_cluster(tmp_path, cluster):
    n, prompt_len = 4, 40
    r = bench(
        tmp_path,
        "parallel-sampling",
        *cluster,
        "-n",
        str(n),
        "--input-len",
        str(prompt_len),
        "--output-len",
        str(OUTPUT_LEN),
    )
    assert_environment(r)
    assert not r["fresh_cluster_per_phase"]  # --address: one cluster, peaks are running maxima
    phases = r["phases"]
    for name in ("n", "distinct", "same"):
        assert phases[name]["failed"] == 0
        assert phases[name]["output_tokens"] == phases[name]["expected_output_tokens"] == n * OUTPUT_LEN
        assert phases[name]["scheduler"]["peak_used_kv_blocks"] > 0
    # Distinct prompts share nothing: every prompt token is computed.
    assert phases["distinct"]["scheduler"]["prefill_tokens_computed"] == n * prompt_len
    assert phases["n"]["scheduler"]["prefill_tokens_computed"] < n * prompt_len
    for key in ("n_over_same", "n_over_distinct"):
        assert r["ratios"][key] > 0
    assert r["peak_block_bound"] == peak_block_bound(n, prompt_len, OUTPUT_LEN, phases["n"]["block_size"])


def test_roofline_through_running_cluster(tmp_path, cluster):
    r = bench(
        tmp_path,
        "roofline",
        *cluster,
        "--batch",
        "4",
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        str(OUTPUT_LEN),
        "--steps",
        "3",
    )
    assert_environment(r)
    roof = r["roofline"]
    shape = roof["model_shape"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    assert roof["kv_bytes"] == 4 * 20 * shape["num_hidden_layers"] * 2 * kv * 4  # float32 on CPU
    assert roof["floor_s"] == pytest.approx(roof["total_bytes"] / roof["bandwidth_bytes_per_s"])
    assert roof["measured_over_floor"] > 0


def test_decode_bytes_reads_every_weight_once_and_gathers_embeddings():
    """Checked against the embedded default's checkpoint: untied, so the embedding table is not
    read whole, only the batch's rows."""
    from strata.services.worker.model.model_config import ModelConfig

    model_dir = ensure_tiny_model()
    config = ModelConfig.from_dir(model_dir)
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        numel = {name: math.prod(f.get_slice(name).get_shape()) for name in f.keys()}
    batch = 3
    expected = sum(numel.values()) - numel["model.embed_tokens.weight"] + batch * config.hidden_size
    got = roofline.decode_bytes(config, 2, batch, context_len=10)
    assert got["weight_bytes"] == 2 * expected
    assert got["total_bytes"] == got["weight_bytes"] + got["kv_bytes"]


def _stats(t_steps, prefill, decode, running, gpu_busy=0.0, gpu_idle=0.0):
    return engine_pb2.SchedulerStats(
        steps=t_steps,
        prefill_tokens_computed=prefill,
        decode_tokens_computed=decode,
        running=running,
        worker_gpu_busy_seconds=gpu_busy,
        worker_gpu_idle_seconds=gpu_idle,
        worker_timed_steps=t_steps,
    )


def test_floor_reads_the_experts_a_step_touches_and_a_sliding_layers_window():
    """Of qwen3-30b-a3b's 128 experts a layer, a batch-1 step reads its 8, a large batch all of
    them (then every weight once, as the parameter count says); gemma-3-12b's sliding layers
    read at most their 1,024-token window of KV, its global layers the whole context."""
    from strata.services.worker.model.shard import CausalLMShard
    from strata.services.worker.model.weights import dummy_config

    moe = dummy_config("qwen3-30b-a3b")
    expert = 3 * moe.hidden_size * moe.moe_intermediate_size
    assert roofline.experts_touched(moe, 1) == pytest.approx(8)
    assert roofline.experts_touched(moe, 256) == pytest.approx(128, rel=1e-6)
    one, many = (roofline.decode_bytes(moe, 2, batch, 0)["weight_bytes"] for batch in (1, 4096))
    assert many - one == pytest.approx(2 * (48 * 120 * expert + 4095 * moe.hidden_size), rel=1e-9)
    params = sum(p.numel() for p in CausalLMShard(moe, 0, 48, device="meta").parameters())
    assert many == 2 * (params - moe.vocab_size * moe.hidden_size + 4096 * moe.hidden_size)
    gemma = dummy_config("gemma-3-12b")
    kv = gemma.num_key_value_heads * gemma.head_dim
    assert roofline.decode_bytes(gemma, 2, 3, 4096)["kv_bytes"] == 2 * 3 * (8 * 4096 + 40 * 1024) * 2 * kv
    assert roofline.attended_keys(gemma, 1, 2048) == 8 * 2048 * 2049 // 2 + 40 * (1024 * 1025 // 2 + 1024 * 1024)


def test_hf_baseline_builds_every_preset_as_transformers_model():
    """The HF baseline's config of each dummy preset reads back as the preset (ids aside) and
    gives transformers' model as many parameters as the workers' (on the meta device)."""
    import dataclasses

    import torch
    import transformers

    from strata.bench.hf_baseline import hf_config
    from strata.services.worker.model.model_config import ModelConfig
    from strata.services.worker.model.shard import CausalLMShard
    from strata.services.worker.model.weights import DUMMY_PRESETS, dummy_config

    for name in DUMMY_PRESETS:
        preset = dummy_config(name)
        config = hf_config(preset)
        back = ModelConfig.from_dict({**config.to_dict(), "architectures": [preset.architecture]})
        ids = dict(eos_token_id=preset.eos_token_id, bos_token_id=preset.bos_token_id, torch_dtype=preset.torch_dtype)
        assert dataclasses.replace(back, **ids) == preset, name
        with torch.device("meta"):
            hf = getattr(transformers, preset.architecture)(config)
        ours = CausalLMShard(preset, 0, preset.num_hidden_layers, device="meta")
        assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in ours.parameters()), name


def test_throughput_mixed_lengths_are_uniform_in_their_ranges():
    from strata.bench import offline

    argv = ["throughput", "--num-prompts", "500", "--input-len", "1024", "--output-len", "1024"]
    args = parse_bench(*argv, "--min-input-len", "100", "--min-output-len", "100")
    prompts, output_lens = offline._workload(args, vocab_size=400)
    for lengths in ([len(p) for p in prompts], output_lens):
        assert 100 <= min(lengths) < 150 and 980 < max(lengths) <= 1024
        assert 450 < sum(lengths) / len(lengths) < 680
    assert offline._lengths(args) == "100-1024 in / 100-1024 out" and not offline._hf_enabled(args)
    prompts, output_lens = offline._workload(parse_bench(*argv), vocab_size=400)
    assert {len(p) for p in prompts} == {1024} and set(output_lens) == {1024}


def test_decode_only_timing_skips_intervals_with_prefill():
    samples = [
        (0.0, _stats(0, 100, 0, 8, 0.0, 0.0)),
        (1.0, _stats(10, 200, 40, 8, 5.0, 0.0)),  # prefill happened: ignored
        (2.0, _stats(20, 200, 80, 8, 5.5, 0.5)),  # may still get prefill's results: ignored
        (3.0, _stats(40, 200, 160, 8, 6.3, 0.7)),  # 20 steps of 4 tokens over 1 s
        (5.0, _stats(60, 200, 240, 8, 7.9, 1.1)),
    ]  # 20 steps of 4 tokens over 2 s
    t = common.decode_only_timing(samples)
    assert t["steps"] == 40 and t["seconds_per_step"] == pytest.approx(3.0 / 40)
    assert t["decode_tokens_per_step"] == pytest.approx(4.0)
    # The worker's CUDA-event view over the same two intervals: 2.4 s busy, 0.6 s idle.
    assert t["gpu_seconds_per_step"] == pytest.approx(2.4 / 40)
    assert t["gpu_idle_fraction"] == pytest.approx(0.6 / 3.0)
    assert t["seconds_per_batch_step"] == pytest.approx(8 * 3 / 160)
    assert common.decode_only_timing(samples[:2]) == {}


def test_peak_block_bound():
    assert peak_block_bound(64, 1024, 256, 16) == 64 + 64 * 16
    assert peak_block_bound(4, 40, 8, 16) == 2 + 4 * 1  # each child copies the 8-token tail block


def test_first_token_groups_are_runs_no_more_than_the_gap_apart():
    records = [common.RequestRecord(prompt_len=1, chunk_times=[t]) for t in (0.0, 0.5, 1.0, 5.0, 5.2, 9.0)]
    records.append(common.RequestRecord(prompt_len=1))  # failed: no first token
    assert common.first_token_groups(records, gap_s=1.0) == [3, 2, 1]
    assert common.first_token_groups(records[::-1], gap_s=1.0) == [3, 2, 1]  # in time order
    assert common.first_token_groups(records, gap_s=0.1) == [1, 1, 1, 1, 1, 1]


def _host_overhead(*argv: str) -> list[str]:
    """`python -m strata.bench.host_overhead ARGV`'s printed lines (it must succeed)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "strata.bench.host_overhead", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=common.REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.splitlines()


def test_host_overhead_with_a_simulated_device():
    """The real gateway and scheduler over a worker whose GPU is simulated, with a cost per
    prefill token: every request completes, the step period is at least the simulated step, and
    every request's first token falls in one of the printed groups."""
    lines = _host_overhead(
        *("--num-prompts", "16", "--input-len", "8", "--output-len", "8", "--step-ms", "5"),
        *("--prefill-us-per-token", "100", "--streams", "4"),
    )
    per_step_ms = float(next(x for x in lines if "ms per step" in x).split("(")[1].split(" ms")[0])
    assert per_step_ms >= 5.0 * 0.99
    groups = next(x for x in lines if "first tokens in groups of" in x).split("groups of")[1].split()
    assert sum(map(int, groups)) == 16
    ttft_p50 = float(next(x for x in lines if "TTFT ms" in x).split("p50")[1].split()[0])
    assert ttft_p50 >= (5.0 + 7 * 0.1) * 0.99  # a step with an 8-token prefill: 7 tokens past the one sampled


def test_scheduler_step_sizes_its_warmup_for_micro_batches():
    """With P stages the bench's own example (P + 2 micro-batches, no --warmup) gets every
    sequence running before it times (a fixed 40 steps did not cover 1,024 prompts' chunks)."""
    import subprocess
    import sys

    args = ["--stages", "2", "--num-seqs", "96", "--prompt-len", "400", "--max-num-batched-tokens", "256"]
    proc = subprocess.run(
        [sys.executable, "-m", "strata.bench.scheduler_step", *args, "--steps", "10", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=common.REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "N=96 over 4 micro-batches:" in proc.stdout


@pytest.mark.parametrize("repeats", ["1", "4"])
def test_scheduler_offline_runs_every_request_to_its_end(repeats):
    """The whole-run bench of the scheduler's Python: every request's output tokens counted, at
    two stages with and without repeated plans (only with them are some plans repeats)."""
    import subprocess
    import sys

    args = ["--num-prompts", "64", "--shortest", "8", "--longest", "40", "--repeat", "1", "--decode-repeats", repeats]
    proc = subprocess.run(
        [sys.executable, "-m", "strata.bench.scheduler_offline", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=common.REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first = proc.stdout.splitlines()[0]
    repeated = int(re.search(r"\((\d+) of them repeats\)", first).group(1))
    assert (repeated > 0) == (repeats == "4"), first
    assert "loop's time a plan" in proc.stdout


@pytest.mark.parametrize("speculate", [[], ["--speculate", "8"]], ids=["plain", "speculating"])
def test_scheduler_step_runs_the_engine_bookkeeping(speculate):
    """The scheduler's per-step host cost benchmark drives Engine._finish_step as the engine does
    (it broke silently when the engine began keeping a deadline per plan in flight); with
    --speculate its fake results verify drafts, and most plans verify."""
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata.bench.scheduler_step",
            "--num-seqs",
            "16",
            "--steps",
            "20",
            "--warmup",
            "10",
            "--repeat",
            "1",
            "--prompt-len",
            "32",
            *speculate,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=common.REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "N=16:" in proc.stdout and "per step" in proc.stdout
    if speculate:
        verified = float(proc.stdout.split("; ")[-1].split("%")[0])
        assert verified > 50, proc.stdout


@pytest.mark.parametrize("speculate", [[], ["--speculate", "8"]], ids=["plain", "speculating"])
def test_worker_step_host_replays_the_schedulers_plans_on_the_worker_side(speculate):
    """The worker's per-plan host cost benchmark: the real Scheduler's plans through the
    worker's table, inputs and (speculating) device speculation, on the CPU; with --speculate
    most of its plans verify drafts on the device."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "strata.bench.worker_step_host", "--num-seqs", "1", "4"]
        + ["--steps", "20", "--warmup", "10", "--repeat", "1", *speculate],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=common.REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0].split(",")[0] for line in lines] == ["N=1", "N=4"], proc.stdout
    if speculate:
        for line in lines:
            assert float(line.split("; ")[-1].split("%")[0]) > 50, proc.stdout


def test_schedule_shape_counts_every_prompt_and_decode_token():
    """An offline batch through the real Scheduler: every prompt token is computed once, every
    output token but the first (which the prompt's last step samples) is a decode row."""
    from strata.bench.schedule_shape import simulate

    args = argparse.Namespace(
        num_prompts=40, input_len=48, output_len=6, max_num_seqs=16, max_num_batched_tokens=256, block_size=16, seed=0
    )
    steps = simulate(args)
    assert sum(prefill for prefill, _ in steps) == 40 * 48
    assert sum(decodes for _, decodes in steps) == 40 * 5
    assert all(prefill + decodes <= 256 and decodes <= 16 for prefill, decodes in steps)


def test_mixed_step_times_each_shape_against_its_floor():
    """On CPU the eager way alone (no graphs): a timed step and a positive floor per shape."""
    from strata.bench import mixed_step

    rows = mixed_step.main(
        [
            "--device",
            "cpu",
            "--model",
            str(ensure_tiny_model()),
            "--shapes",
            "2x6,3x20",
            "--steps",
            "2",
            "--context-len",
            "32",
        ]
    )
    assert [(r["decodes"], r["chunk"]) for r in rows] == [(2, 6), (3, 20)]
    assert all(r["eager"]["median_s"] > 0 and r["pieces"] is None and r["floor_s"] > 0 for r in rows)


def test_pipeline_one_and_two_stages_with_each_stages_timeline_and_hops(tmp_path):
    """Two offline phases of the mixed shape in each run (6 and 3 requests of 4-12 tokens in and
    out), then the streams."""
    r = bench(
        tmp_path,
        "pipeline",
        "--num-prompts",
        "6,3",
        "--shape",
        "mixed",
        "--mixed-lengths",
        "4,12",
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        str(OUTPUT_LEN),
        "--concurrency",
        "2",
        "--latency-num-prompts",
        "2",
        "--stages",
        "1,2",
        "--transports",
        "ipc",
        "--pipeline-micro-batches",
        "2",
        "--max-num-batched-tokens",
        "64",
        "--gpu-clock",
        str(tmp_path / "clock"),
    )
    assert_environment(r)
    runs = r["runs"]
    assert [(x["stages"], x["transport"], x["micro_batches"]) for x in runs] == [(1, "-", 0), (2, "ipc", 2)]
    # CPU stages take no GPU clock stamps: the multi-stage run says so, the one-stage run has none
    assert "gpu_clock" not in runs[0] and all("no stamps" in v for v in runs[1]["gpu_clock"].values())
    assert len(runs[1]["gpu_clock"]) == 3  # two offline phases and the streams
    for x in runs:
        lat = x["latency"]
        assert [o["workload"] for o in x["offline"]] == ["6 x 4-12/4-12", "3 x 4-12/4-12"]
        for off, num in zip(x["offline"], (6, 3)):
            assert off["failed"] == 0 and off["requests"] == num and 4 * num <= off["output_tokens"] <= 12 * num
            assert len(off["stages"]) == x["stages"]
        assert lat["failed"] == 0 and lat["output_tokens"] == 2 * OUTPUT_LEN
        for stage in [s for o in x["offline"] for s in o["stages"]] + lat["stages"]:
            assert stage["steps"] > 0 and stage["timed_steps"] > 0 and stage["busy_seconds"] > 0
            # CPU time: the step thread's is part of the whole process's
            assert 0 < stage["step_thread_cpu_seconds"] <= stage["process_cpu_seconds"]
        assert lat["tpot_ms"]["p50"] > 0
    # The same requests, whatever the stages: the same output lengths.
    assert [o["output_tokens"] for o in runs[0]["offline"]] == [o["output_tokens"] for o in runs[1]["offline"]]
    two = runs[1]["offline"][0]
    first, last = two["stages"]
    assert first["activation_steps_sent"] == first["steps"] and first["activation_bytes_sent"] > 0
    assert last["token_steps_sent"] > 0 and last["token_bytes_sent"] == 8 * two["output_tokens"]
    assert two["scheduler"]["lookahead_decodes"] > 0
    sched = two["scheduler"]  # (the "plans in flight" row): waits for results fall within the round trips
    assert 0 < sched["wait_at_limit_seconds"] + sched["wait_below_limit_seconds"] < sched["plan_round_trip_seconds"]
    assert two["scheduler"]["micro_batches_after"] == 1  # 6 requests: one micro-batch (fewer than 2 x 32)
    ratios = runs[1]["ratios"]
    assert [x["workload"] for x in ratios] == ["6 x 4-12/4-12", "3 x 4-12/4-12"]
    assert all(x["offline_tok_s"] > 0 and x["tpot_p50"] > 0 and x["token_hop_us"] > 0 for x in ratios)
    assert len(r["markdown_rows"]) == 2 and "| 2 | ipc, 2 micro-batches | 6 x 4-12/4-12 |" in r["markdown_row"]


def test_the_pipeline_benchs_offline_workloads():
    """--shape fixed: every prompt --input-len tokens and every output --output-len; mixed: both
    uniform in the range, each request's own max_tokens (ignore_eos), the same for every run."""
    import argparse

    from strata.bench import pipeline

    args = argparse.Namespace(
        num_prompts=[5, 300],
        shape="fixed",
        input_len=7,
        output_len=3,
        mixed_lengths=(100, 1024),
        temperature=0.0,
        seed=1,
    )
    fixed = pipeline.offline_workloads(args, vocab_size=500)
    assert [name for name, _, _ in fixed] == ["5 x 7/3", "300 x 7/3"]
    assert all(len(p) == 7 for _, prompts, _ in fixed for p in prompts)
    assert all(x.max_tokens == 3 and x.ignore_eos for _, _, params in fixed for x in params)
    args.shape = "mixed"
    mixed = pipeline.offline_workloads(args, vocab_size=500)
    _, prompts, params = mixed[1]
    lengths, outputs = [len(p) for p in prompts], [x.max_tokens for x in params]
    assert min(lengths) >= 100 and max(lengths) <= 1024 and min(outputs) >= 100 and max(outputs) <= 1024
    assert max(lengths) - min(lengths) > 700 and len(set(outputs)) > 100  # spread over the range
    assert all(x.ignore_eos and x.min_tokens == x.max_tokens for x in params)
    assert [p for _, p, _ in pipeline.offline_workloads(args, vocab_size=500)] == [p for _, p, _ in mixed]


# Behind the slow marker (STRATA_SLOW_TESTS=1): the replicas' cluster is tests/test_data_parallel.py's,
# and the bench's runs are the case above's; this adds summing the replicas' statistics.
@pytest.mark.slow
def test_pipeline_bench_runs_the_dp_way_beside_one_stage(tmp_path):
    r = bench(
        tmp_path,
        "pipeline",
        "--num-prompts",
        "6",
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        str(OUTPUT_LEN),
        "--concurrency",
        "2",
        "--latency-num-prompts",
        "2",
        "--stages",
        "1",
        "--data-parallel",
        "2",
        "--max-num-batched-tokens",
        "64",
    )
    runs = r["runs"]
    assert [(x["stages"], x["replicas"]) for x in runs] == [(1, 1), (1, 2)]
    dp = runs[1]
    (offline,) = dp["offline"]  # one offline workload (one --num-prompts count)
    for phase in (offline, dp["latency"]):
        assert phase["failed"] == 0 and len(phase["stages"]) == 2  # one stage in each replica
        assert all(stage["steps"] > 0 for stage in phase["stages"])  # both replicas served
    assert offline["output_tokens"] == 6 * OUTPUT_LEN
    assert offline["scheduler"]["finished_requests"] >= 6  # summed over both schedulers
    assert dp["ratios"][0]["offline_tok_s"] > 0
    assert "| 1 x 2 replicas | - |" in r["markdown_row"]


@pytest.mark.parametrize(
    "transport",
    [
        "ipc",
        # Behind the slow marker (STRATA_SLOW_TESTS=1): the benchmark drives either link the same
        # way; the gloo link itself is tests/test_stage_transport.py's (its tests and a cluster).
        pytest.param("distributed", marks=pytest.mark.slow),
    ],
)
def test_stage_hop_plays_ping_pong_through_two_real_links(tmp_path, transport):
    """The hop microbenchmark on CPUs: two processes, a link each way (a /dev/shm ring, or gloo),
    each step read into fixed inputs as a step graph's and returned intact, and a live hop time
    per step."""
    import subprocess
    import sys

    out = tmp_path / "hop.json"
    proc = subprocess.run(
        [sys.executable, "-m", "strata.bench.stage_hop", "--devices", "cpu,cpu", "--transports", transport]
        + ["--rows", "8", "--hidden", "64", "--dtype", "float32", "--warmup", "10", "--rounds", "50"]
        + ["--output", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=common.REPO_ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(out.read_text())["transports"][transport]
    assert figures["intact"] is True
    assert figures["live_hop_us"] > 0 and figures["send_host_us"] > 0
    assert "gpu_hop_us" not in figures  # no GPU: no GPU-side figure


# Three clusters (15 s on an idle host, 65 s on a busy one): with STRATA_SLOW_TESTS=1. A tensor-parallel cluster's path is
# tests/test_tensor_parallel_e2e.py's, the phases' machinery the pipeline bench's above.
@pytest.mark.slow
def test_tensor_parallel_one_gpu_and_two_ranks_with_the_all_reduce_share(tmp_path):
    r = bench(
        tmp_path,
        "tensor-parallel",
        "--ways",
        "1,tp2",
        "--num-prompts",
        "4",
        "--shape",
        "mixed",
        "--mixed-lengths",
        "4,12",
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        str(OUTPUT_LEN),
        "--concurrency",
        "2",
        "--latency-num-prompts",
        "2",
        "--max-num-batched-tokens",
        "64",
    )
    assert_environment(r)
    runs = r["runs"]
    ways = [(x["way"], x["ranks"], x["no_collectives"]) for x in runs]
    assert ways == [("1", 1, False), ("tp2", 2, False), ("tp2", 2, True)]

    for x in runs:
        for name, phase in x.items():
            if name.startswith(("offline", "streams_")):
                assert phase["failed"] == 0 and phase["output_tokens_per_s"] > 0
                assert len(phase["gpu_busy_share"]) == x["ranks"] * x["stages"]
    assert "offline" not in runs[2]  # the run without collectives times batch 1 only
    streams = runs[1]["streams_2"]
    assert sum(streams["first_token_groups"]) == 2 and streams["latency_ms"]["mean"] > 0
    assert runs[1]["ratios"]["latency_streams_mean"] > 0
    assert runs[1]["ratios"]["tpot_1"] > 0 and runs[1]["all_reduce_share"] is not None
    assert "| tp2 |" in r["markdown_row"]


def test_tensor_parallel_ways_name_ranks_stages_and_replicas():
    from strata.bench.tensor_parallel import parse_way

    ways = ("1", "tp2", "pp2", "dp2", "tp2pp2", "tp2dp2", "tp4")
    assert [parse_way(w) for w in ways] == [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (4, 1, 1)]
    with pytest.raises(ValueError, match="unknown way"):
        parse_way("pp2tp2")


def test_pipeline_schedule_runs_the_scheduler_over_simulated_gpus():
    """The policy model (bench/pipeline_schedule.py): every request finishes and every block comes
    back; on two simulated GPUs the mixed shape runs faster than on one, every stage busy."""
    import argparse

    from strata.bench import pipeline_schedule

    args = argparse.Namespace(
        shape="8b",
        min_len=20,
        max_len=120,
        max_num_seqs=32,
        max_num_batched_tokens=1024,
        micro_batch_min_seqs=8,
        micro_batches=0,
        bandwidth=4.0e12,
        flops=6.0e14,
        host_ms=0.3,
        host_us_per_seq=2.0,
        hop_us=100.0,
        result_us=100.0,
        scheduler_us_per_seq=0.0,
        max_plans_in_flight=0,
        staging=0,
        host_after_take=0.5,
        eager_token_waits=False,
        seed=0,
    )
    one, two = (pipeline_schedule.simulate(args, stages, 96) for stages in (1, 2))
    assert two["tok_s"] > 1.2 * one["tok_s"]
    assert all(0.3 < b <= 1.0 for b in two["busy"]) and two["spread"] is not None
    assert one["spread"] is None and one["migrations"] == 0 and two["plans"] > one["plans"]
    # One plan in flight at two stages: each waits for the last one's result, so the stages take turns.
    args.max_plans_in_flight = 1
    lone = pipeline_schedule.simulate(args, 2, 96)
    assert lone["tok_s"] < 0.75 * two["tok_s"] and max(lone["busy"]) < 0.6
    # Hosts held to two steps ahead of their GPUs run no faster than free ones; a host slower than
    # its GPU's step seldom waits for it, a fast one often (what `strata bench pipeline` measured).
    args.max_plans_in_flight, args.host_ms = 0, 3.0
    free, slow = (pipeline_schedule.simulate(args, 2, 96) for args.staging in (0, 2))
    assert slow["tok_s"] <= free["tok_s"] * 1.001 and free["host_wait_ms"] == [0.0, 0.0]
    args.host_ms, args.host_us_per_seq = 0.01, 0.0
    fast = pipeline_schedule.simulate(args, 2, 96)
    assert all(f > 2 * s for f, s in zip(fast["host_wait_ms"], slow["host_wait_ms"]))
    # Stage 0 waiting for every announced step's tokens, needed or not, makes the GPUs take turns.
    args.eager_token_waits = True
    eager = pipeline_schedule.simulate(args, 2, 96)
    assert eager["tok_s"] < 0.8 * fast["tok_s"] and max(eager["busy"]) < max(fast["busy"])


def test_one_rank_alone_runs_its_shard_and_counts_a_steps_collectives():
    """bench/tensor_parallel_rank.py: rank 0 of 2 builds its shard without a group, and one decode
    step calls two all-reduces a layer (o_proj, down), one for the vocab-parallel embedding and one
    max for the greedy draw over the slices."""
    from strata.bench.tensor_parallel_rank import budgets, time_rank

    model = str(ensure_tiny_model())
    (whole,) = time_rank(model, "cpu", 1, [2], context_len=24, steps=2)
    (rank,) = time_rank(model, "cpu", 2, [2], context_len=24, steps=2)
    assert whole["collectives"] == {} and whole["step_ms"] > 0
    layers = 4  # the tiny model's
    assert rank["collectives"] == {"all_reduce_": 2 * layers + 1, "all_reduce_max_": 1}
    b = budgets(whole_ms=10.0, rank_ms=5.0, collectives=10)
    assert b["tpot_budget_us"] == pytest.approx(100.0) and b["share_budget_us"] == pytest.approx(0.15 / 0.85 * 500)


def test_prefix_groups_bench_with_two_replicas_computes_a_prefix_at_most_once_a_replica(tmp_path):
    """`strata bench prefix-groups --data-parallel-size 2`: a group goes whole to one replica, so
    each shared prefix is computed once over both replicas. The one-by-one requests follow their
    prefix to the replica that holds it while its load allows (routing.py's bounded loads: a burst
    may spread a prefix), so each replica computes it at most once."""
    r = bench(
        tmp_path,
        "prefix-groups",
        *("--num-groups", "4", "--group-size", "4", "--prefix-len", "64", "--suffix-len", "8"),
        *("--output-len", "4", "--ways", "groups,cache", "--data-parallel-size", "2"),
    )
    computed = {}
    for way in ("groups", "cache"):
        phase = r["phases"][way]
        assert phase["requests"] == 16 and phase["failed"] == 0
        computed[way] = phase["scheduler"]["prefill_tokens_computed"] - 16 * 8  # the prefixes' part
    assert computed["groups"] == 4 * 64
    assert 4 * 64 <= computed["cache"] <= 2 * 4 * 64


def test_host_overhead_bursts_report_each_process_cpu_per_request():
    """--bursts: every process's CPU per request is reported, the client's and each service's, and
    none is zero (each did work for every request)."""
    lines = _host_overhead(
        *("--bursts", "3", "--burst-size", "4", "--input-len", "8", "--output-len", "2", "--step-ms", "1")
    )
    wall = float(next(x for x in lines if "wall ms" in x).split()[-1])
    fields = next(x for x in lines if "CPU ms" in x).split("CPU ms")[1].split()
    cpu = dict(zip(fields[::2], map(float, fields[1::2])))
    assert set(cpu) == {"client", "worker", "scheduler", "gateway"}
    assert all(0 < ms for ms in cpu.values()) and wall > 0
