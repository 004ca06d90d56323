"""Decode attention of a batch whose requests share prefixes: cascade against paged, and both
against the cascade's floor, in process on one GPU (Llama-3.2-1B attention: 32/8 heads, D=64).

    python -m strata.bench.cascade_attention                      # 32 groups x 16, prefix 2000 + 200 own
    python -m strata.bench.cascade_attention --sweep              # also prefix splits, warps and stages
    python -m strata.bench.cascade_attention --num-groups 1 --group-size 64 --prefix-len 1024 --suffix-len 64

The floor counts each group's shared KV once and each request's own KV, plus the query and the
output, over the device's copy bandwidth measured in the same run. Times are CUDA-graph replays
(as the server's decode steps run), per layer.
"""

from __future__ import annotations

import argparse
import sys

import torch

LLAMA_1B = dict(num_q_heads=32, num_kv_heads=8, head_dim=64)
TARGET_OVER_FLOOR = 1.3


def measure(
    *,
    num_groups: int,
    group_size: int,
    prefix_len: int,
    suffix_len: int,
    block_size: int = 16,
    num_layers: int = 16,
    sweep: bool = False,
    seed: int = 0,
) -> dict:
    import triton.testing

    from strata.bench.bench_attention import copy_bandwidth_gbps
    from strata.kernels.attention_launch import AttentionLaunchConfig
    from strata.kernels.cascade_attention import (
        MAX_PREFIX_SPLITS,
        PrefixLaunchConfig,
        cascade_attention,
        choose_own_keys_config,
        choose_prefix_config,
        launch_shared_prefix,
    )
    from strata.kernels.paged_attention import Partials, launch_paged_attention, paged_attention
    from strata.kernels.testing import make_paged_batch, share_prefixes

    torch.manual_seed(seed)
    num_seqs = num_groups * group_size
    # Mid-decode: each request has its prefix, its own prompt tokens and some generated ones.
    contexts = [prefix_len + suffix_len + (i * 37) % 50 for i in range(num_seqs)]
    batch = make_paged_batch(
        [1] * num_seqs,
        contexts,
        block_size=block_size,
        dtype=torch.bfloat16,
        device="cuda",
        poison_unowned=False,
        seed=seed,
        **LLAMA_1B,
    )
    runs = share_prefixes(batch, [group_size] * num_groups, [prefix_len] * num_groups)
    scale = LLAMA_1B["head_dim"] ** -0.5
    args = batch.attention_args()
    out = torch.empty_like(batch.query)

    def cascade(prefix_config=None, config=None):
        return cascade_attention(*args[:5], runs, *args[5:], scale, out=out, config=config, prefix_config=prefix_config)

    want = paged_attention(*args, scale).float()
    error = (cascade().float() - want).abs().max().item()
    assert error < 3e-2, f"cascade disagrees with paged attention: max abs error {error}"

    copy_gbps = copy_bandwidth_gbps()
    kv_bytes_per_token = 2 * LLAMA_1B["num_kv_heads"] * LLAMA_1B["head_dim"] * batch.kv_cache.element_size()
    io_bytes = 2 * batch.query.numel() * batch.query.element_size()
    own_tokens = sum(contexts) + num_seqs - num_groups * group_size * prefix_len
    cascade_bytes = (num_groups * prefix_len + own_tokens) * kv_bytes_per_token + io_bytes
    paged_bytes = (sum(contexts) + num_seqs) * kv_bytes_per_token + io_bytes
    floor_us = cascade_bytes / (copy_gbps * 1e3)
    paged_floor_us = paged_bytes / (copy_gbps * 1e3)

    def time_us(fn) -> float:
        return triton.testing.do_bench_cudagraph(fn, rep=200) * 1e3

    cascade_us = time_us(cascade)
    paged_us = time_us(lambda: paged_attention(*args, scale, out=out))
    auto = choose_prefix_config(
        num_runs=num_groups,
        max_run_tokens=num_seqs,
        max_prefix_len=prefix_len,
        num_q_heads=LLAMA_1B["num_q_heads"],
        num_kv_heads=LLAMA_1B["num_kv_heads"],
        head_dim=LLAMA_1B["head_dim"],
        sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
    )
    print(
        f"decode attention, {num_groups} groups x {group_size} requests, prefix {prefix_len} + ~{suffix_len} own "
        f"keys each, Llama-3.2-1B heads, bf16, block {block_size} (max abs diff to paged {error:.1e})"
    )
    print(f"  device copy bandwidth {copy_gbps:,.0f} GB/s")
    print(
        f"  cascade (prefix splits {auto.prefix_splits}) {cascade_us:8.1f} us per layer   floor {floor_us:7.1f} us   "
        f"{cascade_us / floor_us:.2f}x its floor (target <= {TARGET_OVER_FLOOR:g}x)"
    )
    print(
        f"  paged                   {paged_us:8.1f} us per layer   floor {paged_floor_us:7.1f} us   "
        f"{paged_us / paged_floor_us:.2f}x its own floor; cascade is {paged_us / cascade_us:.2f}x faster"
    )
    print(
        f"  x {num_layers} layers: cascade {cascade_us * num_layers / 1e3:.2f} ms, paged "
        f"{paged_us * num_layers / 1e3:.2f} ms per decode step"
    )
    # Where the time goes: each of the cascade's two launches alone, against its share of the floor.
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    own_config = choose_own_keys_config(
        num_seqs=num_seqs,
        num_q_heads=LLAMA_1B["num_q_heads"],
        num_kv_heads=LLAMA_1B["num_kv_heads"],
        head_dim=LLAMA_1B["head_dim"],
        max_query_len=1,
        max_seq_len=max(contexts) + 1,
        sm_count=sm_count,
    )
    partials = Partials.allocate(batch.query, auto.prefix_splits)
    launch_shared_prefix(batch.query, batch.kv_cache, args[4], runs, scale, auto, partials)
    prefix_us = time_us(lambda: launch_shared_prefix(batch.query, batch.kv_cache, args[4], runs, scale, auto, partials))

    def own(config=own_config):
        launch_paged_attention(*args[:5], scale, config, out, partials, seq_prefix_lens=runs.seq_prefix_lens)

    own_us = time_us(own)
    prefix_floor_us = num_groups * prefix_len * kv_bytes_per_token / (copy_gbps * 1e3)
    print(
        f"    prefix kernel alone {prefix_us:8.1f} us (floor {prefix_floor_us:.1f}); own keys + merge alone "
        f"{own_us:8.1f} us (floor {floor_us - prefix_floor_us:.1f})"
    )
    swept = {}
    if sweep:
        for splits in [1 << i for i in range(MAX_PREFIX_SPLITS.bit_length())]:
            for tile_n, warps, stages in ((64, 4, 2), (64, 4, 3), (32, 4, 2), (128, 4, 2), (128, 8, 2)):
                config = PrefixLaunchConfig(
                    block_t=auto.block_t, prefix_splits=splits, tile_n=tile_n, num_warps=warps, num_stages=stages
                )
                us = time_us(lambda: cascade(config))
                swept[f"prefix splits={splits} tile={tile_n} warps={warps} stages={stages}"] = us
                print(
                    f"    prefix splits {splits} tile {tile_n:3d} warps {warps} stages {stages}: {us:8.1f} us "
                    f"({us / floor_us:.2f}x floor)"
                )
        # Without the dependent launch (the own keys' kernel waits for the whole prefix kernel),
        # and an odd split count (each value is a compiled variant, so the heuristic keeps powers of two).
        for splits, overlap in ((auto.prefix_splits, False), (3, True)):
            config = PrefixLaunchConfig(block_t=auto.block_t, prefix_splits=splits, overlap=overlap)
            us = time_us(lambda: cascade(config))
            swept[f"prefix splits={splits} overlap={overlap}"] = us
            print(f"    prefix splits {splits} overlap {overlap}: {us:8.1f} us ({us / floor_us:.2f}x floor)")
        for warps, stages in ((2, 2), (2, 3), (2, 4), (4, 3)):
            config = AttentionLaunchConfig(block_q=1, tile_n=64, num_kv_splits=1, num_warps=warps, num_stages=stages)
            us = time_us(lambda: own(config))
            whole = time_us(lambda: cascade(config=config))
            swept[f"own warps={warps} stages={stages}"] = us
            swept[f"cascade, own warps={warps} stages={stages}"] = whole
            print(f"    own keys + merge, warps {warps} stages {stages}: {us:8.1f} us alone, cascade {whole:8.1f} us")
    return {
        "num_groups": num_groups,
        "group_size": group_size,
        "prefix_len": prefix_len,
        "suffix_len": suffix_len,
        "copy_gbps": copy_gbps,
        "cascade_us": cascade_us,
        "cascade_floor_us": floor_us,
        "cascade_over_floor": cascade_us / floor_us,
        "paged_us": paged_us,
        "paged_floor_us": paged_floor_us,
        "prefix_splits": auto.prefix_splits,
        "prefix_kernel_us": prefix_us,
        "own_kernel_us": own_us,
        "sweep_us": swept,
        "max_abs_diff": error,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-groups", type=int, default=32, help="groups of requests sharing a prefix")
    p.add_argument("--group-size", type=int, default=16, help="requests per group")
    p.add_argument("--prefix-len", type=int, default=2000, help="keys every request of a group shares")
    p.add_argument("--suffix-len", type=int, default=200, help="keys of each request's own (plus 0-49 generated)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-layers", type=int, default=16, help="layers, for the per-step total")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also time the prefix kernel's split counts x tiles x warps x stages, and the own keys' "
        "kernel's warps x stages",
    )
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    measure(
        num_groups=a.num_groups,
        group_size=a.group_size,
        prefix_len=a.prefix_len,
        suffix_len=a.suffix_len,
        block_size=a.block_size,
        num_layers=a.num_layers,
        sweep=a.sweep,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
