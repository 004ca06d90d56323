"""`strata bench`: throughput, latency, roofline and parallel-sampling benchmarks.

Each command starts its own local cluster (unless --address points at a running one), prints
tables with the comparison it is about (HF generate(), the roofline, the bare model step) and
writes every number to --output as JSON.
"""

from __future__ import annotations

import argparse
import sys

from strata.bench.cluster_flags import add_common_flags
from strata.flags import OFFLINE_MAX_NUM_BATCHED_TOKENS, OFFLINE_MAX_NUM_SEQS

DESCRIPTIONS = {
    "throughput": "Offline throughput: every prompt submitted at once through gateway -> scheduler -> workers, "
    "then the same workload through HF transformers generate() on the same device, then the "
    "decode-step roofline; prints requests/s, tokens/s and the ratios.",
    "latency": "Serving latency: Poisson arrivals (TTFT, inter-token latency p50/p99), then a fixed number of "
    "streams in a closed loop, whose ITL is compared with the bare model's decode step.",
    "roofline": "Decode step at batch B against its floor, (weight bytes + KV bytes read) / measured copy "
    "bandwidth; also the step time the scheduler sees through the stack.",
    "parallel-sampling": "One request of n=N against N requests of n=1 with distinct prompts and with one "
    "repeated prompt: output tokens/s, prefill tokens computed, peak KV blocks.",
    "prompt-logprobs": "What prompt logprobs cost: a batch where a share of the requests ask (top k) against "
    "the same batch where nobody asks (the others' output tok/s), and a prefill where every request asks "
    "against one where none does (the last stage's GPU time), on one cluster.",
    "prefix-groups": "An offline batch whose requests share prefixes, as prefix groups (GenerateGroups), as plain "
    "requests with the automatic prefix cache, and without it, each on a fresh cluster: req/s, "
    "prefill tokens computed, peak KV blocks and the ratios; on a GPU also the decode attention of "
    "a group batch (cascade and paged) against its floor.",
    "pipeline": "Pipeline parallelism against one stage in one run: the offline workload (fixed or mixed "
    "lengths, at one or more request counts) and --concurrency streams at 1, 2 (and 4 where GPUs allow) "
    "stages, per stage transport, and as many data-parallel replicas of one stage (the dp way); each GPU's "
    "busy share and each stage's idle time (the bubbles), the scheduler's host time and micro-batches, the "
    "hops' bytes and time per step, tok/s and TPOT relative to one stage, and the targets.",
    "tensor-parallel": "Tensor parallelism against one GPU, the pipeline and replicas in one run: for each way "
    "(one GPU, tp2, pp2, dp2, their combinations) an offline workload (mixed or fixed lengths), --concurrency streams and one "
    "stream; output tok/s, TPOT, every GPU's busy share, the ratios to one GPU, and the all-reduce's share of "
    "a batch-1 decode step (the same way without collectives), against issue 51's targets.",
    "speculative": "The same chat requests with and without speculative decoding, on a real model: prompts "
    "where prompt lookup pays (repeat or edit a passage) and open-ended ones, at several "
    "concurrencies; tok/s, acceptance, mean accepted length, speedup, and every request's tokens "
    "checked against the plain run. With a draft model, also the step costs and the speedups "
    "they predict.",
}


def _workload(p, num_prompts: int, input_len: int, output_len: int) -> None:
    p.add_argument("--num-prompts", type=int, default=num_prompts, help="requests")
    p.add_argument("--input-len", type=int, default=input_len, help="prompt tokens (random ids)")
    p.add_argument("--output-len", type=int, default=output_len, help="generated tokens (ignore_eos)")


def add_bench_parser(subparsers, formatter_class=argparse.HelpFormatter) -> argparse.ArgumentParser:
    bench = subparsers.add_parser(
        "bench", formatter_class=formatter_class, help="benchmarks through the full stack", description=__doc__
    )
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")

    p = sub.add_parser(
        "throughput",
        formatter_class=formatter_class,
        help="offline throughput vs HF and roofline",
        description=DESCRIPTIONS["throughput"],
    )
    _workload(p, 1000, 512, 128)
    p.add_argument(
        "--min-input-len", type=int, default=0, help="prompt lengths uniform in [this, --input-len] (0: all fixed)"
    )
    p.add_argument(
        "--min-output-len", type=int, default=0, help="output lengths uniform in [this, --output-len] (0: all fixed)"
    )
    p.add_argument("--max-concurrency", type=int, default=0, help="most requests in flight (0: all at once)")
    p.add_argument(
        "--hf-baseline",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run HF transformers generate() (default: on when CUDA is available)",
    )
    p.add_argument("--hf-batch-size", type=int, default=256, help="HF generate() batch (halved on out-of-memory)")
    p.add_argument(
        "--hf-num-prompts",
        type=int,
        default=0,
        help="prompts given to HF (0: two batches); throughput is extrapolated to the rest",
    )
    p.add_argument(
        "--roofline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the decode step in-process against its roofline",
    )
    p.add_argument("--roofline-batch", type=int, default=256, help="decode batch of the roofline")
    p.add_argument("--roofline-steps", type=int, default=20, help="timed decode steps")
    add_common_flags(p)
    # The offline step budget (strata.flags; bench/RESULTS.md has what it gains over the serving
    # default). It must follow add_common_flags: argparse lets an argument's own default win over
    # an earlier set_defaults.
    p.set_defaults(max_num_batched_tokens=OFFLINE_MAX_NUM_BATCHED_TOKENS)

    p = sub.add_parser(
        "latency",
        formatter_class=formatter_class,
        help="TTFT and inter-token latency",
        description=DESCRIPTIONS["latency"],
    )
    _workload(p, 200, 512, 128)
    p.add_argument(
        "--request-rate", type=float, default=10.0, help="Poisson arrival rate, requests/s (inf: all at once)"
    )
    p.add_argument("--concurrency", type=int, default=16, help="streams of the closed-loop phase")
    p.add_argument(
        "--concurrency-num-prompts", type=int, default=0, help="requests of the closed-loop phase (0: 4 per stream)"
    )
    p.add_argument(
        "--bare-step",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the bare model decode step at batch --concurrency in-process",
    )
    p.add_argument("--bare-steps", type=int, default=30, help="timed bare decode steps")
    add_common_flags(p)

    p = sub.add_parser(
        "roofline",
        formatter_class=formatter_class,
        help="decode step vs its memory floor",
        description=DESCRIPTIONS["roofline"],
    )
    p.add_argument("--batch", type=int, default=256, help="decode batch")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens")
    p.add_argument("--context-len", type=int, default=0, help="cached tokens per sequence (0: input + output / 2)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps")
    p.add_argument(
        "--through-stack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run --batch requests through a cluster for the scheduler's view of the step",
    )
    add_common_flags(p)

    p = sub.add_parser(
        "parallel-sampling",
        formatter_class=formatter_class,
        help="n>1 vs n independent requests",
        description=DESCRIPTIONS["parallel-sampling"],
    )
    p.add_argument("-n", "--n", type=int, default=64, dest="n", help="completions per request")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens per completion")
    p.add_argument(
        "--fresh-cluster",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a new cluster per phase, so each phase's peak KV blocks is its own",
    )
    add_common_flags(p)

    p = sub.add_parser(
        "prompt-logprobs",
        formatter_class=formatter_class,
        help="prompt logprobs' cost to others and to a prefill",
        description=DESCRIPTIONS["prompt-logprobs"],
    )
    _workload(p, 256, 1024, 128)
    p.add_argument("--ask-fraction", type=float, default=0.25, help="share of the batch asking prompt logprobs")
    p.add_argument("--top", type=int, default=5, help="prompt_logprobs: top tokens per position")
    p.add_argument("--prefill-prompts", type=int, default=64, help="requests of each prefill phase (max_tokens 1)")
    p.add_argument("--repeats", type=int, default=2, help="times each pair of phases runs")
    add_common_flags(p)
    _speculative_parser(sub, formatter_class)
    _prefix_groups_parser(sub, formatter_class)
    _pipeline_parser(sub, formatter_class)
    _tensor_parallel_parser(sub, formatter_class)
    return bench


def _parallel_workloads(p, *, shape: str, requests_per_stream: int) -> None:
    """The parallelism benches' two workloads: the offline one's shape, and the latency streams."""
    p.add_argument(
        "--shape",
        choices=("fixed", "mixed"),
        default=shape,
        help="the offline prompts and outputs: fixed, --input-len / --output-len tokens each; mixed, both "
        "uniform in --mixed-lengths (the nano-vllm benchmark's shape)",
    )
    p.add_argument(
        "--mixed-lengths",
        type=_length_range,
        default="100,1024",
        metavar="SHORTEST,LONGEST",
        help="with --shape mixed: the range of prompt and output lengths in tokens",
    )
    p.add_argument(
        "--input-len", type=int, default=512, help="prompt tokens (random ids) of --shape fixed and of the streams"
    )
    p.add_argument(
        "--output-len", type=int, default=128, help="generated tokens (ignore_eos) of --shape fixed and of the streams"
    )
    p.add_argument("--concurrency", type=int, default=16, help="streams of the latency workload (closed loop)")
    p.add_argument(
        "--latency-num-prompts",
        type=int,
        default=0,
        help=f"requests of the --concurrency streams (0: {requests_per_stream} per stream)",
    )


def _tensor_parallel_parser(sub, formatter_class) -> None:
    from strata.flags import DEFAULTS, FLAGS

    p = sub.add_parser(
        "tensor-parallel",
        formatter_class=formatter_class,
        help="tensor parallelism vs one GPU and the pipeline",
        description=DESCRIPTIONS["tensor-parallel"],
    )
    p.add_argument(
        "--ways",
        default="1,tp2,pp2,dp2",
        help="comma-separated, each a cluster of its own: 1 (one GPU), tpT (T ranks in one stage), ppP (P stages), "
        "dpD (D replicas), and their combinations in that order (tp2pp2: T ranks in each of P stages; tp2dp2); a "
        "GPU per worker",
    )
    p.add_argument("--num-prompts", type=int, default=1024, help="requests of the offline workload")
    _parallel_workloads(p, shape="mixed", requests_per_stream=4)
    p.add_argument(
        "--tensor-parallel-all-reduce",
        choices=FLAGS["tensor_parallel_all_reduce"].choices,
        default=DEFAULTS["tensor_parallel_all_reduce"],
        help="the tensor-parallel ways' small all-reduce (strata serve's flag)",
    )
    p.add_argument(
        "--ab-early-send",
        action="store_true",
        help="each tensor-parallel way also runs its batch-1 phase with --tensor-parallel-no-early-send: the decode "
        "chain's row-parallel GEMVs leave the sending to the one-shot's own launch (an A/B)",
    )
    p.add_argument(
        "--no-plan-pacing",
        action="store_true",
        help="every way's scheduler builds each plan as soon as a slot frees (strata serve's flag; an A/B)",
    )
    add_common_flags(p)
    p.set_defaults(max_num_batched_tokens=OFFLINE_MAX_NUM_BATCHED_TOKENS)


def _pipeline_parser(sub, formatter_class) -> None:
    from strata.flags import DEFAULTS

    p = sub.add_parser(
        "pipeline",
        formatter_class=formatter_class,
        help="pipeline parallelism vs one stage",
        description=DESCRIPTIONS["pipeline"],
    )
    p.add_argument(
        "--num-prompts",
        type=_batches,
        default="1000",
        help="requests of the offline workload, comma-separated: an offline phase each, in every run",
    )
    _parallel_workloads(p, shape="fixed", requests_per_stream=16)
    p.add_argument(
        "--stages",
        default="auto",
        help="stage counts, comma-separated (auto: 1,2 and 4 where 4 GPUs are visible; stages share a GPU "
        "when there are fewer GPUs than stages)",
    )
    p.add_argument(
        "--transports",
        default="auto",
        help="stage transports of the multi-stage runs, comma-separated: auto, ipc, distributed, grpc",
    )
    p.add_argument(
        "--data-parallel",
        default="auto",
        help="the dp way: replica counts, comma-separated, each a run of that many one-stage replicas behind one "
        "gateway (strata serve --data-parallel-size), a GPU each (auto: 2 where 2 GPUs are visible, and 4 where "
        "4 are; 0: none)",
    )
    p.add_argument(
        "--no-pipelined-decode",
        action="store_true",
        help="multi-stage runs without pipelined decode (every decode waits for the scheduler; A/B)",
    )
    p.add_argument(
        "--pipeline-micro-batches",
        default=str(DEFAULTS["pipeline_micro_batches"]),
        help="micro-batches of the multi-stage runs, comma-separated, each a run of its own (0: the server's default)",
    )
    p.add_argument(
        "--micro-batch-min-seqs",
        type=int,
        default=DEFAULTS["micro_batch_min_seqs"],
        help="another micro-batch opens only past this many sequences each",
    )
    p.add_argument(
        "--decode-repeats",
        type=int,
        default=DEFAULTS["decode_repeats"],
        help="plans a steady micro-batch commits to at once (1: every plan built anew; A/B)",
    )
    p.add_argument(
        "--mps",
        action="store_true",
        help="every cluster under an NVIDIA MPS daemon of its own (as `strata serve --mps`): stages sharing a GPU "
        "run side by side instead of the GPU switching between their processes at each hand-off",
    )
    p.add_argument(
        "--gpu-clock",
        default=None,
        metavar="DIR",
        help="multi-stage GPU runs stamp their steps on the GPU's clock into DIR (--gpu-clock-dir, env STRATA_GPU_CLOCK_DIR; a "
        "diagnostic that slows steps) and print where each phase's GPU idle went (python -m strata.bench.gpu_clock)",
    )
    add_common_flags(p)
    # The offline step budget, as for the throughput benchmark (the streams run on it too).
    p.set_defaults(max_num_batched_tokens=OFFLINE_MAX_NUM_BATCHED_TOKENS)


def _batches(value: str) -> list[int]:
    return [int(b) for b in value.split(",") if b.strip()]


def _length_range(value: str) -> tuple[int, int]:
    parts = [int(v) for v in value.split(",")]
    if len(parts) != 2 or not 1 <= parts[0] <= parts[1]:
        raise argparse.ArgumentTypeError(f"SHORTEST,LONGEST with 1 <= SHORTEST <= LONGEST, got {value!r}")
    return parts[0], parts[1]


def _prompt_sets(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = sorted(set(names) - {"lookup", "open"})
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"prompt sets are lookup and open, got {value!r}")
    return names


def _speculative_parser(sub, formatter_class) -> None:
    p = sub.add_parser(
        "speculative",
        formatter_class=formatter_class,
        help="with and without speculative decoding",
        description=DESCRIPTIONS["speculative"],
    )
    p.add_argument("--batches", type=_batches, default=[1, 16, 64], help="concurrencies, comma-separated")
    p.add_argument(
        "--sets",
        type=_prompt_sets,
        default=["lookup", "open"],
        help="prompt sets to run, comma-separated, in this order: lookup (answers that repeat the prompt), "
        "open (open questions)",
    )
    p.add_argument("--output-len", type=int, default=256, help="most tokens generated per request")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every request generates exactly --output-len tokens (ignore_eos, min_tokens = max_tokens), "
        "as the other benches' requests do, past the answer's end",
    )
    p.add_argument(
        "--cost-model",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time the target's decode and verify steps and the draft's step in process, and print the "
        "speedups they predict (default: with --method draft)",
    )
    p.add_argument("--cost-context-len", type=int, default=512, help="context of the cost model's steps")
    p.add_argument(
        "--max-divergence-checks",
        type=int,
        default=-1,
        help="rerun at most this many diverging requests per phase for their logit margin (-1: all)",
    )
    p.add_argument(
        "--through-stack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the requests through clusters with and without speculation (--no-through-stack: only the cost model)",
    )
    add_common_flags(p)
    # Speculation on in the speculating run (the plain run turns it off), up to batch 64.
    p.set_defaults(temperature=0.0, speculative_method="ngram", speculative_max_batch=64)


def _prefix_groups_parser(sub, formatter_class) -> None:
    p = sub.add_parser(
        "prefix-groups",
        formatter_class=formatter_class,
        help="shared-prefix groups vs plain requests",
        description=DESCRIPTIONS["prefix-groups"],
    )
    p.add_argument("--num-groups", type=int, default=32, help="prefix groups")
    p.add_argument("--group-size", type=int, default=16, help="requests per group")
    p.add_argument("--prefix-len", type=int, default=2000, help="tokens every request of a group shares")
    p.add_argument("--suffix-len", type=int, default=200, help="tokens of each request's own")
    p.add_argument("--output-len", type=int, default=100, help="generated tokens (ignore_eos)")
    p.add_argument(
        "--attention",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a GPU, time a group batch's decode attention against its floor in process",
    )
    p.add_argument(
        "--ways",
        default="groups,cache,cache-no-cascade,no-cache",
        help="which ways to run, comma-separated, in this order (groups, cache, cache-no-cascade, "
        "no-cache); a ratio is printed where both of its ways ran",
    )
    p.add_argument(
        "--order",
        choices=("shuffled", "grouped"),
        default="shuffled",
        help="the order the one-by-one ways send their requests in: shuffled (seeded by --seed; as an "
        "offline batch in no particular order arrives, issue 27's baseline) or grouped (each group's "
        "requests one after another, which lets the prefix cache keep a prefix while its group runs)",
    )
    p.add_argument(
        "--profile-dir",
        default=None,
        help="each way's workers write a torch.profiler table of their steps to DIR/<way>.txt "
        "(window: STRATA_PROFILE_STEPS=FIRST:COUNT, default 200:100; slows those steps)",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="every way's cluster as this many replicas behind one gateway (a GPU each): groups go whole to "
        "one replica each, spread by load; the statistics are the replicas' summed",
    )
    add_common_flags(p)
    # All 512 requests run at once (the offline budget, as for the throughput benchmark).
    p.set_defaults(max_num_seqs=OFFLINE_MAX_NUM_SEQS, max_num_batched_tokens=OFFLINE_MAX_NUM_BATCHED_TOKENS)


def run_bench(args) -> int:
    if args.bench_command == "pipeline":
        from strata.bench import pipeline

        return pipeline.run(args)
    if args.bench_command == "tensor-parallel":
        from strata.bench import tensor_parallel

        return tensor_parallel.run(args)
    if args.bench_command == "throughput":
        from strata.bench import offline

        return offline.run(args)
    if args.bench_command == "latency":
        from strata.bench import serving

        return serving.run(args)
    if args.bench_command == "roofline":
        from strata.bench import roofline

        return roofline.run(args)
    if args.bench_command == "parallel-sampling":
        from strata.bench import parallel_sampling

        return parallel_sampling.run(args)
    if args.bench_command == "prompt-logprobs":
        from strata.bench import prompt_logprobs

        return prompt_logprobs.run(args)
    if args.bench_command == "prefix-groups":
        from strata.bench import prefix_groups

        return prefix_groups.run(args)
    if args.bench_command == "speculative":
        from strata.bench import speculative

        return speculative.run(args)
    raise SystemExit(f"unknown benchmark {args.bench_command!r}")


def main(argv: list[str] | None = None) -> int:
    """`python -m strata.bench_cli BENCHMARK ...`: the same as `strata bench BENCHMARK ...`."""
    parser = argparse.ArgumentParser(prog="strata")
    add_bench_parser(parser.add_subparsers(dest="command", required=True), argparse.ArgumentDefaultsHelpFormatter)
    return run_bench(parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
