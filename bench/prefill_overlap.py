"""Whether a TP2 prefill step's all-reduces can hide behind its GEMMs: the row-wise part of an 8B
rank's layers (qkv, o_proj, the sum + residual add + norm, gate_up, SiLU, down, the sum + add +
norm), at prefill row counts, three ways on two GPUs:

- serial: as the layers run today, every sum between the GEMMs on one stream;
- chunked: the rows cut in --chunks pieces; every GEMM stays on the step's stream, every sum goes
  to a second stream as soon as its piece's GEMM ended, and the next GEMM of that piece waits only
  for its own sum (one piece's sum runs while the other piece's GEMM does);
- no sums: serial with the collectives skipped, the floor.

Attention is left out: it needs every row of a sequence, so the pieces would meet there anyway,
and it is a small part of a 512-token prompt's layer. Why ask: a TP2 prefill step of 1.5-4k tokens
spends 16% of its time in the sums (bench/RESULTS.md, "Prefill's all-reduces through the
one-shot"), and Hopper's cuBLAS GEMMs may hold every SM until they end, leaving a concurrent sum
nowhere to run; --carveout asks cuBLAS to leave some SMs free (torch's async-TP switch).

    python -m strata.bench.prefill_overlap --rows 1536,4096 --chunks 2 --carveout 0,16
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch

from strata.bench.graph_timing import graph_time_us
from strata.bench.spawn_ranks import run_on_ranks

# An 8B (Llama-3-8B) rank at T = 2: hidden 4,096; qkv (32 + 2 x 8) x 128 / 2; o_proj's input 2,048;
# gate_up 2 x 14,336 / 2; down's input 7,168.
HIDDEN, QKV, ATTN, GATE_UP, INTER = 4096, 3072, 2048, 14336, 7168
EPS = 1e-5


class RankLayers:
    """One rank's weights (shared by every layer: at these rows the GEMMs are compute-bound) and
    the collectives of its group."""

    def __init__(self, group, device, dtype, layers: int):
        gen = torch.Generator(device="cpu").manual_seed(0)

        def weight(n, k):
            return (torch.randn(n, k, generator=gen) / k**0.5).to(device=device, dtype=dtype)

        self.qkv, self.o, self.gate_up, self.down = (
            weight(QKV, HIDDEN),
            weight(HIDDEN, ATTN),
            weight(GATE_UP, HIDDEN),
            weight(HIDDEN, INTER),
        )
        self.norm = torch.ones(HIDDEN, device=device, dtype=dtype)
        self.group, self.layers = group, layers
        self.comm = torch.cuda.Stream(device=device)

    def add_norm(self, x, residual):
        """(norm(sum(x) + residual), sum(x) + residual): the one-shot fused, else the sum then the norm."""
        from strata.kernels.rmsnorm import fused_add_rms_norm

        fused = self.group.all_reduce_add_norm(x, residual, self.norm, EPS, residual_out=residual)
        if fused is not None:
            return fused
        return fused_add_rms_norm(self.group.all_reduce_(x), residual, self.norm, EPS, residual_out=residual)

    def mlp(self, x):
        from strata.kernels.activation import silu_and_mul

        return torch.nn.functional.linear(silu_and_mul(torch.nn.functional.linear(x, self.gate_up)), self.down)

    def serial(self, h, residual):
        for _ in range(self.layers):
            x, residual = self.add_norm(h, residual)
            attn = torch.nn.functional.linear(x, self.qkv)[:, :ATTN].contiguous()  # attention's stand-in
            x, residual = self.add_norm(torch.nn.functional.linear(attn, self.o), residual)
            h = self.mlp(x)
        return h

    def chunked(self, hs, residuals):
        """hs, residuals: the pieces' rows. Sums on self.comm, GEMMs on the current stream."""
        main = torch.cuda.current_stream()
        pieces = range(len(hs))

        def sums(xs):
            """Each piece's sum + add + norm on the comm stream once its GEMM ended; the normed rows."""
            normed = []
            for i in pieces:
                ready = torch.cuda.Event()
                ready.record(main)
                self.comm.wait_event(ready)
                xs[i].record_stream(self.comm)  # (freed here, their memory waits for the sum)
                residuals[i].record_stream(self.comm)
                with torch.cuda.stream(self.comm):
                    x, residuals[i] = self.add_norm(xs[i], residuals[i])
                    done = torch.cuda.Event()
                    done.record(self.comm)
                x.record_stream(main)
                normed.append((x, done))
            return normed

        for _ in range(self.layers):
            attn = []
            for x, done in sums(hs):
                main.wait_event(done)
                attn.append(torch.nn.functional.linear(x, self.qkv)[:, :ATTN].contiguous())
            hs = [None] * len(hs)
            normed = sums([torch.nn.functional.linear(a, self.o) for a in attn])
            for i, (x, done) in enumerate(normed):
                main.wait_event(done)
                hs[i] = self.mlp(x)
        return hs


def _rank(rank: int, size: int, port: int, args, results) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(300, exit=True)
    from strata.stage_links import set_nccl_environment

    set_nccl_environment()
    from strata.services.worker.tensor_parallel.group import TensorParallelGroup

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dtype = torch.bfloat16
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, world_size=size, is_master=rank == 0, timeout=datetime.timedelta(seconds=120)
    )
    group = TensorParallelGroup(rank, size, device, timeout=120.0, dtype=dtype)
    group.form(store, 1)
    fused_norm = group.one_shot_norm
    layers = RankLayers(group, device, dtype, args.layers)

    def meet():
        group.pg.allreduce([torch.zeros(1, device=device)]).wait()
        torch.cuda.synchronize()

    out = []
    for rows in args.rows:
        gen = torch.Generator(device="cpu").manual_seed(rank)
        h0 = (torch.randn(rows, HIDDEN, generator=gen) / 8).to(device=device, dtype=dtype)
        r0 = torch.zeros_like(h0)
        cut = [rows * i // args.chunks for i in range(args.chunks + 1)]
        for carveout in args.carveout:
            torch._C._set_sm_carveout_experimental(carveout or None)
            for sum_way in args.sums:
                group.one_shot_norm = fused_norm if sum_way == "ipc" else None
                ways = {
                    "serial": lambda: layers.serial(h0.clone(), r0.clone()),
                    "chunked": lambda: layers.chunked(
                        [h0[a:b].clone() for a, b in zip(cut, cut[1:])], [r0[a:b].clone() for a, b in zip(cut, cut[1:])]
                    ),
                }
                for way, call in ways.items():
                    us = graph_time_us(lambda _, c=call: c(), 1, replays=args.replays, before_timing=meet)
                    out.append(
                        {"rows": rows, "carveout": carveout, "sums": sum_way, "way": way, "layer_us": us / args.layers}
                    )
            group.skip_collectives = True
            us = graph_time_us(
                lambda _: layers.serial(h0.clone(), r0.clone()), 1, replays=args.replays, before_timing=meet
            )
            group.skip_collectives = False
            out.append(
                {"rows": rows, "carveout": carveout, "sums": "none", "way": "serial", "layer_us": us / args.layers}
            )
    torch._C._set_sm_carveout_experimental(None)
    if rank == 0:
        results.put(out)
    group.abort("done")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.bench.prefill_overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1536, 4096])
    p.add_argument("--chunks", type=int, default=2, help="pieces the rows are cut into")
    p.add_argument("--layers", type=int, default=8, help="layers a timed graph runs")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument(
        "--carveout",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[0],
        help="SMs cuBLAS's GEMMs leave free (torch._C._set_sm_carveout_experimental; 0: none)",
    )
    p.add_argument(
        "--sums", type=lambda s: s.split(","), default=["ipc", "nccl"], help="ipc (the fused one-shot), nccl"
    )
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    rows = run_on_ranks(_rank, 2, args, timeout=900)
    print(f"{'rows':>6} {'carveout':>8} {'sums':>5} {'way':>8} {'us a layer':>11} {'x serial':>9}")
    serial = {(r["rows"], r["carveout"], r["sums"]): r["layer_us"] for r in rows if r["way"] == "serial"}
    for r in rows:
        base = serial.get((r["rows"], r["carveout"], r["sums"]))
        print(
            f"{r['rows']:>6} {r['carveout']:>8} {r['sums']:>5} {r['way']:>8} {r['layer_us']:>11.1f} "
            f"{r['layer_us'] / base:>9.3f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
