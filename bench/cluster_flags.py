"""The flags every `strata bench` command shares: the model and the cluster it runs on, the run,
speculative decoding. Their defaults are the services' own (strata.flags.DEFAULTS), so a
benchmark's cluster is `strata serve`'s unless a flag says otherwise.

`strata.bench_cli` builds the `strata bench` commands on them; scripts that time the worker's
ModelRunner in process (decode_chain, mixed_step, profile_step) take `bench_settings()`, so
neither imports the other.
"""

from __future__ import annotations

import argparse

from strata.flags import DEFAULTS as D
from strata.flags import FLAGS, OFFLINE_MAX_NUM_BATCHED_TOKENS


def add_common_flags(p: argparse.ArgumentParser) -> None:
    """The model, cluster, run and speculation flags of every `strata bench` command."""
    g = p.add_argument_group("model and cluster")
    g.add_argument(
        "--model",
        default=None,
        help="HF model directory or dummy:PRESET (llama-3.2-1b, llama-3-8b, qwen3-8b, qwen3-30b-a3b, gemma-3-12b; "
        "default: dummy:llama-3.2-1b on GPU, the embedded default model on CPU)",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer directory for the gateway (default: --model's; a dummy model's: the "
        "embedded default model's)",
    )
    g.add_argument(
        "--pipeline-stages", type=int, default=D["pipeline_stages"], help="pipeline stages (worker processes)"
    )
    g.add_argument("--device", default=D["device"], help="cpu, cuda, cuda:N or auto")
    g.add_argument("--dtype", default=D["dtype"], help="float32, bfloat16, float16 or auto")
    g.add_argument("--block-size", type=int, default=D["block_size"], help="tokens per KV cache block")
    g.add_argument("--max-num-seqs", type=int, default=D["max_num_seqs"], help="most sequences running at once")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=D["max_num_batched_tokens"],
        help=f"token budget of one step (throughput: {OFFLINE_MAX_NUM_BATCHED_TOKENS}, where large prefill steps "
        f"pay off; {D['max_num_batched_tokens']} elsewhere keeps decodes beside prefill chunks fast)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=D["gpu_memory_utilization"],
        help="share of GPU memory a worker may use",
    )
    g.add_argument("--max-model-len", type=int, default=D["max_model_len"], help="longest sequence (0: the model's)")
    g.add_argument(
        "--num-kv-blocks", type=int, default=D["num_kv_blocks"], help="force this many KV blocks (0: size from memory)"
    )
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument(
        "--max-plans-in-flight",
        type=int,
        default=D["max_plans_in_flight"],
        help="scheduler plans in flight (0: the scheduler's default; see `strata scheduler --help`)",
    )
    g.add_argument(
        "--address", default=None, help="gateway host:port of a running cluster (default: start one for this run)"
    )
    g.add_argument(
        "--scheduler-address", default=None, help="with --address: the scheduler's host:port, for its statistics"
    )
    g.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for the cluster")
    g.add_argument("--service-log-level", default="WARNING", help="log level of the services this run starts")
    g = p.add_argument_group("run")
    g.add_argument("--seed", type=int, default=D["seed"], help="seed of prompts, sampling and dummy weights")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    g.add_argument("--request-timeout", type=float, default=3600.0, help="deadline of each request, in seconds")
    g.add_argument("--warmup-requests", type=int, default=2, help="short requests sent before measuring")
    g.add_argument("--output", default=None, help="write the results to this JSON file")
    g.add_argument("--no-progress", action="store_true", help="no progress bars")
    g = p.add_argument_group("speculative decoding (off unless --speculative-method)")
    g.add_argument(
        "--speculative-method",
        choices=FLAGS["speculative_method"].choices,
        default=D["speculative_method"],
        help="the proposer",
    )
    g.add_argument(
        "--num-speculative-tokens", type=int, default=D["num_speculative_tokens"], help="draft tokens per step (k)"
    )
    g.add_argument(
        "--ngram-proposer",
        choices=FLAGS["ngram_proposer"].choices,
        default=D["ngram_proposer"],
        help="where prompt lookup runs: the last stage's device or the scheduler",
    )
    g.add_argument(
        "--no-adaptive-speculation",
        action="store_true",
        help="k drafts for every request at every step (no per-request k, no cost model)",
    )
    g.add_argument("--ngram-min", type=int, default=D["ngram_min"], help="shortest suffix prompt lookup matches")
    g.add_argument("--ngram-max", type=int, default=D["ngram_max"], help="longest suffix prompt lookup matches")
    g.add_argument(
        "--speculative-max-batch",
        type=int,
        default=D["speculative_max_batch"],
        help="running requests above which the server stops speculating (a cap: below it the cost model decides)",
    )
    g.add_argument(
        "--speculative-rounds",
        type=int,
        default=D["speculative_rounds"],
        help="verify rounds per step up to --speculative-rounds-max-batch (device prompt lookup, one stage; 1: one)",
    )
    g.add_argument(
        "--speculative-rounds-max-batch",
        type=int,
        default=D["speculative_rounds_max_batch"],
        help="running requests up to which steps run --speculative-rounds rounds",
    )
    g.add_argument(
        "--draft-proposals",
        choices=FLAGS["draft_proposals"].choices,
        default=D["draft_proposals"],
        help="a draft model's proposals: straight to the one target stage (link) or through the scheduler",
    )
    g.add_argument("--draft-model", default=D["draft_model"], help="HF directory of the draft model (method draft)")
    g.add_argument(
        "--draft-num-layers",
        type=int,
        default=D["draft_num_layers"],
        help="the draft: the target's first N layers (method draft without --draft-model)",
    )
    g.add_argument(
        "--spy-dir",
        default=None,
        help="sample the Python stacks of the services this run starts with py-spy (on PATH) "
        "during the measured phases, into this folder (`python -m strata.bench.spy_summary DIR`)",
    )
    g.add_argument(
        "--spy-native",
        action="store_true",
        help="with --spy-dir: C frames too (py-spy --native: inside the CUDA driver, the socket calls, "
        "or waiting for the GIL, which Python frames alone cannot tell apart); each sample pauses "
        "the process, so this samples at 200 Hz instead of 1 kHz",
    )


def bench_settings(**overrides) -> argparse.Namespace:
    """The common flags at their defaults, some replaced: what `roofline.load_runner` and
    `common.environment_info` read."""
    p = argparse.ArgumentParser()
    add_common_flags(p)
    args = p.parse_args([])
    unknown = set(overrides) - set(vars(args))
    if unknown:
        raise TypeError(f"not a common bench flag: {sorted(unknown)}")
    vars(args).update(overrides)
    return args
