"""The scheduler's host cost over a whole offline run, piece by piece. CPU only, no RPC.

`scheduler_step` times the steady decode alone. An offline run is more: prompts admitted and
chunked, blocks hashed, requests finished and their outputs delivered. On two H200s the 1B shape's
scheduler spent 2.5 ms of every 3.3 ms plan on its own loop at two stages, against scheduler_step's
0.68 ms here (bench/RESULTS.md, issue 50 on two GPUs): this bench says where the rest goes.

N requests of the mixed shape (prompts and outputs uniform in --shortest..--longest tokens,
ignore_eos, the nano-vllm benchmark's shape) are submitted at once and run to their end through
the real Scheduler and Engine._finish_step, as the engine does for P stages on P GPUs (P + 2
micro-batches of --max-num-seqs each, two plans a micro-batch in flight). A fake last stage
answers each plan with random tokens (outside the timed sections). Per phase:

  admit     Request construction and Scheduler.add_request (Submit's part, once a request)
  schedule  Scheduler.schedule()
  encode    plan_to_proto(plan).SerializeToString()
  result    StepResult.FromString() and Engine._finish_step() (update, finishing, delivery)

and per kind of plan (decode only, or with prompt tokens), the plans' count and mean cost. The
last line divides the loop's time by the plans: a stage whose GPU takes less than that per plan
waits on the scheduler.

    python -m strata.bench.scheduler_offline                        # 1,024 requests, 2 stages
    python -m strata.bench.scheduler_offline --stages 1 --profile   # one stage, cProfile's top functions
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import pstats
import random
import time

import numpy as np

from strata.bench.scheduler_step import _NoPipeline, fake_result, send_plan
from strata.flags import DEFAULTS
from strata.gc_tuning import SERVING_GEN0_THRESHOLD
from strata.services.scheduler.engine import Engine
from strata.services.scheduler.engine_config import SchedulerConfig, default_micro_batches, plans_in_flight
from strata.services.scheduler.output_stream import OutputStream
from strata.services.scheduler.request import Request
from strata.services.scheduler.scheduler import Scheduler
from strata.v1 import engine_pb2

PHASES = ("admit", "schedule", "encode", "result")


def mixed_workload(args) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs, both lengths uniform in shortest..longest."""
    rng = np.random.default_rng(args.seed)
    lengths = rng.integers(args.shortest, args.longest + 1, size=args.num_prompts)
    outputs = rng.integers(args.shortest, args.longest + 1, size=args.num_prompts).tolist()
    return [(rng.integers(100, 30000, size=n).tolist(), m) for n, m in zip(lengths, outputs)]


def make_engine(args) -> Engine:
    micro_batches = default_micro_batches(args.stages, share_one_gpu=False) if args.stages > 1 else 1
    engine = Engine(_NoPipeline(), SchedulerConfig(max_num_seqs=args.max_num_seqs))
    max_len = 2 * args.longest + 16
    engine.scheduler = Scheduler(
        num_blocks=args.num_prompts * -(-max_len // args.block_size),  # every request fits at once
        block_size=args.block_size,
        max_model_len=max_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_lookahead=args.stages if args.stages > 1 else plans_in_flight(1, 1) - 1,
        num_micro_batches=micro_batches,
        pipeline_stages=args.stages,
        decode_repeats=args.decode_repeats,
    )
    return engine


def admit(engine: Engine, workload, totals: dict) -> None:
    t0 = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(workload):
        req = Request(
            f"r{i}",
            prompt,
            engine_pb2.SamplingOptions(temperature=1.0, top_p=1.0, seed=i, logprobs=-1),
            max_tokens=max_tokens,
            min_tokens=max_tokens,
            ignore_eos=True,
            eos_token_ids={2},
        )
        engine.scheduler.add_request(req)
        engine.streams[req.request_id] = OutputStream(
            req.request_id, len(prompt), final_only=True, output=req.output_token_ids
        )
    totals["admit"] += time.perf_counter() - t0


def run_to_end(engine: Engine, args, totals: dict, kinds: dict) -> int:
    """Runs every request to its end; returns the plans' count."""
    sched, clock, rng = engine.scheduler, time.perf_counter, random.Random(args.seed)
    most = engine_plans_in_flight(args, sched)
    results: collections.deque = collections.deque()
    plans = 0
    while engine.streams:
        while len(engine.in_flight) < most:
            before = totals["schedule"] + totals["encode"]
            plan = send_plan(engine, totals)
            if plan is None:
                break
            kind = "with prompt tokens" if any(not s.sample or s.num_scheduled > 1 for s in plan.seqs) else "decode"
            kinds[kind][0] += 1
            kinds[kind][1] += totals["schedule"] + totals["encode"] - before
            kinds[kind][2] += len(plan.seqs)
            results.append((kind, fake_result(plan, rng)))
            plans += 1
        if not results:
            raise RuntimeError("no plan in flight while requests remain: the pool is too small")
        kind, data = results.popleft()
        t0 = clock()
        engine._finish_step(engine_pb2.StepResult.FromString(data))
        spent = clock() - t0
        totals["result"] += spent
        kinds[kind][1] += spent
    return plans


def engine_plans_in_flight(args, sched: Scheduler) -> int:
    if args.max_plans_in_flight:
        return args.max_plans_in_flight
    return plans_in_flight(args.stages, sched.num_micro_batches)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=1024, help="requests, all submitted at once")
    p.add_argument("--shortest", type=int, default=100, help="shortest prompt and output, tokens")
    p.add_argument("--longest", type=int, default=1024, help="longest prompt and output, tokens")
    p.add_argument("--stages", type=int, default=2, help="P pipeline stages on P GPUs (1: one stage)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULTS["max_num_seqs"], help="per micro-batch with P > 1")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=DEFAULTS["max_num_batched_tokens"], help="token budget a step"
    )
    p.add_argument("--max-plans-in-flight", type=int, default=0, help="0: the engine's default")
    p.add_argument(
        "--decode-repeats",
        type=int,
        default=DEFAULTS["decode_repeats"],
        help="plans a steady micro-batch commits to at once (1: every plan built anew)",
    )
    p.add_argument("--block-size", type=int, default=DEFAULTS["block_size"], help="KV block size in tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and the fake tokens")
    p.add_argument("--repeat", type=int, default=3, help="whole runs; the fastest is printed")
    p.add_argument("--profile", action="store_true", help="one run under cProfile: the top functions")
    p.add_argument("--profile-lines", type=int, default=30, help="functions printed with --profile")
    p.add_argument(
        "--gc-threshold",
        type=int,
        default=SERVING_GEN0_THRESHOLD,
        help="first-generation threshold of the garbage collector (default: the scheduler process's)",
    )
    args = p.parse_args()
    gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])
    workload = mixed_workload(args)
    output_tokens = sum(m for _, m in workload)
    best = None
    for _ in range(1 if args.profile else args.repeat):
        engine = make_engine(args)
        totals = dict.fromkeys(PHASES, 0.0)
        kinds = collections.defaultdict(lambda: [0, 0.0, 0])  # plans, seconds, sequences
        profiler = cProfile.Profile() if args.profile else None
        if profiler:
            profiler.enable()
        admit(engine, workload, totals)
        plans = run_to_end(engine, args, totals, kinds)
        if profiler:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile_lines)
        total = sum(totals.values())
        if best is None or total < best[0]:
            best = (total, totals, dict(kinds), plans, engine.scheduler.counters.repeated_plans)
    total, totals, kinds, plans, repeated = best
    print(
        f"{args.num_prompts} mixed requests ({args.shortest}-{args.longest} tokens in and out), {args.stages} stage(s): "
        f"{plans} plans ({repeated} of them repeats), {output_tokens:,} output tokens, {total:.3f} s of the "
        "scheduler's host time"
    )
    print("  " + ", ".join(f"{k} {v * 1e3 / plans:.3f}" for k, v in totals.items()) + " ms a plan")
    for kind, (n, seconds, seqs) in sorted(kinds.items()):
        print(f"  {kind}: {n} plans, {seconds * 1e3 / n:.3f} ms and {seqs / n:.0f} sequences a plan")
    print(
        f"  the loop's time a plan: {total * 1e3 / plans:.3f} ms; its bound on output tokens/s: "
        f"{output_tokens / total:,.0f}"
    )


if __name__ == "__main__":
    main()
