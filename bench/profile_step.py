"""Where a step's time goes: per-phase host timings, the host's Python profile, the top GPU kernels.

python -m strata.bench.profile_step --batch 256 --context-len 640 [--model dummy:llama-3.2-1b]
python -m strata.bench.profile_step --batch 16 --prefill-len 512     # a prefill step of 16 x 512 tokens
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from strata.bench.cluster_flags import bench_settings
from strata.bench.roofline import decode_plans, load_runner, prefill_plan
from strata.bench.tensor_parallel_rank import rank_flags
from strata.flags import DEFAULTS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context-len", type=int, default=640)
    p.add_argument("--model", default="dummy:llama-3.2-1b")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--prefill-len",
        type=int,
        default=0,
        help="profile a step prefilling --batch fresh prompts of this many tokens instead of a decode",
    )
    p.add_argument("--skip-host-profile", action="store_true", help="no cProfile table of the host side")
    p.add_argument("--rows", type=int, default=30, help="rows of the GPU kernel table")
    p.add_argument(
        "--tensor-parallel-rank-of",
        type=int,
        default=1,
        metavar="T",
        help="profile rank 0 of a T-way stage alone, collectives skipped (bench/tensor_parallel_rank.py)",
    )
    p.add_argument(
        "--cublas-small-batches",
        action="store_true",
        help="batches of 2-16 rows through cuBLAS, not kernels/small_batch_linear.py where it is tuned (an A/B)",
    )
    a = p.parse_args()
    if a.cublas_small_batches:
        from strata.kernels import small_batch_linear

        small_batch_linear.enabled = False  # before the runner captures its graphs
    budget = max(DEFAULTS["max_num_batched_tokens"], a.batch * a.prefill_len)
    # The benchmarks' flags at their defaults but these: load_runner reads them.
    args = bench_settings(model=a.model, device="cuda", enforce_eager=a.enforce_eager, max_num_batched_tokens=budget)
    runner = load_runner(args, a.batch, max(a.context_len, a.prefill_len), rank_flags(a.tensor_parallel_rank_of))
    admit, step = decode_plans(a.batch, a.context_len, runner.block_size, runner.config.vocab_size, a.temperature, 0)
    if a.prefill_len:
        admit = step = prefill_plan(
            a.batch, a.prefill_len, runner.block_size, runner.config.vocab_size, a.temperature, 0
        )
    runner.execute(admit).finish()
    for _ in range(5):
        runner.execute(step).finish()
    torch.cuda.synchronize()
    phases = {"apply_plan": 0.0, "build_inputs": 0.0, "execute(total)": 0.0}
    for _ in range(a.steps):
        t0 = time.perf_counter()
        rows = runner.apply_plan(step)
        t1 = time.perf_counter()
        runner.inputs.build(step, rows)
        t2 = time.perf_counter()
        runner.execute(step).finish()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        phases["apply_plan"] += t1 - t0
        phases["build_inputs"] += t2 - t1
        phases["execute(total)"] += t3 - t2
    for k, v in phases.items():
        print(f"{k:>20}: {v / a.steps * 1e3:8.3f} ms/step")
    # Host side of steps run back to back (as the worker runs them): where the Python time goes.
    if not a.skip_host_profile:
        profiler = cProfile.Profile()
        pending = runner.execute(step)
        profiler.enable()
        for _ in range(a.steps):
            launched = runner.execute(step)
            pending.finish()
            pending = launched
        profiler.disable()
        pending.finish()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    profiled_steps = 5
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(profiled_steps):
            runner.execute(step).finish()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=a.rows, max_name_column_width=60))
    print_gpu_busy(prof, profiled_steps)
    print_critical_path(prof, profiled_steps, a.rows)


def gpu_kernels(prof) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU kernel and copy in the trace, by start."""
    return sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )


def print_critical_path(prof, steps: int, rows: int) -> None:
    """Who owns each microsecond of the GPU timeline. Walking kernels by start, a kernel owns the
    part of its run that no earlier kernel covers ("exposed"), and the idle time before it
    ("waited"). With programmatic dependent launch a kernel starts early and overlaps its
    predecessor, so its full duration overstates it; exposed + waited summed over all kernels is
    the timeline's span, which is what a step costs."""
    kernels = gpu_kernels(prof)
    firsts = {cut + 1 for cut in step_cuts([(start, end) for start, end, _ in kernels], steps)}
    covered_until, owned = None, {}
    for i, (start, end, name) in enumerate(kernels):
        if i in firsts:  # the host waited for the previous step's tokens: not part of a step
            covered_until = None
        waited = 0.0 if covered_until is None else max(0.0, start - covered_until)
        exposed = end - start if covered_until is None else max(0.0, end - max(start, covered_until))
        covered_until = end if covered_until is None else max(covered_until, end)
        row = owned.setdefault(name, [0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += end - start
        row[2] += exposed
        row[3] += waited
    total = sum(r[2] + r[3] for r in owned.values())
    print(f"\ncritical path per step: {total / steps:.1f} us (kernels' exposed time + idle before them)")
    print(f"{'kernel':<60} {'calls':>5} {'dur us':>8} {'exposed':>8} {'waited':>7} {'share':>6}")
    for name, (calls, dur, exposed, waited) in sorted(owned.items(), key=lambda kv: -(kv[1][2] + kv[1][3]))[:rows]:
        print(
            f"{name[:60]:<60} {calls / steps:5.0f} {dur / steps:8.1f} {exposed / steps:8.1f} {waited / steps:7.1f} "
            f"{(exposed + waited) / total:6.1%}"
        )


def step_cuts(kernels: list[tuple[float, float]], steps: int) -> list[int]:
    """Steps are separated by the host's wait for each step's tokens: the timeline splits at the
    steps - 1 widest gaps between consecutive kernels; returns the index of each step's last kernel
    but the final one."""
    gaps = sorted(((kernels[i + 1][0] - kernels[i][1], i) for i in range(len(kernels) - 1)), reverse=True)
    return sorted(i for _, i in gaps[: steps - 1])


def print_gpu_busy(prof, steps: int) -> None:
    """Kernel time against the span of each step's kernels: the gap is the GPU waiting (for
    launches, for the host) inside steps; the kernel count is what a graph would replay."""
    kernels = [(start, end) for start, end, _ in gpu_kernels(prof)]
    if not kernels:
        return
    busy = sum(end - start for start, end in kernels)
    cuts = step_cuts(kernels, steps)
    spans, first = [], 0
    for cut in cuts + [len(kernels) - 1]:
        spans.append(max(end for _, end in kernels[first : cut + 1]) - kernels[first][0])
        first = cut + 1
    span = sum(spans)
    print(
        f"GPU per step: {len(kernels) / steps:.0f} kernels, {busy / steps:.1f} us of kernel time in a "
        f"{span / steps:.1f} us span ({busy / span:.0%} busy; spans {', '.join(f'{s:.0f}' for s in spans)} us)"
    )


if __name__ == "__main__":
    main()
