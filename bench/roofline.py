"""The decode step against its floor: (weight bytes + KV bytes read) / measured copy bandwidth.
Of a mixture of experts' layers, the bytes of the experts the step's tokens pick (as many as
uniform routing touches); of a sliding layer, the window of KV at most.

The step is timed in this process on the worker's own ModelRunner (what `strata worker` builds),
fed hand-made StepPlans: every sequence decodes one token over `context_len` cached positions.
The KV contents do not matter for timing, so nothing is prefilled: the plan simply says the
cache already holds context_len - 1 tokens. The same timing is the "bare model step" that the
latency benchmark compares inter-token latency with.
"""

from __future__ import annotations

import math
import statistics
import time

import numpy as np

from strata.bench import common
from strata.flags import argv_for, service_args

# ---------------------------------------------------------------- the floor


def _attention_weights(config) -> int:
    """qkv and o projections of one layer."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return config.hidden_size * (q + 2 * kv) + q * config.hidden_size


def _expert_weights(config) -> int:
    """One expert's gate, up and down projections."""
    return 3 * config.hidden_size * config.moe_intermediate_size


def _moe_layers(config) -> int:
    return sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))


def experts_touched(config, batch: int) -> float:
    """Expected distinct experts a step of `batch` tokens reads in one layer of experts, if each
    token picks its top-k uniformly: E (1 - (1 - k/E)^B). (Uniform routing is what the dummy
    models' random routers give; trained routers are skewed, and touch fewer.)"""
    e, k = config.num_experts, config.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch) if e else 0.0


def matmul_weights_per_token(config) -> int:
    """Weights the whole model multiplies each token by (lm_head aside): every layer's qkv and o
    projections, and its MLP's, or for a layer of experts its router and the k experts it picks."""
    h, moe_layers = config.hidden_size, _moe_layers(config)
    dense_layers = config.num_hidden_layers - moe_layers
    moe = moe_layers * (h * config.num_experts + config.num_experts_per_tok * _expert_weights(config))
    return config.num_hidden_layers * _attention_weights(config) + dense_layers * 3 * h * config.intermediate_size + moe


def attended_keys(config, first: int, count: int) -> int:
    """Keys the queries at context lengths first .. first + count - 1 attend to, over all layers:
    each its whole context, or at most a sliding layer's window."""

    def series(lo: int, n: int) -> int:  # lo + (lo + 1) + ... + (lo + n - 1)
        return n * lo + n * (n - 1) // 2

    total = 0
    for layer in range(config.num_hidden_layers):
        window = config.sliding_window_for_layer(layer)
        if window is None or first + count - 1 <= window:
            total += series(first, count)
        else:
            below = max(0, min(count, window - first + 1))
            total += series(first, below) + (count - below) * window
    return total


def decode_bytes(config, itemsize: int, batch: int, context_len: int) -> dict:
    """Bytes a decode step of `batch` sequences at `context_len` must read at least: every weight
    once (of a layer of experts, the router and the experts its tokens pick: experts_touched),
    every cached K and V once (a sliding layer's window of them at most).

    The embedding table is only gathered (batch rows) unless it is also the lm_head (tied),
    which reads it whole.
    """
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    norms = (4 if config.sandwich_norms else 2) * h + (2 * config.head_dim if config.qk_norm else 0)
    per_layer = _attention_weights(config) + norms
    per_layer += (q + 2 * kv) * config.attention_bias + h * config.o_proj_bias
    moe_layers = _moe_layers(config)
    dense = (layers - moe_layers) * (3 * h * inter + (2 * inter + h) * config.mlp_bias)
    experts = moe_layers * (h * config.num_experts + experts_touched(config, batch) * _expert_weights(config))
    head = config.vocab_size * h
    embeddings = 0 if config.tie_word_embeddings else batch * h
    weight_elems = round(layers * per_layer + dense + experts + h + head + embeddings)
    kv_elems = batch * attended_keys(config, context_len, 1) * 2 * kv
    return {
        "weight_bytes": weight_elems * itemsize,
        "kv_bytes": kv_elems * itemsize,
        "total_bytes": (weight_elems + kv_elems) * itemsize,
    }


def measure_copy_bandwidth(device: str, nbytes: int | None = None, iters: int | None = None) -> float:
    """Device memory bandwidth from a large device-to-device copy: 2 * bytes / time (read + write)."""
    import torch

    cuda = device.startswith("cuda")
    nbytes = nbytes or ((1 << 30) if cuda else (128 << 20))
    iters = iters or (20 if cuda else 5)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if cuda:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1000
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
    del src, dst
    return 2 * nbytes * iters / seconds


def measure_matmul_flops(device: str, n: int = 8192, iters: int = 10) -> float | None:
    """Dense bf16 GEMM rate of the device (n x n x n matmuls back to back), FLOP/s; None on CPU."""
    import torch

    if not device.startswith("cuda"):
        return None
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    end.synchronize()
    del a, b
    return 2 * n**3 * iters / (start.elapsed_time(end) / 1000)


def workload_floor(
    config,
    itemsize: int,
    num_prompts: int,
    input_len: int,
    output_len: int,
    max_batch: int,
    bandwidth: float,
    flops: float,
) -> dict:
    """Least time an offline batch can take on this device, whatever the engine: its prefill at the
    measured GEMM rate, then its decode at the larger of its compute time and its bytes (every
    weight once per step of max_batch sequences, each token's KV once per later token) over the
    copy bandwidth. A lower bound: no engine overlaps prefill and decode work for free."""
    h = config.hidden_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    linear = matmul_weights_per_token(config)
    head = config.vocab_size * h
    # Attention: QK^T and PV, 2 FLOPs per multiply-add, over each query's context (or window).
    prefill_context = num_prompts * attended_keys(config, 1, input_len)
    prefill_flops = 2 * linear * num_prompts * input_len + 2 * head * num_prompts + 4 * q * prefill_context
    decode_tokens = num_prompts * (output_len - 1)  # the first output token comes with the prefill
    decode_context = num_prompts * attended_keys(config, input_len + 1, output_len - 1)
    decode_flops = 2 * (linear + head) * decode_tokens + 4 * q * decode_context
    steps = math.ceil(num_prompts / max_batch) * (output_len - 1)
    # Each step's weights: of a layer of experts, those max_batch tokens pick (decode_bytes).
    weight_bytes = decode_bytes(config, itemsize, min(max_batch, num_prompts), 0)["weight_bytes"]
    decode_bytes_total = steps * weight_bytes + decode_context * 2 * kv * itemsize
    prefill_s = prefill_flops / flops
    decode_s = max(decode_flops / flops, decode_bytes_total / bandwidth)
    return {
        "prefill_flops": prefill_flops,
        "decode_flops": decode_flops,
        "decode_bytes": decode_bytes_total,
        "matmul_flops_per_s": flops,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "floor_s": prefill_s + decode_s,
        "max_output_tokens_per_s": num_prompts * output_len / (prefill_s + decode_s),
    }


# ---------------------------------------------------------------- the measured step


def load_runner(args, batch: int, context_len: int, extra: list[str] = ()):
    """The worker's ModelRunner for the whole model on one device, cache sized for the batch;
    `extra`: more `strata worker` flags."""
    from strata.services.worker.main import build

    block_size = args.block_size
    blocks_per_seq = math.ceil(context_len / block_size)
    num_blocks = batch * blocks_per_seq + 1  # block 0 left unused: tables are padded with it
    settings = {
        **vars(args),
        "max_model_len": (blocks_per_seq + 1) * block_size,
        "num_kv_blocks": num_blocks,
        "max_num_seqs": batch,
        "max_num_batched_tokens": max(batch, args.max_num_batched_tokens),
        "model": common.resolve_model(args),
    }
    names = ("device", "dtype", "block_size", "max_model_len", "num_kv_blocks", "max_num_seqs")
    names += ("max_num_batched_tokens", "gpu_memory_utilization", "seed", "model", "enforce_eager")
    runner, _ = build(service_args(["worker", *argv_for(settings, names), *extra]))
    runner.init_cache(num_blocks)
    return runner


def _admit_plan(
    batch: int, num_computed: int, num_scheduled: int, block_size: int, tokens: list[int], temperature: float, seed: int
):
    """A plan admitting `batch` sequences (re-admitting them if they exist) whose block tables
    cover num_computed + num_scheduled positions, each computing num_scheduled tokens."""
    from strata.v1 import engine_pb2

    blocks_per_seq = math.ceil((num_computed + num_scheduled) / block_size)
    seq_ids = list(range(1, batch + 1))
    return engine_pb2.StepPlan(
        step_id=1,
        released_seq_ids=seq_ids,  # a no-op the first time; lets the same runner be timed again
        new_sequences=[
            engine_pb2.NewSequence(
                seq_id=s,
                sampling=engine_pb2.SamplingOptions(temperature=temperature, top_p=1.0, seed=seed + s, logprobs=-1),
            )
            for s in seq_ids
        ],
        table_keep=[0] * batch,
        table_append_counts=[blocks_per_seq] * batch,
        table_append_ids=np.arange(1, 1 + batch * blocks_per_seq).tolist(),
        seq_ids=seq_ids,
        num_computed=[num_computed] * batch,
        num_scheduled=[num_scheduled] * batch,
        input_token_ids=tokens,
        sample=[True] * batch,
    )


def decode_plans(batch: int, context_len: int, block_size: int, vocab_size: int, temperature: float, seed: int):
    """(admit, step): the first plan admits `batch` sequences with full block tables, the second
    (repeated) decodes one token each at position context_len - 1."""
    from strata.v1 import engine_pb2

    tokens = common.random_prompts(1, batch, vocab_size, seed)[0]
    admit = _admit_plan(batch, context_len - 1, 1, block_size, tokens, temperature, seed)
    blocks_per_seq = math.ceil(context_len / block_size)
    step = engine_pb2.StepPlan(
        step_id=2,
        table_keep=[blocks_per_seq] * batch,
        table_append_counts=[0] * batch,
        seq_ids=admit.seq_ids,
        num_computed=admit.num_computed,
        num_scheduled=admit.num_scheduled,
        input_token_ids=tokens,
        sample=admit.sample,
    )
    return admit, step


def prefill_plan(batch: int, prompt_len: int, block_size: int, vocab_size: int, temperature: float, seed: int):
    """A plan admitting `batch` fresh prompts of prompt_len tokens and computing them whole
    (repeatable: it re-admits the same sequences)."""
    tokens = common.random_prompts(batch, prompt_len, vocab_size, seed)
    return _admit_plan(batch, 0, prompt_len, block_size, [t for p in tokens for t in p], temperature, seed)


def time_decode_step(
    runner, batch: int, context_len: int, steps: int, warmup: int, temperature: float, seed: int = 0
) -> dict:
    """A decode step of `batch` sequences on the worker's ModelRunner, timed three ways:

    - median_s (the step): steady-state time per step as the worker runs them, each plan
      launched while the previous step's tokens are still on their way to the host (the
      worker's step thread and finisher thread); host work, model, sampling and the copy back
      all included, measured between successive completions;
    - serial_s: one step alone, launch to tokens on the host (no overlap at all);
    - gpu_s: the step's GPU time from CUDA events (what the roofline bounds).
    """
    import torch

    admit, step = decode_plans(batch, context_len, runner.block_size, runner.config.vocab_size, temperature, seed)
    cuda = runner.device.type == "cuda"
    runner.execute(admit).finish()
    for _ in range(warmup):
        runner.execute(step).finish()
    if cuda:
        torch.cuda.synchronize(runner.device)
    serial = []
    for _ in range(steps):
        t0 = time.perf_counter()
        result = runner.execute(step).finish()
        if cuda:
            torch.cuda.synchronize(runner.device)
        serial.append(time.perf_counter() - t0)
    if len(result.token_ids) != batch:
        raise RuntimeError(f"decode step sampled {len(result.token_ids)} tokens for a batch of {batch}")
    periods, gpu = back_to_back(runner, step, steps)
    return {
        "batch": batch,
        "context_len": context_len,
        "steps": steps,
        "median_s": float(np.median(periods)),
        "min_s": float(periods.min()),
        "mean_s": float(periods.mean()),
        "p90_s": float(np.percentile(periods, 90)),
        "serial_s": statistics.median(serial),
        "gpu_s": statistics.median(gpu[1:]) if cuda else None,
    }


def back_to_back(runner, plan, steps: int) -> tuple[np.ndarray, list]:
    """`steps` runs of `plan` as the worker runs steps, each launched while the previous step's
    tokens travel to the host: the periods between completions, and each step's GPU seconds
    (CUDA events; the first is the warm-up step's)."""
    pending, done, gpu = runner.execute(plan), [], []
    for _ in range(steps + 1):
        launched = runner.execute(plan)
        result = pending.finish()
        done.append(time.perf_counter())
        gpu.append(result.gpu_seconds)
        pending = launched
    pending.finish()
    return np.diff(done), gpu


def bare_decode_step(args, batch: int, context_len: int, steps: int, warmup: int = 5) -> dict:
    """Load the model in this process, time its decode step, free it again."""
    runner = load_runner(args, batch, context_len)
    try:
        return time_decode_step(runner, batch, context_len, steps, warmup, args.temperature, args.seed)
    finally:
        del runner
        common.free_accelerator_memory()


def in_process_roofline(args, batch: int, context_len: int, steps: int) -> dict:
    """Measured decode step, copy bandwidth and the floor they imply, all in this process."""
    import torch

    runner = load_runner(args, batch, context_len)
    try:
        timing = time_decode_step(
            runner, batch, context_len, steps, warmup=5, temperature=args.temperature, seed=args.seed
        )
        itemsize = torch.empty((), dtype=runner.dtype).element_size()
        config, device, dtype = runner.config, str(runner.device), str(runner.dtype).removeprefix("torch.")
    finally:
        del runner
        common.free_accelerator_memory()
    bandwidth = measure_copy_bandwidth(device)
    floor = decode_bytes(config, itemsize, batch, context_len)
    floor_s = floor["total_bytes"] / bandwidth
    return {
        "batch": batch,
        "context_len": context_len,
        "dtype": dtype,
        "itemsize": itemsize,
        "copy_bandwidth_GBps": bandwidth / 1e9,
        **floor,
        "floor_s": floor_s,
        "measured": timing,
        "measured_over_floor": timing["median_s"] / floor_s,
        "config": config,
        "bandwidth_bytes_per_s": bandwidth,
    }


def with_scheduler_view(result: dict, sched: dict) -> dict:
    """Adds the step time the scheduler saw (decode-only windows) and its ratio to the floor at the
    batch that was actually running then."""
    if not sched:
        return result
    running = max(1, round(sched["mean_running"]))
    floor = decode_bytes(result["config"], result["itemsize"], running, result["context_len"])
    floor_s = floor["total_bytes"] / result["bandwidth_bytes_per_s"]
    result["scheduler"] = {
        **sched,
        "floor_s_at_running": floor_s,
        "batch_step_over_floor": sched["seconds_per_batch_step"] / floor_s,
    }
    return result


def roofline_rows(r: dict) -> list[tuple[str, str]]:
    m = r["measured"]
    rows = [
        ("batch x context", f"{r['batch']} x {r['context_len']} tokens ({r['dtype']})"),
        ("copy bandwidth", f"{r['copy_bandwidth_GBps']:,.0f} GB/s (2 x bytes / time of a device copy)"),
        ("bytes read", f"{r['weight_bytes'] / 1e9:.3f} GB weights + {r['kv_bytes'] / 1e9:.3f} GB KV"),
        ("floor", f"{r['floor_s'] * 1e3:.3f} ms"),
        (
            "measured step",
            f"{m['median_s'] * 1e3:.3f} ms median (min {m['min_s'] * 1e3:.3f}, "
            f"p90 {m['p90_s'] * 1e3:.3f}, {m['steps']} steps back to back, in-process ModelRunner)",
        ),
        ("measured / floor", f"{r['measured_over_floor']:.2f}x   (target <= 1.5x)"),
        (
            "  one step alone",
            f"{m['serial_s'] * 1e3:.3f} ms launch to tokens on the host "
            f"({m['serial_s'] / r['floor_s']:.2f}x the floor)",
        ),
    ]
    if m.get("gpu_s"):
        rows.append(
            (
                "  GPU time",
                f"{m['gpu_s'] * 1e3:.3f} ms per step from CUDA events ({m['gpu_s'] / r['floor_s']:.2f}x the floor)",
            )
        )
    s = r.get("scheduler")
    if s:
        rows += [
            (
                "scheduler view",
                f"{s['seconds_per_step'] * 1e3:.3f} ms per engine step, "
                f"{s['decode_tokens_per_step']:.1f} decode tokens per step",
            ),
            (
                "  batch step",
                f"{s['seconds_per_batch_step'] * 1e3:.3f} ms for all {s['mean_running']:.1f} running "
                f"sequences to advance one token",
            ),
            (
                "  over floor",
                f"{s['batch_step_over_floor']:.2f}x (floor at that batch {s['floor_s_at_running'] * 1e3:.3f} ms)",
            ),
        ]
        if "gpu_seconds_per_step" in s:
            rows.append(
                (
                    "  worker GPU",
                    f"{s['gpu_seconds_per_step'] * 1e3:.3f} ms busy per engine step, "
                    f"idle {s['gpu_idle_fraction']:.1%} of the time between steps",
                )
            )
    return rows


def json_ready(r: dict) -> dict:
    out = {k: v for k, v in r.items() if k != "config"}
    out["model_shape"] = {
        k: getattr(r["config"], k)
        for k in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "tie_word_embeddings",
            "num_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "sliding_window",
        )
    }
    return out


# ---------------------------------------------------------------- `strata bench roofline`


async def _decode_through_stack(endpoints, args, context_len: int) -> dict:
    """B requests at once; the scheduler's decode-only windows give its view of the step."""
    from strata.v1 import generate_pb2

    info = await common.model_info(endpoints.gateway)
    prompts = common.random_prompts(args.batch, args.input_len, info.vocab_size, args.seed)
    params = common.sampling_params(args.output_len, args.temperature, generate_pb2.FINAL_ONLY)
    # The decode-only phase lasts ~output_len steps (well under a second): sample it finely.
    async with common.StatsPoller(endpoints.scheduler, interval=0.1) as poller:
        records = await common.run_all_at_once(
            endpoints.gateway, prompts, params, args.request_timeout, desc="decode batch", progress=not args.no_progress
        )
    errors = common.failures(records)
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, e.g. {errors[0]}")
    return common.decode_only_timing(poller.samples)


def run(args) -> int:
    env = common.environment_info(args)
    common.print_header("roofline", env)
    context_len = args.context_len or args.input_len + args.output_len // 2
    sched = {}
    if args.through_stack:
        with common.cluster_for(args) as endpoints:
            sched = common.run(_decode_through_stack(endpoints, args, context_len))
    result = with_scheduler_view(in_process_roofline(args, args.batch, context_len, args.steps), sched)
    common.print_section(
        "Decode step vs roofline", roofline_rows(result), note="floor = (weight bytes + KV bytes read) / copy bandwidth"
    )
    if args.through_stack and not sched:
        print("  (the scheduler saw no decode-only interval: no stack view)")
    row = _markdown_row(env, args, result)
    print("RESULTS.md row:\n" + row)
    common.write_json(
        args.output,
        {
            "benchmark": "roofline",
            "environment": env,
            "config": common.args_dict(args),
            "roofline": json_ready(result),
            "markdown_row": row,
        },
    )
    return 0


def _markdown_row(env, args, r: dict) -> str:
    f, s = common.fmt, r.get("scheduler", {})
    cells = [
        env["date"][:10],
        env["commit"],
        env["device_name"],
        env["model"],
        str(args.pipeline_stages),
        f"{r['batch']} x {r['context_len']}",
        f(r["copy_bandwidth_GBps"], ",.0f"),
        f(r["floor_s"] * 1e3, ".3f"),
        f(r["measured"]["median_s"] * 1e3, ".3f"),
        f(r["measured_over_floor"], ".2f"),
        f(s.get("seconds_per_batch_step", 0) * 1e3 or None, ".3f"),
        f(s.get("batch_step_over_floor"), ".2f"),
    ]
    return "| " + " | ".join(cells) + " |"
