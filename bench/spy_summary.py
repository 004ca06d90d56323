"""Summarises py-spy folded stacks (bench/spy_services.sh): share of samples per thread and the
functions with the most self time, per process, then those with the most inclusive time (the
samples with the function anywhere on the stack: where a loop's time goes, callees included).

    python -m strata.bench.spy_summary OUTDIR
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path


def summarise(path: Path, top: int = 15) -> str:
    threads, leaves, inclusive, total = collections.Counter(), collections.Counter(), collections.Counter(), 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        threads[frames[0]] += n
        leaves[frames[-1]] += n
        for name in {frame.split(" (")[0] for frame in frames[1:]}:  # (once a sample: recursion)
            inclusive[name] += n
    lines = [f"== {path.stem}: {total} samples"]
    lines += [f"  thread {name[:70]:<70} {n / total:6.1%}" for name, n in threads.most_common(6)]
    lines += [f"  self   {name[:70]:<70} {n / total:6.1%}" for name, n in leaves.most_common(top)]
    lines += [f"  within {name[:70]:<70} {n / total:6.1%}" for name, n in inclusive.most_common(2 * top)]
    return "\n".join(lines)


if __name__ == "__main__":
    for file in sorted(Path(sys.argv[1]).glob("*.txt")):
        print(summarise(file))
