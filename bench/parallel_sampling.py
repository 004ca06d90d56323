"""`strata bench parallel-sampling`: one request of n = N against N requests of n = 1.

Three phases, each on a fresh cluster by default (the scheduler's peak KV blocks is a running
maximum, so only a fresh scheduler gives each phase its own peak):
  n=N      one request, n = N, one prompt
  distinct N requests, n = 1, N different prompts
  same     N requests, n = 1, one prompt repeated (the prefix cache should compute it once)
Each reports output tokens/s, prefill tokens computed, prefix-cache hits and peak KV blocks.
"""

from __future__ import annotations

import math
import time

from strata.bench import common

TARGET_OVER_SAME = 0.95
TARGET_OVER_DISTINCT = 2.0  # issue 12 (1.5 before cascade attention)
PHASES = ("n", "distinct", "same")


async def _phase(endpoints, args, name: str) -> dict:
    from strata.v1 import generate_pb2

    info = await common.model_info(endpoints.gateway)
    seed = args.seed + 10 * (PHASES.index(name) + 1)  # no prompt is shared between phases
    await common.warm_up(endpoints.gateway, args, info.vocab_size, 8, seed + 1)
    n = args.n
    if name == "n":
        prompts = common.random_prompts(1, args.input_len, info.vocab_size, seed)
        params = common.sampling_params(args.output_len, args.temperature, generate_pb2.FINAL_ONLY, n=n, seed=args.seed)
    elif name == "distinct":
        prompts = common.random_prompts(n, args.input_len, info.vocab_size, seed)
        params = [
            common.sampling_params(args.output_len, args.temperature, generate_pb2.FINAL_ONLY, seed=args.seed + i)
            for i in range(n)
        ]
    else:
        prompts = common.random_prompts(1, args.input_len, info.vocab_size, seed) * n
        params = [
            common.sampling_params(args.output_len, args.temperature, generate_pb2.FINAL_ONLY, seed=args.seed + i)
            for i in range(n)
        ]
    before = await common.scheduler_stats(endpoints.scheduler)
    start = time.perf_counter()
    records = await common.run_all_at_once(
        endpoints.gateway, prompts, params, args.request_timeout, desc=name, progress=not args.no_progress
    )
    elapsed = time.perf_counter() - start
    after = await common.scheduler_stats(endpoints.scheduler)
    done = [r for r in records if not r.error]
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "requests": len(records),
        "failed": len(records) - len(done),
        "errors": common.failures(records)[:5],
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "expected_output_tokens": n * args.output_len,
        "output_tokens_per_s": output_tokens / elapsed,
        "cached_prompt_tokens": sum(r.cached_prompt_tokens for r in done),
        "block_size": info.block_size,
        "scheduler": common.stats_delta(before, after),
    }


def _run_phases(args) -> tuple[dict, bool]:
    """Every phase's result, and whether each phase had a scheduler of its own."""
    results = {}
    fresh = args.fresh_cluster and not args.address
    if fresh:
        for name in PHASES:
            with common.cluster_for(args) as endpoints:
                results[name] = common.run(_phase(endpoints, args, name))
    else:
        with common.cluster_for(args) as endpoints:
            for name in PHASES:
                results[name] = common.run(_phase(endpoints, args, name))
    return results, fresh


def peak_block_bound(n: int, prompt_len: int, output_len: int, block_size: int) -> int:
    """The prompt's full blocks once, plus each child's own blocks: its copy of the partial last
    prompt block (if any) followed by its generated tokens."""
    return prompt_len // block_size + n * math.ceil((prompt_len % block_size + output_len) / block_size)


def run(args) -> int:
    env = common.environment_info(args)
    common.print_header("parallel-sampling", env)
    phases, fresh = _run_phases(args)
    labels = {
        "n": f"1 request, n={args.n}",
        "distinct": f"{args.n} requests, distinct prompts",
        "same": f"{args.n} requests, same prompt",
    }
    for name in PHASES:
        p, s = phases[name], phases[name]["scheduler"]
        common.print_section(
            labels[name],
            [
                ("requests", f"{p['requests'] - p['failed']} ok, {p['failed']} failed in {p['elapsed_s']:.2f} s"),
                (
                    "output tokens/s",
                    f"{p['output_tokens_per_s']:,.0f} ({p['output_tokens']:,} tokens, "
                    f"{p['expected_output_tokens']:,} requested)",
                ),
                ("prefill tokens computed", common.fmt(s.get("prefill_tokens_computed"), ",")),
                (
                    "prefix cache hits",
                    f"{common.fmt(s.get('prefix_cache_hits'), ',')} tokens; usage says "
                    f"{p['cached_prompt_tokens']:,} cached prompt tokens",
                ),
                (
                    "peak KV blocks",
                    common.fmt(s.get("peak_used_kv_blocks"), ",")
                    + ("" if fresh else " (running maximum since the cluster started)"),
                ),
            ],
        )
    block_size = phases["n"]["block_size"]
    bound = peak_block_bound(args.n, args.input_len, args.output_len, block_size)
    tps = {name: phases[name]["output_tokens_per_s"] for name in PHASES}
    ratios = {
        "n_over_same": common.ratio(tps["n"], tps["same"]),
        "n_over_distinct": common.ratio(tps["n"], tps["distinct"]),
    }
    peak_n = phases["n"]["scheduler"].get("peak_used_kv_blocks")
    common.print_section(
        f"n={args.n} against n=1 (prompt {args.input_len}, output {args.output_len}, block size {block_size})",
        [
            ("n / same prompt", f"{common.fmt(ratios['n_over_same'], '.2f')}x   (target >= {TARGET_OVER_SAME:g}x)"),
            (
                "n / distinct prompts",
                f"{common.fmt(ratios['n_over_distinct'], '.2f')}x   (target >= {TARGET_OVER_DISTINCT:g}x)",
            ),
            ("peak blocks of n", f"{common.fmt(peak_n, ',')} (one prompt copy + generated = {bound:,})"),
        ],
        note=None if fresh else "one cluster for all phases: peak blocks are running maxima",
    )
    result = {
        "benchmark": "parallel-sampling",
        "environment": env,
        "config": common.args_dict(args),
        "fresh_cluster_per_phase": fresh,
        "phases": phases,
        "peak_block_bound": bound,
        "ratios": ratios,
    }
    result["markdown_row"] = _markdown_row(env, args, phases, ratios, bound)
    print("RESULTS.md row:\n" + result["markdown_row"])
    common.write_json(args.output, result)
    return 1 if any(phases[name]["failed"] for name in PHASES) else 0


def _markdown_row(env, args, phases, ratios, bound) -> str:
    f = common.fmt

    def each(key):
        return " / ".join(f(phases[name]["scheduler"].get(key), ",") for name in PHASES)

    cells = [
        env["date"][:10],
        env["commit"],
        env["device_name"],
        env["model"],
        str(args.pipeline_stages),
        f"{args.n} x {args.input_len}/{args.output_len}",
        " / ".join(f(phases[name]["output_tokens_per_s"], ",.0f") for name in PHASES),
        f(ratios["n_over_same"], ".2f"),
        f(ratios["n_over_distinct"], ".2f"),
        each("prefill_tokens_computed"),
        each("peak_used_kv_blocks") + f" (bound {bound:,})",
    ]
    return "| " + " | ".join(cells) + " |"
