"""Mixed steps (a prefill chunk beside decodes) eagerly and on the piecewise CUDA graphs, against
their floor, on the worker's ModelRunner in this process.

    python -m strata.bench.mixed_step --model dummy:llama-3.2-1b --shapes 16x48,64x448,128x1920

A shape DxP is D sequences decoding one token over --context-len cached positions beside one
sequence computing a P-token chunk of a fresh prompt: D + P tokens, the kind of step a server
runs while a new prompt arrives under a small step budget. Each way is timed as the worker runs
steps (each launched while the previous step's tokens travel to the host; the period between
completions), with the GPU time of a step from CUDA events beside it. The same runner serves both
ways (its piecewise graphs set aside for the eager one). Floor: the larger of the step's bytes
(weights, and the cached K/V it reads) over the copy bandwidth and its FLOPs over the GEMM rate,
both measured in this run.
"""

from __future__ import annotations

import argparse
import math
import statistics

import numpy as np

from strata.bench import common
from strata.bench.cluster_flags import bench_settings
from strata.bench.roofline import (
    attended_keys,
    back_to_back,
    decode_bytes,
    load_runner,
    matmul_weights_per_token,
    measure_copy_bandwidth,
    measure_matmul_flops,
)
from strata.flags import DEFAULTS


def mixed_plan(decodes: int, chunk: int, context_len: int, block_size: int, vocab_size: int, new: bool):
    """Sequences 1..decodes decode at position context_len - 1; sequence decodes + 1 computes a
    chunk of `chunk` fresh prompt tokens. new: admit them all (the first plan), else repeat."""
    from strata.v1 import engine_pb2

    n = decodes + 1
    blocks = math.ceil(max(context_len, chunk) / block_size)
    seq_ids = list(range(1, n + 1))
    tokens = common.random_prompts(1, decodes + chunk, vocab_size, seed=0)[0]
    plan = engine_pb2.StepPlan(
        step_id=1,
        seq_ids=seq_ids,
        num_computed=[context_len - 1] * decodes + [0],
        num_scheduled=[1] * decodes + [chunk],
        input_token_ids=tokens,
        sample=[True] * n,
        table_keep=[0 if new else blocks] * n,
        table_append_counts=[blocks if new else 0] * n,
    )
    if new:  # (re-)admits them: releasing first lets the next shape reuse the seq ids
        plan.released_seq_ids.extend(seq_ids)
        plan.new_sequences.extend(
            engine_pb2.NewSequence(
                seq_id=s, sampling=engine_pb2.SamplingOptions(temperature=1.0, top_p=1.0, seed=s, logprobs=-1)
            )
            for s in seq_ids
        )
        plan.table_append_ids.extend(range(1, 1 + n * blocks))
    return plan


def time_steps(runner, plan, steps: int) -> dict:
    """Back-to-back steps of `plan`: median period between completions, and median GPU time."""
    for _ in range(3):
        runner.execute(plan).finish()
    periods, gpu = back_to_back(runner, plan, steps)
    return {"median_s": float(np.median(periods)), "gpu_s": statistics.median(gpu[1:])}


def step_floor(
    config, itemsize: int, decodes: int, chunk: int, context_len: int, bandwidth: float, flops: float | None
) -> float:
    """max(bytes / bandwidth, FLOPs / GEMM rate) of one mixed step (causal attention FLOPs); the
    bytes alone where no GEMM rate was measured (CPU)."""
    kv = config.num_key_value_heads * config.head_dim
    q = config.num_attention_heads * config.head_dim
    layers = config.num_hidden_layers
    # The weights all the step's tokens need (experts: those they pick), the decodes' KV, the chunk's.
    data = decode_bytes(config, itemsize, decodes + chunk, context_len)["weight_bytes"]
    data += (decodes * attended_keys(config, context_len, 1) + chunk * layers) * 2 * kv * itemsize
    tokens = decodes + chunk
    attention = 4 * q * (decodes * attended_keys(config, context_len, 1) + attended_keys(config, 1, chunk))
    work = (
        2 * matmul_weights_per_token(config) * tokens
        + 2 * config.vocab_size * config.hidden_size * (decodes + 1)
        + attention
    )
    return max(data / bandwidth, work / flops if flops else 0.0)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:llama-3.2-1b", help="HF model directory or dummy:NAME")
    p.add_argument(
        "--shapes",
        default="16x48,64x448,128x896,128x1920",
        help="comma-separated DxP: D decodes beside a P-token prompt chunk",
    )
    p.add_argument("--context-len", type=int, default=576, help="cached tokens each decode reads")
    p.add_argument("--steps", type=int, default=30, help="timed steps per way and shape")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (no graphs: the eager way alone)")
    a = p.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")]
    largest = max(d + c for d, c in shapes)
    budget = max(DEFAULTS["max_num_batched_tokens"], largest)
    args = bench_settings(model=a.model, device=a.device, max_num_batched_tokens=budget)
    max_decodes = max(d for d, _ in shapes)
    runner = load_runner(
        args,
        max_decodes + 1,
        max(a.context_len, max(c for _, c in shapes)),
        extra=["--piecewise-graph-max-tokens", str(budget)],
    )
    import torch

    device = str(runner.device)
    bandwidth, flops = measure_copy_bandwidth(device), measure_matmul_flops(device)
    itemsize = torch.empty((), dtype=runner.dtype).element_size()
    pieces = runner.piecewise
    rows = []
    print(
        f"{'shape':>10} {'tokens':>6} {'padded':>6} {'eager ms':>9} {'pieces ms':>9} {'pieces/eager':>12} "
        f"{'eager GPU':>9} {'pieces GPU':>10} {'floor ms':>8}"
    )
    for decodes, chunk in shapes:
        admit = mixed_plan(decodes, chunk, a.context_len, runner.block_size, runner.config.vocab_size, new=True)
        step = mixed_plan(decodes, chunk, a.context_len, runner.block_size, runner.config.vocab_size, new=False)
        runner.execute(admit).finish()
        timings = {}
        for way, graphs in [("eager", None)] + ([("pieces", pieces)] if pieces else []):
            runner.piecewise = graphs
            timings[way] = time_steps(runner, step, a.steps)
        floor = step_floor(runner.config, itemsize, decodes, chunk, a.context_len, bandwidth, flops)
        e, w = timings["eager"], timings.get("pieces")
        tokens = decodes + chunk

        def ms(t: dict | None, key: str) -> str:
            return common.fmt(t and t[key] and t[key] * 1e3, ".3f")

        print(
            f"{decodes:>4}x{chunk:<5} {tokens:>6} {common.fmt(pieces and pieces.padded_size(tokens), 'd'):>6} "
            f"{ms(e, 'median_s'):>9} {ms(w, 'median_s'):>9} "
            f"{common.fmt(w and w['median_s'] / e['median_s'], '.2f'):>12} {ms(e, 'gpu_s'):>9} {ms(w, 'gpu_s'):>10} "
            f"{floor * 1e3:8.3f}"
        )
        rows.append({"decodes": decodes, "chunk": chunk, "eager": e, "pieces": w, "floor_s": floor})
    print(
        f"\ncopy bandwidth {bandwidth / 1e9:,.0f} GB/s, GEMM rate {common.fmt(flops and flops / 1e12, ',.0f')} "
        f"TFLOP/s\nRESULTS.md rows:"
    )
    env = common.environment_info(args)
    for r in rows:
        e, w, floor = r["eager"], r["pieces"], r["floor_s"]
        print(
            f"| {env['date'][:10]} | {env['commit']} | {env['device_name']} | {a.model} | {r['decodes']} x 1 + "
            f"{r['chunk']} | {e['median_s'] * 1e3:.3f} ({e['median_s'] / floor:.2f}x) | "
            f"{common.fmt(w and w['median_s'] * 1e3, '.3f')} ({common.fmt(w and w['median_s'] / floor, '.2f')}x) "
            f"| {floor * 1e3:.3f} |"
        )
    return rows


if __name__ == "__main__":
    main()
