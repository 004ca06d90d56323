"""The real Scheduler over P simulated GPUs: what its micro-batch policy does to a pipeline's
throughput, on any machine, in seconds.

    python -m strata.bench.pipeline_schedule                         # 8B shape, 256 and 1,024 requests
    python -m strata.bench.pipeline_schedule --shape 1b --num-prompts 1024 --stages 1,2,4

The workload is `strata bench pipeline --shape mixed`'s: every request at once, prompts and
outputs uniform in --min-len..--max-len tokens, ignore_eos. The engine loop is Engine's (plans in
flight, decode lookahead, micro-batches as Engine configures them for P stages on P GPUs); each
plan then runs through P simulated stages as CUDA streams run steps: in step order, a stage's step
after the previous stage's (plus --hop-us) and, on stage 0, after the tokens its lookahead decodes
need came back from the last stage (plus --hop-us). A stage's step takes its share (1 / P) of the
weights and KV read at --bandwidth plus 2 x params FLOPs a token at --flops,
once its host has done its work (--host-ms + --host-us-per-seq x sequences; hosts run ahead of
their GPUs, one step after another). With --staging N a host runs at most N steps ahead of its GPU
(the decode graphs' host staging buffers: the launch of step n waits for the GPU to finish step
n - N - 1), and a later stage's host does the --host-after-take share of its work only once the
previous stage's host has launched the step (its take() waits for that announcement); --staging 0
leaves both out, as the model did before it reproduced a run's host waits. --eager-token-waits
models stage 0's token waits before 9a18257: a wait for every step whose tokens were announced by
its pump, needed or not (bench/RESULTS.md, "Stage 0 waited for tokens it did not need").
The scheduler's own host time is --scheduler-us-per-seq a sequence of each plan built and of each
result taken (python -m strata.bench.scheduler_step measures it; 0 leaves it out).

It is a model: its figures place one policy against another and P stages against one, not the
tokens/s a GPU reaches (`strata bench pipeline` measures those). Printed per run: output tok/s,
x one stage, each stage's busy share of the run, plans, and the micro-batch statistics.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import random

from strata.protocol import PLACEHOLDER_TOKEN
from strata.services.scheduler.engine_config import default_micro_batches, plans_in_flight
from strata.services.scheduler.request import Request
from strata.services.scheduler.scheduler import Scheduler
from strata.v1 import engine_pb2

# Model shapes: parameters, and KV bytes a token (bf16 K and V over every layer's KV heads).
SHAPES = {
    "1b": {"params": 1.24e9, "kv_bytes": 2 * 16 * 8 * 64 * 2},
    "8b": {"params": 8.03e9, "kv_bytes": 2 * 32 * 8 * 128 * 2},
}


def _gpu_seconds(plan, stages: int, args, shape) -> float:
    """One stage's GPU time for the plan (its 1/P of the layers)."""
    tokens = sum(s.num_scheduled for s in plan.seqs)
    context = sum(s.num_computed + s.num_scheduled for s in plan.seqs)
    read = 2 * shape["params"] + context * shape["kv_bytes"]
    # The sum, not the larger, of the two: a decode step with a prefill chunk pays for both
    # (bench/RESULTS.md, "Mixed steps").
    return (read / args.bandwidth + tokens * 2 * shape["params"] / args.flops) / stages


def simulate(args, stages: int, num_prompts: int) -> dict:
    shape = SHAPES[args.shape]
    rng = random.Random(args.seed)
    micro_batches = args.micro_batches or (default_micro_batches(stages, share_one_gpu=False) if stages > 1 else 1)
    lookahead = stages if stages > 1 else 2
    max_in_flight = args.max_plans_in_flight or plans_in_flight(stages, micro_batches)
    max_len = 2 * args.max_len + 16
    sched = Scheduler(
        num_blocks=micro_batches * args.max_num_seqs * -(-max_len // 16) + 1,
        block_size=16,
        max_model_len=max_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_lookahead=lookahead,
        num_micro_batches=micro_batches,
        micro_batch_min_seqs=args.micro_batch_min_seqs,
        pipeline_stages=stages,
    )
    for i in range(num_prompts):
        prompt = [rng.randrange(3, 30000) for _ in range(rng.randint(args.min_len, args.max_len))]
        sampling = engine_pb2.SamplingOptions(temperature=1.0, seed=i)
        sched.add_request(
            Request(f"r{i}", prompt, sampling, max_tokens=rng.randint(args.min_len, args.max_len), ignore_eos=True)
        )

    hop = args.hop_us / 1e6 if stages > 1 else 0.0
    gpu_free = [0.0] * stages
    host_free = [0.0] * stages
    ends: list[list[float]] = [[] for _ in range(stages)]  # each stage's GPU end of every step, in order
    last_launched: list[float] = []  # the last stage's host launch of every step (its tokens' announcement)
    host_waits = [0.0] * stages  # hosts' waits for their own GPU (the staging limit)
    busy = [0.0] * stages
    sampled_at: dict[str, float] = {}  # request -> when its latest token reaches stage 0
    results: list[tuple[float, int, object]] = []  # (time, step, plan)
    in_flight = 0
    now = 0.0
    output_tokens = plans = 0
    counts = []
    while True:
        while in_flight < max_in_flight and (plan := sched.schedule()) is not None:
            now += args.scheduler_us_per_seq * len(plan.seqs) / 1e6
            plans += 1
            counts.append(len(plan.seqs))
            ready = now
            for s in plan.seqs:  # stage 0 waits for the tokens its lookahead decodes need
                if s.input_token_ids and s.input_token_ids[0] == PLACEHOLDER_TOKEN:
                    ready = max(ready, sampled_at.get(s.request.request_id, 0.0))
            step = _gpu_seconds(plan, stages, args, shape)
            host = (args.host_ms + args.host_us_per_seq * len(plan.seqs) / 1e3) / 1e3
            after = host * args.host_after_take if args.staging else 0.0
            end = launched = now
            for i in range(stages):
                t = max(host_free[i], now) + host - after  # hosts run ahead of their GPUs
                n = len(ends[i])
                if args.staging and n > args.staging:  # wait_for: a staging buffer's last copy
                    free = ends[i][n - args.staging - 1]
                    host_waits[i] += max(free - t, 0.0)
                    t = max(t, free)
                if args.staging and i > 0:  # take(): the previous stage's announcement
                    t = max(t, launched + hop)
                launched = host_free[i] = t + after
                if i == 0 and args.eager_token_waits and stages > 1:
                    # stage 0's pump (before its launch's last share) queued a wait for every
                    # step whose tokens' announcement (the last stage's launch, a hop) was in by then
                    announced = bisect.bisect_right(last_launched, t - hop)
                    if announced:
                        ready = max(ready, ends[-1][announced - 1] + hop)
                start = max(gpu_free[i], launched, ready if i == 0 else end + hop)
                end = start + step
                gpu_free[i] = end
                ends[i].append(end)
                busy[i] += step
            last_launched.append(launched)
            for s in plan.seqs:
                if s.sample:
                    sampled_at[s.request.request_id] = end + hop
            heapq.heappush(results, (end + args.result_us / 1e6, plan.step_id, plan))
            in_flight += 1
        if not results:
            break
        when, _, plan = heapq.heappop(results)
        now = max(now, when)
        in_flight -= 1
        sampled = {s.seq_id: [rng.randrange(3, 30000)] for s in plan.seqs if s.sample}
        for update in sched.update(plan, sampled):
            output_tokens += len(update.new_token_ids)
        now += args.scheduler_us_per_seq * len(plan.seqs) / 1e6
    stats = engine_pb2.SchedulerStats()
    sched.fill_stats(stats)
    assert not sched.unfinished_request_ids() and stats.used_kv_blocks == 0
    return {
        "seconds": now,
        "tok_s": output_tokens / now,
        "busy": [b / now for b in busy],
        "host_wait_ms": [w / max(plans, 1) * 1e3 for w in host_waits],
        "plans": plans,
        "mean_seqs": sum(counts) / max(len(counts), 1),
        "spread": stats.micro_batch_token_spread / stats.micro_batch_rounds if stats.micro_batch_rounds else None,
        "migrations": stats.micro_batch_migrations,
        "preemptions": stats.preemptions,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="model shape (dense Llama)")
    p.add_argument("--num-prompts", default="256,1024", help="requests, comma-separated (a run each)")
    p.add_argument("--stages", default="1,2", help="stage counts, comma-separated (1 is the baseline)")
    p.add_argument("--min-len", type=int, default=100, help="shortest prompt and output")
    p.add_argument("--max-len", type=int, default=1024, help="longest prompt and output")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--micro-batch-min-seqs", type=int, default=32)
    p.add_argument("--micro-batches", type=int, default=0, help="the most micro-batches (0: P + 2)")
    p.add_argument("--max-plans-in-flight", type=int, default=0, help="the engine's limit (0: as Engine sets it)")
    p.add_argument("--bandwidth", type=float, default=4.0e12, help="bytes/s a GPU reads (model)")
    p.add_argument("--flops", type=float, default=6.0e14, help="FLOP/s a GPU computes (model)")
    p.add_argument("--host-ms", type=float, default=0.3, help="a stage's host work a step (model)")
    p.add_argument("--host-us-per-seq", type=float, default=2.0, help="and per sequence (model)")
    p.add_argument("--hop-us", type=float, default=100.0, help="activations or tokens between GPUs (model)")
    p.add_argument(
        "--staging",
        type=int,
        default=0,
        help="steps a host may run ahead of its GPU (the graphs' host staging buffers; 0: no limit, no take)",
    )
    p.add_argument(
        "--eager-token-waits",
        action="store_true",
        help="stage 0 waits for every step whose tokens were announced before its launch, needed or not",
    )
    p.add_argument(
        "--host-after-take",
        type=float,
        default=0.5,
        help="the share of a later stage's host work after its take() (with --staging)",
    )
    p.add_argument("--result-us", type=float, default=100.0, help="a result's trip to the scheduler (model)")
    p.add_argument(
        "--scheduler-us-per-seq",
        type=float,
        default=0.0,
        help="the scheduler's host time per sequence of a plan, and of a result",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for n in [int(v) for v in args.num_prompts.split(",")]:
        base = None
        for stages in [int(v) for v in args.stages.split(",")]:
            r = simulate(args, stages, n)
            base = base or r["tok_s"]
            spread = "-" if r["spread"] is None else f"{r['spread']:.1%}"
            print(
                f"{args.shape} {n:>5} requests, {stages} stage(s): {r['tok_s']:>9,.0f} tok/s ({r['tok_s'] / base:.2f}x), "
                f"{r['seconds']:.2f} s, busy {' '.join(f'{b:.0%}' for b in r['busy'])}, host waits "
                f"{' '.join(f'{w:.2f}' for w in r['host_wait_ms'])} ms/step, {r['plans']:,} plans "
                f"of {r['mean_seqs']:.0f} seqs, plan spread {spread}, {r['migrations']} migrations, "
                f"{r['preemptions']} preemptions",
                flush=True,
            )


if __name__ == "__main__":
    main()
