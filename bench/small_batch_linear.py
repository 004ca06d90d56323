"""kernels/small_batch_linear.py against cuBLAS at a decode batch of 16 rows: per shape and config,
then a layer stack (norm, qkv, o_proj, norm, gate_up + SiLU, down; 32 layers, one CUDA graph).

    python -m strata.bench.small_batch_linear                  # 8B: one GPU's shapes and a TP2 rank's
    python -m strata.bench.small_batch_linear --models llama-3.2-1b,qwen3-8b --ranks 1,2,4 --jobs 8

Each shape is timed over 32 weight copies (past L2), as bench_linear does. gate_up's cuBLAS row is
F.linear then the SiLU-and-mul launch, against the kernel's fused epilogue. The configs compile in
--jobs processes first (they fill Triton's cache), then one process times them.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing

import torch
import torch.nn.functional as F

LAYERS, ROWS = 32, 16


def shapes(model: str, ranks: int) -> dict[str, tuple[int, int, bool]]:
    """name -> (W rows, K, silu_mul) of one layer of the dummy preset `model` (strata serve --model
    dummy:NAME) at `ranks` ranks: qkv and gate_up split by columns, o_proj and down by rows."""
    from strata.services.worker.model.weights import dummy_config

    c = dummy_config(model)
    hidden, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {
        "qkv": ((q + 2 * kv) // ranks, hidden, False),
        "o_proj": (hidden, q // ranks, False),
        "gate_up": (2 * c.intermediate_size // ranks, hidden, True),
        "down": (hidden, c.intermediate_size // ranks, False),
    }


def configs(rows: int, k: int, silu: bool, stages: list[int]):
    from strata.kernels.small_batch_linear import SmallBatchConfig

    n = rows // 2 if silu else rows
    out = []
    for bn, bk, s in itertools.product((32, 64, 128), (128, 256), stages):
        steps = k // bk
        for split in [d for d in range(1, steps + 1) if steps % d == 0 and steps // d >= 2]:
            programs = -(-n // bn) * split
            if 100 <= programs <= 800 and (bn * (2 if silu else 1) + ROWS) * bk * 2 * s <= 200 * 1024:
                out.append(SmallBatchConfig(bn, bk, split, s, 8 if bn * (2 if silu else 1) >= 256 else 4))
    return out


def neighbours(rows: int, k: int, silu: bool):
    """The tuned config of the shape and those one step from it in each field (and in block_n and
    split_k together, at the same program count): a local search around the table."""
    from dataclasses import replace

    from strata.kernels.small_batch_linear import choose_config

    c = choose_config(rows=rows, k=k, silu_mul=silu)
    if c is None:
        return []
    out = [c]
    out += [replace(c, block_n=b) for b in (c.block_n // 2, c.block_n * 2)]
    out += [replace(c, block_k=b) for b in (c.block_k // 2, c.block_k * 2)]
    out += [replace(c, split_k=s) for s in (c.split_k // 2, c.split_k * 2)]
    out += [replace(c, num_stages=s) for s in (c.num_stages - 1, c.num_stages + 1, c.num_stages + 2)]
    out += [replace(c, num_warps=w) for w in (2, 8) if w != c.num_warps]
    out += [
        replace(c, block_n=c.block_n * 2, split_k=c.split_k * 2),
        replace(c, block_n=c.block_n // 2, split_k=c.split_k // 2),
    ]
    out += [
        replace(c, block_k=c.block_k * 2, num_stages=c.num_stages - 1),
        replace(c, block_k=c.block_k // 2, num_stages=c.num_stages + 2),
    ]
    width = 2 if silu else 1
    return [
        o
        for o in dict.fromkeys(out)
        if o.block_n >= 16
        and o.block_k >= 64
        and o.split_k >= 1
        and 2 <= o.num_stages <= 6
        and k % (o.split_k * o.block_k) == 0
        and (o.block_n * width + ROWS) * o.block_k * 2 * o.num_stages <= 220 * 1024
    ]


def sweep_plan(ways, linears: list[str], around_tuned: bool, stages: list[int]) -> dict:
    """(model, ranks) -> [(linear, W rows, K, silu_mul, its configs)] of the linears swept."""
    plan = {}
    for model, ranks in ways:
        plan[(model, ranks)] = [
            (name, rows, k, silu, neighbours(rows, k, silu) if around_tuned else configs(rows, k, silu, stages))
            for name, (rows, k, silu) in shapes(model, ranks).items()
            if name in linears
        ]
    return plan


def _compile(job):
    """Run each config once on the shape (fills Triton's on-disk cache for the timing process)."""
    from strata.kernels.small_batch_linear import small_batch_linear

    rows, k, silu, cfgs = job
    w = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
    bad = []
    for c in cfgs:
        try:
            small_batch_linear(x, w, silu_mul=silu, config=c)
        except Exception as e:  # out of shared memory and such: dropped from the timing
            bad.append((c, type(e).__name__))
    torch.cuda.synchronize()
    return bad


def time_layer_stack(weights: dict, best: dict, hidden: int, q: int) -> tuple[float, float]:
    """A decode layer's norms and linears (attention left out: o_proj reads qkv's first q
    columns), 32 layers in one graph, through cuBLAS and through the small-batch GEMM at each
    linear's best config: us a stack each."""
    from strata.bench.graph_timing import graph_time_us
    from strata.kernels.activation import silu_and_mul
    from strata.kernels.rmsnorm import fused_add_rms_norm
    from strata.kernels.small_batch_linear import small_batch_linear

    h = torch.randn(ROWS, hidden, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)

    def linear(x, name, i, small, silu=False):
        if small:
            return small_batch_linear(x, weights[name][i], silu_mul=silu, config=best[name])
        y = F.linear(x, weights[name][i])
        return silu_and_mul(y) if silu else y

    def layer(i, small: bool):
        x, res = fused_add_rms_norm(h, h.clone(), norm_w, 1e-5)
        o = linear(linear(x, "qkv", i, small)[:, :q].contiguous(), "o_proj", i, small)
        x, res = fused_add_rms_norm(o, res, norm_w, 1e-5)
        return linear(linear(x, "gate_up", i, small, silu=True), "down", i, small)

    return tuple(
        graph_time_us(lambda i, s=s: layer(i, s), LAYERS, replays=10, repeats=3) * LAYERS for s in (False, True)
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models", default="llama-3-8b", help="comma-separated dummy presets (llama-3-8b, llama-3.2-1b, qwen3-8b, ...)"
    )
    p.add_argument("--ranks", default="1,2", help="comma-separated tensor-parallel widths (a rank's shapes)")
    p.add_argument(
        "--linears",
        default="qkv,o_proj,gate_up,down",
        help="comma-separated, the linears swept (the layer stack needs all four)",
    )
    p.add_argument("--stages", default="3,4")
    p.add_argument("--jobs", type=int, default=8, help="processes compiling the configs")
    p.add_argument("--top", type=int, default=3, help="configs printed per shape")
    p.add_argument(
        "--around-tuned",
        action="store_true",
        help="time only the tuned config of each shape and its neighbours (a local search), not the grid",
    )
    a = p.parse_args()
    stages = [int(s) for s in a.stages.split(",")]
    linears = a.linears.split(",")
    ways = [(m, int(r)) for m in a.models.split(",") for r in a.ranks.split(",")]
    plan = sweep_plan(ways, linears, a.around_tuned, stages)
    todo = [
        (rows, k, silu, cs[i :: a.jobs])
        for swept in plan.values()
        for _, rows, k, silu, cs in swept
        for i in range(a.jobs)
        if cs[i :: a.jobs]
    ]
    with multiprocessing.get_context("spawn").Pool(a.jobs) as pool:
        dropped = {c for bad in pool.map(_compile, todo) for c, _ in bad}
    print(f"compiled; {len(dropped)} configs dropped", flush=True)

    from strata.bench.graph_timing import graph_time_us
    from strata.kernels import dependent_launch
    from strata.kernels.activation import silu_and_mul
    from strata.kernels.small_batch_linear import choose_config, small_batch_linear

    dev, dtype = torch.device("cuda"), torch.bfloat16
    tuned = {}
    for model, ranks in ways:
        which = f"{model}/{ranks}"
        hidden, q, _ = shapes(model, 1)["o_proj"]  # (W rows, K) of o_proj at one rank
        best, weights = {}, {}
        for name, rows, k, silu, candidates in plan[(model, ranks)]:
            ws = [torch.randn(rows, k, device=dev, dtype=dtype) * k**-0.5 for _ in range(LAYERS)]
            x = torch.randn(ROWS, k, device=dev, dtype=dtype)
            want = F.linear(x, ws[0])
            want = silu_and_mul(want) if silu else want

            def cublas(i, ws=ws, x=x, silu=silu):
                y = F.linear(x, ws[i])
                return silu_and_mul(y) if silu else y

            base = graph_time_us(cublas, LAYERS, replays=20, repeats=3)
            mb = rows * k * 2 / 1e6
            print(
                f"{which:>4} {name:<8} N={rows:<6} K={k:<6} {mb:6.1f} MB  cuBLAS {base:6.2f} us ({mb / base:4.2f} TB/s)"
            )
            timed = []
            for c in [c for c in candidates if c not in dropped]:
                got = small_batch_linear(x, ws[0], silu_mul=silu, config=c)
                err = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()

                def call(i, ws=ws, x=x, silu=silu, c=c):
                    return small_batch_linear(x, ws[i], silu_mul=silu, config=c)

                timed.append((graph_time_us(call, LAYERS, replays=20, repeats=3), c, err))
            timed.sort(key=lambda r: r[0])
            for t, c, err in timed[: a.top]:
                print(f"        {t:6.2f} us ({mb / t:4.2f} TB/s, {base / t:4.2f}x cuBLAS) {c} rel.err {err:.1e}")
            c0 = choose_config(rows=rows, k=k, silu_mul=silu)
            t0 = [t for t, c, _ in timed if c == c0]
            print(f"        tuned {c0}: {t0[0] if t0 else float('nan'):6.2f} us", flush=True)
            with dependent_launch.plain_launches():
                plain = graph_time_us(
                    lambda i, c=timed[0][1], ws=ws, x=x, silu=silu: small_batch_linear(
                        x, ws[i], silu_mul=silu, config=c
                    ),
                    LAYERS,
                    replays=20,
                    repeats=3,
                )
            print(f"        best without PDL {plain:6.2f} us")
            best[name], weights[name] = timed[0][1], ws
            if timed[0][0] < base:
                tuned[(rows, k, silu)] = (timed[0][1], base / timed[0][0])

        if len(weights) == 4:
            t_cublas, t_small = time_layer_stack(weights, best, hidden, q // ranks)
            print(
                f"{which}: 32 layers (norms, linears, SiLU), {ROWS} rows: cuBLAS {t_cublas:7.1f} us, small-batch "
                f"GEMM {t_small:7.1f} us ({t_small - t_cublas:+.1f} us, {t_cublas / t_small:.3f}x)",
                flush=True,
            )
        weights.clear()
        torch.cuda.empty_cache()
    print("\nFaster than cuBLAS, (W rows, K, silu_mul): config, x cuBLAS")
    for key, (c, x) in sorted(tuned.items()):
        print(
            f"    {key}: SmallBatchConfig({c.block_n}, {c.block_k}, {c.split_k}, {c.num_stages}, {c.num_warps}),  # {x:.2f}x"
        )


if __name__ == "__main__":
    main()
