"""Batch-1 decode steps with and without the decode chain and programmatic dependent launch,
each against its floor, in one process on the worker's own ModelRunner (as `strata bench roofline`).

    python -m strata.bench.decode_chain                                   # 1B and 8B shapes, batch 1
    python -m strata.bench.decode_chain --models dummy:llama-3.2-1b --batches 1,4 --tile-kb 16,64 --json out.json
    python -m strata.bench.decode_chain --models dummy:llama-3-8b --ways "chain + PDL" --tensor-parallel-rank-of 2 \
        --wide-max-pairs 0,8        # a TP2 rank's step, its attention at 4 warps against 8

Five ways per model and batch, the CUDA graphs recaptured for each:
- chain + PDL: the default (services/worker/model/decode_chain.py, kernels/dependent_launch.py), with
  rotary, KV write, attention and merge in one launch (kernels/decode_attention.py);
- chain + PDL (3-kernel attention): those as three kernels (Attention.one_launch_decode off);
- chain: the fused GEMVs and attention, launched plainly (dependent_launch.plain_launches);
- unfused + PDL: cuBLAS and the separate norm / SiLU kernels (rotary and attention still PDL);
- unfused: neither, the engine as it was before the chain.
The step is the worker's back-to-back period (host work, graph replay, sampling and the copy back
included); GPU ms from CUDA events; floor = (weight bytes + KV bytes) / the copy bandwidth
measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json

from strata.bench import common
from strata.bench.cluster_flags import bench_settings
from strata.bench.roofline import decode_bytes, load_runner, measure_copy_bandwidth, time_decode_step
from strata.bench.tensor_parallel_rank import rank_flags
from strata.flags import DEFAULTS
from strata.kernels import attention_launch, decode_linear, dependent_launch

# (decode chain, PDL, one-launch decode attention)
WAYS = {
    "chain + PDL": (True, True, True),
    "chain + PDL (3-kernel attention)": (True, True, False),
    "chain": (True, False, True),
    "unfused + PDL": (False, True, False),
    "unfused": (False, False, False),
}


def roofline_args(model: str, max_batch: int):
    budget = max(DEFAULTS["max_num_batched_tokens"], max_batch)
    return bench_settings(model=model, device="cuda", max_num_batched_tokens=budget)


def set_way(runner, num_blocks: int, chain: bool, fused_attention: bool) -> None:
    """The way's kernels (PDL is the caller's plain_launches block): both are read at every
    launch, so the recapture below takes them."""
    for layer in runner.shard.layers:
        layer.self_attn.one_launch_decode = fused_attention
    runner.shard.decode_chain = chain
    runner.init_cache(num_blocks)  # new cache, graphs recaptured the new way


def time_way(runner, model: str, way: str, batches: list[int], a, bandwidth: float, itemsize: int) -> list[dict]:
    """Each batch's decode step the way the runner is set, against its floor."""
    rows = []
    for batch in batches:
        t = time_decode_step(runner, batch, a.context_len, a.steps, warmup=5, temperature=0.0)
        floor_s = decode_bytes(runner.config, itemsize, batch, a.context_len)["total_bytes"] / bandwidth
        r = {
            "model": model,
            "way": way,
            "batch": batch,
            "step_ms": t["median_s"] * 1e3,
            "gpu_ms": t["gpu_s"] * 1e3,
            "floor_ms": floor_s * 1e3,
            "step_over_floor": t["median_s"] / floor_s,
            "gpu_over_floor": t["gpu_s"] / floor_s,
        }
        rows.append(r)
        print(
            f"{model:<22} {way:<14} batch {batch:>3}: step {r['step_ms']:7.3f} ms  GPU {r['gpu_ms']:7.3f} ms"
            f"  floor {r['floor_ms']:6.3f} ms  step/floor {r['step_over_floor']:.2f}x",
            flush=True,
        )
    return rows


def _set_knobs(knobs: tuple[int, int, int]) -> None:
    """The chain's tile bytes, and decode attention's wide-program and split knobs."""
    decode_linear.TILE_BYTES, wide, per_sm = knobs
    attention_launch.WIDE_PROGRAMS_MAX_PAIRS, attention_launch.KV_SPLIT_PROGRAMS_PER_SM = wide, per_sm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="dummy:llama-3.2-1b,dummy:llama-3-8b", help="comma-separated --model values")
    p.add_argument("--batches", default="1", help="comma-separated decode batch sizes (1 takes the chain)")
    p.add_argument("--context-len", type=int, default=576, help="cached tokens per sequence (roofline's 512 + 64)")
    p.add_argument("--steps", type=int, default=50, help="timed steps per way and batch")
    p.add_argument("--ways", default=",".join(WAYS), help="comma-separated subset of: " + ", ".join(WAYS))
    p.add_argument("--tile-kb", default="", help="also time the chain with these TILE_BYTES (comma-separated KB)")
    p.add_argument(
        "--wide-max-pairs",
        default="",
        help="also time the chain with decode attention at 8 warps up to these many (sequence, KV head) pairs "
        f"and 4 beyond (comma-separated; the default is {attention_launch.WIDE_PROGRAMS_MAX_PAIRS})",
    )
    p.add_argument(
        "--split-programs-per-sm",
        default="",
        help="also time the chain with decode attention's KV splits aiming at these many programs per SM "
        f"(comma-separated; the default is {attention_launch.KV_SPLIT_PROGRAMS_PER_SM})",
    )
    p.add_argument(
        "--tensor-parallel-rank-of",
        type=int,
        default=1,
        help="T > 1: time rank 0 of a T-way stage alone, its collectives skipped (its heads, its share of each "
        "GEMV, its vocabulary slice: what a rank computes, as python -m strata.bench.tensor_parallel_rank)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="the worker's --max-model-len (0: just past the context, as the roofline sets it); under "
        "CUDA graphs the batch-1 attention's split count follows it",
    )
    p.add_argument("--json", default=None, help="write every number here")
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    ways = [w.strip() for w in a.ways.split(",")]
    defaults = (
        decode_linear.TILE_BYTES,
        attention_launch.WIDE_PROGRAMS_MAX_PAIRS,
        attention_launch.KV_SPLIT_PROGRAMS_PER_SM,
    )
    tile, wide, per_sm = defaults
    # (way, (TILE_BYTES, WIDE_PROGRAMS_MAX_PAIRS, KV_SPLIT_PROGRAMS_PER_SM)): the ways asked, then the chain's variants
    variants = [(w, defaults) for w in ways]
    variants += [(f"chain + PDL, {int(kb)} KB", (int(kb) * 1024, wide, per_sm)) for kb in a.tile_kb.split(",") if kb]
    variants += [
        (f"chain + PDL, 8 warps to {int(n)} pairs", (tile, int(n), per_sm)) for n in a.wide_max_pairs.split(",") if n
    ]
    variants += [
        (f"chain + PDL, splits for {int(n)} programs an SM", (tile, wide, int(n)))
        for n in a.split_programs_per_sm.split(",")
        if n
    ]
    bandwidth = measure_copy_bandwidth("cuda")
    print(
        f"copy bandwidth {bandwidth / 1e9:,.0f} GB/s; commit {common.environment_info(roofline_args('dummy:llama-3.2-1b', 1))['commit']}"
    )
    rows = []
    for model in a.models.split(","):
        args = roofline_args(model, max(batches))
        flags = ["--max-model-len", str(a.max_model_len)] if a.max_model_len else []
        runner = load_runner(args, max(batches), a.context_len, flags + rank_flags(a.tensor_parallel_rank_of))
        num_blocks = runner.kv_caches[0].shape[1]
        itemsize = runner.kv_caches[0].element_size()
        try:
            for way, knobs in variants:
                _set_knobs(knobs)
                chain, pdl, fused_attention = WAYS.get(way, WAYS["chain + PDL"])  # sweeps: the default way
                launches = contextlib.nullcontext() if pdl else dependent_launch.plain_launches()
                with launches:
                    set_way(runner, num_blocks, chain, fused_attention)
                    rows += time_way(runner, model, way, batches, a, bandwidth, itemsize)
        finally:
            _set_knobs(defaults)
            del runner
            common.free_accelerator_memory()
    ways = [way for way, _ in variants]
    print("\n| model | batch | " + " | ".join(f"{w} ms (x floor)" for w in ways) + " | floor ms |")
    print("| --- | --- | " + " | ".join("---" for _ in ways) + " | --- |")
    for model in a.models.split(","):
        for batch in batches:
            cells = {r["way"]: r for r in rows if r["model"] == model and r["batch"] == batch}
            print(
                f"| {model} | {batch} | "
                + " | ".join(
                    f"{cells[w]['step_ms']:.3f} ({cells[w]['step_over_floor']:.2f}x)" for w in ways if w in cells
                )
                + f" | {next(iter(cells.values()))['floor_ms']:.3f} |"
            )
    if a.json:
        with open(a.json, "w") as handle:
            json.dump({"copy_bandwidth_Bps": bandwidth, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
