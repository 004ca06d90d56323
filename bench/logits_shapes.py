"""The host's time for the last stage's eager lm_head (F.linear of [M, hidden] by [vocab, hidden])
at row counts M it has not seen yet, against M seen before: does cuBLAS's choice per new shape
cost the step thread? py-spy put 9% of the 1B's last-stage step thread in that call
(bench/RESULTS.md, issue 50, session 12), where each mixed step samples a different number of rows.

    python -m strata.bench.logits_shapes --hidden 2048 --vocab 128256 --rows 1-300
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def host_us(weight: torch.Tensor, rows: list[int]) -> list[float]:
    """Host microseconds of one F.linear launch per row count, each followed by a synchronize
    (not timed), so that no launch queues behind another."""
    times = []
    for m in rows:
        x = torch.randn(m, weight.shape[1], device=weight.device, dtype=weight.dtype)
        torch.cuda.synchronize()
        start = time.perf_counter()
        F.linear(x, weight)
        times.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rows", default="1-300", help="row counts FIRST-LAST")
    args = p.parse_args()
    first, last = (int(x) for x in args.rows.split("-"))
    weight = torch.randn(args.vocab, args.hidden, device="cuda", dtype=torch.bfloat16)
    host_us(weight, [7])  # cuBLAS's handle and workspace
    rows = list(range(first, last + 1))
    new = host_us(weight, rows)
    seen = host_us(weight, rows)
    for name, t in (("row counts new to cuBLAS", new), ("the same again", seen)):
        print(
            f"{name:26s} median {statistics.median(t):8.1f} us  mean {statistics.mean(t):8.1f} us  max {max(t):8.1f} us"
        )


if __name__ == "__main__":
    main()
