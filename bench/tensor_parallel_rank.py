"""One rank of a tensor-parallel stage alone on one GPU: its decode step without the collectives,
against the whole model's step on the same GPU. Issue 51's targets are two-GPU ones; this bench
says, on one GPU, how much of each target the rank's own compute already spends and so what each
collective may cost.

    python -m strata.bench.tensor_parallel_rank --model dummy:llama-3-8b --ranks 2 --batches 1,16

Rank 0 of T is built as `strata worker --tensor-parallel-size T --tensor-parallel-rank 0` builds it
(its query and KV heads, its part of each intermediate size, its vocabulary slice, its sampler
over the slice) and runs with --tensor-parallel-no-collectives: wrong tokens, a rank's compute.
Nothing else joins: the group is never formed, so the GPU holds this one process.

Per batch it prints the whole model's step S1 and the rank's step St (the worker's back-to-back
period, as `strata bench roofline` times it), and the collectives one step runs (counted on an
eager step). A T-way step is St + n x c for n collectives of c seconds each, so:
- the TPOT target (T-way step <= 0.6 x S1) leaves c <= (0.6 x S1 - St) / n;
- the share target (n x c <= 15% of the T-way step) leaves c <= 0.15 / 0.85 x St / n.
Compare those with `python -m strata.bench.all_reduce`'s per-call times on two GPUs.
"""

from __future__ import annotations

import argparse
import collections
import json

from strata.bench import common
from strata.bench.cluster_flags import bench_settings
from strata.bench.roofline import decode_plans, load_runner, time_decode_step
from strata.bench.tensor_parallel import TARGET_ALL_REDUCE_SHARE, TARGET_TPOT_RATIO
from strata.flags import DEFAULTS
from strata.kernels import small_batch_linear


def rank_flags(ranks: int) -> list[str]:
    """Rank 0 of `ranks`, collectives skipped. The master address is never dialled: only
    InitCache through the servicer forms the group."""
    if ranks == 1:
        return []
    return [
        "--tensor-parallel-size",
        str(ranks),
        "--tensor-parallel-rank",
        "0",
        "--tensor-parallel-master",
        "127.0.0.1:1",
        "--tensor-parallel-no-collectives",
    ]


def count_collectives(runner, batch: int, context_len: int) -> dict[str, int]:
    """The collectives one eager decode step of `batch` calls on the rank's group (the decode and
    piecewise graphs are set aside for it: a replay runs no Python)."""
    counts: collections.Counter = collections.Counter()
    tp = runner.tp
    originals = {name: getattr(tp, name) for name in ("all_reduce_", "all_reduce_max_", "all_gather")}

    def counting(name):
        def call(x, *a, **k):
            counts[name] += 1
            return originals[name](x, *a, **k)

        return call

    admit, step = decode_plans(batch, context_len, runner.block_size, runner.config.vocab_size, 0.0, 0)
    graphs = runner.graphs, runner.cascade_graphs, runner.piecewise
    runner.graphs = runner.cascade_graphs = runner.piecewise = None
    try:
        runner.execute(admit).finish()
        for name in originals:
            setattr(tp, name, counting(name))
        runner.execute(step).finish()
    finally:
        for name in originals:
            setattr(tp, name, originals[name])  # the bound methods, set back as instance attributes
        runner.graphs, runner.cascade_graphs, runner.piecewise = graphs
    return dict(counts)


def time_rank(model: str, device: str, ranks: int, batches: list[int], context_len: int, steps: int) -> list[dict]:
    budget = max(DEFAULTS["max_num_batched_tokens"], max(batches))
    args = bench_settings(model=model, device=device, max_num_batched_tokens=budget)
    runner = load_runner(args, max(batches), context_len, rank_flags(ranks))
    rows = []
    try:
        for batch in batches:
            t = time_decode_step(runner, batch, context_len, steps, warmup=5, temperature=0.0)
            rows.append(
                {
                    "model": model,
                    "ranks": ranks,
                    "batch": batch,
                    "step_ms": t["median_s"] * 1e3,
                    "gpu_ms": t["gpu_s"] * 1e3 if t["gpu_s"] is not None else None,
                    "collectives": count_collectives(runner, batch, context_len) if ranks > 1 else {},
                }
            )
            r = rows[-1]
            print(
                f"{model} rank 0 of {ranks}, batch {batch}: step {r['step_ms']:.3f} ms, GPU {common.fmt(r['gpu_ms'], '.3f')} ms, "
                f"collectives {r['collectives'] or '-'}",
                flush=True,
            )
    finally:
        del runner
        common.free_accelerator_memory()
    return rows


def budgets(whole_ms: float, rank_ms: float, collectives: int) -> dict:
    """What each collective may cost (us) for a T-way step to meet each target."""
    n = max(collectives, 1)
    return {
        "tpot_budget_us": (TARGET_TPOT_RATIO * whole_ms - rank_ms) * 1e3 / n,
        "share_budget_us": TARGET_ALL_REDUCE_SHARE / (1 - TARGET_ALL_REDUCE_SHARE) * rank_ms * 1e3 / n,
    }


def print_budgets(rows: list[dict], gemms: str) -> None:
    """The table of each rank's step against one GPU's, and what each collective may cost."""
    whole = {r["batch"]: r for r in rows if r["ranks"] == 1}
    print(
        f"\nlinears of 2-16 rows: {gemms}\n| ranks | batch | one GPU step ms | rank step ms | rank / one GPU "
        f"| collectives a step | each collective's budget, us: TPOT <= {TARGET_TPOT_RATIO}x "
        f"| share <= {TARGET_ALL_REDUCE_SHARE:.0%} |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r["ranks"] == 1:
            continue
        n = sum(r["collectives"].values())
        r.update(budgets(whole[r["batch"]]["step_ms"], r["step_ms"], n))
        print(
            f"| {r['ranks']} | {r['batch']} | {whole[r['batch']]['step_ms']:.3f} | {r['step_ms']:.3f} "
            f"| {r['step_ms'] / whole[r['batch']]['step_ms']:.3f}x | {n} | {r['tpot_budget_us']:.1f} "
            f"| {r['share_budget_us']:.1f} |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dummy:llama-3-8b", help="--model value (a dummy preset or an HF directory)")
    p.add_argument("--ranks", default="2", help="comma-separated T values; each rank 0 of T is timed against T = 1")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (cpu: a check that it runs, not a timing)")
    p.add_argument("--batches", default="1,16", help="comma-separated decode batch sizes")
    p.add_argument("--context-len", type=int, default=576, help="cached tokens per sequence (roofline's 512 + 64)")
    p.add_argument("--steps", type=int, default=50, help="timed steps per batch")
    p.add_argument(
        "--small-batch-gemm",
        choices=("off", "on", "both"),
        default="on",
        help="batches of 2-16 rows through kernels/small_batch_linear.py where it is tuned (on, as served) or "
        "cuBLAS (off); both: an A/B, each way's table",
    )
    p.add_argument("--json", default=None, help="write every number here")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    ranks = [int(t) for t in a.ranks.split(",")]
    env = common.environment_info(bench_settings(model=a.model, device=a.device))
    print(f"commit {env['commit']}, {env['device_name']}, {env['model']}, context {a.context_len}")
    rows = []
    for small in {"off": [False], "on": [True], "both": [False, True]}[a.small_batch_gemm]:
        small_batch_linear.enabled = small  # read when the runner captures its graphs
        ways = [r for t in [1, *ranks] for r in time_rank(a.model, a.device, t, batches, a.context_len, a.steps)]
        for r in ways:
            r["small_batch_gemm"] = small
        print_budgets(ways, "kernels/small_batch_linear.py" if small else "cuBLAS")
        rows += ways
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
