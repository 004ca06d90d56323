"""Where a pipeline's shared GPU idles between its stages' steps, from the workers' GPU clock stamps
(services/worker/diagnostics/gpu_clock.py: run the cluster with --gpu-clock-dir DIR (env STRATA_GPU_CLOCK_DIR), then):

    python -m strata.bench.gpu_clock DIR            # the last dump of each cluster
    python -m strata.bench.gpu_clock DIR --call 3   # `strata bench pipeline`: 3 = its 16-stream phase

(`strata bench pipeline --gpu-clock DIR` does both for each multi-stage run.)

Each stage's step k is busy on the GPU from its `start` stamp to its `handed` stamp. The union of
every stage's busy intervals, against the span they cover, gives the GPU's idle; gaps longer than
--max-gap-ms (no work: clients between requests) are left out, as the bench's own idle leaves out
steps sent after the scheduler idled. Each remaining gap ends when some stage's step starts, and is
charged to one cause:
  - host late: that step's work was launched (host clock, mapped onto the GPU's) after the gap
    opened; split by whether its `queued` stamp was launched late too (its own host was behind) or
    in time (its host then waited on the host for a peer: the activations' announcement);
  - hand-off: everything was queued in time, so the GPU itself took that long to pass the
    dependency (the wait on the other process's event or word, and the restart after it).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os

import numpy as np

from strata.services.worker.diagnostics.gpu_clock import POINTS  # (importing it loads torch, as the stamps need)


def load(directory: str, call: int | None) -> list[list[dict]]:
    """The dumps grouped per cluster (files of one call written within a few seconds), each a list
    of stages in order: {point: (step_ids, gpu_ns, host_ns)}."""
    by_call = collections.defaultdict(list)
    for path in glob.glob(os.path.join(directory, "stage*-*-*.npz")):
        by_call[int(path.rsplit("-", 1)[1].split(".")[0])].append(path)
    if not by_call:
        raise FileNotFoundError(f"no stamps in {directory} (did the GPU workers run with --gpu-clock-dir?)")
    calls = [call] if call is not None else sorted(by_call)[-1:]
    clusters = []
    for c in calls:
        paths = sorted(by_call[c], key=os.path.getmtime)
        group: list[str] = []
        for path in paths:  # a cluster's stages answer GetStats one after the other
            if group and os.path.getmtime(path) - os.path.getmtime(group[-1]) > 5.0:
                clusters.append(_stages(group))
                group = []
            group.append(path)
        clusters.append(_stages(group))
    return clusters


def _stages(paths: list[str]) -> list[dict]:
    stages = {}
    for path in paths:
        d = np.load(path)
        keep = d["t_ns"] > 0
        stage = {}
        for i, name in enumerate(POINTS):
            m = keep & (d["point"] == i)
            stage[name] = (d["step_id"][m], d["t_ns"][m], d["host_ns"][m])
        if "need" in d and d["need"].size:  # stage 0's token dependencies (dumps since session 12 of issue 50)
            stage["need"] = d["need"]
        if "ref_rate" in d and d["ref_rate"].size:  # (dumps since session 14 keep their references)
            stage["placement"] = (int(d["ref_rate"].size), float(np.median(d["ref_rate"])))
        stages[int(d["stage"])] = stage
    return [stages[i] for i in sorted(stages)]


def _by_step(stage: dict, point: str) -> dict[int, tuple[int, int]]:
    ids, gpu, host = stage[point]
    return {int(s): (int(g), int(h)) for s, g, h in zip(ids, gpu, host)}


def analyse(stages: list[dict], max_gap_ns: float) -> dict:
    # The host's perf_counter onto the GPU's clock: a stamp runs no earlier than its launch, so the
    # smallest (gpu - host) over all stamps is the offset plus the shortest launch latency.
    for stage in stages:
        diffs = np.concatenate([stage[p][1] - stage[p][2] for p in POINTS])
        stage["offset"] = int(diffs.min()) if diffs.size else 0
    steps = []  # (start, end, stage index, step id)
    segments = [collections.defaultdict(list) for _ in stages]
    for i, stage in enumerate(stages):
        points = {p: _by_step(stage, p) for p in POINTS}
        for step_id, (start, _) in points["start"].items():
            if step_id not in points["handed"]:
                continue
            end = points["handed"][step_id][0]
            steps.append((start, end, i, step_id))
            if step_id in points["queued"]:
                segments[i]["queued -> start (waits)"].append(start - points["queued"][step_id][0])
            if step_id in points["body"]:
                body = points["body"][step_id][0]
                segments[i]["start -> body (graph)"].append(body - start)
                segments[i]["body -> handed (hand-off work)"].append(end - body)
            # The host's side: how far ahead of its GPU it launched the step's own work, and its
            # time from the previous step's last launch to this step's first (the plan, inputs).
            segments[i]["host: GPU start - its launch"].append(start - (points["start"][step_id][1] + stage["offset"]))
            previous = points["handed"].get(step_id - 1)
            if previous is not None and step_id in points["queued"]:
                segments[i]["host: previous handed -> queued"].append(points["queued"][step_id][1] - previous[1])
        stage["points"] = points
    steps.sort()
    busy = idle = 0
    skipped = 0
    causes = collections.defaultdict(lambda: collections.defaultdict(list))
    cover_end = None
    for start, end, i, step_id in steps:
        if cover_end is None:
            busy += end - start
            cover_end, last_stage = end, i
            continue
        if start > cover_end:
            gap = start - cover_end
            if gap > max_gap_ns:
                skipped += 1
            else:
                idle += gap
                points, offset = stages[i]["points"], stages[i]["offset"]
                start_launch = points["start"][step_id][1] + offset
                queued = points["queued"].get(step_id)
                queued_launch = queued[1] + offset if queued else start_launch
                late = max(0, min(start_launch - cover_end, gap))
                key = f"stage {last_stage} -> stage {i}"
                if late and queued_launch > cover_end:
                    causes[key]["host late: its own host behind"].append(late)
                elif late:
                    causes[key]["host late: waited on the host for a peer"].append(late)
                causes[key]["hand-off on the GPU"].append(gap - late)
            busy += end - start
            cover_end, last_stage = end, i
        elif end > cover_end:
            busy += end - cover_end
            cover_end, last_stage = end, i
    return {"busy_ns": busy, "idle_ns": idle, "skipped_gaps": skipped, "causes": causes, "segments": segments}


def token_waits(stages: list[dict]) -> list[str]:
    """Stage 0's waits for tokens, by how far back the step it needs lies (its step id minus the
    sampling step's: about the micro-batches in turn): steps, their GPU wait (queued -> start),
    and how late the last stage handed those tokens against stage 0's queued (positive: the
    tokens were the wait) and how soon stage 0 started after that hand-off. Those two compare two
    stages' stamps: on separate GPUs, whose global timers are not one clock, they carry the
    timers' offset (hundreds of us on two H200s); the GPU wait is one stage's own."""
    if len(stages) < 2 or "need" not in stages[0] or "points" not in stages[0]:
        return []
    first, last = stages[0]["points"], stages[-1]["points"]
    by_distance = collections.defaultdict(lambda: ([], [], []))
    for step_id, need in stages[0]["need"]:
        step_id, need = int(step_id), int(need)
        if step_id not in first["start"] or step_id not in first["queued"] or need not in last["handed"]:
            continue
        start, queued = first["start"][step_id][0], first["queued"][step_id][0]
        waits, lates, after = by_distance[step_id - need]
        waits.append(start - queued)
        lates.append(last["handed"][need][0] - queued)
        after.append(start - max(last["handed"][need][0], queued))
    lines = ["  stage 0's token waits, by the steps between a step and the one whose tokens it takes:"]
    total = sum(len(v[0]) for v in by_distance.values())
    for distance in sorted(by_distance):
        waits, lates, after = (np.asarray(v) / 1e3 for v in by_distance[distance])
        lines.append(
            f"    {distance:3d} back: {len(waits):6,} steps ({len(waits) / max(total, 1):5.1%}), GPU wait "
            f"{waits.mean():7.1f} us (p50 {np.median(waits):.1f}); tokens handed {lates.mean():7.1f} us after "
            f"queued (p50 {np.median(lates):.1f}); started {after.mean():6.1f} us after both"
        )
    return lines


def report(result: dict, num_steps: int) -> str:
    busy, idle = result["busy_ns"], result["idle_ns"]
    lines = [
        f"GPU busy {busy / 1e6:,.1f} ms, idle {idle / 1e6:,.1f} ms between steps: "
        f"{idle / max(busy + idle, 1):.1%} idle ({result['skipped_gaps']} gaps longer than the cut left out); "
        f"{num_steps:,} steps of the last stage"
    ]
    for i, seg in enumerate(result["segments"]):
        for name, values in seg.items():
            lines.append(
                f"  stage {i} {name:34s} {np.mean(values) / 1e3:8.1f} us a step (p50 {np.median(values) / 1e3:.1f})"
            )
    for key, parts in sorted(result["causes"].items()):
        total = sum(sum(v) for v in parts.values())
        lines.append(f"  gaps {key}: {total / max(num_steps, 1) / 1e3:.1f} us a step")
        for name, values in parts.items():
            lines.append(
                f"    {name:42s} {sum(values) / max(num_steps, 1) / 1e3:8.1f} us a step ({len(values):,} gaps)"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("directory", help="the --gpu-clock-dir the workers wrote to")
    p.add_argument("--call", type=int, default=None, help="which GetStats dump (default: the last)")
    p.add_argument("--max-gap-ms", type=float, default=2.0, help="longer gaps are no work, not a bubble")
    args = p.parse_args(argv)
    try:
        clusters = load(args.directory, args.call)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    for n, stages in enumerate(clusters):
        print(f"cluster {n}: {len(stages)} stage(s)")
        print(breakdown(stages, args.max_gap_ms))


def breakdown(stages: list[dict], max_gap_ms: float = 2.0) -> str:
    """The report of one cluster's dump, after how each stage's stamps were placed on the global
    clock (services/worker/diagnostics/gpu_clock.py, place_references)."""
    placement = [
        f"  stage {i} placed by {s['placement'][0]} references; global clock against its events' "
        f"clock: rate {s['placement'][1]:.5f} (p50)"
        for i, s in enumerate(stages)
        if "placement" in s
    ]
    text = report(analyse(stages, max_gap_ms * 1e6), len(_by_step(stages[-1], "handed")))
    return "\n".join([text.split("\n", 1)[0], *placement, *text.split("\n")[1:], *token_waits(stages)])


if __name__ == "__main__":
    main()
