"""The fused-MoE layer (kernels/fused_moe.py) on one GPU against its floor and a naive torch path.

    python -m strata.bench.fused_moe                                  # both models, decode and prefill
    python -m strata.bench.fused_moe --models qwen3-30b-a3b --tokens 1,256
    python -m strata.bench.fused_moe --sweep                          # also time other tile configs

Shapes (bf16): Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts, top 8, moe_intermediate 768)
and Mixtral 8x7B's (hidden 4096, 8 experts, top 2, intermediate 14336), at decode token counts
(1, 16, 256) and prefill (2048, 8192).

Floor: the larger of
- memory: the bytes of the experts the step touches (distinct experts routed to, times their
  gate/up and down weight bytes, plus hidden states in and out) over the copy bandwidth measured
  in this run (a torch copy of 2 GiB, read + write; the H200's nominal 4.8 TB/s is shown beside);
- compute: 2 * T * k * 3 * H * I flops at --peak-tflops (790 on an H200, dense bf16).
Times are per call, from CUDA-graph replays timed with CUDA events: each graph calls the layer on
two copies of the weights in turn and on several routings, so every call's experts were evicted
from L2 by the calls between (as in a model, where 47 other layers run in between). "routed"
adds select_experts (routing from router logits) to the layer: the MoE part of a decode step.
The naive path is HF transformers' eager expert loop (kernels/reference.py: a gather, two
linears and an index_add per expert hit, with host synchronisation), timed eagerly.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass

import torch
import triton

from strata.bench.graph_timing import eager_time_us, graph_time_us
from strata.kernels.fused_moe import (
    GemmTile,
    MoELaunchConfig,
    choose_moe_config,
    fused_moe,
    fused_moe_reference,
    select_experts,
)

DEVICE = "cuda"
NOMINAL_GBPS = 4800.0  # H200 HBM3e
ROUTINGS = 4  # distinct routings the timed calls cycle through
COPIES = 2  # layer copies the timed calls alternate between


@dataclass(frozen=True)
class MoEShape:
    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    round_weights: bool  # Qwen3-MoE rounds its routing weights to the activation dtype

    def expert_bytes(self, element_size: int) -> int:
        return 3 * self.hidden * self.intermediate * element_size


SHAPES = {
    "qwen3-30b-a3b": MoEShape("qwen3-30b-a3b", 2048, 768, 128, 8, True),
    "mixtral": MoEShape("mixtral-8x7b", 4096, 14336, 8, 2, False),
}

# Alternative tiles for --sweep, by block_m (the table's own row is timed too).
SWEEP = {
    16: [
        MoELaunchConfig(16, GemmTile(64, 128, 4, 4), GemmTile(64, 128, 4, 4)),
        MoELaunchConfig(16, GemmTile(32, 256, 4, 3), GemmTile(32, 256, 4, 3)),
        MoELaunchConfig(16, GemmTile(16, 128, 4, 5), GemmTile(32, 128, 4, 5)),
        MoELaunchConfig(16, GemmTile(64, 64, 4, 5), GemmTile(128, 64, 4, 4)),
    ],
    32: [
        MoELaunchConfig(32, GemmTile(32, 128, 4, 4), GemmTile(64, 128, 4, 4)),
        MoELaunchConfig(32, GemmTile(128, 64, 4, 3), GemmTile(128, 64, 4, 3)),
    ],
    64: [
        MoELaunchConfig(64, GemmTile(128, 64, 8, 3, group_m=8), GemmTile(128, 64, 4, 4, group_m=8)),
        MoELaunchConfig(64, GemmTile(64, 128, 4, 3, group_m=8), GemmTile(64, 128, 4, 4, group_m=8)),
    ],
    128: [
        MoELaunchConfig(128, GemmTile(64, 64, 4, 4, group_m=8), GemmTile(128, 64, 8, 3, group_m=8)),
        MoELaunchConfig(128, GemmTile(128, 64, 8, 4, group_m=16), GemmTile(256, 64, 8, 3, group_m=8)),
        MoELaunchConfig(64, GemmTile(128, 64, 8, 3, group_m=8), GemmTile(128, 64, 4, 4, group_m=8)),
    ],
}


@dataclass
class Case:
    """One (shape, T): weight copies, hidden states, router logits and routings."""

    shape: MoEShape
    tokens: int
    w13: list[torch.Tensor]
    w2: list[torch.Tensor]
    hidden: list[torch.Tensor]
    logits: list[torch.Tensor]
    weights: list[torch.Tensor]
    ids: list[torch.Tensor]

    @property
    def weight_dtype(self):
        return self.hidden[0].dtype if self.shape.round_weights else None

    def distinct_experts(self) -> float:
        """Experts a call touches, averaged over the routings."""
        return statistics.mean(ids.unique().numel() for ids in self.ids)

    def floor_us(self, copy_gbps: float, peak_tflops: float) -> tuple[float, float]:
        """(memory floor, compute floor) in microseconds."""
        element = self.hidden[0].element_size()
        moved = self.distinct_experts() * self.shape.expert_bytes(element) + 2 * self.hidden[0].numel() * element
        flops = 2.0 * self.tokens * self.shape.top_k * 3 * self.shape.hidden * self.shape.intermediate
        return moved / (copy_gbps * 1e3), flops / (peak_tflops * 1e6)


def make_case(shape: MoEShape, tokens: int, dtype: torch.dtype, seed: int = 0) -> Case:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*size, scale):
        return (torch.randn(*size, device=DEVICE, generator=gen) * scale).to(dtype)

    w13 = [randn(shape.experts, 2 * shape.intermediate, shape.hidden, scale=shape.hidden**-0.5) for _ in range(COPIES)]
    w2 = [randn(shape.experts, shape.hidden, shape.intermediate, scale=shape.intermediate**-0.5) for _ in range(COPIES)]
    hidden = [randn(tokens, shape.hidden, scale=1.0) for _ in range(ROUTINGS)]
    logits = [randn(tokens, shape.experts, scale=1.0) for _ in range(ROUTINGS)]
    case = Case(shape, tokens, w13, w2, hidden, logits, [], [])
    for one in logits:
        weights, ids = select_experts(one, shape.top_k, True, weight_dtype=case.weight_dtype)
        case.weights.append(weights)
        case.ids.append(ids)
    return case


def layer_call(case: Case, config: MoELaunchConfig | None = None, routed: bool = False):
    """Call i: weight copy i % COPIES, routing i % ROUTINGS (select_experts included if routed)."""

    def call(i: int):
        r, c = i % ROUTINGS, i % COPIES
        if routed:
            weights, ids = select_experts(case.logits[r], case.shape.top_k, True, weight_dtype=case.weight_dtype)
        else:
            weights, ids = case.weights[r], case.ids[r]
        return fused_moe(case.hidden[r], case.w13[c], case.w2[c], weights, ids, config=config)

    return call


def naive_call(case: Case):
    def call(i: int):
        r, c = i % ROUTINGS, i % COPIES
        return fused_moe_reference(case.hidden[r], case.w13[c], case.w2[c], case.weights[r], case.ids[r])

    return call


def calls_per_graph(tokens: int) -> int:
    """Enough back-to-back calls that a decode call's launch gaps are counted as in a captured step,
    a multiple of COPIES * ROUTINGS so every pairing is timed equally."""
    return 2 * COPIES * ROUTINGS if tokens <= 256 else COPIES * ROUTINGS


def check_against_reference(case: Case) -> float:
    """Max abs difference of the kernel from the bf16 reference on routing 0 (a sanity check)."""
    got = layer_call(case)(0)
    want = naive_call(case)(0)
    return (got.float() - want.float()).abs().max().item()


HEADER = (
    f"{'model':<14} {'T':>5} {'BM':>3} {'experts':>7} {'floor us':>9} {'bound':>7} {'layer us':>9} "
    f"{'x floor':>7} {'routed us':>9} {'x floor':>7} {'naive us':>9} {'speedup':>7}"
)


def bench_case(case: Case, args, copy_gbps: float) -> dict:
    memory_us, compute_us = case.floor_us(copy_gbps, args.peak_tflops)
    floor = max(memory_us, compute_us)
    calls = calls_per_graph(case.tokens)
    timing = dict(replays=args.replays, repeats=args.repeats)
    layer_us = graph_time_us(layer_call(case), calls, **timing)
    routed_us = graph_time_us(layer_call(case, routed=True), calls, **timing)
    naive_us = eager_time_us(naive_call(case), COPIES * ROUTINGS, max(1, args.repeats // 2)) if args.naive else None
    config = choose_moe_config(case.tokens, case.shape.top_k, case.shape.experts)
    row = dict(
        model=case.shape.name,
        tokens=case.tokens,
        block_m=config.block_m,
        distinct_experts=case.distinct_experts(),
        memory_floor_us=memory_us,
        compute_floor_us=compute_us,
        nominal_memory_floor_us=memory_us * copy_gbps / NOMINAL_GBPS,
        layer_us=layer_us,
        routed_us=routed_us,
        naive_us=naive_us,
    )
    naive = f"{naive_us:9.1f} {naive_us / layer_us:6.1f}x" if naive_us else f"{'-':>9} {'-':>7}"
    print(
        f"{case.shape.name:<14} {case.tokens:>5} {config.block_m:>3} {row['distinct_experts']:>7.1f} {floor:9.1f} "
        f"{'memory' if memory_us >= compute_us else 'compute':>7} {layer_us:9.1f} {layer_us / floor:7.2f} "
        f"{routed_us:9.1f} {routed_us / floor:7.2f} {naive}",
        flush=True,
    )
    if args.sweep:
        row["sweep"] = sweep(case, config, calls, timing, floor)
    return row


def sweep(case: Case, chosen: MoELaunchConfig, calls: int, timing: dict, floor: float) -> list[dict]:
    """The table's config and the alternatives for its block_m (and the neighbouring block_m's)."""
    results = []
    block_ms = sorted(SWEEP)
    index = block_ms.index(chosen.block_m)
    candidates = [chosen]
    for block_m in block_ms[max(0, index - 1) : index + 2]:
        candidates += [config for config in SWEEP[block_m] if config != chosen]
    for config in candidates:
        try:
            us = graph_time_us(layer_call(case, config), calls, **timing)
        except Exception as error:  # a config that does not fit (shared memory) on this device
            print(f"{'':>20} sweep {describe(config)}: failed ({type(error).__name__}: {str(error)[:80]})")
            continue
        mark = "  <- table" if config == chosen else ""
        print(f"{'':>20} sweep {describe(config)}: {us:9.1f} us = {us / floor:5.2f}x floor{mark}", flush=True)
        results.append(dict(config=describe(config), us=us))
    return results


def describe(config: MoELaunchConfig) -> str:
    def tile(t: GemmTile) -> str:
        return f"N{t.block_n} K{t.block_k} w{t.num_warps} s{t.num_stages} g{t.group_m}"

    return f"BM{config.block_m} gate_up({tile(config.gate_up)}) down({tile(config.down)})"


def parse_list(text: str, kind=str, allowed=None) -> list:
    values = [kind(v) for v in text.split(",") if v]
    unknown = [v for v in values if allowed is not None and v not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {sorted(allowed)}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models",
        type=lambda s: parse_list(s, str, SHAPES),
        default=list(SHAPES),
        help=f"comma-separated, from {','.join(SHAPES)}; default both",
    )
    p.add_argument(
        "--tokens",
        type=lambda s: parse_list(s, int),
        default=[1, 16, 256, 2048, 8192],
        help="comma-separated token counts T; default 1,16,256 (decode),2048,8192 (prefill)",
    )
    p.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak for the compute floor")
    p.add_argument("--sweep", action="store_true", help="also time alternative tile configs per case")
    p.add_argument("--no-naive", dest="naive", action="store_false", help="skip the naive torch loop")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the check against the reference")
    p.add_argument("--output", help="write the rows as JSON here")
    p.add_argument("--replays", type=int, default=10, help="graph replays between the two timing events")
    p.add_argument("--repeats", type=int, default=5, help="timed batches of replays; the median is reported")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench fused_moe: no CUDA device here, nothing to time (needs an NVIDIA GPU); skipped.")
        return 0

    from strata.bench.bench_attention import copy_bandwidth_gbps

    props = torch.cuda.get_device_properties(0)
    print(
        f"device: {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
        f"triton {triton.__version__}, bf16"
    )
    copy_gbps = copy_bandwidth_gbps()
    print(
        f"device copy bandwidth (torch copy of 2 GiB, read+write): {copy_gbps:.0f} GB/s "
        f"(memory floors use it; at the nominal {NOMINAL_GBPS:.0f} GB/s they are {copy_gbps / NOMINAL_GBPS:.2f}x as long)"
    )
    print(
        f"compute floor at {args.peak_tflops:.0f} TFLOP/s; times per call from CUDA-graph replays; "
        "layer = fused_moe, routed = select_experts + fused_moe, naive = HF's eager expert loop\n"
    )
    print(HEADER)
    rows = []
    for key in args.models:
        shape = SHAPES[key]
        for tokens in args.tokens:
            case = make_case(shape, tokens, torch.bfloat16, seed=tokens)
            if args.check:
                error = check_against_reference(case)
                assert error < 0.1, f"{shape.name} T={tokens}: kernel differs from the reference by {error}"
            rows.append(bench_case(case, args, copy_gbps))
            del case
            torch.cuda.empty_cache()
    if args.output:
        with open(args.output, "w") as handle:
            json.dump(dict(device=props.name, copy_gbps=copy_gbps, rows=rows), handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
