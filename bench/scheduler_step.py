"""The scheduler's host (Python) cost per engine step in the decode steady state. CPU only,
runs in seconds.

N sequences decode with `--lookahead` + 1 plans in flight (the one-stage engine's default: 3,
the later two decode lookaheads whose input token the worker fills in). Each step does what the
scheduler process does for one step, with no RPC and no device:

  schedule  Scheduler.schedule() (usually one plan per step: the one whose result came back)
  encode    plan_to_proto(plan).SerializeToString() (what the Steps stream sends)
  result    StepResult.FromString() of the oldest plan's result, then Engine._finish_step():
            split_result, Scheduler.update and delivery into each request's OutputStream

A fake worker builds each result from random tokens outside the timed sections. Requests never
finish (ignore_eos, huge max_tokens), so every step covers all N sequences. The machine's noise
and Python's garbage collector (see --gc-threshold) move single runs by 10-20%: compare the best
of several repeats, on one machine.

With --speculate K the scheduler speculates as with the device's prompt lookup (k = K, each
request's k adaptive, the cost model on: the fake results carry a GPU time): each verifying
sequence's drafts are accepted left to right with probability --accept each, and every sampling
sequence gets K proposals back. Its line says how many timed steps verified.

    python -m strata.bench.scheduler_step                          # 256 and 512 sequences
    python -m strata.bench.scheduler_step --num-seqs 256 --profile # cProfile of the timed steps
    python -m strata.bench.scheduler_step --num-seqs 16 --speculate 8 --accept 0.35
    python -m strata.bench.scheduler_step --stages 2 --num-seqs 1024  # 4 micro-batches of 256

With --stages P > 1 the scheduler runs pipelined decode as the engine does for P stages on P GPUs:
up to P + 2 micro-batches of at most N / (P + 2) sequences, decode lookahead P, and two plans per
micro-batch in flight; a step is then one plan (one micro-batch's), and its line says so.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import pstats
import random
import statistics
import time

from strata.flags import DEFAULTS
from strata.gc_tuning import SERVING_GEN0_THRESHOLD
from strata.services.scheduler.engine import Engine
from strata.services.scheduler.engine_config import SchedulerConfig, default_micro_batches, plans_in_flight
from strata.services.scheduler.output_stream import OutputStream
from strata.services.scheduler.plan_codec import plan_to_proto
from strata.services.scheduler.request import Request
from strata.services.scheduler.scheduler import Scheduler
from strata.services.scheduler.speculation.config import SpeculativeConfig
from strata.v1 import engine_pb2

PHASES = ("schedule", "encode", "result")
COUNTED = (*PHASES, "verifying")  # (plans that verify drafts: a count, not seconds)


class _NoPipeline:
    """Engine needs a pipeline object; the benchmark sends nothing."""

    num_stages = 1


def micro_batches_of(args) -> int:
    """The engine's micro-batches for P stages on P GPUs (one with one stage)."""
    return default_micro_batches(args.stages, share_one_gpu=False) if args.stages > 1 else 1


def make_engine(args, rng: random.Random) -> Engine:
    micro_batches = micro_batches_of(args)
    per_micro_batch = -(-args.num_seqs // micro_batches)
    engine = Engine(_NoPipeline(), SchedulerConfig(max_num_seqs=per_micro_batch))
    # No sequence ends by length (a verify step emits up to k + 1 tokens).
    max_len = args.prompt_len + (args.warmup + args.repeat * args.steps) * (args.speculate + 1) + 64
    engine.scheduler = Scheduler(
        num_blocks=args.num_seqs * -(-max_len // args.block_size),
        block_size=args.block_size,
        max_model_len=max_len,
        max_num_seqs=per_micro_batch,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_lookahead=args.stages if args.stages > 1 else args.lookahead,
        num_micro_batches=micro_batches,
        pipeline_stages=args.stages,
        decode_repeats=args.decode_repeats,
        speculation=SpeculativeConfig(
            "ngram", num_speculative_tokens=args.speculate, proposer="device", max_batch=args.num_seqs
        )
        if args.speculate
        else None,
    )
    for i in range(args.num_seqs):
        req = Request(
            f"r{i}",
            [rng.randrange(100, 30000) for _ in range(args.prompt_len)],
            engine_pb2.SamplingOptions(temperature=1.0, top_p=1.0, seed=i, logprobs=-1),
            max_tokens=1_000_000,
            ignore_eos=True,
            eos_token_ids={2},
        )
        engine.scheduler.add_request(req)
        engine.streams[req.request_id] = OutputStream(
            req.request_id, args.prompt_len, final_only=True, output=req.output_token_ids
        )
    return engine


def fake_result(plan, rng: random.Random, speculate: int = 0, accept: float = 0.0) -> bytes:
    """What the last stage sends back: one random token per sampling sequence, or with
    speculation the accepted drafts and one more, the next proposals and a GPU time."""
    seqs = [s for s in plan.seqs if s.sample]
    counts = []
    for s in seqs:
        accepted = 0
        while accepted < s.num_draft and rng.random() < accept:
            accepted += 1
        counts.append(accepted + 1)
    result = engine_pb2.StepResult(
        step_id=plan.step_id,
        seq_ids=[s.seq_id for s in seqs],
        num_tokens=counts,
        token_ids=[rng.randrange(100, 30000) for _ in range(sum(counts))],
    )
    if speculate:
        result.num_proposed.extend([speculate] * len(seqs))
        result.proposed_token_ids.extend(rng.randrange(100, 30000) for _ in range(speculate * len(seqs)))
        result.gpu_seconds = 1e-3
    return result.SerializeToString()


def send_plan(engine: Engine, totals: dict[str, float]):
    """The scheduler's next plan, encoded as the engine sends it and put in flight, its schedule
    and encode times added to totals; None when it has none."""
    clock = time.perf_counter
    t0 = clock()
    plan = engine.scheduler.schedule()
    t1 = clock()
    if plan is None:
        return None
    plan_to_proto(plan).SerializeToString()
    totals["schedule"] += t1 - t0
    totals["encode"] += clock() - t1
    engine.in_flight.append(plan)
    engine._deadlines.append(0.0)  # the engine's bookkeeping of a plan sent (no clock runs here)
    return plan


def run_steps(
    engine: Engine, results: collections.deque, steps: int, rng: random.Random, totals: dict[str, float], args
) -> None:
    sched, clock = engine.scheduler, time.perf_counter
    # The engine's plans in flight: lookahead + 1 with one stage, two per micro-batch with P.
    most = (
        plans_in_flight(args.stages, sched.num_micro_batches)
        if sched.num_micro_batches > 1
        else sched.decode_lookahead + 1
    )
    for _ in range(steps):
        while len(engine.in_flight) < most:
            plan = send_plan(engine, totals)
            if plan is None:
                break
            totals["verifying"] += any(s.num_draft for s in plan.seqs)
            results.append(fake_result(plan, rng, args.speculate, args.accept))
        t0 = clock()
        engine._finish_step(engine_pb2.StepResult.FromString(results.popleft()))
        totals["result"] += clock() - t0


def measure(args, num_seqs: int) -> list[dict[str, float]]:
    """Per-repeat seconds per step, by phase."""
    args = argparse.Namespace(**{**vars(args), "num_seqs": num_seqs})
    if not args.warmup:  # every prompt's chunks (a plan each, spread over the micro-batches), then decodes
        args.warmup = -(-num_seqs * args.prompt_len // args.max_num_batched_tokens) * micro_batches_of(args) + 20
    rng = random.Random(args.seed)
    engine = make_engine(args, rng)
    results: collections.deque = collections.deque()
    run_steps(engine, results, args.warmup, rng, dict.fromkeys(COUNTED, 0.0), args)  # prefill, then steady state
    if len(engine.scheduler.running) != num_seqs:
        raise RuntimeError("not every sequence is running: raise --max-num-batched-tokens or the block pool")
    runs = []
    for _ in range(args.repeat):
        totals = dict.fromkeys(COUNTED, 0.0)
        profiler = cProfile.Profile() if args.profile else None
        if profiler:
            profiler.enable()
        run_steps(engine, results, args.steps, rng, totals, args)
        if profiler:
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile_lines)
        runs.append({k: v / args.steps for k, v in totals.items()})
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--num-seqs",
        type=int,
        nargs="+",
        default=[256, 512],
        help="running decode sequences (one measurement per value)",
    )
    p.add_argument("--steps", type=int, default=300, help="timed engine steps per repeat")
    p.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="untimed steps first (prefill and the first decodes; 0: enough for every prompt's chunks plus 20)",
    )
    p.add_argument("--repeat", type=int, default=5, help="timed repeats; the best and the median are printed")
    p.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per sequence")
    p.add_argument("--block-size", type=int, default=DEFAULTS["block_size"], help="KV block size in tokens")
    p.add_argument(
        "--lookahead",
        type=int,
        default=2,
        help="decode lookahead: plans in flight beyond the first (the one-stage engine uses 2; "
        "0: one plan in flight, each decode scheduled after its token came back)",
    )
    p.add_argument(
        "--stages",
        type=int,
        default=1,
        help="P > 1: pipelined decode over P stages (P + 2 micro-batches, lookahead P; --lookahead unused)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="token budget per step")
    p.add_argument(
        "--decode-repeats",
        type=int,
        default=DEFAULTS["decode_repeats"],
        help="with --stages P > 1: plans a steady micro-batch commits to at once (1: every plan built anew)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and sampled tokens")
    p.add_argument("--speculate", type=int, default=0, help="k: speculate as with the device's prompt lookup (0: off)")
    p.add_argument("--accept", type=float, default=0.35, help="with --speculate: each draft's chance to be accepted")
    p.add_argument(
        "--profile",
        action="store_true",
        help="run the timed steps under cProfile and print the top functions (slows every step)",
    )
    p.add_argument("--profile-lines", type=int, default=25, help="functions printed with --profile")
    p.add_argument(
        "--gc-threshold",
        type=int,
        default=SERVING_GEN0_THRESHOLD,
        help="first-generation threshold of Python's garbage collector (default: what the scheduler "
        "process sets, strata/gc_tuning.py; 0: Python's default, 700); "
        "a plan holds several collected objects per sequence, so collections cost a share of "
        "every step that grows with N",
    )
    args = p.parse_args()
    if args.gc_threshold:
        gc.set_threshold(args.gc_threshold, *gc.get_threshold()[1:])

    for n in args.num_seqs:
        runs = measure(args, n)
        totals = [sum(r[k] for k in PHASES) for r in runs]
        best = min(range(len(runs)), key=totals.__getitem__)
        median = statistics.median(totals)
        phases = ", ".join(f"{k} {runs[best][k] * 1e3:.3f}" for k in PHASES)
        verifying = f"; {runs[best]['verifying'] * 100:.0f}% of plans verified" if args.speculate else ""
        per_plan = -(-n // micro_batches_of(args))  # sequences in one step's plan
        print(
            f"N={n}{f' over {micro_batches_of(args)} micro-batches' if args.stages > 1 else ''}: "
            f"{totals[best] * 1e3:.3f} ms per step (median {median * 1e3:.3f}), "
            f"{totals[best] / per_plan * 1e6:.2f} us per sequence of a plan; best run in ms: {phases}{verifying}"
        )


if __name__ == "__main__":
    main()
