"""The service stack's host overhead, on any machine: gateway + scheduler + a worker whose GPU is
simulated (bench/simulated_worker.py: real service and per-step host work, a device that takes
--step-ms per step). A stack that never left the device waiting would run one step per step-ms;
the device's idle share is what the host costs.

    python -m strata.bench.host_overhead                      # offline: 1000 x 512/128, all at once
    python -m strata.bench.host_overhead --num-prompts 256 --step-ms 1.4 --profile-dir /tmp/spy
    python -m strata.bench.host_overhead --streams 16 --num-prompts 64 --step-ms 1.34   # streamed ITL
    python -m strata.bench.host_overhead --bursts 40 --output-len 2 --step-ms 0.3   # CPU per request
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from strata.bench import common
from strata.default_model import ensure_tiny_model
from strata.launcher import Cluster, free_port


async def _run(gateway: str, scheduler: str, args) -> dict:
    from strata.v1 import generate_pb2

    info = await common.model_info(gateway)
    if args.shape == "mixed":
        prompts, lengths = common.mixed_prompts(args.num_prompts, 100, 1024, info.vocab_size, args.seed)
    else:
        prompts, lengths = common.random_prompts(args.num_prompts, args.input_len, info.vocab_size, args.seed), None
    before = await common.scheduler_stats(scheduler)
    start = time.perf_counter()
    if args.streams:
        params = common.sampling_params(args.output_len, 1.0, generate_pb2.DELTA)
        records = await common.run_closed_loop(gateway, prompts, params, args.streams, 600.0, progress=False)
    else:
        params = common.sampling_params(args.output_len, 1.0, generate_pb2.FINAL_ONLY)
        if lengths:  # one max_tokens a request
            params = [common.sampling_params(n, 1.0, generate_pb2.FINAL_ONLY) for n in lengths]
        records = await common.run_all_at_once(gateway, prompts, params, 600.0, desc="simulated", progress=False)
    elapsed = time.perf_counter() - start
    after = await common.scheduler_stats(scheduler)
    errors = common.failures(records)
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, e.g. {errors[0]}")
    steps = after.steps - before.steps
    prefill_tokens = after.prefill_tokens_computed - before.prefill_tokens_computed
    return {
        "elapsed_s": elapsed,
        "steps": steps,
        "host_s": after.host_seconds - before.host_seconds,
        "output_tokens": sum(r.output_tokens for r in records),
        # (About: the device charges a sequence's prefill tokens but one, the stats count them all.)
        "device_busy_s": steps * args.step_ms / 1e3 + prefill_tokens * args.prefill_us_per_token / 1e6,
        "itl_ms": common.summarize([x for r in records for x in r.inter_token_latencies()]),
        "tpot_ms": common.summarize(
            [(r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1) for r in records if r.output_tokens > 1]
        ),
        "ttft_ms": common.summarize([r.ttft for r in records if r.chunk_times]),
        "latency_ms": common.summarize([r.latency for r in records]),
        "first_token_groups": common.first_token_groups(records, args.step_ms / 2e3),
    }


def _cpu_seconds(pid: int) -> float:
    """A process's CPU time so far, every thread's, in nanoseconds' precision (Linux /proc
    schedstat: /proc/PID/stat counts clock ticks of 10 ms, coarser than a small burst's work)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except FileNotFoundError:
            continue  # a thread that ended meanwhile (its time is lost from the sum: a few threads, rarely)
    return total / 1e9


async def _bursts(gateway: str, args, pids: dict[str, int]) -> dict:
    """args.bursts bursts of args.burst_size requests sent at once, each burst after the last
    finished: every process's CPU time per request (what admitting and finishing one costs)."""
    from strata.v1 import generate_pb2, generate_pb2_grpc

    info = await common.model_info(gateway)
    params = common.sampling_params(args.output_len, 1.0, generate_pb2.DELTA)
    async with common.open_channel(gateway) as channel:
        stub = generate_pb2_grpc.GatewayStub(channel)

        async def burst(seed: int) -> None:
            prompts = common.random_prompts(args.burst_size, args.input_len, info.vocab_size, seed)
            records = await asyncio.gather(*(common.send_request(stub, p, params, 60.0) for p in prompts))
            if common.failures(records):
                raise RuntimeError(f"a burst failed: {common.failures(records)[0]}")

        await burst(args.bursts)  # warm-up (a seed the measured bursts do not use)
        before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
        client, start = time.process_time(), time.perf_counter()
        for seed in range(args.bursts):
            await burst(seed)
        requests = args.bursts * args.burst_size
        per_request = {name: (_cpu_seconds(pid) - before[name]) / requests for name, pid in pids.items()}
        return {
            "wall_s": (time.perf_counter() - start) / requests,
            "cpu_s": {"client": (time.process_time() - client) / requests, **per_request},
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--step-ms", type=float, default=2.8, help="simulated device time per step")
    p.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=0.0,
        help="simulated device time per prefill token, added to the step's (TP2 8B on H200s: about 12)",
    )
    p.add_argument("--num-prompts", type=int, default=1000, help="requests")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens (random ids)")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens (ignore_eos)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384, help="as `strata bench throughput`")
    p.add_argument(
        "--max-plans-in-flight", type=int, default=0, help="scheduler plans in flight (0: the scheduler's default)"
    )
    p.add_argument(
        "--streams",
        type=int,
        default=0,
        help="N > 0: N streams in a closed loop with DELTA outputs, reporting inter-token latency "
        "(0: every prompt at once, FINAL_ONLY)",
    )
    p.add_argument(
        "--shape",
        choices=("fixed", "mixed"),
        default="fixed",
        help="fixed: --input-len / --output-len each; mixed: prompts and outputs uniform in 100..1,024 tokens "
        "(the nano-vllm benchmark's shape, as `strata bench pipeline --shape mixed`)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    p.add_argument(
        "--bursts",
        type=int,
        default=0,
        help="N > 0: in place of the workload, N bursts of --burst-size requests sent at once (each after the "
        "last finished), reporting every process's CPU time per request: admitting and finishing one "
        "(with --output-len 2, say)",
    )
    p.add_argument("--burst-size", type=int, default=16, help="requests in each of --bursts")
    p.add_argument(
        "--profile-dir",
        default=None,
        help="also sample each service with py-spy (on PATH) into this folder (bench/spy_summary.py)",
    )
    args = p.parse_args()

    cluster = Cluster()
    try:
        worker, sched, gateway = (f"127.0.0.1:{free_port()}" for _ in range(3))
        cluster.start(
            "worker",
            [
                "--port",
                worker.split(":")[1],
                "--step-ms",
                str(args.step_ms),
                "--prefill-us-per-token",
                str(args.prefill_us_per_token),
                "--max-num-seqs",
                str(args.max_num_seqs),
            ],
            module="strata.bench.simulated_worker",
        )
        cluster.start(
            "scheduler",
            [
                "scheduler",
                "--host",
                "127.0.0.1",
                "--port",
                sched.split(":")[1],
                "--workers",
                worker,
                "--max-num-seqs",
                str(args.max_num_seqs),
                "--max-num-batched-tokens",
                str(args.max_num_batched_tokens),
                "--max-plans-in-flight",
                str(args.max_plans_in_flight),
            ],
        )
        cluster.start(
            "gateway",
            [
                "gateway",
                "--host",
                "127.0.0.1",
                "--port",
                gateway.split(":")[1],
                "--scheduler-address",
                sched,
                "--model",
                str(ensure_tiny_model()),
            ],
        )
        cluster.wait_healthy(gateway, "gateway", 120.0)
        if args.bursts:
            pids = {name: proc.pid for name, proc in cluster.procs}
            r = common.run(_bursts(gateway, args, pids))
            cpu = "  ".join(f"{name} {seconds * 1e3:.2f}" for name, seconds in r["cpu_s"].items())
            common.print_section(
                f"Bursts of {args.burst_size} ({args.input_len}/{args.output_len} tokens), per request",
                [("wall ms", f"{r['wall_s'] * 1e3:.2f}"), ("CPU ms", cpu)],
            )
            return
        with (
            common.cluster_token_env(cluster.cluster_token),  # the scheduler's stats are internal
            common.sampled_stacks({name: proc.pid for name, proc in cluster.procs}, args.profile_dir, "run"),
        ):
            r = common.run(_run(gateway, sched, args))
    finally:
        cluster.stop()
    idle = 1 - r["device_busy_s"] / r["elapsed_s"]
    common.print_section(
        f"Host overhead, simulated {args.step_ms} ms steps ({args.num_prompts} x "
        f"{'100-1024 mixed' if args.shape == 'mixed' else f'{args.input_len}/{args.output_len}'})",
        [
            (
                "elapsed",
                f"{r['elapsed_s']:.2f} s for {r['steps']} steps ({r['elapsed_s'] / r['steps'] * 1e3:.2f} ms per step)",
            ),
            ("device busy", f"{r['device_busy_s']:.2f} s; idle {idle:.1%} of the time"),
            ("scheduler host", f"{r['host_s'] / r['steps'] * 1e3:.3f} ms per step on results and plans"),
            (
                "output tokens/s",
                f"{r['output_tokens'] / r['elapsed_s']:,.0f} (with no host overhead: "
                f"{r['output_tokens'] / r['device_busy_s']:,.0f})",
            ),
            *(
                [
                    (
                        "ITL ms",
                        f"p50 {r['itl_ms']['p50']:.3f}  p99 {r['itl_ms']['p99']:.3f}  "
                        f"(p50 {r['itl_ms']['p50'] / args.step_ms:.2f}x the step)",
                    ),
                    ("TPOT ms", f"p50 {r['tpot_ms']['p50']:.3f}  mean {r['tpot_ms']['mean']:.3f}"),
                    ("TTFT ms", f"p50 {r['ttft_ms']['p50']:.2f}  mean {r['ttft_ms']['mean']:.2f}"),
                    ("request latency ms", f"p50 {r['latency_ms']['p50']:.1f}  mean {r['latency_ms']['mean']:.1f}"),
                    ("first tokens in groups of", " ".join(map(str, r["first_token_groups"]))),
                ]
                if args.streams
                else []
            ),
        ],
    )


if __name__ == "__main__":
    main()
