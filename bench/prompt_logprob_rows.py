"""Where an asking prompt's extra GPU time goes: the last stage's prompt-logprob rows of one
1,024-token prompt on the 1B shape (hidden 2048, vocabulary 128,256, bf16), in process, against
the lm_head those rows need at the least. CUDA only.

  lm_head     the final norm and lm_head over the rows, in the worker's row chunks (the floor)
  kernel      kernels/prompt_logprobs.py over those logits (fill and merge)
  rows        sampling/prompt_logprobs.prompt_logprobs: everything the step adds (gather, chunks,
              kernel, merge)

    python -m strata.bench.prompt_logprob_rows
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from strata.kernels.prompt_logprobs import LogprobRows
from strata.services.worker.sampling import prompt_logprobs as rows_module


def _time(fn, repeats: int) -> float:
    """Median milliseconds of fn over `repeats` calls (CUDA events, after a warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1023, help="prompt positions asked (a 1,024-token prompt)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, device=dev, dtype=bf16, generator=g)
    residual = torch.randn(args.rows, args.hidden, device=dev, dtype=bf16, generator=g)
    norm = torch.ones(args.hidden, device=dev, dtype=bf16)
    head = torch.randn(args.vocab, args.hidden, device=dev, dtype=bf16, generator=g) * 0.02

    def compute_logits(h, r):
        return F.linear(F.rms_norm(h + r, (args.hidden,), norm, 1e-5), head)

    chunk = rows_module.chunk_rows(args.vocab)
    targets = torch.randint(0, args.vocab, (args.rows,), device=dev, generator=g)
    logits = compute_logits(hidden, residual)

    def lm_head():
        for s in range(0, args.rows, chunk):
            compute_logits(hidden[s : s + chunk], residual[s : s + chunk])

    def kernel():
        stats = LogprobRows(args.rows, args.vocab, args.top, dev)
        for s in range(0, args.rows, chunk):
            stats.fill(logits[s : s + chunk], targets[s : s + chunk], s)
        stats.merge()

    asked = rows_module.PromptRows(
        np.arange(args.rows, dtype=np.int64),
        targets.cpu().numpy(),
        np.full(args.rows, args.top, dtype=np.int64),
    )

    def rows():
        rows_module.prompt_logprobs(compute_logits, hidden, residual, asked, args.vocab)

    flops = 2 * args.rows * args.hidden * args.vocab
    t_head, t_kernel, t_rows = (_time(f, args.repeats) for f in (lm_head, kernel, rows))
    print(f"{args.rows} rows, hidden {args.hidden}, vocabulary {args.vocab:,}, top {args.top}, chunks of {chunk}")
    print(f"  lm_head  {t_head:.3f} ms ({flops / t_head / 1e9:.0f} TFLOP/s)")
    print(f"  kernel   {t_kernel:.3f} ms ({args.rows * args.vocab * 2 / t_kernel / 1e6:.0f} GB/s of logits read)")
    print(f"  rows     {t_rows:.3f} ms (everything the step adds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
