"""The sampler's Gumbel-max draw (kernels/gumbel_sampling.py) on one GPU, against its bytes floor.

    python -m strata.bench.bench_sampling                        # batch 1, 16, 64, 256; vocab 128256
    python -m strata.bench.bench_sampling --batches 256 --sweep  # also a grid of launch shapes

A decode step samples every row of [batch, vocab] bf16 logits. The draw reads them once, so its
floor is their bytes over the copy bandwidth measured in the same run; with temperature > 0
each vocabulary entry also costs two 32-bit hash rounds and two logarithms, which is where the
time over that floor goes. Times are CUDA-graph replays over enough copies of the logits that
they overflow L2 (graph_timing.graph_time_us). --sweep checks that every launch shape draws the
same tokens as the default one before timing it.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from strata.bench.bench_attention import copy_bandwidth_gbps
from strata.bench.bench_linear import parse_list
from strata.bench.graph_timing import graph_time_us
from strata.kernels.gumbel_sampling import gumbel_argmax

DEVICE = "cuda"


def sweep_shapes() -> list[tuple[int, int, int, bool]]:
    """(chunk, block, num_warps, prefetch) alternatives to the default launch."""
    grid = itertools.product((4096, 8192, 16384, 32768), (1024, 2048), (4, 8), (False, True))
    return [(c, b, w, p) for c, b, w, p in grid if b <= c]


def time_draw(logits: list[torch.Tensor], greedy: bool, launch) -> tuple[float, torch.Tensor]:
    rows = logits[0].shape[0]
    seeds = torch.arange(rows, device=DEVICE, dtype=torch.int64) * 7919 + 1
    positions = torch.full((rows,), 576, device=DEVICE, dtype=torch.int64)
    inv_t = torch.ones(rows, device=DEVICE, dtype=torch.float32)
    flags = torch.full((rows,), greedy, device=DEVICE, dtype=torch.bool)

    def draw(i: int) -> torch.Tensor:
        return gumbel_argmax(logits[i], seeds, positions, inv_t, flags, None, False, launch=launch)[0]

    tokens = draw(0)
    us = graph_time_us(lambda i: draw(i % len(logits)), max(len(logits), 8), replays=10, repeats=5)
    return us, tokens


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--batches",
        type=lambda s: parse_list(s, kind=int),
        default=[1, 16, 64, 256],
        help="comma-separated rows of logits",
    )
    p.add_argument("--vocab", type=int, default=128256, help="vocabulary size (Llama 3: 128256)")
    p.add_argument("--sweep", action="store_true", help="also time a grid of launch shapes (temperature 1 only)")
    args = p.parse_args(argv)
    gbps = copy_bandwidth_gbps()
    print(f"device: {torch.cuda.get_device_name()}; copy bandwidth {gbps:.0f} GB/s; vocab {args.vocab}")
    print(f"{'batch':>5} {'mode':<11} {'floor us':>9} {'us':>9} {'x floor':>8}  launch")
    for batch in args.batches:
        nbytes = batch * args.vocab * 2
        copies = max(2, (150 << 20) // nbytes + 1)
        logits = [torch.randn(batch, args.vocab, device=DEVICE, dtype=torch.bfloat16) * 3 for _ in range(copies)]
        floor_us = nbytes / (gbps * 1e3)
        shapes = [None] + (sweep_shapes() if args.sweep else [])
        for greedy in (False, True):
            mode = "greedy" if greedy else "temperature"
            baseline = None
            results = []
            for launch in shapes if not greedy else [None]:
                us, tokens = time_draw(logits, greedy, launch)
                if baseline is None:
                    baseline = tokens
                elif not torch.equal(tokens, baseline):
                    print(f"      {launch}: draws differ from the default launch")
                    continue
                results.append((us, launch))
            default_us = results[0][0]
            for us, launch in sorted(results, key=lambda r: r[0])[: 6 if args.sweep else 1]:
                label = "default" if launch is None else f"{launch} ({us / default_us:.2f}x default)"
                print(f"{batch:>5} {mode:<11} {floor_us:9.1f} {us:9.1f} {us / floor_us:8.2f}  {label}")
        del logits


if __name__ == "__main__":
    main()
