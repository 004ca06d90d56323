"""What structured outputs and penalties cost a decode step, in process (one worker's ModelRunner).

    python -m strata.bench.bench_constrained                      # batch 256, the 1B dummy shape on GPU
    python -m strata.bench.bench_constrained --batch 64 --device cpu --model DIR --tokenizer DIR

Times the same decode step (every row decodes one token at context --context) three ways:
unconstrained, every row under a JSON schema (xgrammar bitmask: fill on the host, apply on the
device), every row penalised (presence, frequency, repetition, a logit bias), and prints the
ratios to the unconstrained step (the issue's targets: <= 1.1x and <= 1.03x). A constrained
row's grammar needs the model's tokenizer: a dummy model takes --tokenizer (default: the
embedded default model's tokenizer directory when built, ~/.cache/strata/SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from strata.bench import common
from strata.bench.roofline import decode_plans, load_runner
from strata.flags import service_args
from strata.v1 import engine_pb2

SCHEMA = json.dumps({"type": "array", "items": {"type": "integer"}})  # never completes: every step is masked


def _time_steps(runner, admit, step, steps: int) -> float:
    runner.execute(admit).finish()
    for _ in range(3):
        runner.execute(step).finish()
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        runner.execute(step).finish()
    return (time.perf_counter() - start) / steps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--tokenizer", default=str(Path.home() / ".cache" / "strata" / "SmolLM2-135M-Instruct"), help="tokenizer dir"
    )
    args = p.parse_args(argv)
    settings = service_args(["worker"])
    settings.device, settings.model = args.device, args.model
    settings.model = common.resolve_model(settings)
    runner = load_runner(settings, args.batch, args.context, ["--tokenizer", args.tokenizer])
    vocab = runner.config.vocab_size
    admit, step = decode_plans(args.batch, args.context, settings.block_size, vocab, 1.0, 0)

    def with_options(**kw) -> engine_pb2.StepPlan:
        plan = engine_pb2.StepPlan()
        plan.CopyFrom(admit)
        for seq in plan.new_sequences:
            seq.sampling.MergeFrom(engine_pb2.SamplingOptions(**kw))
            seq.num_prompt_tokens = args.context - 1
            seq.history_start = args.context - 1
        return plan

    results = {}
    results["unconstrained"] = _time_steps(runner, admit, step, args.steps)
    schema = with_options(constraint_kind=engine_pb2.CONSTRAINT_KIND_JSON_SCHEMA, constraint=SCHEMA)
    grammar = runner.controls.grammar
    grammar.fill_seconds, grammar.fill_rows = 0.0, 0
    results["json schema"] = _time_steps(runner, schema, step, args.steps)
    fill_us = grammar.fill_seconds / max(grammar.fill_rows, 1) * 1e6
    fill_step_ms = grammar.fill_seconds / max(grammar.fill_rows // args.batch, 1) * 1e3
    penalised = with_options(
        presence_penalty=0.5,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias_token_ids=[11, 13],
        logit_bias_values=[1.0, -1.0],
    )
    results["penalties"] = _time_steps(runner, penalised, step, args.steps)
    results["unconstrained again"] = _time_steps(runner, admit, step, args.steps)
    base = float(np.mean([results["unconstrained"], results["unconstrained again"]]))
    print(f"decode step, batch {args.batch}, context {args.context}, {runner.device}, vocab {vocab}:")
    for name, seconds in results.items():
        print(f"  {name:20s} {seconds * 1e3:8.2f} ms   {seconds / base:5.2f}x")
    print(
        f"  grammar bitmask fill on the host: {fill_us:.1f} us/row, {fill_step_ms:.2f} ms/step "
        f"(overlaps the forward, {base * 1e3:.2f} ms, when shorter)"
    )


if __name__ == "__main__":
    main()
