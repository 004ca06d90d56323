"""Would kernels/skinny_linear.py beat cuBLAS on a decode batch's linears? Per shape and config,
then a layer stack of each (qkv, o_proj, gate_up, SiLU, down x 32 layers, one CUDA graph).

    python -m strata.bench.skinny_linear                       # 8B: one GPU's shapes and a TP2 rank's, 16 rows
    python -m strata.bench.skinny_linear --rows 8 --shapes rank

Each shape is timed over 32 weight copies (past L2), as bench_linear does; down_proj's row is
cuBLAS after the SiLU-and-mul launch against the skinny kernel's fused prologue.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from strata.bench.graph_timing import graph_time_us
from strata.kernels.activation import silu_and_mul
from strata.kernels.skinny_linear import SkinnyConfig, skinny_linear

HIDDEN, INTERMEDIATE, Q, KV = 4096, 14336, 4096, 1024  # Llama-3-8B
LAYERS = 32


def shapes(ranks: int) -> dict[str, tuple[int, int, bool]]:
    """name -> (N, K, silu_mul) of one layer at `ranks` ranks."""
    return {
        "qkv": ((Q + 2 * KV) // ranks, HIDDEN, False),
        "o_proj": (HIDDEN, Q // ranks, False),
        "gate_up": (2 * INTERMEDIATE // ranks, HIDDEN, False),
        "down": (HIDDEN, INTERMEDIATE // ranks, True),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--shapes", default="one,rank", help="one (one GPU's 8B), rank (a TP2 rank's)")
    p.add_argument("--block-n", default="16,32,64")
    p.add_argument("--block-k", default="128,256")
    p.add_argument("--stages", default="3,5")
    p.add_argument("--warps", default="4")
    a = p.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    configs = [
        SkinnyConfig(n, k, s, w)
        for n, k, s, w in itertools.product(ints(a.block_n), ints(a.block_k), ints(a.stages), ints(a.warps))
    ]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    stack = {}
    for which in a.shapes.split(","):
        ranks = 1 if which == "one" else 2
        best_of = {}
        for name, (n, k, silu) in shapes(ranks).items():
            ws = [torch.randn(n, k, device=dev, dtype=dtype) * k**-0.5 for _ in range(LAYERS)]
            x = torch.randn(a.rows, 2 * k if silu else k, device=dev, dtype=dtype)
            want = F.linear(silu_and_mul(x) if silu else x, ws[0])

            def cublas(i, ws=ws, x=x, silu=silu):
                return F.linear(silu_and_mul(x) if silu else x, ws[i])

            base = graph_time_us(cublas, LAYERS, replays=20, repeats=3)
            mb = n * k * 2 / 1e6
            print(f"{which:>4} {name:<8} N={n:<6} K={k:<6} {mb:6.1f} MB  cuBLAS {base:6.2f} us ({mb / base:4.2f} TB/s)")
            rows = []
            for c in configs:
                if k % c.block_k:
                    continue
                got = skinny_linear(x, ws[0], silu_mul=silu, config=c)
                err = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
                t = graph_time_us(
                    lambda i, ws=ws, x=x, silu=silu, c=c: skinny_linear(x, ws[i], silu_mul=silu, config=c),
                    LAYERS,
                    replays=20,
                    repeats=3,
                )
                rows.append((t, c, err))
            rows.sort(key=lambda r: r[0])
            for t, c, err in rows[:4]:
                print(f"        {t:6.2f} us ({mb / t:4.2f} TB/s, {base / t:4.2f}x cuBLAS) {c} rel.err {err:.1e}")
            best_of[name] = rows[0][1]
            stack[(which, name)] = (ws, x, silu)
        # The layer stack: every shape after the other, 32 layers, one graph.
        names = list(shapes(ranks))

        def layer(i, skinny, which=which, best_of=best_of, names=names):
            for name in names:
                ws, x, silu = stack[(which, name)]
                if skinny:
                    skinny_linear(x, ws[i], silu_mul=silu, config=best_of[name])
                else:
                    F.linear(silu_and_mul(x) if silu else x, ws[i])

        t_cublas = graph_time_us(lambda i: layer(i, False), LAYERS, replays=10, repeats=3) * LAYERS
        t_skinny = graph_time_us(lambda i: layer(i, True), LAYERS, replays=10, repeats=3) * LAYERS
        print(
            f"{which}: 32 layers' linears, {a.rows} rows: cuBLAS {t_cublas:7.1f} us, skinny {t_skinny:7.1f} us "
            f"({t_cublas / t_skinny:.2f}x)",
            flush=True,
        )
        for key in [k for k in stack if k[0] == which]:
            del stack[key]
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
