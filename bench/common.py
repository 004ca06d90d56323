"""What every benchmark shares: the cluster it drives, load generators, scheduler stats, output.

Load is generated with grpc.aio on one event loop (hundreds of concurrent streams, no threads);
every response is timestamped on arrival so TTFT and inter-token latency come from what the
client actually saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from strata.flags import SPECULATIVE_FLAGS, argv_for, service_args

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GPU_MODEL = "dummy:llama-3.2-1b"
# Token ids below this are the special tokens of the embedded default model (BOS, EOS);
# random prompts stay clear of them.
FIRST_PROMPT_TOKEN = 2


# ---------------------------------------------------------------- device, model, environment


def resolve_device(name: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; anything else unchanged."""
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_model(args) -> str | None:
    """--model, else the Llama-3.2-1B-shaped dummy on GPU and the embedded default on CPU."""
    if args.model:
        return args.model
    return DEFAULT_GPU_MODEL if resolve_device(args.device).startswith("cuda") else None


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index or 0
        return torch.cuda.get_device_name(index)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def git_commit() -> str:
    """$STRATA_GIT_COMMIT when set (a copy of the tree on a GPU host, whose git metadata may be
    stale), else HEAD's short hash with '+dirty' when the working tree has changes, else 'unknown'.
    (The benchmarks' own variable, for their records; not a service switch.)"""
    if os.environ.get("STRATA_GIT_COMMIT"):
        return os.environ["STRATA_GIT_COMMIT"]

    def git(*argv: str) -> str:
        return subprocess.run(
            ["git", *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment_info(args) -> dict:
    import torch

    device = resolve_device(args.device)
    return {
        "device": device,
        "device_name": device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "model": resolve_model(args) or "embedded default",
        "pipeline_stages": args.pipeline_stages,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
        # Lent machines of one kind differ in host CPU and runtime (a gVisor sandbox reports kernel
        # 4.4.0), and host-bound figures move with them (bench/RESULTS.md, issue 29).
        "cpu": cpu_model(),
        "kernel": platform.release(),
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    except OSError:
        pass
    return f"{platform.processor() or 'unknown'} x {os.cpu_count()}"


def free_accelerator_memory() -> None:
    """Return cached GPU memory between phases that each load a model into this process."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- the cluster


@dataclass
class Endpoints:
    gateway: str
    scheduler: str | None  # None: stats are not available (--address without --scheduler-address)
    own_cluster: bool
    service_pids: dict[str, int] = field(default_factory=dict)  # of a cluster this run started
    workers: list[str] = field(default_factory=list)  # its workers' addresses, in stage order (replica by replica)
    schedulers: list[str] = field(default_factory=list)  # one per data-parallel replica (scheduler is the first)


def with_overrides(args, **overrides):
    """A copy of the argparse namespace with some values replaced."""
    import argparse

    return argparse.Namespace(**{**vars(args), **overrides})


# The `strata serve` flags a benchmark's cluster takes from the benchmark's own flags; the
# speculative ones only when a method is set (a draft model alone would turn speculation on).
SERVE_FLAGS = (
    "pipeline_stages",
    "data_parallel_size",  # `strata bench pipeline`'s dp way
    "tensor_parallel_size",  # (the tensor-parallel bench's, as below)
    "tensor_parallel_all_reduce",
    "tensor_parallel_no_collectives",
    "tensor_parallel_no_early_send",
    "device",
    "dtype",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "gpu_memory_utilization",
    "max_model_len",
    "max_plans_in_flight",
    # The pipeline's: only `strata bench pipeline` sets them (argv_for skips what args lack).
    "stage_transport",
    "no_pipelined_decode",
    "no_plan_pacing",
    "pipeline_micro_batches",
    "micro_batch_min_seqs",
    "decode_repeats",
    "mps",
    "model",
    "tokenizer",
    "num_kv_blocks",
    "enforce_eager",
    "no_prefix_caching",
    "disable_cascade_attn",
    "profile_output",
)
SPECULATIVE_SERVE_FLAGS = (*SPECULATIVE_FLAGS, "draft_num_layers", "draft_model")


def serve_argv(args, model: str | None) -> list[str]:
    """`strata serve` arguments for the cluster a benchmark starts."""
    from strata.launcher import free_port

    # No HTTP front: the benchmarks speak gRPC, and each port handed out early can be taken by
    # the time its server binds it (the 8B pipeline bench lost its gateway to that once).
    settings = {**vars(args), "model": model, "port": free_port(), "http_port": 0}
    names = ("port", "http_port", *SERVE_FLAGS)
    if getattr(args, "speculative_method", None):
        names += SPECULATIVE_SERVE_FLAGS
    return ["serve", *argv_for(settings, names)]


@contextlib.contextmanager
def env_var(key: str, value: str | None):
    """$key is `value` while the block runs, restored after (None: left as it is). Services a
    cluster starts inside the block inherit it."""
    if value is None:
        yield
        return
    previous = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous


def cluster_token_env(token: str):
    """$STRATA_CLUSTER_TOKEN is `token` while the block runs: the scheduler calls this process
    makes (scheduler_channel) carry the token of the cluster it started. With --address they
    carry the running cluster's, which the environment names."""
    return env_var("STRATA_CLUSTER_TOKEN", token)


@contextlib.contextmanager
def cluster_for(args):
    """The running cluster named by --address, or a fresh local one stopped on exit."""
    if args.address:
        yield Endpoints(args.address, args.scheduler_address, own_cluster=False)
        return
    from strata.launcher import start_cluster

    serve_args = service_args(serve_argv(args, resolve_model(args)))
    # The services' INFO logs would bury the tables; they inherit this from the environment.
    previous = os.environ.get("STRATA_LOG_LEVEL")
    os.environ["STRATA_LOG_LEVEL"] = previous or args.service_log_level
    try:
        started = time.perf_counter()
        cluster = start_cluster(serve_args, startup_timeout=args.startup_timeout)
    finally:
        if previous is None:
            os.environ.pop("STRATA_LOG_LEVEL", None)
    print(
        f"cluster up in {time.perf_counter() - started:.1f}s: gateway {cluster.gateway_address}, "
        f"scheduler {cluster.scheduler_address}",
        flush=True,
    )
    try:
        with cluster_token_env(cluster.cluster_token):
            yield Endpoints(
                cluster.gateway_address,
                cluster.scheduler_address,
                own_cluster=True,
                service_pids={name.replace(" ", "_"): proc.pid for name, proc in cluster.procs},
                workers=[w for replica in cluster.replicas for w in replica.workers],
                schedulers=[replica.scheduler for replica in cluster.replicas],
            )
    finally:
        cluster.stop()


@contextlib.contextmanager
def sampled_stacks(service_pids: dict[str, int], out_dir: str | None, phase: str, native: bool = False):
    """While the block runs, py-spy (on PATH) samples every service's Python stacks into
    OUT_DIR/PHASE-SERVICE.txt (summarise with `python -m strata.bench.spy_summary OUT_DIR`): which
    process and which code bound the step rate. Nothing without out_dir. native: C frames too
    (--spy-native), sampled at 200 Hz, as each sample then pauses the process."""
    if not out_dir or not service_pids:
        yield
        return
    os.makedirs(out_dir, exist_ok=True)
    spies = [
        subprocess.Popen(
            [
                "py-spy",
                "record",
                *(["--native"] if native else ["--nonblocking"]),
                "--threads",
                "--idle",  # waits too (the GIL, a doorbell, a queue): the step thread's whole time
                "-r",
                "200" if native else "1000",
                "-d",
                "3600",
                "-f",
                "raw",
                "-p",
                str(pid),
                "-o",
                f"{out_dir}/{phase}-{name}.txt",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in service_pids.items()
    ]
    try:
        yield
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
        for spy in spies:
            spy.wait(timeout=120)


# ---------------------------------------------------------------- workload


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num` prompts of `length` uniformly random token ids, clear of the special ids."""
    rng = np.random.default_rng(seed)
    return rng.integers(FIRST_PROMPT_TOKEN, vocab_size, size=(num, length)).tolist()


def mixed_prompts(
    num: int, shortest: int, longest: int, vocab_size: int, seed: int
) -> tuple[list[list[int]], list[int]]:
    """`num` prompts of random ids and their output lengths, both uniform in shortest..longest
    (the nano-vllm benchmark's shape)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(shortest, longest + 1, size=num)
    outputs = rng.integers(shortest, longest + 1, size=num).tolist()
    return [rng.integers(FIRST_PROMPT_TOKEN, vocab_size, size=n).tolist() for n in lengths], outputs


def sampling_params(max_tokens: int, temperature: float, output_kind: int, n: int = 1, seed: int | None = None):
    """Fixed-length generation: ignore_eos, min_tokens = max_tokens, no top-k/top-p."""
    from strata.v1 import generate_pb2

    params = generate_pb2.SamplingParams(
        n=n,
        temperature=temperature,
        max_tokens=max_tokens,
        min_tokens=max_tokens,
        ignore_eos=True,
        output_kind=output_kind,
    )
    if seed is not None:
        params.seed = seed
    return params


# ---------------------------------------------------------------- requests over grpc.aio


@dataclass
class RequestRecord:
    prompt_len: int
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each response with tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens it carried (all outputs)
    completion_tokens: int = 0  # usage of the finished request (sums over n outputs)
    cached_prompt_tokens: int = 0
    error: str = ""

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    def inter_token_latencies(self) -> list[float]:
        """Gap between successive token-carrying responses, per token they carried."""
        gaps = np.diff(self.chunk_times)
        return (gaps / np.asarray(self.chunk_tokens[1:])).tolist()


def first_token_groups(records: list[RequestRecord], gap_s: float) -> list[int]:
    """Sizes of the runs of first tokens no more than gap_s apart, in time order: how the requests'
    arrivals fell into prefill steps."""
    firsts = sorted(r.chunk_times[0] for r in records if r.chunk_times)
    groups = []
    for i, t in enumerate(firsts):
        if i and t - firsts[i - 1] <= gap_s:
            groups[-1] += 1
        else:
            groups.append(1)
    return groups


def scheduler_channel(address: str):
    """A channel to a scheduler: internal, so its calls carry the cluster token."""
    from strata.grpc_util import aio_channel, cluster_token

    return aio_channel(address, cluster_token())


def open_channel(address: str):
    import grpc

    from strata.grpc_util import CHANNEL_OPTIONS

    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


async def send_request(stub, prompt: list[int], params, timeout: float) -> RequestRecord:
    import grpc

    from strata.v1 import generate_pb2

    rec = RequestRecord(prompt_len=len(prompt))
    request = generate_pb2.GenerateRequest(prompt_token_ids=generate_pb2.TokenIds(ids=prompt), params=params)
    rec.start = time.perf_counter()
    try:
        async for response in stub.Generate(request, timeout=timeout):
            now = time.perf_counter()
            tokens = sum(len(o.token_ids) for o in response.outputs)
            if tokens:
                rec.chunk_times.append(now)
                rec.chunk_tokens.append(tokens)
            if response.finished:
                rec.completion_tokens = response.usage.completion_tokens
                rec.cached_prompt_tokens = response.usage.cached_prompt_tokens
    except grpc.aio.AioRpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"
    rec.end = time.perf_counter()
    if not rec.error and not rec.chunk_times:
        rec.error = "no tokens returned"
    return rec


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, dynamic_ncols=True)


async def warm_up(gateway: str, args, vocab_size: int, prompt_len: int, seed: int, output_kind=None) -> None:
    """--warmup-requests short requests before a timed phase, so start-up work (first compiles,
    the first steps of each shape) stays out of it."""
    if not args.warmup_requests:
        return
    from strata.v1 import generate_pb2

    await run_all_at_once(
        gateway,
        random_prompts(args.warmup_requests, prompt_len, vocab_size, seed),
        sampling_params(4, args.temperature, generate_pb2.FINAL_ONLY if output_kind is None else output_kind),
        args.request_timeout,
        progress=False,
    )


async def run_all_at_once(
    address: str,
    prompts,
    params,
    timeout: float,
    max_concurrency: int = 0,
    desc: str = "requests",
    progress: bool = True,
) -> list[RequestRecord]:
    """Submit every prompt at once (at most `max_concurrency` in flight when > 0)."""
    from strata.v1 import generate_pb2_grpc

    limit = asyncio.Semaphore(max_concurrency or len(prompts))
    async with open_channel(address) as channel:
        stub = generate_pb2_grpc.GatewayStub(channel)
        with _progress(len(prompts), desc, progress) as bar:

            async def one(prompt, p):
                async with limit:
                    rec = await send_request(stub, prompt, p, timeout)
                bar.update(1)
                return rec

            per_prompt = params if isinstance(params, list) else [params] * len(prompts)
            tasks = []
            for prompt, p in zip(prompts, per_prompt):
                tasks.append(asyncio.create_task(one(prompt, p)))
                # Let the loop send it before building the next: gathered at once, the first
                # request left only after all were built and started, time the server spent idle
                # at the start of the measurement (bench/RESULTS.md, "Figures moved from code
                # comments").
                await asyncio.sleep(0)
            return list(await asyncio.gather(*tasks))


async def run_poisson(
    address: str, prompts, params, rate: float, timeout: float, seed: int, desc: str = "poisson", progress: bool = True
) -> list[RequestRecord]:
    """Requests arrive as a Poisson process of `rate` per second (inf: all at once)."""
    from strata.v1 import generate_pb2_grpc

    rng = np.random.default_rng(seed)
    async with open_channel(address) as channel:
        stub = generate_pb2_grpc.GatewayStub(channel)
        with _progress(len(prompts), desc, progress) as bar:

            async def one(prompt):
                rec = await send_request(stub, prompt, params, timeout)
                bar.update(1)
                return rec

            tasks = []
            for prompt in prompts:
                tasks.append(asyncio.create_task(one(prompt)))
                # An infinite rate still yields, so each request leaves as it is made (run_all_at_once).
                await asyncio.sleep(rng.exponential(1.0 / rate) if math.isfinite(rate) else 0)
            return list(await asyncio.gather(*tasks))


async def run_closed_loop(
    address: str, prompts, params, concurrency: int, timeout: float, desc: str = "closed loop", progress: bool = True
) -> list[RequestRecord]:
    """`concurrency` streams, each sending its next request as soon as the last one finished."""
    from strata.v1 import generate_pb2_grpc

    queue = list(reversed(prompts))
    records: list[RequestRecord] = []
    async with open_channel(address) as channel:
        stub = generate_pb2_grpc.GatewayStub(channel)
        with _progress(len(prompts), desc, progress) as bar:

            async def stream():
                while queue:
                    records.append(await send_request(stub, queue.pop(), params, timeout))
                    bar.update(1)

            await asyncio.gather(*(stream() for _ in range(concurrency)))
    return records


async def model_info(address: str):
    from strata.v1 import generate_pb2, generate_pb2_grpc

    async with open_channel(address) as channel:
        return await generate_pb2_grpc.GatewayStub(channel).GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=60)


def failures(records: list[RequestRecord]) -> list[str]:
    return [r.error for r in records if r.error]


# ---------------------------------------------------------------- scheduler statistics

COUNTERS = (
    "prefill_tokens_computed",
    "decode_tokens_computed",
    "lookahead_decodes",
    "steps",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "preemptions",
    "finished_requests",
    "worker_gpu_busy_seconds",
    "worker_gpu_idle_seconds",
    "worker_timed_steps",
    "worker_launch_seconds",
    "host_seconds",
    "busy_seconds",
    "spec_decode_verify_steps",
    "spec_decode_verify_rounds",
    "micro_batch_migrations",
    "micro_batch_rounds",
    "micro_batch_token_spread",
    "repeated_plans",
    "plan_round_trip_seconds",
    "wait_at_limit_seconds",
    "wait_below_limit_seconds",
)


async def scheduler_stats(address: str | None):
    if not address:
        return None
    from strata.v1 import engine_pb2, engine_pb2_grpc

    async with scheduler_channel(address) as channel:
        return await engine_pb2_grpc.SchedulerStub(channel).GetStats(engine_pb2.GetStatsRequest(), timeout=30)


async def cluster_stats(endpoints):
    """The scheduler's statistics; with data-parallel replicas, their counters (and pools) summed."""
    from strata.v1 import engine_pb2

    addresses = endpoints.schedulers or [endpoints.scheduler]
    if len(addresses) == 1:
        return await scheduler_stats(addresses[0])
    total = engine_pb2.SchedulerStats()
    for stats in [await scheduler_stats(a) for a in addresses]:
        for name in (*COUNTERS, "num_kv_blocks", "peak_used_kv_blocks", "used_kv_blocks"):
            setattr(total, name, getattr(total, name) + getattr(stats, name))
        total.gpu_idle_fraction = max(total.gpu_idle_fraction, stats.gpu_idle_fraction)
    return total


def stats_delta(before, after) -> dict:
    """Counters over a phase, plus the pool's size and (cumulative) peak after it."""
    if before is None or after is None:
        return {}
    delta = {name: getattr(after, name) - getattr(before, name) for name in COUNTERS}
    delta.update(
        num_kv_blocks=after.num_kv_blocks,
        peak_used_kv_blocks=after.peak_used_kv_blocks,
        used_kv_blocks_after=after.used_kv_blocks,
        gpu_idle_fraction_since_start=after.gpu_idle_fraction,
        micro_batches_after=after.micro_batches,
    )
    return delta


def gpu_timeline_rows(delta: dict, wall_s: float) -> list[tuple[str, str]]:
    """The last stage's view over a phase: host time from each plan to its step's last launch
    (waits for the GPU included, when the worker runs ahead), and from CUDA events the GPU time in
    steps and its idle time between them. GPU time in steps counts the GPU waiting inside a step
    for launches the host has not made yet: a launch time near it can mean the host paces the GPU."""
    rows = []
    if delta.get("steps"):
        launch = delta["worker_launch_seconds"] / delta["steps"]
        rows.append(("worker launching", f"{launch * 1e3:.3f} ms of host time per step"))
        own = delta.get("host_seconds", 0.0) / delta["steps"]
        rows.append(("scheduler", f"{own * 1e3:.3f} ms of host time per step on results and plans"))
    steps = delta.get("worker_timed_steps", 0)
    if not steps:
        return rows + [("GPU timeline", "- (no CUDA-event timings: CPU worker)")]
    busy, idle = delta["worker_gpu_busy_seconds"], delta["worker_gpu_idle_seconds"]
    return rows + [
        (
            "GPU busy in steps",
            f"{busy:.2f} s over {steps:,} steps ({busy / steps * 1e3:.2f} ms per step), "
            f"{busy / wall_s:.0%} of the wall time",
        ),
        (
            "GPU idle between steps",
            f"{idle:.2f} s ({idle / max(busy + idle, 1e-9):.1%} of the GPU's "
            f"timeline, {idle / steps * 1e3:.3f} ms per step)",
        ),
    ]


class StatsPoller:
    """Samples GetStats every `interval` seconds while a phase runs (decode step timing)."""

    def __init__(self, address: str | None, interval: float = 0.25):
        self.address = address
        self.interval = interval
        self.samples: list[tuple[float, object]] = []
        self._task: asyncio.Task | None = None

    async def __aenter__(self):
        if self.address:
            self._task = asyncio.create_task(self._poll())
        return self

    async def __aexit__(self, *exc):
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _poll(self) -> None:
        from strata.v1 import engine_pb2, engine_pb2_grpc

        async with scheduler_channel(self.address) as channel:
            stub = engine_pb2_grpc.SchedulerStub(channel)
            while True:
                stats = await stub.GetStats(engine_pb2.GetStatsRequest(), timeout=30)
                self.samples.append((time.perf_counter(), stats))
                await asyncio.sleep(self.interval)


def decode_only_timing(samples) -> dict:
    """Step timing the scheduler saw while nothing was being prefilled.

    Over the intervals between samples in which no prefill token was computed: seconds per
    engine step, decode tokens per step, and seconds per batch step (every running sequence
    advancing one token = running / decode-token rate), comparable to an in-process decode
    step at that batch size. Empty when there was no such interval.
    """
    dt = steps = tokens = weighted_running = gpu_busy = gpu_idle = gpu_steps = 0.0
    for i, ((t0, a), (t1, b)) in enumerate(zip(samples, samples[1:])):
        d_steps = b.steps - a.steps
        d_tokens = b.decode_tokens_computed - a.decode_tokens_computed
        # Results lag their plans by the plans in flight: the interval after one that scheduled
        # prefill may still receive a prefill step's GPU time, so it is skipped too.
        prefill_before = i > 0 and a.prefill_tokens_computed != samples[i - 1][1].prefill_tokens_computed
        if b.prefill_tokens_computed != a.prefill_tokens_computed or prefill_before or d_steps <= 0 or d_tokens <= 0:
            continue
        dt += t1 - t0
        steps += d_steps
        tokens += d_tokens
        weighted_running += (a.running + b.running) / 2 * (t1 - t0)
        gpu_busy += b.worker_gpu_busy_seconds - a.worker_gpu_busy_seconds
        gpu_idle += b.worker_gpu_idle_seconds - a.worker_gpu_idle_seconds
        gpu_steps += b.worker_timed_steps - a.worker_timed_steps
    if steps == 0:
        return {}
    running = weighted_running / dt
    timing = {
        "window_seconds": dt,
        "steps": int(steps),
        "seconds_per_step": dt / steps,
        "decode_tokens_per_step": tokens / steps,
        "mean_running": running,
        "seconds_per_batch_step": running * dt / tokens,
    }
    if gpu_steps:
        timing.update(
            gpu_seconds_per_step=gpu_busy / gpu_steps, gpu_idle_fraction=gpu_idle / max(gpu_busy + gpu_idle, 1e-9)
        )
    return timing


# ---------------------------------------------------------------- numbers and output


def summarize(values, scale: float = 1000.0) -> dict:
    """mean/p50/p90/p99/max of `values` times `scale` (seconds -> ms by default)."""
    if len(values) == 0:
        return {}
    v = np.asarray(values, dtype=np.float64) * scale
    return {
        "mean": float(v.mean()),
        "p50": float(np.percentile(v, 50)),
        "p90": float(np.percentile(v, 90)),
        "p99": float(np.percentile(v, 99)),
        "max": float(v.max()),
    }


def ratio(numerator, denominator):
    return numerator / denominator if numerator is not None and denominator else None


def fmt(value, spec: str = ",.1f") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec) if isinstance(value, (int, float)) else str(value)


def print_header(name: str, env: dict) -> None:
    line = "=" * 78
    print(
        f"\n{line}\nstrata bench {name}\n  device  {env['device_name']} ({env['device']})\n"
        f"  model   {env['model']}, {env['pipeline_stages']} pipeline stage(s)\n"
        f"  host    {env.get('cpu', '?')}, kernel {env.get('kernel', '?')}\n"
        f"  date    {env['date']}\n  commit  {env['commit']}\n{line}",
        flush=True,
    )


def print_section(title: str, rows: list[tuple[str, str]], note: str = "") -> None:
    print(f"\n{title}")
    width = max((len(k) for k, _ in rows), default=0)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")
    if note:
        print(f"  ({note})")
    print(flush=True)


def write_json(path: str | None, result: dict) -> None:
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2, sort_keys=False, default=_json_default) + "\n")
    print(f"wrote {path}")


def _json_default(value):
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    return repr(value)


def args_dict(args) -> dict:
    return {k: v for k, v in vars(args).items() if not callable(v)}


def run(coro):
    return asyncio.run(coro)
