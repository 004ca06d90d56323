"""`strata bench prompt-logprobs`: what prompt logprobs cost, on one cluster, in one run (issue 52).

Two measures, each a pair of phases on fresh random prompts (the prefix cache helps neither):
  others   --num-prompts requests (--input-len in, --output-len out) at once, nobody asking; then
           the same shape with every 1/--ask-fraction-th request asking prompt logprobs (top
           --top). For the requests that did not ask, output tokens per second up to the last
           one's end: asking run over plain run (target >= 0.97: they pay nothing measurable).
  prefill  --prefill-prompts requests of --input-len with max_tokens 1 at once, none asking, then
           all asking: the last stage's GPU time in steps (CUDA events; wall time on a CPU
           worker), asking over plain (target <= 1.3: the rows' lm_head, log-softmax and top k
           against the plain prefill).
The pairs run --repeats times in the order plain, asking, asking, plain, ... so that drift of the
device's clocks weighs on both sides alike; each ratio is over the sums.
"""

from __future__ import annotations

import time

from strata.bench import common

TARGET_OTHERS = 0.97
TARGET_PREFILL = 1.3


async def _phase(endpoints, args, info, seed: int, num: int, output_len: int, asking) -> dict:
    """`num` requests at once; asking(i): whether request i asks prompt logprobs."""
    from strata.v1 import generate_pb2

    prompts = common.random_prompts(num, args.input_len, info.vocab_size, seed)
    params = []
    for i in range(num):
        p = common.sampling_params(output_len, args.temperature, generate_pb2.FINAL_ONLY, seed=args.seed + i)
        if asking(i):
            p.prompt_logprobs = args.top
        params.append(p)
    before = await common.scheduler_stats(endpoints.scheduler)
    start = time.perf_counter()
    records = await common.run_all_at_once(
        endpoints.gateway, prompts, params, args.request_timeout, desc=f"seed {seed}", progress=not args.no_progress
    )
    after = await common.scheduler_stats(endpoints.scheduler)
    others = [r for i, r in enumerate(records) if not _asks(args, i)]
    failed = [r for r in records if r.error]
    return {
        "failed": len(failed),
        "errors": common.failures(records)[:5],
        "wall_s": max(r.end for r in records) - start,
        "others_tokens": sum(r.output_tokens for r in others),
        "others_s": max(r.end for r in others) - start,
        "gpu_busy_s": after.worker_gpu_busy_seconds - before.worker_gpu_busy_seconds if after else 0.0,
        "prompt_logprob_positions": after.prompt_logprob_positions - before.prompt_logprob_positions if after else 0,
    }


def _asks(args, i: int) -> bool:
    return i % round(1 / args.ask_fraction) == 0


async def _measure(endpoints, args) -> dict:
    info = await common.model_info(endpoints.gateway)
    await common.warm_up(endpoints.gateway, args, info.vocab_size, args.input_len, args.seed + 1)
    # A warm-up request that asks: the rows' kernels compile before the timed phases.
    await _phase(endpoints, args, info, args.seed + 2, 2, 2, lambda i: True)
    phases: dict[str, list[dict]] = {"others_plain": [], "others_asking": [], "prefill_plain": [], "prefill_asking": []}
    seed = args.seed + 100
    for r in range(args.repeats):
        order = ("plain", "asking") if r % 2 == 0 else ("asking", "plain")
        for kind in order:
            seed += 1
            asking = (lambda i: _asks(args, i)) if kind == "asking" else (lambda i: False)
            phases[f"others_{kind}"].append(
                await _phase(endpoints, args, info, seed, args.num_prompts, args.output_len, asking)
            )
        for kind in order:
            seed += 1
            asking = (lambda i: True) if kind == "asking" else (lambda i: False)
            phases[f"prefill_{kind}"].append(await _phase(endpoints, args, info, seed, args.prefill_prompts, 1, asking))
    return phases


def _sum(runs: list[dict], key: str) -> float:
    return sum(run[key] for run in runs)


def run(args) -> int:
    env = common.environment_info(args)
    common.print_header("prompt-logprobs", env)
    with common.cluster_for(args) as endpoints:
        phases = common.run(_measure(endpoints, args))
    plain, asking = phases["others_plain"], phases["others_asking"]
    tps_plain = _sum(plain, "others_tokens") / _sum(plain, "others_s")
    tps_asking = _sum(asking, "others_tokens") / _sum(asking, "others_s")
    others_ratio = common.ratio(tps_asking, tps_plain)
    gpu = _sum(phases["prefill_plain"], "gpu_busy_s") > 0
    key = "gpu_busy_s" if gpu else "wall_s"
    prefill_plain, prefill_asking = _sum(phases["prefill_plain"], key), _sum(phases["prefill_asking"], key)
    prefill_ratio = common.ratio(prefill_asking, prefill_plain)
    asked = _sum(phases["prefill_asking"], "prompt_logprob_positions")
    want = args.repeats * args.prefill_prompts * (args.input_len - 1)
    share = f"1 in {round(1 / args.ask_fraction)}"
    common.print_section(
        f"others: {args.num_prompts} x {args.input_len}/{args.output_len}, {share} asking top {args.top}",
        [
            ("others' output tok/s, nobody asks", common.fmt(tps_plain, ",.0f")),
            ("others' output tok/s, some ask", common.fmt(tps_asking, ",.0f")),
            ("ratio", f"{common.fmt(others_ratio, '.3f')}   (target >= {TARGET_OTHERS})"),
        ],
    )
    common.print_section(
        f"prefill: {args.prefill_prompts} x {args.input_len}, max_tokens 1, all asking top {args.top} or none",
        [
            (f"plain prefill ({'GPU time in steps' if gpu else 'wall'})", f"{prefill_plain * 1e3:,.1f} ms"),
            ("asking prefill", f"{prefill_asking * 1e3:,.1f} ms"),
            ("ratio", f"{common.fmt(prefill_ratio, '.3f')}   (target <= {TARGET_PREFILL})"),
            ("prompt positions computed", f"{asked:,} (expected {want:,})"),
        ],
    )
    failed = sum(run["failed"] for runs in phases.values() for run in runs)
    result = {
        "benchmark": "prompt-logprobs",
        "environment": env,
        "config": common.args_dict(args),
        "phases": phases,
        "others_ratio": others_ratio,
        "prefill_ratio": prefill_ratio,
        "prefill_measure": key,
    }
    row = [
        env["date"][:10],
        env["commit"],
        env["device_name"],
        env["model"],
        f"{args.num_prompts} x {args.input_len}/{args.output_len}, {share} top {args.top}",
        common.fmt(others_ratio, ".3f"),
        f"{common.fmt(prefill_ratio, '.3f')} ({key})",
    ]
    result["markdown_row"] = "| " + " | ".join(row) + " |"
    print("RESULTS.md row:\n" + result["markdown_row"])
    common.write_json(args.output, result)
    return 1 if failed or asked != want else 0
