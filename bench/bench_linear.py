"""Decode-sized linear layers (M = 1..16 rows) on one GPU: cuBLAS (F.linear) against the memory
floor; at M = 1 also the decode chain's GEMV (kernels/decode_linear.py), whose back-to-back calls
overlap through PDL (and without it). (The Triton small-M GEMM it was written to judge lost to
cuBLAS and was removed: bench/RESULTS.md.)

    python -m strata.bench.bench_linear                              # every shape, M = 1, 2, 4, 8, 16
    python -m strata.bench.bench_linear --models 1b --m 1,16         # a subset

Floor: (W + x + y bytes) / copy bandwidth, the bandwidth measured in the same run as a
device-to-device copy of a large buffer (read + write bytes over its time, as bench_attention).
Times are CUDA-graph replays timed with CUDA events, per call: each graph calls the op back to
back on enough distinct copies of the weight that they overflow L2 several times (as in a decode
step, where a layer's weights were evicted long before), so every call streams W from HBM; the
launch gaps between the calls are counted, as they are in a captured decode step. Per-model
totals add layers x (qkv + o_proj + gate_up + down) + lm_head.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
import triton

from strata.bench.graph_timing import graph_time_us
from strata.kernels import dependent_launch
from strata.kernels.decode_linear import plain_linear

LINEARS = ("qkv", "o_proj", "gate_up", "down", "lm_head")


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    shapes: dict  # linear -> (N, K) of W


MODELS = {
    "1b": Model(
        "Llama-3.2-1B",
        16,
        dict(qkv=(3072, 2048), o_proj=(2048, 2048), gate_up=(16384, 2048), down=(2048, 8192), lm_head=(128256, 2048)),
    ),
    "8b": Model(
        "Llama-3.1-8B",
        32,
        dict(qkv=(6144, 4096), o_proj=(4096, 4096), gate_up=(28672, 4096), down=(4096, 14336), lm_head=(128256, 4096)),
    ),
    # A rank of two of the 8B (tensor parallelism): column-parallel qkv and gate_up, row-parallel
    # o_proj and down, half of lm_head's vocabulary.
    "8b-tp2": Model(
        "Llama-3.1-8B, TP2 rank",
        32,
        dict(qkv=(3072, 4096), o_proj=(4096, 2048), gate_up=(14336, 4096), down=(4096, 7168), lm_head=(64128, 4096)),
    ),
    "smol": Model(
        "SmolLM2-135M",
        30,
        dict(qkv=(960, 576), o_proj=(576, 576), gate_up=(3072, 576), down=(576, 1536), lm_head=(49152, 576)),
    ),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE = "cuda"


def bench_shape(
    model: str, linear: str, n: int, k: int, ms: list[int], dtype: torch.dtype, args, copy_gbps: float
) -> list[dict]:
    """Every M for one weight shape: cuBLAS and floor (and the chain's GEMV at M = 1)."""
    element = torch.finfo(dtype).bits // 8
    weight_bytes = n * k * element
    copies = max(1, -(-args.footprint_mb * 2**20 // weight_bytes))
    calls = max(copies, args.min_calls)
    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    weights = [(torch.randn(n, k, device=DEVICE, generator=gen) / k**0.5).to(dtype) for _ in range(copies)]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device=DEVICE, dtype=dtype)

        def timed(fn) -> float:
            return graph_time_us(lambda i: fn(i % copies), calls, replays=args.replays, repeats=args.repeats)

        cublas_us = timed(lambda i: torch.nn.functional.linear(x, weights[i]))
        floor_us = (weight_bytes + (m * k + m * n) * element) / (copy_gbps * 1e3)
        row = dict(n=n, k=k, m=m, cublas_us=cublas_us, floor_us=floor_us)
        if m == 1:  # the batch-1 decode chain's GEMV (decode_linear), with and without PDL between calls
            row["chain_us"] = timed(lambda i: plain_linear(x, weights[i]))
            with dependent_launch.plain_launches():
                row["chain_no_pdl_us"] = timed(lambda i: plain_linear(x, weights[i]))
        rows.append(row)
        print_row(model, linear, row)
    weights.clear()  # free the copies before the next shape
    torch.cuda.empty_cache()
    return rows


HEADER = f"{'model':<13} {'linear':<8} {'N x K':>14} {'M':>3} {'cuBLAS us':>10} {'floor us':>9} {'cuBLAS/floor':>13}"


def print_row(model: str, linear: str, row: dict) -> None:
    f = row["floor_us"]
    print(
        f"{model:<13} {linear:<8} {row['n']:>6} x {row['k']:<5} {row['m']:>3} {row['cublas_us']:10.2f} "
        f"{f:9.2f} {row['cublas_us'] / f:13.2f}",
        flush=True,
    )
    if "chain_us" in row:
        print(
            f"{'':>40} decode chain GEMV {row['chain_us']:7.2f} us = {row['chain_us'] / f:4.2f}x floor "
            f"(without PDL {row['chain_no_pdl_us']:7.2f} us = {row['chain_no_pdl_us'] / f:4.2f}x)",
            flush=True,
        )


def print_totals(results: dict, models: list[str], ms: list[int]) -> None:
    """Per model and M: layers x (qkv + o_proj + gate_up + down) + lm_head, cuBLAS and floor."""
    print("\nper-model linear time per decode step (layers x (qkv + o_proj + gate_up + down) + lm_head):")
    print(f"  {'model':<14} {'M':>3} {'cuBLAS us':>10} {'floor us':>10} {'cuBLAS/floor':>13}")
    for key in models:
        model = MODELS[key]
        for m in ms:
            rows = [results.get((key, linear, m)) for linear in LINEARS]
            if any(row is None for row in rows):
                continue  # not every linear of the model was timed (--linears)
            total = {
                field: sum(
                    row[field] * (1 if linear == "lm_head" else model.layers) for linear, row in zip(LINEARS, rows)
                )
                for field in ("cublas_us", "floor_us")
            }
            print(
                f"  {model.name:<14} {m:>3} {total['cublas_us']:10.1f} {total['floor_us']:10.1f} "
                f"{total['cublas_us'] / total['floor_us']:13.2f}"
            )
            if all("chain_us" in row for row in rows):
                for field, label in (("chain_us", "decode chain GEMV"), ("chain_no_pdl_us", "  without PDL")):
                    t = sum(
                        row[field] * (1 if linear == "lm_head" else model.layers) for linear, row in zip(LINEARS, rows)
                    )
                    print(f"  {'':<14} {'':>3} {label}: {t:.1f} us = {t / total['floor_us']:.2f}x floor")


def parse_list(text: str, allowed=None, kind=str) -> list:
    values = [kind(v) for v in text.split(",") if v]
    if allowed is not None:
        unknown = [v for v in values if v not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {sorted(allowed)}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models",
        type=lambda s: parse_list(s, MODELS),
        default=list(MODELS),
        help="comma-separated models whose linear shapes to time: 1b (Llama-3.2-1B, 16 layers), "
        "8b (Llama-3.1-8B, 32 layers), smol (SmolLM2-135M, 30 layers); default all",
    )
    p.add_argument(
        "--linears",
        type=lambda s: parse_list(s, LINEARS),
        default=list(LINEARS),
        help=f"comma-separated subset of {','.join(LINEARS)} (per-model totals need all five)",
    )
    p.add_argument(
        "--m",
        type=lambda s: parse_list(s, range(1, 17), int),
        default=[1, 2, 4, 8, 16],
        help="comma-separated rows of x (decode batch sizes, 1..16); default 1,2,4,8,16",
    )
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16", help="weight and activation dtype")
    p.add_argument(
        "--footprint-mb",
        type=int,
        default=512,
        help="weight copies per shape add up to at least this many MB, to stream W from HBM "
        "rather than L2 (50 MB on an H100/H200); default 512",
    )
    p.add_argument(
        "--min-calls",
        type=int,
        default=16,
        help="calls per captured graph at least (a big weight has one copy, called repeatedly)",
    )
    p.add_argument("--replays", type=int, default=20, help="graph replays between the two timing events")
    p.add_argument("--repeats", type=int, default=5, help="timed batches of replays; the median is reported")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_linear: no CUDA device here, nothing to time (needs an NVIDIA GPU); skipped.")
        return 0

    from strata.bench.bench_attention import copy_bandwidth_gbps

    dtype = DTYPES[args.dtype]
    props = torch.cuda.get_device_properties(0)
    print(
        f"device: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
        f"triton {triton.__version__}, {args.dtype}"
    )
    copy_gbps = copy_bandwidth_gbps()
    print(f"device copy bandwidth (torch copy of 2 GiB, read+write): {copy_gbps:.0f} GB/s")
    print("times per call, CUDA-graph replays; x/floor = time over the floor\n")
    print(HEADER)
    results = {}
    for key in args.models:
        model = MODELS[key]
        for linear in args.linears:
            n, k = model.shapes[linear]
            for row in bench_shape(model.name, linear, n, k, args.m, dtype, args, copy_gbps):
                results[(key, linear, row["m"])] = row
    print_totals(results, args.models, args.m)
    return 0


if __name__ == "__main__":
    sys.exit(main())
