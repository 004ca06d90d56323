"""The steps an offline batch becomes: the real Scheduler, no model, no services, any machine.

    python -m strata.bench.schedule_shape                       # 1000 x 512/128, throughput's defaults
    python -m strata.bench.schedule_shape --max-num-seqs 512 --max-num-batched-tokens 8192

Plans run one at a time, every sequence drawing one token per step (ignore_eos, fixed length,
as `strata bench throughput` sends them); the engine's plans in flight and decode lookahead are
left out. What it shows is where an offline run's GPU time must go: how many steps prefill
(and how big they are) and how many only decode (and at what batch). Multiply by the step times
of `python -m strata.bench.profile_step` to place a throughput run against its floor.
"""

from __future__ import annotations

import argparse
import collections
import random

from strata.flags import DEFAULTS, OFFLINE_MAX_NUM_BATCHED_TOKENS
from strata.services.scheduler.request import Request
from strata.services.scheduler.scheduler import Scheduler
from strata.v1 import engine_pb2


def simulate(args) -> list[tuple[int, int]]:
    """(prompt tokens computed, decode rows) of every step, in order."""
    blocks_per_seq = -(-(args.input_len + args.output_len) // args.block_size)
    sched = Scheduler(
        num_blocks=args.max_num_seqs * blocks_per_seq + 1,
        block_size=args.block_size,
        max_model_len=blocks_per_seq * args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    rng = random.Random(args.seed)
    for i in range(args.num_prompts):
        sampling = engine_pb2.SamplingOptions(temperature=1.0, top_p=1.0, seed=i, logprobs=-1)
        prompt = [rng.randrange(1, 30000) for _ in range(args.input_len)]
        sched.add_request(Request(f"r{i}", prompt, sampling, max_tokens=args.output_len, ignore_eos=True))
    steps = []
    while (plan := sched.schedule()) is not None:
        prefill = sum(s.num_scheduled for s in plan.seqs if s.num_computed < args.input_len)
        decodes = sum(1 for s in plan.seqs if s.num_computed >= args.input_len)
        steps.append((prefill, decodes))
        sched.update(plan, {s.seq_id: [7] for s in plan.seqs if s.sample})
    return steps


def histogram(values: list[int], width: int) -> str:
    counts = collections.Counter(v // width * width for v in values)
    return ", ".join(f"{low}-{low + width - 1}: {n}" for low, n in sorted(counts.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=1000, help="requests, all submitted at once")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    p.add_argument(
        "--max-num-seqs", type=int, default=DEFAULTS["max_num_seqs"], help="the scheduler's running-sequence cap"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=OFFLINE_MAX_NUM_BATCHED_TOKENS,  # the offline workload's budget
        help="the scheduler's token budget per step",
    )
    p.add_argument("--block-size", type=int, default=DEFAULTS["block_size"], help="KV block size in tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    args = p.parse_args()
    steps = simulate(args)
    mixed = [s for s in steps if s[0]]
    decode_only = [s for s in steps if not s[0]]
    print(f"{len(steps)} steps: {len(mixed)} with prompt tokens, {len(decode_only)} decode-only")
    print(
        f"  prompt tokens {sum(s[0] for s in steps):,}; decode rows {sum(s[1] for s in steps):,} "
        f"({sum(s[1] for s in mixed):,} of them in steps with prompt tokens)"
    )
    print(f"  steps with prompt tokens, by prompt tokens: {histogram([s[0] for s in mixed], 2048)}")
    print(f"  decode-only steps, by batch: {histogram([s[1] for s in decode_only], 32)}")


if __name__ == "__main__":
    main()
