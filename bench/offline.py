"""`strata bench throughput`: offline throughput through the full stack, against HF generate() and
the decode roofline, printed in the same run.

Every prompt (random token ids, fixed input and output lengths, ignore_eos) is submitted at once
(or with at most --max-concurrency in flight); FINAL_ONLY responses keep the client out of the
way of the measurement. --min-input-len / --min-output-len make the lengths uniform in
[min, --input-len] and [min, --output-len] instead (a mixed shape: no HF run nor workload floor,
which assume fixed lengths).
"""

from __future__ import annotations

import time

import numpy as np

from strata.bench import common, roofline
from strata.bench.hf_baseline import run_hf_baseline

TARGET_HF_RATIO = 8.0
TARGET_OUTPUT_TOKENS_PER_S = 25_000
TARGET_ROOFLINE = 1.5


async def _strata_phase(endpoints, args) -> tuple[dict, list[list[int]], list]:
    from strata.v1 import generate_pb2

    info = await common.model_info(endpoints.gateway)
    await common.warm_up(endpoints.gateway, args, info.vocab_size, args.input_len, args.seed + 1)
    prompts, output_lens = _workload(args, info.vocab_size)
    params = [common.sampling_params(n, args.temperature, generate_pb2.FINAL_ONLY) for n in output_lens]
    before = await common.scheduler_stats(endpoints.scheduler)
    with common.sampled_stacks(endpoints.service_pids, args.spy_dir, "offline", args.spy_native):
        async with common.StatsPoller(endpoints.scheduler) as poller:
            start = time.perf_counter()
            records = await common.run_all_at_once(
                endpoints.gateway,
                prompts,
                params,
                args.request_timeout,
                args.max_concurrency,
                desc="strata",
                progress=not args.no_progress,
            )
            elapsed = time.perf_counter() - start
    after = await common.scheduler_stats(endpoints.scheduler)
    done = [r for r in records if not r.error]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.prompt_len for r in done)
    result = {
        "num_prompts": len(records),
        "failed": len(records) - len(done),
        "errors": common.failures(records)[:5],
        "elapsed_s": elapsed,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "all_outputs_full_length": all(r.output_tokens == n for r, n in zip(records, output_lens) if not r.error),
        "requests_per_s": len(done) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (input_tokens + output_tokens) / elapsed,
        "latency_ms": common.summarize([r.latency for r in done]),
        "scheduler": common.stats_delta(before, after),
    }
    return result, prompts, poller.samples


def _workload(args, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """The prompts and each one's output length: fixed, or uniform from the --min-* lengths."""
    if not _mixed_lengths(args):
        return common.random_prompts(args.num_prompts, args.input_len, vocab_size, args.seed), [
            args.output_len
        ] * args.num_prompts
    rng = np.random.default_rng(args.seed)
    input_lens = rng.integers(args.min_input_len or args.input_len, args.input_len + 1, args.num_prompts)
    output_lens = rng.integers(args.min_output_len or args.output_len, args.output_len + 1, args.num_prompts)
    prompts = [rng.integers(common.FIRST_PROMPT_TOKEN, vocab_size, n).tolist() for n in input_lens]
    return prompts, output_lens.tolist()


def _mixed_lengths(args) -> bool:
    return bool(args.min_input_len or args.min_output_len)


def _hf_enabled(args) -> bool:
    if _mixed_lengths(args):
        return False
    if args.hf_baseline is not None:
        return args.hf_baseline
    return common.resolve_device(args.device).startswith("cuda")


def run(args) -> int:
    env = common.environment_info(args)
    common.print_header("throughput", env)
    with common.cluster_for(args) as endpoints:
        strata, prompts, samples = common.run(_strata_phase(endpoints, args))
    s = strata
    common.print_section(
        f"Strata, full stack ({args.num_prompts} prompts, {_lengths(args)}, "
        f"temperature {args.temperature}, ignore_eos)",
        [
            ("requests", f"{s['num_prompts'] - s['failed']} ok, {s['failed']} failed"),
            ("elapsed", f"{s['elapsed_s']:.2f} s"),
            ("requests/s", common.fmt(s["requests_per_s"], ",.2f")),
            ("output tokens/s", common.fmt(s["output_tokens_per_s"], ",.0f")),
            ("total tokens/s", common.fmt(s["total_tokens_per_s"], ",.0f")),
            ("output tokens", f"{s['output_tokens']:,} (every output full length: {s['all_outputs_full_length']})"),
            (
                "scheduler",
                ", ".join(
                    f"{k} {v:,}"
                    for k, v in s["scheduler"].items()
                    if k in ("steps", "prefill_tokens_computed", "preemptions")
                )
                or "-",
            ),
            *common.gpu_timeline_rows(s["scheduler"], s["elapsed_s"]),
        ],
    )

    result = {"benchmark": "throughput", "environment": env, "config": common.args_dict(args), "strata": strata}

    hf = None
    if _hf_enabled(args):
        hf_num = min(args.hf_num_prompts or 2 * args.hf_batch_size, len(prompts))
        hf = run_hf_baseline(args, prompts[:hf_num], args.output_len)
        hf["extrapolated_elapsed_s"] = hf["elapsed_s"] * len(prompts) / hf_num
        hf["extrapolated"] = hf_num < len(prompts)
        note = (
            f"measured on {hf_num} of {len(prompts)} prompts; the full run would take about "
            f"{hf['extrapolated_elapsed_s']:.1f} s"
            if hf["extrapolated"]
            else "all prompts"
        )
        common.print_section(
            f"HF transformers generate() (batch {hf['batch_size']}, {hf['dtype']}, left padding)",
            [
                ("weights", hf["weights"]),
                ("elapsed", f"{hf['elapsed_s']:.2f} s for {hf_num} prompts"),
                ("requests/s", common.fmt(hf["requests_per_s"], ",.2f")),
                ("output tokens/s", common.fmt(hf["output_tokens_per_s"], ",.0f")),
                ("total tokens/s", common.fmt(hf["total_tokens_per_s"], ",.0f")),
            ],
            note=note,
        )
        result["hf"] = hf

    roof = None
    if args.roofline:
        context_len = args.input_len + args.output_len // 2
        roof = roofline.with_scheduler_view(
            roofline.in_process_roofline(args, args.roofline_batch, context_len, args.roofline_steps),
            common.decode_only_timing(samples),
        )
        common.print_section(
            "Decode step vs roofline",
            roofline.roofline_rows(roof),
            note="floor = (weight bytes + KV bytes read) / copy bandwidth",
        )
        result["roofline"] = roofline.json_ready(roof)
        floor = None if _mixed_lengths(args) else _workload_floor(args, roof, hf, s)
        if floor:
            result["workload_floor"] = floor

    ratios = {
        "strata_over_hf_output_tokens_per_s": common.ratio(s["output_tokens_per_s"], hf and hf["output_tokens_per_s"]),
        "decode_step_over_floor": roof and roof["measured_over_floor"],
    }
    result["ratios"] = ratios
    common.print_section(
        "Targets (Llama-3.2-1B shape, one H100/H200)",
        [
            (
                "strata / HF output tokens/s",
                f"{common.fmt(ratios['strata_over_hf_output_tokens_per_s'], '.2f')}x"
                f"   (target >= {TARGET_HF_RATIO:g}x)",
            ),
            ("strata output tokens/s", f"{s['output_tokens_per_s']:,.0f}   (target >= {TARGET_OUTPUT_TOKENS_PER_S:,})"),
            (
                "decode step / floor",
                f"{common.fmt(ratios['decode_step_over_floor'], '.2f')}x"
                f"   (target <= {TARGET_ROOFLINE:g}x at batch {args.roofline_batch})",
            ),
        ],
    )
    result["markdown_row"] = _markdown_row(env, args, s, hf, roof, ratios)
    print("RESULTS.md row:\n" + result["markdown_row"])
    common.write_json(args.output, result)
    return 1 if s["failed"] else 0


def _workload_floor(args, roof: dict, hf: dict | None, s: dict) -> dict | None:
    """What this device allows the whole workload, beside the HF target (GPU only)."""
    flops = roofline.measure_matmul_flops(common.resolve_device(args.device))
    if flops is None:
        return None
    floor = roofline.workload_floor(
        roof["config"],
        roof["itemsize"],
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.max_num_seqs,
        roof["bandwidth_bytes_per_s"],
        flops,
    )
    rows = [
        ("GEMM rate", f"{flops / 1e12:,.0f} TFLOP/s (bf16 8192^3 matmuls)"),
        ("prefill", f"{floor['prefill_flops'] / 1e12:,.0f} TFLOP -> {floor['prefill_s']:.2f} s"),
        (
            "decode",
            f"{floor['decode_flops'] / 1e12:,.0f} TFLOP, {floor['decode_bytes'] / 1e9:,.0f} GB at "
            f"batch {args.max_num_seqs} -> {floor['decode_s']:.2f} s",
        ),
        ("floor", f"{floor['floor_s']:.2f} s: at most {floor['max_output_tokens_per_s']:,.0f} output tokens/s"),
        ("strata", f"{s['output_tokens_per_s'] / floor['max_output_tokens_per_s']:.0%} of that"),
    ]
    if hf:
        needed = TARGET_HF_RATIO * hf["output_tokens_per_s"]
        rows.append(
            (
                f"{TARGET_HF_RATIO:g}x HF",
                f"{needed:,.0f} output tokens/s = {needed / floor['max_output_tokens_per_s']:.0%} of the floor's rate",
            )
        )
    common.print_section("Workload floor (prefill at the GEMM rate, decode at max(compute, bytes / bandwidth))", rows)
    return floor


def _lengths(args) -> str:
    if not _mixed_lengths(args):
        return f"{args.input_len} in / {args.output_len} out"
    return (
        f"{args.min_input_len or args.input_len}-{args.input_len} in / "
        f"{args.min_output_len or args.output_len}-{args.output_len} out"
    )


def _markdown_row(env, args, s, hf, roof, ratios) -> str:
    f = common.fmt
    cells = [
        env["date"][:10],
        env["commit"],
        env["device_name"],
        env["model"],
        str(args.pipeline_stages),
        f"{args.num_prompts} x {_lengths(args)}",
        f(s["requests_per_s"], ".2f"),
        f(s["output_tokens_per_s"], ",.0f"),
        f(s["total_tokens_per_s"], ",.0f"),
        f(hf and hf["output_tokens_per_s"], ",.0f"),
        f(ratios["strata_over_hf_output_tokens_per_s"], ".2f"),
        f(roof and roof["measured"]["median_s"] * 1e3, ".2f"),
        f(roof and roof["floor_s"] * 1e3, ".2f"),
        f(ratios["decode_step_over_floor"], ".2f"),
    ]
    return "| " + " | ".join(cells) + " |"
