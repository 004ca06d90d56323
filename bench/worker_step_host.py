"""The worker's host (Python) cost per plan before a step's launch, on the CPU: what the last
stage of one stage does with each plan of a decode or speculating steady state before any
torch call, with no model and no device.

  apply  SequenceTable.apply (releases, admissions, block-table deltas)
  build  StepInputBuilder.build (positions, slots, tables, sample rows, verification rows)
  spec   DeviceSpeculation.begin_step (the known tokens for history, the step's meta rows)

The plans come from the real Scheduler, driven by fake results as in scheduler_step.py: N
sequences decode (or, with --speculate K, verify K drafts on the device ahead of their results),
and each plan is encoded as the Steps stream sends it (fake_result: scheduler_step.py's). Only the worker side is timed. On a GPU
worker these run on the step thread before the graph's launch, so at batch 1 they are part of
every step's host time (bench/RESULTS.md).

    python -m strata.bench.worker_step_host --num-seqs 1 16 --speculate 8
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time

import numpy as np
import torch

from strata.bench.scheduler_step import fake_result
from strata.services.scheduler.engine import Engine
from strata.services.scheduler.engine_config import SchedulerConfig
from strata.services.scheduler.output_stream import OutputStream
from strata.services.scheduler.plan_codec import plan_to_proto
from strata.services.scheduler.request import Request
from strata.services.scheduler.scheduler import Scheduler
from strata.services.scheduler.speculation.config import SpeculativeConfig
from strata.services.worker.speculation.device_speculation import DeviceSpeculation
from strata.services.worker.step.sequence_table import SequenceTable
from strata.services.worker.step.step_inputs import StepInputBuilder
from strata.v1 import engine_pb2

PHASES = ("apply", "build", "spec")
BLOCK_SIZE, MAX_MODEL_LEN, VOCAB = 16, 4096, 32000


class _NoPipeline:
    num_stages = 1


def scheduler_plans(num_seqs: int, steps: int, speculate: int, accept: float, seed: int) -> list[bytes]:
    """The encoded plans of `steps` engine steps after the prefill, N sequences decoding."""
    rng = random.Random(seed)
    engine = Engine(_NoPipeline(), SchedulerConfig(max_num_seqs=num_seqs))
    spec = None
    if speculate:
        # Not adaptive: every step verifies k drafts (the cost model would want GPU times).
        spec = SpeculativeConfig(
            "ngram", num_speculative_tokens=speculate, proposer="device", max_batch=num_seqs, adaptive=False
        )
    engine.scheduler = sched = Scheduler(
        num_blocks=num_seqs * (MAX_MODEL_LEN // BLOCK_SIZE),
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=8192,
        decode_lookahead=2,
        speculation=spec,
    )
    for i in range(num_seqs):
        req = Request(
            f"r{i}",
            [rng.randrange(100, VOCAB) for _ in range(256)],
            engine_pb2.SamplingOptions(temperature=0.0, top_p=1.0, seed=i, logprobs=-1),
            max_tokens=MAX_MODEL_LEN - 512,
            ignore_eos=True,
            eos_token_ids={2},
        )
        sched.add_request(req)
        engine.streams[req.request_id] = OutputStream(req.request_id, 256, final_only=True, output=req.output_token_ids)
    plans, results = [], collections.deque()
    while len(plans) < steps:
        while len(engine.in_flight) <= sched.decode_lookahead:
            plan = sched.schedule()
            if plan is None:
                break
            engine.in_flight.append(plan)
            engine._deadlines.append(0.0)
            plans.append(plan_to_proto(plan).SerializeToString())
            results.append(fake_result(plan, rng, speculate, accept))
        engine._finish_step(engine_pb2.StepResult.FromString(results.popleft()))
    return plans


def worker_side(num_seqs: int, speculate: int):
    """The last stage of one stage's host objects, on the CPU."""
    table = SequenceTable(num_seqs, MAX_MODEL_LEN // BLOCK_SIZE)
    table.reset(num_seqs * (MAX_MODEL_LEN // BLOCK_SIZE))
    builder = StepInputBuilder(
        table,
        block_size=BLOCK_SIZE,
        max_model_len=MAX_MODEL_LEN,
        first_stage=True,
        last_stage=True,
        device=torch.device("cpu"),
        vocab_size=VOCAB,
    )
    spec = None
    if speculate:
        size = DeviceSpeculation.last_sampled_size(num_seqs, speculate)
        spec = DeviceSpeculation(
            max_seqs=num_seqs,
            max_model_len=MAX_MODEL_LEN,
            max_k=speculate,
            ngram_min=1,
            ngram_max=4,
            block_size=BLOCK_SIZE,
            last_sampled=torch.zeros(size, dtype=torch.long),
            device=torch.device("cpu"),
        )
        table.speculation = builder.speculation = spec
    return table, builder, spec


def measure(args, num_seqs: int) -> list[dict[str, float]]:
    """Seconds per plan by phase, per repeat (the first plans, prefill included, run untimed)."""
    plans = [
        engine_pb2.StepPlan.FromString(b)
        for b in scheduler_plans(num_seqs, args.warmup + args.steps, args.speculate, args.accept, args.seed)
    ]
    timed = plans[args.warmup :]
    verifying = sum(1 for plan in timed if any(plan.num_draft_tokens)) / len(timed)
    runs = []
    for _ in range(args.repeat):
        table, builder, spec = worker_side(num_seqs, args.speculate)
        totals = dict.fromkeys(PHASES, 0.0)
        for i, plan in enumerate(plans):
            t0 = time.perf_counter()
            rows = table.apply(plan)
            t1 = time.perf_counter()
            h = builder.build(plan, rows, shared_kv=not any(plan.num_draft_tokens))  # (a GPU's verification graphs)
            t2 = time.perf_counter()
            if spec is not None:
                tokens = h.input_ids if h.input_ids is not None else np.asarray(plan.input_token_ids, dtype=np.int64)
                spec.begin_step(plan, h, tokens)
            t3 = time.perf_counter()
            if i >= args.warmup:
                for name, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
                    totals[name] += seconds
        runs.append({**{k: v / args.steps for k, v in totals.items()}, "verifying": verifying})
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-seqs", type=int, nargs="+", default=[1, 16], help="decoding sequences (one line each)")
    p.add_argument("--steps", type=int, default=300, help="timed plans per repeat")
    p.add_argument("--warmup", type=int, default=20, help="untimed plans first (the prefill and first decodes)")
    p.add_argument("--repeat", type=int, default=5, help="timed repeats; the best is printed with the median")
    p.add_argument("--speculate", type=int, default=0, help="k: verify k drafts on the device each step (0: decode)")
    p.add_argument("--accept", type=float, default=0.5, help="with --speculate: each draft's chance to be accepted")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the fake results")
    args = p.parse_args()
    for n in args.num_seqs:
        runs = measure(args, n)
        totals = [sum(r[k] for k in PHASES) for r in runs]
        best = min(range(len(runs)), key=totals.__getitem__)
        phases = ", ".join(f"{k} {runs[best][k] * 1e6:.1f}" for k in PHASES)
        verifying = f"; {runs[best]['verifying']:.0%} of plans verified" if args.speculate else ""
        print(
            f"N={n}{f', k={args.speculate}' if args.speculate else ''}: {totals[best] * 1e6:.1f} us per plan "
            f"(median {statistics.median(totals) * 1e6:.1f}); best run in us: {phases}{verifying}"
        )


if __name__ == "__main__":
    main()
