"""`strata bench pipeline`: pipeline parallelism against one stage, in one run (issue 29), and
data-parallel replicas beside them (the `dp` way, issue 50: --data-parallel, replicas of one
stage each behind one gateway, a GPU each).

For each stage count (1, 2, and 4 where the GPUs allow; stages share a GPU when the host has
fewer GPUs than stages) and each stage transport (--transports), and each replica count, a fresh
cluster runs:

- the offline workload, all at once, FINAL_ONLY, once per --num-prompts count: with --shape
  fixed, --input-len / --output-len tokens each; with --shape mixed, prompts and outputs uniform
  in --mixed-lengths (100..1,024: the nano-vllm benchmark's shape), ignore_eos: output tokens/s;
- the latency workload (--concurrency streams in a closed loop, DELTA): TPOT and ITL.

It prints, per run and phase, each stage's own timeline (WorkerStats: time inside steps and idle
between them, from CUDA events on GPUs, host time on CPUs: the bubbles; not the time before a
step the scheduler sent after it had nothing to run, waiting for clients) and each GPU's busy
share of the phase's wall time, the scheduler's host time per step and its micro-batches
(how many ran, requests moved between them, how unequal a round's plans were), the hops (activations
stage i -> i+1 and sampled tokens last -> stage 0: bytes and the sender's transport time per
step, and the time stage 0's steps waited for tokens), tok/s and TPOT relative to one stage, and
the targets measured against in the same run, plus a RESULTS.md row per multi-stage run and
offline workload:
`| Date | Commit | Device | Model | Stages | Transport | Offline | out tok/s | x one stage | GPU busy by stage, offline | TPOT p50 ms, 16 streams | x one stage | idlest stage idle, offline | GPU idle, 16 streams | token hop us/step |`
"""

from __future__ import annotations

import os
import time

from strata.bench import common

TARGET_OFFLINE_RATIO = 0.9  # output tok/s of P stages / one stage, 1B offline
TARGET_TPOT_RATIO = 1.25  # TPOT p50 of P stages / one stage, 16 streams
TARGET_IDLE = 0.10  # each stage's GPU idle between steps / its timeline, offline
# The issue's hop: 2 MiB of activations at batch 256 (bench/stage_hop.py measures it); printed
# here beside the token link's sender host time per step, which this bench measures.
TARGET_HOP_US = 100.0
# Issue 50, on two GPUs (8B, 1,024 requests): D replicas' output tok/s / one GPU's, and P stages'
# / the D = P replicas'.
TARGET_DP_RATIO = 1.85
TARGET_PP_OVER_DP = 0.9

WORKER_COUNTERS = (
    "steps",
    "busy_seconds",
    "idle_seconds",
    "timed_steps",
    "launch_seconds",
    "input_wait_seconds",
    "token_wait_seconds",
    "token_waits",
    "activation_steps_sent",
    "activation_bytes_sent",
    "activation_send_seconds",
    "token_steps_sent",
    "token_bytes_sent",
    "token_send_seconds",
    "step_thread_cpu_seconds",
    "process_cpu_seconds",
    "gpu_wait_seconds",
    "gpu_waits",
)


def _visible_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def stage_counts(value: str) -> list[int]:
    """'auto': 1 and 2, and 4 where at least 4 GPUs are visible; else a comma list."""
    if value != "auto":
        return [int(s) for s in value.split(",") if s.strip()]
    return [1, 2, 4] if _visible_gpus() >= 4 else [1, 2]


def replica_counts(value: str) -> list[int]:
    """'auto': 2 replicas where 2 GPUs are visible (and 4 where 4 are); else a comma list (0: none)."""
    if value != "auto":
        return [int(d) for d in value.split(",") if d.strip() and int(d) > 0]
    gpus = _visible_gpus()
    return [d for d in (2, 4) if d <= gpus]


async def worker_stats(addresses: list[str]):
    from strata.v1 import engine_pb2, engine_pb2_grpc

    out = []
    for address in addresses:
        async with common.scheduler_channel(address) as channel:  # internal: carries the cluster token
            out.append(await engine_pb2_grpc.WorkerStub(channel).GetStats(engine_pb2.WorkerStatsRequest(), timeout=30))
    return out


def _worker_delta(before, after) -> list[dict]:
    return [{name: getattr(a, name) - getattr(b, name) for name in WORKER_COUNTERS} for b, a in zip(before, after)]


async def _phase(endpoints, workers, run):
    before_w = await worker_stats(workers)
    before = await common.cluster_stats(endpoints)
    start = time.perf_counter()
    records = await run()
    elapsed = time.perf_counter() - start
    after = await common.cluster_stats(endpoints)
    # Stages finish their last steps' timing as their events complete: read them after a moment.
    after_w = await worker_stats(workers)
    done = [r for r in records if not r.error]
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    itls = [x for r in done for x in r.inter_token_latencies()]
    return {
        "requests": len(records),
        "failed": len(records) - len(done),
        "errors": common.failures(records)[:5],
        "elapsed_s": elapsed,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed,
        "tpot_ms": common.summarize(tpots),
        "itl_ms": common.summarize(itls),
        "scheduler": common.stats_delta(before, after),
        "stages": _worker_delta(before_w, after_w),
    }


def offline_workloads(args, vocab_size: int) -> list[tuple[str, list[list[int]], list]]:
    """(name, prompts, each prompt's SamplingParams) of each offline phase: one per --num-prompts
    count, in the --shape asked for."""
    from strata.v1 import generate_pb2

    out = []
    for i, num in enumerate(args.num_prompts):
        seed = args.seed + 10 * i
        if args.shape == "mixed":
            shortest, longest = args.mixed_lengths
            prompts, lengths = common.mixed_prompts(num, shortest, longest, vocab_size, seed)
            name = f"{num} x {shortest}-{longest}/{shortest}-{longest}"
        else:
            prompts = common.random_prompts(num, args.input_len, vocab_size, seed)
            lengths = [args.output_len] * num
            name = f"{num} x {args.input_len}/{args.output_len}"
        params = [common.sampling_params(n, args.temperature, generate_pb2.FINAL_ONLY) for n in lengths]
        out.append((name, prompts, params))
    return out


async def _run_config(endpoints, workers, args, name: str) -> dict:
    from strata.v1 import generate_pb2

    info = await common.model_info(endpoints.gateway)
    await common.warm_up(endpoints.gateway, args, info.vocab_size, args.input_len, args.seed + 1)
    # --spy-dir: the services' Python stacks in each phase, a folder per run (bench/spy_summary.py).
    spy_dir = args.spy_dir and os.path.join(args.spy_dir, name)
    offline = []
    for workload, prompts, params in offline_workloads(args, info.vocab_size):
        with common.sampled_stacks(endpoints.service_pids, spy_dir, f"offline-{len(prompts)}", args.spy_native):
            phase = await _phase(
                endpoints,
                workers,
                lambda: common.run_all_at_once(
                    endpoints.gateway,
                    prompts,
                    params,
                    args.request_timeout,
                    desc=f"offline {workload}",
                    progress=not args.no_progress,
                ),
            )
        offline.append({"workload": workload, **phase})
    # 16 requests a stream: at 4 the phase lasted about a second on an H200, and one stage's GPU
    # idle in it swung from 3% to 12% between runs of one machine (bench/RESULTS.md, session 10).
    num = args.latency_num_prompts or 16 * args.concurrency
    stream_prompts = common.random_prompts(num, args.input_len, info.vocab_size, args.seed + 2)
    with common.sampled_stacks(endpoints.service_pids, spy_dir, "latency", args.spy_native):
        latency = await _phase(
            endpoints,
            workers,
            lambda: common.run_closed_loop(
                endpoints.gateway,
                stream_prompts,
                common.sampling_params(args.output_len, args.temperature, generate_pb2.DELTA),
                args.concurrency,
                args.request_timeout,
                desc=f"{args.concurrency} streams",
                progress=not args.no_progress,
            ),
        )
    return {"offline": offline, "latency": latency}


def _stage_rows(phase: dict, replicas: int = 1) -> list[tuple[str, str]]:
    rows = []
    stages = phase["stages"]
    per_replica = len(stages) // replicas
    for j, s in enumerate(stages):
        i = j % per_replica  # the stage within its replica
        label = f"replica {j // per_replica} stage {i}" if replicas > 1 else f"stage {i}"
        timed = s["timed_steps"]
        busy, idle = s["busy_seconds"], s["idle_seconds"]
        share = idle / max(busy + idle, 1e-9)
        line = (
            f"{s['steps']:,} steps: busy {busy:.2f} s ({busy / phase['elapsed_s']:.0%} of the wall time), idle "
            f"between steps {idle:.2f} s ({share:.1%} of its timeline"
            f"{', CUDA events' if common.resolve_device('auto').startswith('cuda') else ', host time'})"
            if timed
            else f"{s['steps']:,} steps (no timeline)"
        )
        if s["input_wait_seconds"] and i > 0:
            line += f"; waited {s['input_wait_seconds'] / max(s['steps'], 1) * 1e3:.3f} ms/step for activations"
        if s["token_waits"]:
            line += f"; {s['token_waits']:,} steps waited for tokens, {s['token_wait_seconds'] * 1e3 / s['token_waits']:.3f} ms each"
        rows.append((label, line))
        if s["steps"] and s["process_cpu_seconds"]:  # which host paces: CPU, not waits
            n, wall = s["steps"], phase["elapsed_s"]
            thread, process = s["step_thread_cpu_seconds"], s["process_cpu_seconds"]
            rows.append(
                (
                    f"{label} CPU",
                    f"step thread {thread / n * 1e3:.2f} ms/step ({thread / wall:.0%} of the wall time), the process "
                    f"{process / n * 1e3:.2f} ms/step ({process / wall:.0%} of a core); waited for its GPU "
                    f"{s['gpu_wait_seconds'] / n * 1e3:.2f} ms/step ({s['gpu_waits']:,} waits)",
                )
            )
        if s["activation_steps_sent"]:
            n = s["activation_steps_sent"]
            rows.append(
                (
                    f"hop {i} -> {i + 1}",
                    f"activations: {s['activation_bytes_sent'] / n / 1024:,.1f} KiB and "
                    f"{s['activation_send_seconds'] / n * 1e6:,.1f} us of transport per step",
                )
            )
        if s["token_steps_sent"]:
            n = s["token_steps_sent"]
            rows.append(
                (
                    f"hop {i} -> 0",
                    f"sampled tokens: {s['token_bytes_sent'] / n:,.0f} bytes and "
                    f"{s['token_send_seconds'] / n * 1e6:,.1f} us of transport per step",
                )
            )
    return rows


def _busy_shares(phase: dict) -> list[float]:
    """Each GPU's (stage's) time inside steps over the phase's wall time: where it is short of
    1, that GPU waited (bubbles, hops, hosts, clients)."""
    return [s["busy_seconds"] / phase["elapsed_s"] for s in phase["stages"] if s["timed_steps"]]


def _scheduler_rows(phase: dict) -> list[tuple[str, str]]:
    """The scheduler's host time per step, and its micro-batches over the phase."""
    sched = phase["scheduler"]
    if not sched.get("steps"):
        return []
    steps = sched["steps"]
    rows = [
        ("scheduler host", f"{sched['host_seconds'] / steps * 1e3:.3f} ms per step on results and plans"),
        # At the limit: more plans in flight would have gone out; below it: none could (its work
        # waited on results: a micro-batch's turn, its lookahead depth).
        (
            "plans in flight",
            f"{sched['plan_round_trip_seconds'] / phase['elapsed_s']:.1f} on average, a round trip of "
            f"{sched['plan_round_trip_seconds'] / steps * 1e3:.2f} ms; the loop waited for results "
            f"{sched['wait_at_limit_seconds'] / steps * 1e3:.3f} ms a step at the limit, "
            f"{sched['wait_below_limit_seconds'] / steps * 1e3:.3f} below it",
        ),
    ]
    if sched.get("micro_batch_rounds"):
        rows.append(
            (
                "micro-batches",
                f"{sched['micro_batches_after']} running at the end; {sched['micro_batch_migrations']:,} requests "
                f"moved between them; a round's plans {sched['micro_batch_token_spread'] / sched['micro_batch_rounds']:.1%} "
                "short of its heaviest on average (1 - mean / most tokens)",
            )
        )
    return rows


def _idle_share(phase: dict) -> float | None:
    shares = [
        s["idle_seconds"] / (s["busy_seconds"] + s["idle_seconds"])
        for s in phase["stages"]
        if s["timed_steps"] and s["busy_seconds"] + s["idle_seconds"] > 0
    ]
    return max(shares) if shares else None


def _shared_gpu_idle(phase: dict) -> float | None:
    """Stages sharing one GPU take turns on it, so each stage's own idle share counts the others'
    steps: the GPU's idle is what no stage's steps cover, 1 - sum of busy / the longest timeline
    (exact where steps do not overlap, as in a lone micro-batch's chain; a floor otherwise)."""
    timed = [s for s in phase["stages"] if s["timed_steps"]]
    span = max((s["busy_seconds"] + s["idle_seconds"] for s in timed), default=0.0)
    if not timed or span <= 0:
        return None
    return max(0.0, 1.0 - sum(s["busy_seconds"] for s in timed) / span)


def _token_hop_us(phase: dict) -> float | None:
    last = phase["stages"][-1] if phase["stages"] else None
    if not last or not last["token_steps_sent"]:
        return None
    return last["token_send_seconds"] / last["token_steps_sent"] * 1e6


def _run_name(stages: int, transport: str, micro_batches: int, replicas: int = 1) -> str:
    if replicas > 1:
        return f"{replicas}-replicas-of-{stages}-stage"
    return f"{stages}-stages-{transport}-{micro_batches or 'default'}-mb"


def _clock_dir(args, stages: int, transport: str, micro_batches: int) -> str | None:
    if not args.gpu_clock or stages == 1:
        return None
    return os.path.join(args.gpu_clock, _run_name(stages, transport, micro_batches))


def _gpu_clock_breakdown(directory: str, num_offline: int) -> dict[str, str]:
    """Where each phase's GPU idle went, from the stages' stamps (bench/gpu_clock.py): each phase
    is read between two GetStats calls (_phase), so the dumps after the phases are calls 1, 3, ..."""
    from strata.bench import gpu_clock

    out = {}
    phases = [(f"offline {i + 1}" if num_offline > 1 else "offline", 2 * i + 1) for i in range(num_offline)]
    for phase, call in (*phases, ("latency", 2 * num_offline + 1)):
        try:
            clusters = gpu_clock.load(directory, call)
        except FileNotFoundError as e:
            out[phase] = str(e)
        else:
            out[phase] = gpu_clock.breakdown(clusters[-1])
        print(f"\nGPU clock, {phase}:\n{out[phase]}", flush=True)
    return out


def run(args) -> int:
    env = common.environment_info(args)
    common.print_header("pipeline", env)
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    micro_batches = [int(m) for m in str(args.pipeline_micro_batches).split(",") if m.strip()] or [0]
    configs = []
    for stages in stage_counts(args.stages):
        for transport in transports if stages > 1 else ["-"]:
            for mb in micro_batches if stages > 1 else [0]:
                configs.append((stages, transport, mb, 1))
    # The dp way: replicas of one stage each, a GPU each (and no MPS: nothing shares a GPU).
    configs += [(1, "-", 0, d) for d in replica_counts(args.data_parallel) if d > 1]
    runs = []
    failed = 0
    for stages, transport, mb, replicas in configs:
        run_args = common.with_overrides(
            args,
            pipeline_stages=stages,
            stage_transport=None if transport == "-" else transport,
            pipeline_micro_batches=mb,
            data_parallel_size=replicas,
            mps=args.mps and replicas == 1,
        )
        name = (
            (f"{replicas} replicas of " if replicas > 1 else "")
            + f"{stages} stage(s)"
            + ("" if stages == 1 else f", {transport}")
            + (f", {mb} micro-batches" if mb else "")
            + (", under the cluster's MPS daemon" if run_args.mps else "")
        )
        print(f"\n--- {name}", flush=True)
        clock_dir = _clock_dir(args, stages, transport, mb) if replicas == 1 else None
        run_name = _run_name(stages, transport, mb, replicas)
        with common.env_var("STRATA_GPU_CLOCK_DIR", clock_dir), common.cluster_for(run_args) as endpoints:
            workers = list(endpoints.workers)
            phases = common.run(_run_config(endpoints, workers, run_args, run_name))
        if clock_dir:
            phases["gpu_clock"] = _gpu_clock_breakdown(clock_dir, len(phases["offline"]))
        runs.append({"stages": stages, "transport": transport, "micro_batches": mb, "replicas": replicas, **phases})
        failed += sum(o["failed"] for o in phases["offline"]) + phases["latency"]["failed"]

    base = next((r for r in runs if r["stages"] == 1 and r["replicas"] == 1), None)
    result = {"benchmark": "pipeline", "environment": env, "config": common.args_dict(args), "runs": runs}
    rows_md = []
    for r in runs:
        rows_md += _report(r, base, runs, args, env)
    result["markdown_rows"] = rows_md
    result["markdown_row"] = "\n".join(rows_md)
    if rows_md:
        print("RESULTS.md row(s):\n" + result["markdown_row"])
    common.write_json(args.output, result)
    return 1 if failed else 0


def _report(r: dict, base: dict | None, runs: list[dict], args, env: dict) -> list[str]:
    """Prints a run's sections (and its targets against one stage, and a pipeline's against as
    many replicas when both ran); returns its RESULTS.md rows, one per offline workload."""
    lat = r["latency"]
    title = f"{r['stages']} stage(s)" + ("" if r["stages"] == 1 else f", {r['transport']} transport")
    dp = r["replicas"] > 1
    if dp:
        title = f"{r['replicas']} replicas of {title}"
    if r["micro_batches"]:
        title += f", {r['micro_batches']} micro-batches"
    for off in r["offline"]:
        sched = off["scheduler"]
        common.print_section(
            f"{title}: offline {off['workload']}",
            [
                (
                    "requests",
                    f"{off['requests'] - off['failed']} ok, {off['failed']} failed in {off['elapsed_s']:.2f} s",
                ),
                ("output tokens/s", f"{off['output_tokens_per_s']:,.0f}"),
                (
                    "lookahead decodes",
                    f"{sched.get('lookahead_decodes', 0):,} of {sched.get('decode_tokens_computed', 0):,}",
                ),
                ("repeated plans", f"{sched.get('repeated_plans', 0):,} of {sched.get('steps', 0):,} steps"),
                ("GPU busy", " / ".join(f"{b:.0%}" for b in _busy_shares(off)) + " of the wall time, by stage"),
                *_scheduler_rows(off),
                *_stage_rows(off, r["replicas"]),
            ],
        )
    common.print_section(
        f"{title}: {args.concurrency} streams, closed loop",
        [
            ("requests", f"{lat['requests'] - lat['failed']} ok in {lat['elapsed_s']:.2f} s"),
            (
                "TPOT ms",
                f"p50 {common.fmt(lat['tpot_ms'].get('p50'), '.2f')}  p99 {common.fmt(lat['tpot_ms'].get('p99'), '.2f')}",
            ),
            ("ITL ms", f"p50 {common.fmt(lat['itl_ms'].get('p50'), '.2f')}"),
            ("GPU busy", " / ".join(f"{b:.0%}" for b in _busy_shares(lat)) + " of the wall time, by stage"),
            *_scheduler_rows(lat),
            *_stage_rows(lat, r["replicas"]),
        ],
    )
    if base is None or r is base:
        return []
    tpot = common.ratio(lat["tpot_ms"].get("p50"), base["latency"]["tpot_ms"].get("p50"))
    shared = 0 < _visible_gpus() < r["stages"]
    # The issue's idle target is the 16-stream run's; on a shared GPU, the GPU's own idle.
    stream_idle = _shared_gpu_idle(lat) if shared else _idle_share(lat)
    base_idle = _idle_share(base["latency"])
    # P stages against as many replicas of one stage (the same GPUs), when both ran.
    peer = None if dp else next((d for d in runs if d["replicas"] == r["stages"] and d["stages"] == 1), None)
    r["ratios"] = []
    rows = []
    for n, (off, base_off) in enumerate(zip(r["offline"], base["offline"])):
        tok = common.ratio(off["output_tokens_per_s"], base_off["output_tokens_per_s"])
        over_dp = peer and common.ratio(off["output_tokens_per_s"], peer["offline"][n]["output_tokens_per_s"])
        idle = _idle_share(off)
        hop = _token_hop_us(off)
        r["ratios"].append(
            {
                "workload": off["workload"],
                "offline_tok_s": tok,
                "offline_tok_s_over_dp": over_dp,
                "tpot_p50": tpot,
                "max_stage_idle_share": idle,
                "streams_gpu_idle_share": stream_idle,
                "token_hop_us": hop,
            }
        )
        common.print_section(
            f"Targets, {title} against one stage (same run), offline {off['workload']}",
            [
                (
                    "offline output tok/s",
                    f"{common.fmt(tok, '.2f')}x   (target >= {TARGET_DP_RATIO if dp else TARGET_OFFLINE_RATIO:g}x"
                    f"{' on two GPUs, 8B' if dp else ''})",
                ),
                *(
                    [
                        (
                            f"offline tok/s over {r['stages']} replicas",
                            f"{common.fmt(over_dp, '.2f')}x   (target >= {TARGET_PP_OVER_DP:g}x on two GPUs, 8B)",
                        )
                    ]
                    if peer
                    else []
                ),
                ("16-stream TPOT p50", f"{common.fmt(tpot, '.2f')}x   (target <= {TARGET_TPOT_RATIO:g}x)"),
                (
                    "GPU idle between steps",
                    f"{common.fmt(stream_idle and stream_idle * 100, '.1f')}% at {args.concurrency} streams"
                    f"{' (stages share the GPU: 1 - sum of busy / timeline)' if shared else ', idlest stage'}, "
                    f"{common.fmt(base_idle and base_idle * 100, '.1f')}% one stage   (target <= {TARGET_IDLE:.0%})",
                ),
                ("idlest stage, offline", f"{common.fmt(idle and idle * 100, '.1f')}% of its timeline"),
                (
                    "token hop per decode step",
                    f"{common.fmt(hop, ',.1f')} us, offline, the sender's host time   (target <= {TARGET_HOP_US:g} us "
                    "for 2 MiB of activations at batch 256: python -m strata.bench.stage_hop)",
                ),
            ],
        )
        f = common.fmt
        rows.append(
            "| "
            + " | ".join(
                [
                    env["date"][:10],
                    env["commit"],
                    env["device_name"],
                    env["model"],
                    f"{r['stages']} x {r['replicas']} replicas" if dp else str(r["stages"]),
                    r["transport"]
                    + (f", {r['micro_batches']} micro-batches" if r["micro_batches"] else "")
                    + (", MPS" if args.mps and not dp else ""),
                    off["workload"],
                    f(off["output_tokens_per_s"], ",.0f"),
                    f(tok, ".2f"),
                    " / ".join(f"{b:.0%}" for b in _busy_shares(off)) or "-",
                    f(lat["tpot_ms"].get("p50"), ".2f"),
                    f(tpot, ".2f"),
                    f(idle and idle * 100, ".1f"),
                    f(stream_idle and stream_idle * 100, ".1f"),
                    f(hop, ",.1f"),
                ]
            )
            + " |"
        )
    return rows
