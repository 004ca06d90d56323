"""Batched decode linear layers (M = 64..512 rows) on one GPU: cuBLAS (F.linear) against Triton's
batched_linear, both against the compute/memory floor.

    python -m strata.bench.bench_gemm                                    # 1b + 8b qkv/o_proj/gate_up/down, M 64..512
    python -m strata.bench.bench_gemm --models 1b --m 256                # a subset
    python -m strata.bench.bench_gemm --sweep --models 1b --m 256        # also time a grid of launch configs
    python -m strata.bench.bench_gemm --sweep --linears qkv,down --json out.json

Floor: the larger of FLOPs at the bf16 matmul rate and bytes (W + x + y) at the copy bandwidth,
both measured in the same run: the rate as torch's 8192^3 bf16 matmul, the bandwidth as a
device-to-device copy of a large buffer (read + write bytes over its time, as bench_attention).
Times are CUDA-graph replays timed with CUDA events, per call (strata.bench.bench_linear's
graph_time_us): each graph calls the op back to back on enough distinct copies of the weight
that they overflow L2 (as in a decode step, where a layer's weights were evicted long before),
so every call streams W from HBM while x stays in L2; the launch gaps between calls are counted,
as they are in a captured decode step.

--sweep times, for each shape and M, a grid of alternative configs (tile shapes x BLOCK_K x
warps x stages x TMA, each with the schedules that fit the shape: data parallel, split-K,
stream-K over 1 or 2 programs per SM) and lists the fastest; every config is first checked
against F.linear. The kernels are compiled up front, in parallel (--jobs), since M, N and K are
run-time arguments one compile serves every shape. Per-model totals add layers x (qkv + o_proj +
gate_up + down) for cuBLAS, the heuristic, the best of the sweep (or the heuristic if faster) and
the best of cuBLAS and Triton per linear.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
import triton
import triton.testing

from strata.bench.bench_linear import MODELS, graph_time_us, parse_list
from strata.kernels.batched_linear import (
    GemmLaunchConfig,
    batched_linear,
    choose_batched_linear_config,
    compile_batched_linear,
)

LINEARS = ("qkv", "o_proj", "gate_up", "down", "lm_head")
STEP_LINEARS = ("qkv", "o_proj", "gate_up", "down")  # per layer; the totals need all four
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE = "cuda"

# Kernel variants of the sweep: (block_m, block_n, block_k, num_warps, num_stages, use_tma).
VARIANTS = [
    (128, 128, 64, 8, 4, False),
    (128, 128, 64, 8, 4, True),
    (128, 128, 64, 4, 4, True),
    (128, 128, 128, 8, 3, True),
    (128, 64, 64, 4, 4, False),
    (128, 64, 64, 4, 4, True),
    (128, 64, 64, 4, 6, True),
    (128, 64, 128, 4, 3, True),
    (64, 128, 64, 4, 4, True),
    (64, 128, 64, 4, 6, True),
    (64, 128, 128, 4, 4, True),
    (64, 128, 128, 4, 3, True),
    (64, 256, 64, 4, 3, True),
    (64, 64, 64, 4, 6, True),
    (128, 256, 64, 8, 3, True),
    (256, 128, 64, 8, 3, True),
]
TWO_PER_SM_SHARED = 110 * 1024  # operand buffers small enough for two programs per SM


def sweep_configs(m: int, n: int, k: int, sm_count: int) -> list[GemmLaunchConfig]:
    """The grid: each variant (rows of 256 only from M = 256) with data parallel; the three largest
    split-K counts (2..8, >= 4 steps a split) whose programs fit in one wave (two when two fit per
    SM); stream-K over the SMs (and twice the SMs when two fit) when that leaves >= 2 steps each."""
    configs = []
    for block_m, block_n, block_k, warps, stages, tma in VARIANTS:
        if block_m == 256 and m < 256:
            continue
        base = GemmLaunchConfig(
            block_m=block_m, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages, use_tma=tma
        )
        per_sm = 2 if base.shared_bytes() <= TWO_PER_SM_SHARED else 1
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        steps = triton.cdiv(k, block_k)
        configs.append(base)
        splits = [s for s in range(2, 9) if tiles * s <= per_sm * sm_count and steps >= 4 * s]
        configs += [GemmLaunchConfig(**{**base.__dict__, "split_k": s}) for s in splits[-3:]]
        for programs in sorted({sm_count, per_sm * sm_count}):
            if tiles * steps >= 2 * programs:
                configs.append(GemmLaunchConfig(**{**base.__dict__, "stream_k": programs}))
    return list(dict.fromkeys(configs))


def matmul_tflops(size: int = 8192) -> float:
    """bf16 rate of torch's size^3 matmul (cuBLAS at its best: large tiles, all SMs busy)."""
    a = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: torch.matmul(a, b), warmup=50, rep=300)
    return 2 * size**3 / (ms * 1e-3) / 1e12


def precompile(configs: list[GemmLaunchConfig], x: torch.Tensor, weight: torch.Tensor, jobs: int) -> float:
    """Compile every config's kernels (M, N, K are run-time arguments: one compile serves all
    shapes), in parallel through triton's AsyncCompileMode; serially if that is unavailable.
    Failures are left for the timed call to report. Returns the seconds spent."""
    start = time.perf_counter()
    out = torch.empty(x.shape[0], weight.shape[0], device=DEVICE, dtype=x.dtype)
    try:
        from triton.runtime._async_compile import AsyncCompileMode

        with ThreadPoolExecutor(max_workers=jobs) as executor, AsyncCompileMode(executor, ignore_errors=True):
            for config in configs:
                try:
                    compile_batched_linear(x, weight, out=out, config=config)
                except Exception:  # noqa: BLE001 - reported when the config is timed
                    pass
    except Exception as error:  # noqa: BLE001
        print(f"  parallel compile unavailable ({type(error).__name__}: {error}); compiling on first use")
    return time.perf_counter() - start


def check(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max abs error against the float32 reference (outputs ~N(0, 1): bf16 rounding is ~4e-3)."""
    return (got.float() - want).abs().max().item()


def bench_shape(
    model: str, linear: str, n: int, k: int, ms: list[int], dtype: torch.dtype, args, rates: dict, deadline: float
) -> list[dict]:
    """Every M for one weight shape: cuBLAS, the heuristic, floor; the sweep's best on request."""
    element = torch.finfo(dtype).bits // 8
    weight_bytes = n * k * element
    copies = max(1, -(-args.footprint_mb * 2**20 // weight_bytes))
    calls = max(copies, args.min_calls)
    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    weights = [(torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5).to(dtype) for _ in range(copies)]
    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=DEVICE, dtype=dtype, generator=gen)
        out = torch.empty(m, n, device=DEVICE, dtype=dtype)
        config = choose_batched_linear_config(m, n, k, sm_count, element)
        want = F.linear(x.float(), weights[0].float())
        tolerance = 8 * (want.abs().max().item() + 1) * 2.0**-8
        if not args.no_check:
            error = check(batched_linear(x, weights[0], config=config), want)
            assert error < tolerance, f"batched_linear disagrees with F.linear at N={n} K={k} M={m}: max error {error}"

        def timed(fn) -> float:
            return graph_time_us(fn, copies, calls=calls, replays=args.replays, repeats=args.repeats)

        flops = 2.0 * m * n * k
        cublas_us = timed(lambda i: F.linear(x, weights[i]))
        with blas_library("cublaslt"):  # the graph keeps the kernel chosen at capture
            cublaslt_us = timed(lambda i: F.linear(x, weights[i]))
        triton_us = timed(lambda i: batched_linear(x, weights[i], out=out, config=config))
        floor_us = max(
            flops / (rates["tflops"] * 1e6), (weight_bytes + (m * k + m * n) * element) / (rates["copy_gbps"] * 1e3)
        )
        row = dict(
            model=model,
            linear=linear,
            n=n,
            k=k,
            m=m,
            flops=flops,
            cublas_us=cublas_us,
            cublaslt_us=cublaslt_us,
            triton_us=triton_us,
            floor_us=floor_us,
            config=config.describe(),
            best_us=triton_us,
            best_config=config.describe(),
        )
        if args.sweep and time.perf_counter() > deadline:
            print(f"  (sweep time budget spent: {linear} M={m} not swept)", flush=True)
        elif args.sweep:
            timings = []
            for alternative in sweep_configs(m, n, k, sm_count):
                if alternative == config:
                    continue
                try:
                    error = check(batched_linear(x, weights[0], out=out, config=alternative), want)
                    if error >= tolerance:
                        print(f"    {alternative.describe()}: WRONG (max error {error:.3g})", flush=True)
                        continue
                    timings.append(
                        (timed(lambda i, c=alternative: batched_linear(x, weights[i], out=out, config=c)), alternative)
                    )
                except Exception as error:  # out of shared memory / registers for this combination
                    print(f"    {alternative.describe()}: {type(error).__name__}: {str(error)[:120]}", flush=True)
            timings.sort(key=lambda t: t[0])
            row["sweep"] = [(us, c.describe()) for us, c in timings[: args.sweep_top]]
            row["all"] = [(round(us, 3), c.describe()) for us, c in timings]  # for --json
            if timings and timings[0][0] < triton_us:
                row["best_us"], row["best_config"] = timings[0][0], timings[0][1].describe()
                best = timings[0][1]
            else:
                best = config
            if best.split_k > 1 or best.stream_k:  # is the programmatic dependent launch worth it?
                flipped = GemmLaunchConfig(**{**best.__dict__, "pdl": not best.pdl})
                row["pdl_flipped"] = (
                    timed(lambda i: batched_linear(x, weights[i], out=out, config=flipped)),
                    flipped.describe(),
                )
            row["swept"] = len(timings)
        rows.append(row)
        print_row(row)
        del want
    weights.clear()  # free the copies before the next shape
    torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def blas_library(name: str):
    """torch's preferred BLAS backend for F.linear inside the block ("cublas" or "cublaslt")."""
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def tflops(row: dict, field: str) -> float:
    return row["flops"] / (row[field] * 1e6)


HEADER = (
    f"{'model':<13} {'linear':<8} {'N x K':>13} {'M':>5} {'cuBLAS us':>9} {'TF/s':>4} {'Lt us':>8} {'TF/s':>4} "
    f"{'heur us':>8} {'TF/s':>4} "
    f"{'best us':>8} {'TF/s':>4} {'floor us':>8} {'best/cuBLAS':>11}  heuristic config | best config"
)


def print_row(row: dict) -> None:
    print(
        f"{row['model']:<13} {row['linear']:<8} {row['n']:>6}x{row['k']:<6} {row['m']:>5} "
        f"{row['cublas_us']:9.2f} {tflops(row, 'cublas_us'):4.0f} "
        f"{row['cublaslt_us']:8.2f} {tflops(row, 'cublaslt_us'):4.0f} "
        f"{row['triton_us']:8.2f} {tflops(row, 'triton_us'):4.0f} "
        f"{row['best_us']:8.2f} {tflops(row, 'best_us'):4.0f} {row['floor_us']:8.2f} "
        f"{row['best_us'] / row['cublas_us']:11.2f}  {row['config']} | {row['best_config']}",
        flush=True,
    )
    for us, name in row.get("sweep", []):
        print(f"{'':>44} sweep {us:8.2f} us {row['flops'] / (us * 1e6):4.0f} TF/s  {name}", flush=True)
    if "pdl_flipped" in row:
        us, name = row["pdl_flipped"]
        print(f"{'':>44} best with pdl flipped: {us:8.2f} us  {name}", flush=True)


def print_totals(results: dict, models: list[str], ms: list[int]) -> None:
    """Per model and M: layers x (qkv + o_proj + gate_up + down)."""
    print("\nper-model linear time per decode step (layers x (qkv + o_proj + gate_up + down); lm_head not included):")
    print(
        f"  {'model':<14} {'M':>3} {'cuBLAS us':>10} {'heuristic us':>12} {'best sweep us':>13} {'min(both) us':>12} "
        f"{'floor us':>9} {'heur/cuBLAS':>11} {'best/cuBLAS':>11} {'min/cuBLAS':>10}"
    )
    for key in models:
        model = MODELS[key]
        for m in ms:
            rows = [results.get((key, linear, m)) for linear in STEP_LINEARS]
            if any(row is None for row in rows):
                continue  # not every linear of the model was timed (--linears)
            total = {
                field: model.layers * sum(row[field] for row in rows)
                for field in ("cublas_us", "triton_us", "best_us", "floor_us")
            }
            mixed = model.layers * sum(min(row["cublas_us"], row["best_us"]) for row in rows)
            print(
                f"  {model.name:<14} {m:>3} {total['cublas_us']:10.1f} {total['triton_us']:12.1f} "
                f"{total['best_us']:13.1f} {mixed:12.1f} {total['floor_us']:9.1f} "
                f"{total['triton_us'] / total['cublas_us']:11.2f} {total['best_us'] / total['cublas_us']:11.2f} "
                f"{mixed / total['cublas_us']:10.2f}"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models",
        type=lambda s: parse_list(s, MODELS),
        default=["1b", "8b"],
        help="comma-separated models whose linear shapes to time: 1b (Llama-3.2-1B, 16 layers), "
        "8b (Llama-3.1-8B, 32 layers), smol (SmolLM2-135M, 30 layers); default 1b,8b",
    )
    p.add_argument(
        "--linears",
        type=lambda s: parse_list(s, LINEARS),
        default=list(STEP_LINEARS),
        help=f"comma-separated subset of {','.join(LINEARS)}; default {','.join(STEP_LINEARS)} "
        "(the per-model totals need those four; lm_head is optional)",
    )
    p.add_argument(
        "--m",
        type=lambda s: parse_list(s, None, int),
        default=[64, 128, 256, 512],
        help="comma-separated rows of x (decode batch sizes, >= 1); default 64,128,256,512",
    )
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="weight and activation dtype")
    p.add_argument(
        "--footprint-mb",
        type=int,
        default=256,
        help="weight copies per shape add up to at least this many MB, to stream W from HBM "
        "rather than L2 (50-60 MB on an H100/H200); default 256",
    )
    p.add_argument(
        "--min-calls",
        type=int,
        default=16,
        help="calls per captured graph at least (a big weight has one copy, called repeatedly)",
    )
    p.add_argument("--replays", type=int, default=10, help="graph replays between the two timing events")
    p.add_argument("--repeats", type=int, default=3, help="timed batches of replays; the median is reported")
    p.add_argument(
        "--matmul-size",
        type=int,
        default=8192,
        help="side of the square bf16 matmul whose rate sets the compute floor; default 8192",
    )
    p.add_argument(
        "--no-check",
        action="store_true",
        help="skip the check of the heuristic's batched_linear against F.linear (float32 reference); "
        "sweep configs are always checked",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also time a grid of alternative launch configs for each shape and M and list the fastest "
        "(~50 configs per shape and M; narrow with --models/--linears/--m)",
    )
    p.add_argument("--sweep-top", type=int, default=4, help="how many of the sweep's fastest configs to list")
    p.add_argument(
        "--sweep-budget-s",
        type=float,
        default=0,
        help="stop sweeping (keep timing cuBLAS and the heuristic) once this many seconds have passed "
        "since the start; 0 = no limit",
    )
    p.add_argument("--jobs", type=int, default=16, help="threads compiling the sweep's kernels up front")
    p.add_argument("--json", metavar="PATH", help="also write every row (with every swept config's time) to this file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm: no CUDA device here, nothing to time (needs an NVIDIA GPU); skipped.")
        return 0

    from strata.bench.bench_attention import copy_bandwidth_gbps

    started = time.perf_counter()
    deadline = started + args.sweep_budget_s if args.sweep_budget_s > 0 else float("inf")
    dtype = DTYPES[args.dtype]
    props = torch.cuda.get_device_properties(0)
    print(
        f"device: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
        f"triton {triton.__version__}, {args.dtype}"
    )
    rates = dict(copy_gbps=copy_bandwidth_gbps(), tflops=matmul_tflops(args.matmul_size))
    print(
        f"device copy bandwidth (torch copy of 2 GiB, read+write): {rates['copy_gbps']:.0f} GB/s; "
        f"bf16 matmul {args.matmul_size}^3: {rates['tflops']:.0f} TFLOP/s"
    )
    shapes = [(key, linear, *MODELS[key].shapes[linear]) for key in args.models for linear in args.linears]
    if args.sweep:
        sm_count = props.multi_processor_count
        element = torch.finfo(dtype).bits // 8
        configs = {choose_batched_linear_config(m, n, k, sm_count, element) for _, _, n, k in shapes for m in args.m}
        configs |= {c for _, _, n, k in shapes for m in args.m for c in sweep_configs(m, n, k, sm_count)}
        _, _, n, k = shapes[0]
        seconds = precompile(
            sorted(configs, key=lambda c: c.describe()),
            torch.randn(64, k, device=DEVICE, dtype=dtype),
            torch.randn(n, k, device=DEVICE, dtype=dtype),
            args.jobs,
        )
        print(f"compiled {len(configs)} configs in {seconds:.0f} s ({args.jobs} threads)")
    print("times per call, CUDA-graph replays; TF/s = dense TFLOP/s; best = fastest of heuristic and sweep\n")
    print(HEADER)
    results = {}
    for key, linear, n, k in shapes:
        for row in bench_shape(MODELS[key].name, linear, n, k, args.m, dtype, args, rates, deadline):
            results[(key, linear, row["m"])] = row
    print_totals(results, args.models, args.m)
    print(f"\nbench_gemm: {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(rates=rates, device=props.name, rows=list(results.values())), handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
