"""Does an L2 bulk prefetch of the next GEMM's weights, issued by a latency-bound kernel before it,
speed up torch's cuBLAS GEMM at 16 rows? (Issue 51: the rank's small GEMMs lose to their ramp.)

    python -m strata.bench.l2_prefetch      # one GPU; us a (kernel + GEMM) pair, 32 distinct weights

A stand-in kernel of 64 programs spins for a window (3 or 13 us, the one-shot's or the attention's
latency at a TP2 rank's batch 16) and, in the timed variants, first issues
cp.async.bulk.prefetch.L2.global over the first 8, 16 or 32 MB of the GEMM's weights. Answer on an
H200 (bench/RESULTS.md, session 17): slower for every shape; dropped.
"""

import torch
import triton
import triton.language as tl

THREADS = 128


@triton.jit
def _spin_prefetch(w_ptr, nbytes, chunk, ns, PREFETCH: tl.constexpr, SPIN: tl.constexpr):
    pid = tl.program_id(0)
    if PREFETCH:
        tid = tl.arange(0, 128)
        offs = (pid * 128 + tid).to(tl.int64) * chunk
        size = tl.minimum(nbytes - offs, chunk).to(tl.int32)
        size = tl.where(offs < nbytes, size, 0)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [w_ptr + offs, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    if SPIN:
        start = tl.extra.cuda.globaltimer()
        now = start
        while now - start < ns:
            now = tl.extra.cuda.globaltimer()


def main():
    import torch.nn.functional as F

    from strata.bench.graph_timing import graph_time_us

    dev = "cuda"
    programs = 64
    shapes = {
        "rank o_proj": (4096, 2048),
        "rank qkv": (3072, 4096),
        "rank gate_up": (14336, 4096),
        "rank down": (4096, 7168),
        "one o_proj": (4096, 4096),
        "one qkv": (6144, 4096),
        "one gate_up": (28672, 4096),
        "one down": (4096, 14336),
    }
    caps_mb = [8, 16, 32]
    for name, (n, k) in shapes.items():
        ws = [
            torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 64 for _ in range(max(2, 600 * 2**20 // (n * k * 2)))
        ]
        x = torch.randn(16, k, device=dev, dtype=torch.bfloat16)
        nb = n * k * 2
        line = []
        base = graph_time_us(lambda i: F.linear(x, ws[i % len(ws)]), 32, replays=20)
        line.append(f"gemm {base:.2f}")
        for window_us in (3, 13):

            def spin_only(i):
                _spin_prefetch[(programs,)](
                    ws[i % len(ws)].view(torch.uint8), nb, 16, window_us * 1000, PREFETCH=False, SPIN=True
                )
                F.linear(x, ws[i % len(ws)])

            t0 = graph_time_us(spin_only, 32, replays=20)
            res = [f"w{window_us}: spin {t0:.2f}"]
            for cap in caps_mb:
                pb = min(nb, cap * 2**20)
                chunk = max(16, (pb // (programs * THREADS)) // 16 * 16)

                def spin_pref(i, pb=pb, chunk=chunk):
                    w = ws[i % len(ws)]
                    _spin_prefetch[(programs,)](
                        w.view(torch.uint8), pb, chunk, window_us * 1000, PREFETCH=True, SPIN=True
                    )
                    F.linear(x, w)

                t1 = graph_time_us(spin_pref, 32, replays=20)
                res.append(f"pf{cap}MB {t1:.2f}")
            line.append(" ".join(res))
        print(f"{name} [{n}x{k}] {nb / 2**20:.1f} MB: " + " | ".join(line), flush=True)


if __name__ == "__main__":
    main()
