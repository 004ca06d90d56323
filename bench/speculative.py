"""`strata bench speculative`: the same requests with and without speculative decoding, through
the full stack, in one run.

Two prompt sets on a real chat model (the default SmolLM2-135M-Instruct, or --model): `lookup`,
where the answer repeats or edits a passage of the prompt (prompt lookup pays), and `open`,
open-ended questions (it does not). Each runs at the --batches concurrencies. The table gives
output tok/s with and without speculation, the speedup, the acceptance rate and the mean
accepted length, and checks every request's tokens against the run without speculation. In
bf16 a verify step over k + 1 positions need not round like k + 1 decode steps, so for a request
that diverges it prints the first divergence and the target's logit margin there (the top-2
logprob gap of the plain run): a near-tie is numerics, a clear margin is a bug.

With --cost-model (on by default with a draft model) it also times, in this process, the
target's decode step, its verify step over k + 1 positions and the draft's decode step, and
prints the speedup those costs give at acceptance rates 0.5, 0.7 and 0.9: the draft made of the
target's first --draft-num-layers layers, and a dummy 8B target with a dummy 1B draft.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np

from strata.bench import common
from strata.openai_format import chat_prompt_ids

PASSAGES = [
    '''def moving_average(values, window):
    """Average of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages''',
    """class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}

    def get(self, key):
        if key not in self.items:
            return None
        value = self.items.pop(key)
        self.items[key] = value
        return value

    def put(self, key, value):
        self.items.pop(key, None)
        self.items[key] = value
        if len(self.items) > self.capacity:
            self.items.pop(next(iter(self.items)))""",
    """SELECT customers.name, COUNT(orders.id) AS order_count, SUM(orders.total) AS revenue
FROM customers
JOIN orders ON orders.customer_id = customers.id
WHERE orders.created_at >= '2024-01-01'
GROUP BY customers.name
HAVING COUNT(orders.id) > 3
ORDER BY revenue DESC
LIMIT 20;""",
    "The old lighthouse stood at the edge of the harbour for more than two hundred years. Every evening "
    "the keeper climbed one hundred and twelve steps, trimmed the wick, polished the brass and wound the "
    "clockwork that turned the great lens. Sailors said they could see its beam from thirty miles out on a "
    "clear night, and on foggy nights they listened instead for the horn, which sounded twice every minute.",
    'The report says: "Revenue grew by 12.5 percent in 2023." The chairman added: "We expect similar growth '
    'next year." A spokesperson later clarified: "The figures exclude the acquisition." Analysts called the '
    'statement "cautious but credible", and one wrote that "the margins are the real story here."',
    """{"name": "strata", "version": "0.1.0", "services": ["gateway", "scheduler", "worker"],
 "ports": {"gateway": 50051, "scheduler": 50052, "worker": 50061},
 "features": {"speculative_decoding": true, "prefix_caching": true, "pipeline_parallel": true}}""",
]
TASKS = [
    "Repeat the following text exactly, character for character, and nothing else:\n\n{}",
    "Rewrite the following, changing nothing except that every name written in lower case with underscores "
    "is kept as it is. Output the full text again:\n\n{}",
    "Copy the following into a Markdown code block, unchanged:\n\n{}",
    "Quote back every line of the following that contains a number or a quotation, exactly as written:\n\n{}",
]
OPEN = [
    "Write a short poem about the sea at night.",
    "What are three tips for learning a new language?",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "What is the difference between a list and a tuple in Python?",
    "Describe a perfect autumn day.",
    "Suggest a name for a small bakery and explain why.",
    "How do bees make honey?",
    "Write a two-sentence horror story.",
    "What should I pack for a weekend hiking trip?",
    "Why do cats purr?",
    "Summarise the plot of a fairy tale of your choice in three sentences.",
    "What are the benefits of regular exercise?",
    "Invent a new board game and describe its rules briefly.",
    "How does a rainbow form?",
    "Write a friendly email inviting a colleague to lunch.",
]
ACCEPTANCE_RATES = (0.5, 0.7, 0.9)


def prompt_sets(model_dir: str) -> dict[str, list[list[int]]]:
    """Token ids of both sets, through the model's chat template when it has one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def encode(text: str) -> list[int]:
        if tokenizer.chat_template:
            return chat_prompt_ids(tokenizer, [{"role": "user", "content": text}])
        return tokenizer.encode(text)

    lookup = [encode(task.format(p)) for p in PASSAGES for task in TASKS]
    return {"lookup": lookup, "open": [encode(q) for q in OPEN]}


def _rounds_note(stats: dict) -> str:
    """', N verify rounds' where verify steps ran several rounds (--speculative-rounds)."""
    rounds = stats.get("spec_decode_verify_rounds", 0)
    return f", {rounds:,} verify rounds" if rounds > stats["spec_decode_verify_steps"] else ""


def _params(args):
    from strata.v1 import generate_pb2

    params = generate_pb2.SamplingParams(
        max_tokens=args.output_len, temperature=args.temperature, output_kind=generate_pb2.DELTA
    )
    if args.temperature > 0:
        params.seed = args.seed
    if args.ignore_eos:  # fixed-length requests
        params.ignore_eos, params.min_tokens = True, args.output_len
    return params


async def _generate(stub, prompt: list[int], params, timeout: float) -> list[int]:
    from strata.v1 import generate_pb2

    request = generate_pb2.GenerateRequest(prompt_token_ids=generate_pb2.TokenIds(ids=prompt), params=params)
    tokens: list[int] = []
    async for response in stub.Generate(request, timeout=timeout):
        for output in response.outputs:
            tokens.extend(output.token_ids)
    return tokens


async def _phase(endpoints, args, prompts: list[list[int]], batch: int) -> dict:
    """Closed loop at `batch` streams over max(2 * batch, 8) requests; tokens of each request."""
    from strata.v1 import generate_pb2_grpc

    count = max(2 * batch, 8)
    work = [prompts[i % len(prompts)] for i in range(count)]
    outputs: list[list[int] | None] = [None] * count
    params = _params(args)
    before = await common.scheduler_stats(endpoints.scheduler)
    async with common.open_channel(endpoints.gateway) as channel:
        stub = generate_pb2_grpc.GatewayStub(channel)
        queue = list(range(count))
        start = time.perf_counter()

        async def stream():
            while queue:
                i = queue.pop(0)
                outputs[i] = await _generate(stub, work[i], params, args.request_timeout)

        await asyncio.gather(*(stream() for _ in range(min(batch, count))))
        elapsed = time.perf_counter() - start
    after = await common.scheduler_stats(endpoints.scheduler)
    spec = {}
    if before is not None:
        spec = {
            name: getattr(after, name) - getattr(before, name)
            for name in ("spec_decode_drafts", "spec_decode_draft_tokens", "spec_decode_accepted_tokens")
        }
        spec["scheduler"] = common.stats_delta(before, after)
    tokens = sum(len(o) for o in outputs)
    return {
        "requests": count,
        "output_tokens": tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed,
        "outputs": outputs,
        "prompts": work,
        **spec,
    }


def _cluster_runs(args, sets, method: str | None, spec: dict | None = None) -> dict:
    """Every (set, batch) phase on a fresh cluster (speculating with `method`, or not). Given the
    speculating run's results (`spec`), also each phase's divergences from it, with the plain
    run's logit margin there, measured while the cluster is still up."""
    results = {}
    with common.cluster_for(common.with_overrides(args, speculative_method=method)) as endpoints:
        warm_up = sets.get("open") or next(iter(sets.values()))  # (the open set's, as before --sets)
        common.run(_phase(endpoints, args, warm_up[:2], 1))  # warm-up (graphs, caches)
        for name, prompts in sets.items():
            for batch in args.batches:
                spied = f"{method or 'plain'}-{name}-{batch}"  # (--spy-dir: each phase's stacks)
                with common.sampled_stacks(endpoints.service_pids, args.spy_dir, spied, args.spy_native):
                    results[(name, batch)] = phase = common.run(_phase(endpoints, args, prompts, batch))
                if spec is None:
                    continue
                diverged = _divergences(spec[(name, batch)]["outputs"], phase["outputs"])
                phase["num_diverged"] = len(diverged)
                if args.max_divergence_checks >= 0:  # (each is a rerun of the prompt alone)
                    diverged = diverged[: args.max_divergence_checks]
                cases = [(phase["prompts"][i], position, phase["outputs"][i]) for i, position in diverged]
                margins = common.run(_margins(endpoints, args, cases)) if cases else []
                phase["divergences"] = [(i, pos, *m) for (i, pos), m in zip(diverged, margins)]
    return results


async def _margins(endpoints, args, divergent: list[tuple[list[int], int, list[int]]]) -> list[tuple[float, bool]]:
    """At each (prompt, position, plain tokens) divergence: the top-2 logprob gap there when the
    plain cluster reruns the prompt alone, and whether that rerun already differs from the plain
    run's tokens before it (the batched run drifted: a batch-size rounding effect, and the gap
    belongs to another context)."""
    from strata.v1 import generate_pb2, generate_pb2_grpc

    margins = []
    async with common.open_channel(endpoints.gateway) as channel:
        stub = generate_pb2_grpc.GatewayStub(channel)
        for prompt, position, plain_tokens in divergent:
            params = _params(args)
            params.logprobs = 2
            params.max_tokens = position + 1
            request = generate_pb2.GenerateRequest(prompt_token_ids=generate_pb2.TokenIds(ids=prompt), params=params)
            logprobs, tokens = [], []
            async for response in stub.Generate(request, timeout=args.request_timeout):
                for output in response.outputs:
                    logprobs.extend(output.logprobs)
                    tokens.extend(output.token_ids)
            top = logprobs[position].top if position < len(logprobs) else []
            margin = top[0].logprob - top[1].logprob if len(top) > 1 else float("inf")
            margins.append((margin, tokens[:position] != list(plain_tokens[:position])))
    return margins


def _divergences(spec_outputs: list[list[int]], plain_outputs: list[list[int]]) -> list[tuple[int, int]]:
    """(request, first differing token) of every request whose tokens differ."""
    diverged = []
    for i, (a, b) in enumerate(zip(spec_outputs, plain_outputs)):
        if a != b:
            diverged.append((i, next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))))
    return diverged


def run(args) -> int:
    env = common.environment_info(args)
    model = common.resolve_model(args) or _default_model()
    args = common.with_overrides(args, model=model)
    common.print_header("speculative", env)
    print(
        f"{args.speculative_method}, k={args.num_speculative_tokens}, model {model}, batches {args.batches}, "
        f"{args.output_len} tokens {'each (ignore_eos)' if args.ignore_eos else 'at most'}, temperature {args.temperature}",
        flush=True,
    )
    rows = []
    if args.through_stack:
        every = prompt_sets(args.tokenizer or model)  # (a dummy model's prompts: --tokenizer's)
        sets = {name: every[name] for name in args.sets}
        spec = _cluster_runs(args, sets, args.speculative_method)
        plain = _cluster_runs(args, sets, None, spec=spec)
        rows = _table(spec, plain, near_tie_margin(args))
    cost = None
    if args.cost_model if args.cost_model is not None else args.speculative_method == "draft":
        cost = cost_model(args, model)
    common.write_json(args.output, {"environment": env, "rows": rows, "cost_model": cost})
    return 0


def near_tie_margin(args) -> float:
    """Largest top-2 logit gap a rounding difference explains: two bf16 ulps of a logit between 16
    and 32 (where chat models' top logits sit), or float32's rounding."""
    dtype = (
        args.dtype
        if args.dtype != "auto"
        else ("bfloat16" if common.resolve_device(args.device).startswith("cuda") else "float32")
    )
    return 0.25 if dtype in ("bfloat16", "float16") else 1e-3


def _table(spec: dict, plain: dict, tie: float) -> list[dict]:
    rows = []
    print(
        f"\n{'set':<8}{'batch':>6}{'plain tok/s':>13}{'spec tok/s':>12}{'speedup':>9}{'accept':>8}"
        f"{'mean acc len':>14}{'identical':>11}"
    )
    for key in spec:
        s, p = spec[key], plain[key]
        drafts = s.get("spec_decode_drafts", 0)
        acceptance = s["spec_decode_accepted_tokens"] / s["spec_decode_draft_tokens"] if drafts else 0.0
        mean_len = 1 + s["spec_decode_accepted_tokens"] / drafts if drafts else 1.0
        diverged = p["divergences"]
        row = {
            "set": key[0],
            "batch": key[1],
            "plain_tokens_per_s": p["tokens_per_s"],
            "spec_tokens_per_s": s["tokens_per_s"],
            "speedup": s["tokens_per_s"] / p["tokens_per_s"],
            "acceptance_rate": acceptance,
            "mean_accepted_length": mean_len,
            "requests": s["requests"],
            "identical": s["requests"] - p.get("num_diverged", len(diverged)),
            "divergences": diverged,
        }
        rows.append(row)
        print(
            f"{key[0]:<8}{key[1]:>6}{p['tokens_per_s']:>13,.0f}{s['tokens_per_s']:>12,.0f}{row['speedup']:>8.2f}x"
            f"{acceptance:>8.2f}{mean_len:>14.2f}{row['identical']:>7}/{s['requests']}"
        )
        for run, phase in (("plain", p), ("spec", s)):
            stats = phase.get("scheduler") or {}
            if stats.get("steps"):
                steps = stats["steps"]
                rows_ = common.gpu_timeline_rows(stats, phase["elapsed_s"])
                print(
                    f"    {run}: {steps:,} steps"
                    + (
                        f" ({stats['spec_decode_verify_steps']:,} verifying" + _rounds_note(stats) + ")"
                        if "spec_decode_verify_steps" in stats
                        else ""
                    )
                    + f", {phase['output_tokens'] / steps:.2f} output tokens per step; "
                    + "; ".join(f"{k}: {v}" for k, v in rows_)
                )
        for i, position, margin, drifted in diverged:
            if drifted:
                verdict = "the plain run alone differs earlier (batch-size rounding): margin of another context"
            else:
                verdict = "near-tie (rounding)" if margin <= tie else "CLEAR MARGIN (a bug)"
            print(f"    request {i}: first divergence at token {position}, target logit margin {margin:.4f}: {verdict}")
    return rows


def _default_model() -> str:
    from strata.model_source import resolve_model

    return resolve_model(None)[0]


# ---------------------------------------------------------------- cost model


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification emits when each draft is accepted with probability alpha."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def predicted_speedup(alpha: float, k: int, decode_s: float, verify_s: float, draft_s: float) -> float:
    """k draft steps and one verify step emit expected_tokens; plain decoding needs that many steps."""
    return expected_tokens(alpha, k) * decode_s / (k * draft_s + verify_s)


def cost_model(args, model: str) -> list[dict]:
    pairs = []
    if args.draft_num_layers:
        pairs.append(
            (f"{model} (first {args.draft_num_layers} layers as the draft)", model, model, args.draft_num_layers)
        )
    if common.resolve_device(args.device).startswith("cuda"):  # 8B of random weights: GPU only
        pairs.append(("dummy 8B target, dummy 1B draft", "dummy:llama-3-8b", "dummy:llama-3.2-1b", 0))
    rows = []
    for name, target, draft, layers in pairs:
        costs = _step_costs(args, target, draft, layers)
        print(f"\ncost model: {name} (k={args.num_speculative_tokens}, context {args.cost_context_len})")
        print(
            f"{'batch':>6}{'decode ms':>11}{'verify ms':>11}{'draft ms':>10}{'draft/decode':>14}"
            + "".join(f"{f'@{a}':>9}" for a in ACCEPTANCE_RATES)
        )
        for batch, t in costs.items():
            speedups = [
                predicted_speedup(a, args.num_speculative_tokens, t["decode_s"], t["verify_s"], t["draft_s"])
                for a in ACCEPTANCE_RATES
            ]
            rows.append({"pair": name, "batch": batch, **t, "predicted_speedup": dict(zip(ACCEPTANCE_RATES, speedups))})
            print(
                f"{batch:>6}{t['decode_s'] * 1e3:>11.3f}{t['verify_s'] * 1e3:>11.3f}{t['draft_s'] * 1e3:>10.3f}"
                f"{t['draft_s'] / t['decode_s']:>14.2f}" + "".join(f"{s:>8.2f}x" for s in speedups)
            )
    return rows


def _step_costs(args, target: str, draft: str, draft_layers: int) -> dict[int, dict]:
    """Per batch: decode, verify (k + 1 positions) and draft decode step times, in process. Decode
    and draft steps as they run back to back (the worker's pipelined rate: plain decoding runs
    that way, and so do a proposal's k draft steps); the verify step alone, launch to tokens on
    the host, as each round waits for it. One runner per model, sized for the largest batch."""
    from strata.bench.roofline import load_runner, time_decode_step

    k, context, largest = args.num_speculative_tokens, args.cost_context_len, max(args.batches)
    spec = [
        "--speculative-method",
        "draft",
        "--num-speculative-tokens",
        str(k),
        "--speculative-max-batch",
        str(largest),
    ]
    costs = {b: {} for b in args.batches}
    runner = load_runner(common.with_overrides(args, model=target), largest, context + k + 1, extra=spec)
    try:
        for b in args.batches:
            costs[b]["decode_s"] = time_decode_step(runner, b, context, 20, 5, 0.0, args.seed)["median_s"]
            costs[b]["verify_s"] = _time_verify_step(runner, b, context, k, args.seed)
    finally:
        del runner
        common.free_accelerator_memory()
    extra = ["--role", "draft", "--speculative-max-batch", str(largest)]  # graphs up to the largest batch
    extra += ["--draft-num-layers", str(draft_layers)] if draft_layers else []
    runner = load_runner(common.with_overrides(args, model=draft), largest, context + k + 1, extra=extra)
    try:
        for b in args.batches:
            costs[b]["draft_s"] = time_decode_step(runner, b, context, 20, 5, 0.0, args.seed)["median_s"]
    finally:
        del runner
        common.free_accelerator_memory()
    return costs


def _time_verify_step(runner, batch: int, context: int, k: int, seed: int, steps: int = 20) -> float:
    """A verify step: every sequence computes its last token plus k drafts at position context - 1."""
    from strata.bench.roofline import decode_plans

    admit, step = decode_plans(batch, context + k, runner.block_size, runner.config.vocab_size, 0.0, seed)
    runner.execute(admit).finish()
    rng = np.random.default_rng(seed)
    tokens = rng.integers(2, runner.config.vocab_size, size=batch * (k + 1)).tolist()
    del step.num_computed[:], step.num_scheduled[:], step.input_token_ids[:]
    step.num_computed.extend([context - 1] * batch)
    step.num_scheduled.extend([k + 1] * batch)
    step.input_token_ids.extend(tokens)
    step.num_draft_tokens.extend([k] * batch)
    for _ in range(5):
        runner.execute(step).finish()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.execute(step).finish()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
