"""`strata bench prefix-groups`: an offline batch whose requests share prefixes, three ways in one
run, each on a fresh cluster:

  groups              Gateway.GenerateGroups: each group's prefix computed once, pinned, read once
                      per step (cascade attention)
  cache               the same requests one by one (Generate), with the automatic prefix cache;
                      requests that hit the same cached prefix get cascade attention too
  cache, no cascade   the same, with --disable-cascade-attn: the prefix cache as it was before
                      cascade attention (issue 12's baseline)
  no cache            the same requests with the prefix cache off (and so no shared prefixes)

Default workload (issue 12): 32 groups of 16 requests, each group sharing a 2,000-token prefix,
each request 200 tokens of its own and 100 generated. Where pinning matters, the prefixes do not
all fit in the KV cache at once, and the cache way recomputes the ones it evicted:

    strata bench prefix-groups --num-kv-blocks 2500 --max-model-len 4096   # 32 prefixes = 4,000 blocks

The one-by-one ways send their requests shuffled (--order shuffled, the default; issue 27's
baseline) or each group's together (--order grouped). It prints req/s, output tok/s, prefill
tokens computed and peak KV blocks of each way, and the ratios. On a GPU it then times the decode
attention of a group batch (cascade against paged) against its floor, in process
(strata.bench.cascade_attention).
"""

from __future__ import annotations

import os
import time

import numpy as np

from strata.bench import common

TARGET_OVER_CACHE = 1.35
TARGET_OVER_NO_CACHE = 3.5
WAYS = ("groups", "cache", "cache, no cascade", "no cache")
CLUSTER_FLAGS = {
    "groups": {},
    "cache": {},
    "cache, no cascade": {"disable_cascade_attn": True},
    "no cache": {"no_prefix_caching": True},
}


def workload(args, vocab_size: int) -> list[tuple[list[int], list[list[int]]]]:
    """(prefix, members' own tokens) per group, random ids clear of the special tokens."""
    rng = np.random.default_rng(args.seed)
    return [
        (
            rng.integers(common.FIRST_PROMPT_TOKEN, vocab_size, args.prefix_len).tolist(),
            rng.integers(common.FIRST_PROMPT_TOKEN, vocab_size, (args.group_size, args.suffix_len)).tolist(),
        )
        for _ in range(args.num_groups)
    ]


async def _as_groups(endpoints, args, groups) -> tuple[int, int]:
    """(output tokens, failed members) through GenerateGroups."""
    from strata.v1 import generate_pb2, generate_pb2_grpc

    params = common.sampling_params(args.output_len, args.temperature, generate_pb2.FINAL_ONLY, seed=args.seed)

    def messages():
        for g, (prefix, members) in enumerate(groups):
            yield generate_pb2.PrefixGroup(
                prefix_token_ids=generate_pb2.TokenIds(ids=prefix),
                members=[
                    generate_pb2.GenerateRequest(
                        request_id=f"g{g}m{m}", params=params, prompt_token_ids=generate_pb2.TokenIds(ids=own)
                    )
                    for m, own in enumerate(members)
                ],
            )

    tokens = failed = 0
    total = sum(len(members) for _, members in groups)
    async with common.open_channel(endpoints.gateway) as channel:
        stub = generate_pb2_grpc.GatewayStub(channel)
        with common._progress(total, "groups", not args.no_progress) as bar:
            async for response in stub.GenerateGroups(messages(), timeout=args.request_timeout):
                if response.HasField("error"):
                    failed += 1
                    bar.update(1)
                elif response.response.finished:
                    tokens += response.response.usage.completion_tokens
                    bar.update(1)
    return tokens, failed


def request_order(prompts: list, order: str, seed: int) -> list:
    """The one-by-one ways' send order: `grouped` keeps each group's requests together, which
    lets the prefix cache keep a group's prefix while its members run; `shuffled` (seeded) is an
    offline batch in no particular order, where the cache way meets prefixes it evicted."""
    if order == "grouped":
        return prompts
    permutation = np.random.default_rng(seed).permutation(len(prompts))
    return [prompts[i] for i in permutation]


async def _as_requests(endpoints, args, groups) -> tuple[int, int]:
    from strata.v1 import generate_pb2

    prompts = request_order([prefix + own for prefix, members in groups for own in members], args.order, args.seed)
    params = common.sampling_params(args.output_len, args.temperature, generate_pb2.FINAL_ONLY, seed=args.seed)
    records = await common.run_all_at_once(
        endpoints.gateway, prompts, params, args.request_timeout, desc="requests", progress=not args.no_progress
    )
    return sum(r.output_tokens for r in records), len(common.failures(records))


async def _phase(endpoints, args, way: str) -> dict:

    info = await common.model_info(endpoints.gateway)
    await common.warm_up(endpoints.gateway, args, info.vocab_size, 8, args.seed + 99)
    groups = workload(args, info.vocab_size)
    before = await common.cluster_stats(endpoints)
    start = time.perf_counter()
    tokens, failed = await (_as_groups if way == "groups" else _as_requests)(endpoints, args, groups)
    elapsed = time.perf_counter() - start
    after = await common.cluster_stats(endpoints)
    requests = args.num_groups * args.group_size
    return {
        "requests": requests,
        "failed": failed,
        "elapsed_s": elapsed,
        "requests_per_s": requests / elapsed,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "scheduler": common.stats_delta(before, after),
    }


def _cluster_flags(args, way: str) -> dict:
    """The way's cluster: its flags, and with --profile-dir its workers' profile in DIR/<way>.txt
    (the window: STRATA_PROFILE_STEPS, which `strata serve` reads)."""
    flags = dict(CLUSTER_FLAGS[way])
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
        flags["profile_output"] = os.path.join(args.profile_dir, way.replace(", ", "-").replace(" ", "-") + ".txt")
    return flags


def selected_ways(spec: str) -> tuple[str, ...]:
    """--ways' names (dashes for the spaces and commas of WAYS) as WAYS' names, in the order given."""
    by_flag = {way.replace(", ", "-").replace(" ", "-"): way for way in WAYS}
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in by_flag]
    if unknown or not names:
        raise SystemExit(f"--ways: unknown {', '.join(unknown) or '(empty)'}; choose from {', '.join(by_flag)}")
    return tuple(by_flag[name] for name in names)


RATIOS = {  # (name, numerator way, denominator way, target)
    "groups_over_cache": ("groups / prefix cache", "groups", "cache", TARGET_OVER_CACHE),
    "groups_over_no_cache": ("groups / no prefix cache", "groups", "no cache", TARGET_OVER_NO_CACHE),
    "groups_over_cache_no_cascade": ("groups / cache, no cascade", "groups", "cache, no cascade", None),
}


def run(args) -> int:
    env = common.environment_info(args)
    common.print_header("prefix-groups", env)
    ways = selected_ways(args.ways)
    phases = {}
    for way in ways:
        with common.cluster_for(common.with_overrides(args, **_cluster_flags(args, way))) as endpoints:
            phases[way] = common.run(_phase(endpoints, args, way))
    # With replicas the statistics are their sums: wall-time shares are each replica's mean.
    replicas = max(args.data_parallel_size, 1)
    for way in ways:
        p, s = phases[way], phases[way]["scheduler"]
        idle = p["elapsed_s"] - s.get("busy_seconds", 0) / replicas
        common.print_section(
            way,
            [
                ("requests", f"{p['requests'] - p['failed']} ok, {p['failed']} failed in {p['elapsed_s']:.2f} s"),
                ("req/s", f"{p['requests_per_s']:,.1f} ({p['output_tokens_per_s']:,.0f} output tok/s)"),
                ("prefill tokens computed", common.fmt(s.get("prefill_tokens_computed"), ",")),
                ("peak KV blocks", common.fmt(s.get("peak_used_kv_blocks"), ",")),
                ("steps", common.fmt(s.get("steps"), ",")),
                # Where a way loses time: wall with no step in flight (the client's requests not
                # yet arrived, a group waiting for its members), the host launching, the GPU.
                (
                    "no step in flight",
                    f"{idle:.3f} s of the wall time" + (" (a replica's mean)" if replicas > 1 else ""),
                ),
                *common.gpu_timeline_rows(s, p["elapsed_s"] * replicas),
            ],
        )
    rps = {way: phases[way]["requests_per_s"] for way in ways}
    ratios = {key: rps[a] / rps[b] for key, (_, a, b, _) in RATIOS.items() if a in rps and b in rps}
    common.print_section(
        f"{args.num_groups} groups x {args.group_size}, prefix {args.prefix_len}, "
        f"own {args.suffix_len}, output {args.output_len}, one by one {args.order}",
        [
            (label, f"{ratios[key]:.2f}x" + (f"   (target >= {target:g}x)" if target else ""))
            for key, (label, _, _, target) in RATIOS.items()
            if key in ratios
        ],
    )
    attention = None
    if args.attention and common.resolve_device(args.device).startswith("cuda"):
        from strata.bench import cascade_attention

        attention = cascade_attention.measure(
            num_groups=args.num_groups,
            group_size=args.group_size,
            prefix_len=args.prefix_len,
            suffix_len=args.suffix_len,
            block_size=args.block_size,
        )
    result = {
        "benchmark": "prefix-groups",
        "environment": env,
        "config": common.args_dict(args),
        "phases": phases,
        "ratios": ratios,
        "decode_attention": attention,
    }
    cells = [
        env["date"][:10],
        env["commit"],
        env["device_name"],
        env["model"],
        f"{args.num_groups} x {args.group_size}, {args.prefix_len} + {args.suffix_len} / {args.output_len}",
        " / ".join(f"{rps[way]:,.1f}" if way in rps else "-" for way in WAYS),
        *(f"{ratios[key]:.2f}" if key in ratios else "-" for key in RATIOS),
        " / ".join(
            common.fmt(phases[way]["scheduler"].get("prefill_tokens_computed"), ",") if way in phases else "-"
            for way in WAYS
        ),
    ]
    result["markdown_row"] = "| " + " | ".join(cells) + " |"
    print("RESULTS.md row:\n" + result["markdown_row"])
    common.write_json(args.output, result)
    return 1 if any(phases[way]["failed"] for way in ways) else 0
