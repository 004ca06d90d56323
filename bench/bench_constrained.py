"""What structured outputs and penalties cost a decode step, in process (one worker's ModelRunner).

    python -m strata.bench.bench_constrained --tokenizer DIR      # batch 256, the 1B dummy shape on GPU
    python -m strata.bench.bench_constrained --batch 64 --device cpu --model DIR --tokenizer DIR

Times decode steps of --batch sequences as the worker runs them: each step decodes the token
after the last one sampled (a placeholder input, the decode lookahead), positions advance by
one per step, ending at --context. Four cases, each on freshly admitted sequences:

- unconstrained;
- json schema: every row under a JSON schema (an array of at least 256 integers, so no row's
  grammar ends during the bench: every step of every row is masked);
- penalties: every row with presence, frequency and repetition penalties and a logit bias;
- mixed: 1 row in 8 under the schema, 1 in 8 penalised, the rest unconstrained beside them.

Two timings per case: serial (launch a step, wait for its tokens: no overlap between steps: the
median step) and back-to-back (each step launched while the previous one's tokens travel to the
host, as the worker's step and finisher threads run them: the median period between
completions), plus the GPU's busy time per step (CUDA events, serial steps) and the host's time
to launch a step (execute(): the step thread's whole share, the controls' included).
The ratios to the unconstrained case are the issue's targets (json <= 1.1x, penalties <= 1.03x,
mixed ~1.0x: unconstrained rows lose nothing). Where the time goes: the host's part of the
controlled draw (inputs: counts and penalty arrays; masks: accepting the last tokens, waiting for
them included, and filling the bitmasks; launch: uploads and launches) and the GPU's (idle after
the graph until those inputs are up, then the penalty patch and the controlled draw).

A constrained row's grammar needs the model's tokenizer: a dummy model takes --tokenizer (default
~/.cache/strata/SmolLM2-135M-Instruct). Older trees lack some counters: they print as '-'.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from strata.bench import common
from strata.bench.roofline import load_runner
from strata.flags import service_args
from strata.protocol import PLACEHOLDER_TOKEN
from strata.v1 import engine_pb2

# At least 256 items: no row can close the array (and end its grammar) within the bench's steps.
SCHEMA = json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 256})
JSON = dict(constraint_kind=engine_pb2.CONSTRAINT_KIND_JSON_SCHEMA, constraint=SCHEMA)
PENALTIES = dict(
    presence_penalty=0.5,
    frequency_penalty=0.5,
    repetition_penalty=1.2,
    logit_bias_token_ids=[11, 13],
    logit_bias_values=[1.0, -1.0],
)
WARMUP, TIMED = 5, 30


def admit_plan(batch: int, prompt_len: int, total_len: int, block_size: int, tokens, options) -> engine_pb2.StepPlan:
    """Admits `batch` sequences (re-admitting them if they exist) whose first prompt_len - 1
    tokens are computed; computes the last prompt token and samples. options(i): row i's extra
    sampling options."""
    blocks = math.ceil(total_len / block_size)
    seq_ids = list(range(1, batch + 1))
    return engine_pb2.StepPlan(
        step_id=1,
        released_seq_ids=seq_ids,
        new_sequences=[
            engine_pb2.NewSequence(
                seq_id=s,
                sampling=engine_pb2.SamplingOptions(temperature=1.0, top_p=1.0, seed=s, logprobs=-1, **options(s - 1)),
                num_prompt_tokens=prompt_len,
                history_start=prompt_len,
            )
            for s in seq_ids
        ],
        table_keep=[0] * batch,
        table_append_counts=[blocks] * batch,
        table_append_ids=np.arange(1, 1 + batch * blocks).tolist(),
        seq_ids=seq_ids,
        num_computed=[prompt_len - 1] * batch,
        num_scheduled=[1] * batch,
        input_token_ids=list(tokens),
        sample=[True] * batch,
    )


def step_plan(step_id: int, batch: int, position: int, blocks: int) -> engine_pb2.StepPlan:
    """Every sequence decodes the token at `position`: the one it sampled last (a placeholder)."""
    return engine_pb2.StepPlan(
        step_id=step_id,
        table_keep=[blocks] * batch,
        table_append_counts=[0] * batch,
        seq_ids=list(range(1, batch + 1)),
        num_computed=[position] * batch,
        num_scheduled=[1] * batch,
        input_token_ids=[PLACEHOLDER_TOKEN] * batch,
        sample=[True] * batch,
    )


def _counters(runner) -> dict:
    c = runner.controls
    g = c.grammar
    out = {"fill": g.fill_seconds, "fill_rows": g.fill_rows}
    out["accept"] = getattr(g, "accept_seconds", float("nan"))
    out["wait"] = getattr(g, "wait_seconds", float("nan"))
    for name, value in getattr(c, "host_seconds", {}).items():
        out[name] = value
    return out


def run_case(runner, batch: int, context: int, options) -> dict:
    total = 1 + WARMUP + 2 * TIMED + 1  # the admission's step, then the decodes
    prompt_len = context - total
    blocks = math.ceil(context / runner.block_size)
    tokens = common.random_prompts(1, batch, runner.config.vocab_size, 0)[0]
    runner.execute(admit_plan(batch, prompt_len, context, runner.block_size, tokens, options)).finish()
    plans = iter(step_plan(2 + i, batch, prompt_len + i, blocks) for i in range(total))
    cuda = runner.device.type == "cuda"
    controls = runner.controls
    if hasattr(controls, "profile"):
        controls.profile = cuda
        controls.gpu_events.clear()
    for _ in range(WARMUP):
        runner.execute(next(plans)).finish()
    if cuda:
        torch.cuda.synchronize(runner.device)
    before = _counters(runner)
    serial, gpu, launch = [], [], []
    for _ in range(TIMED):
        t0 = time.perf_counter()
        result = runner.execute(next(plans)).finish()
        serial.append(time.perf_counter() - t0)
        gpu.append(result.gpu_seconds)
        launch.append(result.launch_seconds)
    after = _counters(runner)
    if cuda:
        torch.cuda.synchronize(runner.device)
    pending, done = runner.execute(next(plans)), []
    for _ in range(TIMED):
        launched = runner.execute(next(plans))
        pending.finish()
        done.append(time.perf_counter())
        pending = launched
    pending.finish()
    parts = {k: (after[k] - before[k]) / TIMED * 1e3 for k in after if k != "fill_rows"}
    waits, draws = [], []
    if cuda and hasattr(controls, "profile"):
        torch.cuda.synchronize(runner.device)
        for graph_done, ready, drawn in controls.gpu_events[WARMUP:]:
            waits.append(graph_done.elapsed_time(ready))
            draws.append(ready.elapsed_time(drawn))
        controls.profile = False
    periods = np.diff(done)
    return {
        "serial_ms": float(np.median(serial)) * 1e3,
        "b2b_ms": float(np.median(periods)) * 1e3,
        "b2b_mean_ms": float(np.mean(periods)) * 1e3,
        "gpu_ms": float(np.median(gpu)) * 1e3 if cuda else float("nan"),
        "launch_ms": float(np.median(launch)) * 1e3,
        "parts_ms": parts,
        "gpu_wait_ms": float(np.median(waits)) if waits else float("nan"),
        "gpu_controls_ms": float(np.median(draws)) if draws else float("nan"),
        "masked_rows": int(len(controls.grammar.rows)),
    }


def grammar_host_ms(tokenizer: str, batch: int, threads: int, vocab: int) -> tuple[float, float]:
    """The grammar's host work alone, without a model: `batch` rows under SCHEMA, each step
    filling every row's bitmask on `threads` of xgrammar's threads and accepting one token per
    row (the JSON the schema asks for), as many steps as a case times. Returns (accept, fill) ms
    per step. (xgrammar's accept grows with the array's items under minItems: ~10x by item 200.)"""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from strata.services.worker.sampling import grammar

    ids = AutoTokenizer.from_pretrained(tokenizer).encode("[" + ", ".join(map(str, range(100))))[: WARMUP + TIMED]
    default, grammar.FILL_THREADS = grammar.FILL_THREADS, threads
    try:
        state = grammar.GrammarState(
            grammar.GrammarCompilerPool(tokenizer, vocab, []), batch, vocab, torch.device("cpu")
        )
        options = engine_pb2.SamplingOptions(**JSON)
        for row in range(batch):
            state.add(row, options, 1, 1, [])
        idx = np.arange(batch)
        for k in range(len(ids)):
            if k == WARMUP:  # warm: the matchers' first states
                state.accept_seconds = state.fill_seconds = 0.0
            h = SimpleNamespace(sample_rows=idx, sample_positions=np.full(batch, 1 + k), verify=None)
            state._fill(h, idx, state._bitmask_rows(batch))
            state.after_draw(h, idx, torch.full((batch,), ids[k], dtype=torch.int64))
            state._drain()
    finally:
        grammar.FILL_THREADS = default
    timed = len(ids) - WARMUP
    return state.accept_seconds / timed * 1e3, state.fill_seconds / timed * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--cases", default="unconstrained,json schema,penalties,mixed,unconstrained again")
    p.add_argument(
        "--tokenizer", default=str(Path.home() / ".cache" / "strata" / "SmolLM2-135M-Instruct"), help="tokenizer dir"
    )
    args = p.parse_args(argv)
    settings = service_args(["worker"])
    settings.device, settings.model = args.device, args.model
    settings.model = common.resolve_model(settings)
    runner = load_runner(settings, args.batch, args.context, ["--tokenizer", args.tokenizer])
    vocab = runner.config.vocab_size
    cases = {
        "unconstrained": lambda i: {},
        "json schema": lambda i: JSON,
        "penalties": lambda i: PENALTIES,
        "mixed": lambda i: JSON if i % 8 == 0 else PENALTIES if i % 8 == 1 else {},
        "unconstrained again": lambda i: {},
    }
    for name in ("unconstrained", "mixed"):  # untimed: first-use costs (allocations, grammar compile)
        run_case(runner, args.batch, args.context, cases[name])
    results = {name: run_case(runner, args.batch, args.context, cases[name]) for name in args.cases.split(",")}
    plain = [r for name, r in results.items() if name.startswith("unconstrained")]
    base = {k: float(np.mean([r[k] for r in plain])) for k in ("serial_ms", "b2b_ms", "gpu_ms")}
    print(f"decode step, batch {args.batch}, context up to {args.context}, {runner.device}, vocab {vocab}:")
    print(
        f"  {'case':20s} {'serial ms':>10s} {'(x)':>6s} {'b2b ms':>8s} {'(x)':>6s} {'GPU ms':>8s} {'(x)':>6s}"
        f" {'host launch ms':>15s}"
    )
    for name, r in results.items():
        print(
            f"  {name:20s} {r['serial_ms']:10.3f} {r['serial_ms'] / base['serial_ms']:6.3f}"
            f" {r['b2b_ms']:8.3f} {r['b2b_ms'] / base['b2b_ms']:6.3f}"
            f" {r['gpu_ms']:8.3f} {r['gpu_ms'] / base['gpu_ms']:6.3f} {r['launch_ms']:15.3f}"
        )
    print(
        "  (b2b: the median period; means: "
        + ", ".join(f"{n} {r['b2b_mean_ms']:.3f}" for n, r in results.items())
        + ")"
    )
    print("  where the controlled steps' time goes (per step, serial steps):")
    for name, r in results.items():
        if name.startswith("unconstrained"):
            continue
        parts = " ".join(f"{k} {v:.3f}" for k, v in r["parts_ms"].items())
        print(
            f"  {name:20s} host ms: {parts}; GPU ms: idle after the graph {r['gpu_wait_ms']:.3f},"
            f" patch + draw {r['gpu_controls_ms']:.3f}; rows under a grammar {r['masked_rows']}"
        )
    host = {t: grammar_host_ms(args.tokenizer, args.batch, t, vocab) for t in (1, 2, 4, 8)}
    print(f"  the grammar's host work alone (no model; {args.batch} rows, ms per step), by xgrammar fill threads:")
    for t, (accept, fill) in host.items():
        print(f"    {t} threads: accept {accept:.3f} fill {fill:.3f}")
    print(json.dumps({"batch": args.batch, "context": args.context, "results": results, "grammar_host_ms": host}))


if __name__ == "__main__":
    main()
