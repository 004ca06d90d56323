"""`strata bench latency`: serving latency through the full stack.

Two phases on one cluster: Poisson arrivals at --request-rate, then --concurrency streams in a
closed loop. DELTA responses are timestamped on arrival: TTFT is the first one, inter-token
latency (ITL) the gap between successive ones per token they carried. The closed-loop ITL is
compared with the bare model's decode step at that batch size, timed in this process afterwards.
"""

from __future__ import annotations

import math
import time

from strata.bench import common, roofline

TARGET_ITL_OVER_STEP = 1.3


def _latency_summary(records, elapsed: float, output_len: int) -> dict:
    done = [r for r in records if not r.error]
    itls = [x for r in done for x in r.inter_token_latencies()]
    tpots = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "num_requests": len(records),
        "failed": len(records) - len(done),
        "errors": common.failures(records)[:5],
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "all_outputs_full_length": all(r.output_tokens == output_len for r in done),
        "requests_per_s": len(done) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "ttft_ms": common.summarize([r.ttft for r in done]),
        "itl_ms": common.summarize(itls),
        "tpot_ms": common.summarize(tpots),
        "e2e_latency_ms": common.summarize([r.latency for r in done]),
    }


async def _phases(endpoints, args) -> dict:
    from strata.v1 import generate_pb2

    info = await common.model_info(endpoints.gateway)
    params = common.sampling_params(args.output_len, args.temperature, generate_pb2.DELTA)
    await common.warm_up(endpoints.gateway, args, info.vocab_size, args.input_len, args.seed + 1, generate_pb2.DELTA)
    prompts = common.random_prompts(args.num_prompts, args.input_len, info.vocab_size, args.seed)
    before = await common.scheduler_stats(endpoints.scheduler)
    start = time.perf_counter()
    records = await common.run_poisson(
        endpoints.gateway,
        prompts,
        params,
        args.request_rate,
        args.request_timeout,
        args.seed,
        desc=f"poisson {args.request_rate}/s",
        progress=not args.no_progress,
    )
    poisson = _latency_summary(records, time.perf_counter() - start, args.output_len)
    poisson["request_rate"] = args.request_rate
    after = await common.scheduler_stats(endpoints.scheduler)
    poisson["scheduler"] = common.stats_delta(before, after)

    num = args.concurrency_num_prompts or 4 * args.concurrency
    prompts = common.random_prompts(num, args.input_len, info.vocab_size, args.seed + 2)
    before = after
    start = time.perf_counter()
    with common.sampled_stacks(endpoints.service_pids, args.spy_dir, "closed_loop", args.spy_native):
        records = await common.run_closed_loop(
            endpoints.gateway,
            prompts,
            params,
            args.concurrency,
            args.request_timeout,
            desc=f"{args.concurrency} streams",
            progress=not args.no_progress,
        )
    closed = _latency_summary(records, time.perf_counter() - start, args.output_len)
    closed["concurrency"] = args.concurrency
    closed["scheduler"] = common.stats_delta(before, await common.scheduler_stats(endpoints.scheduler))
    return {"poisson": poisson, "closed_loop": closed}


def _rows(s: dict) -> list[tuple[str, str]]:
    def pct(d):
        return f"p50 {d['p50']:.2f}  p99 {d['p99']:.2f}  mean {d['mean']:.2f}" if d else "-"

    return [
        ("requests", f"{s['num_requests'] - s['failed']} ok, {s['failed']} failed in {s['elapsed_s']:.2f} s"),
        ("throughput", f"{s['requests_per_s']:.2f} req/s, {s['output_tokens_per_s']:,.0f} output tokens/s"),
        ("TTFT ms", pct(s["ttft_ms"])),
        ("ITL ms", pct(s["itl_ms"])),
        ("TPOT ms", pct(s["tpot_ms"])),
        ("E2E ms", pct(s["e2e_latency_ms"])),
        *_step_rows(s),
    ]


def _step_rows(s: dict) -> list[tuple[str, str]]:
    """Engine steps over the phase and, on a GPU, how busy the last stage's GPU was: with the
    GPU idle between steps, host time (not the model) sets the inter-token latency."""
    stats = s.get("scheduler")
    if not stats or not stats["steps"]:
        return []
    return [
        ("engine steps", f"{stats['steps']:,} ({s['elapsed_s'] / stats['steps'] * 1e3:.3f} ms of wall time each)"),
        *common.gpu_timeline_rows(stats, s["elapsed_s"]),
    ]


def run(args) -> int:
    env = common.environment_info(args)
    common.print_header("latency", env)
    with common.cluster_for(args) as endpoints:
        phases = common.run(_phases(endpoints, args))
    rate = "all at once" if math.isinf(args.request_rate) else f"{args.request_rate:g} req/s"
    common.print_section(
        f"Poisson arrivals ({rate}, {args.input_len} in / {args.output_len} out)", _rows(phases["poisson"])
    )
    common.print_section(f"{args.concurrency} concurrent streams, closed loop", _rows(phases["closed_loop"]))
    result = {"benchmark": "latency", "environment": env, "config": common.args_dict(args), **phases}

    bare = None
    if args.bare_step:
        context_len = args.input_len + args.output_len // 2
        bare = roofline.bare_decode_step(args, args.concurrency, context_len, args.bare_steps)
        result["bare_step"] = bare
    itl = phases["closed_loop"]["itl_ms"].get("p50")
    ratio = common.ratio(itl, bare and bare["median_s"] * 1e3)
    result["ratios"] = {"itl_p50_over_bare_step": ratio}
    if bare:
        common.print_section(
            "Inter-token latency vs the bare model step",
            [
                (
                    "bare decode step",
                    f"{bare['median_s'] * 1e3:.3f} ms median at batch {bare['batch']}, context "
                    f"{bare['context_len']} (in-process ModelRunner, steps back to back, "
                    f"sampling included; one step alone {bare['serial_s'] * 1e3:.3f} ms)",
                ),
                ("ITL p50", f"{common.fmt(itl, '.3f')} ms at {args.concurrency} streams"),
                ("ITL p50 / step", f"{common.fmt(ratio, '.2f')}x   (target <= {TARGET_ITL_OVER_STEP:g}x)"),
            ],
        )
    result["markdown_row"] = _markdown_row(env, args, phases, bare, ratio)
    print("RESULTS.md row:\n" + result["markdown_row"])
    common.write_json(args.output, result)
    return 1 if phases["poisson"]["failed"] or phases["closed_loop"]["failed"] else 0


def _markdown_row(env, args, phases, bare, ratio) -> str:
    f = common.fmt
    p, c = phases["poisson"], phases["closed_loop"]

    def pair(d):
        return f"{f(d.get('p50'), '.1f')} / {f(d.get('p99'), '.1f')}"

    cells = [
        env["date"][:10],
        env["commit"],
        env["device_name"],
        env["model"],
        str(args.pipeline_stages),
        f"{args.request_rate:g}",
        f"{args.input_len}/{args.output_len}",
        pair(p["ttft_ms"]),
        pair(p["itl_ms"]),
        str(args.concurrency),
        pair(c["itl_ms"]),
        f(bare and bare["median_s"] * 1e3, ".2f"),
        f(ratio, ".2f"),
    ]
    return "| " + " | ".join(cells) + " |"
