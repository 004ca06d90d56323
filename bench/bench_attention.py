"""Paged-attention kernel benchmark on one GPU, against the memory roofline.

    python bench/bench_attention.py            # decode, small-batch decode, long-context decode, prefill
    python bench/bench_attention.py --sweep    # also time alternative tile/warp/stage configs

Decode is memory-bound: its floor is (KV bytes read) / (device copy bandwidth), the copy
bandwidth measured here with a torch copy of a large tensor (read + write bytes / time). Prefill
is compute-bound: it is reported in TFLOP/s next to torch's SDPA (flash) on the same dense
causal problem. Times are CUDA-graph replays (triton.testing.do_bench_cudagraph), so launch
overhead is excluded, as it is for the server's captured decode.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import triton
import triton.testing
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.kernels.attention_launch import AttentionLaunchConfig, choose_launch_config
from strata.kernels.paged_attention import paged_attention  # noqa: E402
from strata.kernels.reference import paged_attention_reference  # noqa: E402
from strata.kernels.testing import PagedBatch, make_paged_batch  # noqa: E402

# Llama-3.2-1B attention: 32 query heads, 8 KV heads, head_dim 64, 16 layers.
LLAMA_1B = dict(num_q_heads=32, num_kv_heads=8, head_dim=64)
LLAMA_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)


def copy_bandwidth_gbps(num_bytes: int = 2 << 30) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300)
    return 2 * num_bytes / (ms * 1e-3) / 1e9


def attention_bytes(batch: PagedBatch) -> int:
    """Bytes a perfect kernel moves: every context key and value once, query in, output out."""
    _, _, num_kv_heads, _, head_dim = batch.kv_cache.shape
    kv = int(batch.seq_lens.sum()) * num_kv_heads * head_dim * 2 * batch.kv_cache.element_size()
    return kv + 2 * batch.query.numel() * batch.query.element_size() + batch.block_tables.numel() * 4


def causal_flops(batch: PagedBatch) -> float:
    """2 matmuls x 2 flops per multiply-add over the (query, visible key) pairs."""
    q_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).long()
    contexts = batch.seq_lens.long() - q_lens
    # Query i of a sequence sees context + i + 1 keys.
    pairs = (q_lens * contexts + q_lens * (q_lens + 1) // 2).sum().item()
    _, num_q_heads, head_dim = batch.query.shape
    return 4.0 * pairs * num_q_heads * head_dim


def shortest_query(batch: PagedBatch) -> int:
    """The launch's min_query_len, as the worker passes it."""
    return int((batch.query_start_loc[1:] - batch.query_start_loc[:-1]).min())


def time_ms(batch: PagedBatch, scale: float, **kwargs) -> float:
    out = torch.empty_like(batch.query)
    min_query_len = shortest_query(batch)
    return triton.testing.do_bench_cudagraph(
        lambda: paged_attention(*batch.attention_args(), scale, out=out, min_query_len=min_query_len, **kwargs), rep=200
    )


def check(batch: PagedBatch, scale: float, **kwargs) -> float:
    got = paged_attention(*batch.attention_args(), scale, min_query_len=shortest_query(batch), **kwargs).float()
    want = paged_attention_reference(*batch.attention_args(), scale)
    error = (got - want).abs().max().item()
    assert error < 5e-2, f"kernel disagrees with the reference: max abs error {error}"
    return error


def auto_config(batch: PagedBatch) -> AttentionLaunchConfig:
    _, num_q_heads, head_dim = batch.query.shape
    return choose_launch_config(
        num_seqs=batch.seq_lens.shape[0],
        num_q_heads=num_q_heads,
        num_kv_heads=batch.kv_cache.shape[2],
        head_dim=head_dim,
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
        min_query_len=shortest_query(batch),
    )


def report_memory_bound(name: str, batch: PagedBatch, scale: float, copy_gbps: float, **kwargs) -> float:
    ms = time_ms(batch, scale, **kwargs)
    moved = attention_bytes(batch)
    floor_us = moved / (copy_gbps * 1e9) * 1e6
    print(
        f"{name:<46} {ms * 1e3:8.1f} us  {moved / (ms * 1e-3) / 1e9:7.0f} GB/s  "
        f"= {moved / (ms * 1e-3) / 1e9 / copy_gbps:5.1%} of copy bw  (floor {floor_us:.1f} us, "
        f"{ms * 1e3 / floor_us:.2f}x)"
    )
    return ms


def sdpa_ms(num_seqs: int, q_len: int, kv_len: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> float:
    """torch SDPA on dense [B, H, L, D] bf16 with the same causal structure (flash backend)."""
    q = torch.randn(num_seqs, num_q_heads, q_len, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(num_seqs, num_kv_heads, kv_len, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    # Bottom-right aligned causal mask (query i sees keys <= kv_len - q_len + i), flash-compatible.
    mask = causal_lower_right(q_len, kv_len) if q_len != kv_len else None
    fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
    return triton.testing.do_bench_cudagraph(fn, rep=200)


def sweep(name: str, batch: PagedBatch, scale: float, block_qs: list[int]) -> None:
    base = auto_config(batch)
    print(f"  sweep {name} (heuristic: {base})")
    rows = []
    for block_q, tile_n, warps, stages in itertools.product(block_qs, [32, 64, 128], [2, 4, 8], [2, 3, 4]):
        config = AttentionLaunchConfig(
            block_q=block_q, tile_n=tile_n, num_kv_splits=base.num_kv_splits, num_warps=warps, num_stages=stages
        )
        try:
            rows.append((time_ms(batch, scale, config=config), config))
        except Exception as error:  # out of shared memory / registers for this combination
            print(f"    {config}: {type(error).__name__}")
    for ms, config in sorted(rows, key=lambda row: row[0])[:8]:
        print(
            f"    {ms * 1e3:8.1f} us  block_q={config.block_q} tile_n={config.tile_n} "
            f"warps={config.num_warps} stages={config.num_stages}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="also time alternative launch configs")
    parser.add_argument(
        "--cases",
        default="decode,small,long,prefill,mixed",
        help="comma-separated subset of decode,small,long,prefill,mixed to run",
    )
    parser.add_argument(
        "--candidates",
        action="store_true",
        help="prefill: also time (and check) a few launch configs against the heuristic's",
    )
    parser.add_argument(
        "--only", default="", help="prefill: run only the cases whose label contains this text (e.g. D=128)"
    )
    parser.add_argument(
        "--ptx",
        action="store_true",
        help="at the end, count the Hopper instructions (wgmma, TMA, cp.async) of each compiled variant",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  ({torch.cuda.get_device_properties(0).multi_processor_count} SMs)")
    copy_gbps = copy_bandwidth_gbps()
    print(f"device copy bandwidth (torch copy of 2 GiB, read+write): {copy_gbps:.0f} GB/s\n")

    cases = set(args.cases.split(","))
    if "decode" in cases:
        decode_cases(args, copy_gbps)
    if "small" in cases:
        small_batch_cases()
    if "long" in cases:
        long_context_cases(copy_gbps)
    if "prefill" in cases:
        prefill_cases(args)
    if "mixed" in cases:
        mixed_cases()
    if args.ptx:
        report_instructions()


def decode_cases(args, copy_gbps: float) -> None:
    """Llama-3.2-1B, batch 256 at context 640, then ragged contexts."""
    decode = make_paged_batch(
        [1] * 256, [639] * 256, block_size=16, dtype=torch.bfloat16, device="cuda", poison_unowned=False, **LLAMA_1B
    )
    error = check(decode, 0.125)
    print(f"decode Llama-3.2-1B B=256 ctx=640 bf16 block 16 (max err vs fp32 reference {error:.1e}), per layer:")
    ms = report_memory_bound("  paged_attention (auto)", decode, 0.125, copy_gbps)
    print(f"  x16 layers = {ms * 16 * 1e3:.0f} us of attention per decode step; config {auto_config(decode)}")
    if args.sweep:
        sweep("decode B=256", decode, 0.125, block_qs=[1])
    ragged = make_paged_batch(
        [1] * 256,
        torch.randint(1, 1280, (256,)).tolist(),
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        poison_unowned=False,
        **LLAMA_1B,
    )
    report_memory_bound("  ragged contexts 1..1280 (mean 640)", ragged, 0.125, copy_gbps)
    del decode, ragged
    decode = make_paged_batch(
        [1] * 128, [639] * 128, block_size=16, dtype=torch.bfloat16, device="cuda", poison_unowned=False, **LLAMA_8B
    )
    check(decode, 128**-0.5)
    print("decode 8B shape (32/8 heads, D=128) B=128 ctx=640 bf16, per layer:")
    report_memory_bound("  paged_attention (auto)", decode, 128**-0.5, copy_gbps)
    if args.sweep:
        sweep("decode 8B B=128", decode, 128**-0.5, block_qs=[1])
    del decode


def small_batch_cases() -> None:
    """Decode batches of 1-16 (batch-1 latency, speculative drafts): too few (sequence, KV head)
    programs to fill the GPU, so the time is the latency of each program's chain of tiles; the
    heuristic's split count against every power of two. The floor is tiny (a few us of KV);
    launch and merge dominate."""
    print("\nsmall-batch decode (split-KV count; time includes the merge kernel):")
    for heads, name in ((LLAMA_1B, "1B"), (LLAMA_8B, "8B")):
        for num_seqs, context in [(1, 576), (1, 4096), (4, 576), (16, 576), (16, 4096)]:
            batch = make_paged_batch(
                [1] * num_seqs,
                [context - 1] * num_seqs,
                block_size=16,
                dtype=torch.bfloat16,
                device="cuda",
                poison_unowned=False,
                **heads,
            )
            scale = heads["head_dim"] ** -0.5
            check(batch, scale)
            auto = auto_config(batch).num_kv_splits
            times = {splits: time_ms(batch, scale, num_kv_splits=splits) * 1e3 for splits in (1, 2, 4, 8, 16, 32, 64)}
            best = min(times, key=times.get)
            print(
                f"  {name} B={num_seqs:<3} ctx={context:<5} auto splits={auto:<3} {times[auto]:6.1f} us   best "
                f"splits={best:<3} {times[best]:6.1f} us   all: " + " ".join(f"{s}:{t:.1f}" for s, t in times.items())
            )
            del batch


def long_context_cases(copy_gbps: float) -> None:
    """Few sequences, long contexts: split-KV against the single pass."""
    print("\nlong-context decode, 32/8 heads, D=128, bf16 (split-KV vs single pass):")
    for num_seqs, context in [(1, 32768), (4, 16384), (16, 8192), (64, 4096)]:
        batch = make_paged_batch(
            [1] * num_seqs,
            [context - 1] * num_seqs,
            block_size=16,
            dtype=torch.bfloat16,
            device="cuda",
            poison_unowned=False,
            **LLAMA_8B,
        )
        check(batch, 128**-0.5)
        splits = auto_config(batch).num_kv_splits
        report_memory_bound(f"  B={num_seqs} ctx={context} auto (splits={splits})", batch, 128**-0.5, copy_gbps)
        report_memory_bound(f"  B={num_seqs} ctx={context} single pass", batch, 128**-0.5, copy_gbps, num_kv_splits=1)
        del batch


def prefill_cases(args) -> None:
    """Prefill chunks: compute-bound, compared with torch SDPA on the dense problem."""
    print("\nprefill, bf16 (TFLOP/s counts only the causal half):")
    for label, shapes, num_seqs, q_len, context in [
        ("Llama-3.2-1B 4 x 2048 fresh prompts", LLAMA_1B, 4, 2048, 0),
        ("Llama-3.2-1B 32 x 512 fresh prompts", LLAMA_1B, 32, 512, 0),  # an offline prefill step
        ("Llama-3.2-1B 8 x 512 chunks over 2048 cached", LLAMA_1B, 8, 512, 2048),
        ("Llama-3.2-1B 16 x 200 over 2000 cached", LLAMA_1B, 16, 200, 2000),  # prefix-groups members
        ("D=128 32/8 heads 4 x 2048 fresh prompts", LLAMA_8B, 4, 2048, 0),
        ("D=128 32/8 heads 32 x 512 fresh prompts", LLAMA_8B, 32, 512, 0),  # an 8B offline prefill step
    ]:
        if args.only not in label:
            continue
        batch = make_paged_batch(
            [q_len] * num_seqs,
            [context] * num_seqs,
            block_size=16,
            dtype=torch.bfloat16,
            device="cuda",
            poison_unowned=False,
            **shapes,
        )
        scale = shapes["head_dim"] ** -0.5
        check(batch, scale)
        ms = time_ms(batch, scale)
        flops = causal_flops(batch)
        try:
            torch_ms = sdpa_ms(
                num_seqs, q_len, q_len + context, shapes["num_q_heads"], shapes["num_kv_heads"], shapes["head_dim"]
            )
            versus = f"torch SDPA (dense, contiguous) {torch_ms * 1e3:8.1f} us -> {ms / torch_ms:.2f}x its time"
        except RuntimeError as error:  # no SDPA backend for this mask/GQA combination
            versus = f"torch SDPA n/a ({str(error).splitlines()[0][:60]})"
        print(f"  {label:<46} {ms * 1e3:8.1f} us  {flops / (ms * 1e-3) / 1e12:6.1f} TFLOP/s   {versus}")
        group = shapes["num_q_heads"] // shapes["num_kv_heads"]
        if args.sweep:
            sweep(label, batch, scale, block_qs=[64 // group, 128 // group])
        if args.candidates:
            for rows, tile_n, warps, stages, unmasked in CANDIDATES:
                config = AttentionLaunchConfig(
                    block_q=rows // group,
                    tile_n=tile_n,
                    num_kv_splits=1,
                    num_warps=warps,
                    num_stages=stages,
                    unmasked_full_tiles=unmasked,
                )
                masks = "full tiles unmasked" if unmasked else "every tile masked"
                try:
                    check(batch, scale, config=config)
                    ms_c = time_ms(batch, scale, config=config)
                    print(
                        f"    {rows:>3} rows, {tile_n:>3}-key tiles, {warps} warps, {stages} stages, {masks:<19}: "
                        f"{ms_c * 1e3:8.1f} us {flops / (ms_c * 1e-3) / 1e12:6.1f} TFLOP/s "
                        f"({ms_c / ms:.2f}x the heuristic's)"
                    )
                except Exception as error:  # out of shared memory / registers for this combination
                    print(f"    {config}: {type(error).__name__}: {str(error)[:80]}")
        del batch


# (query rows = tokens x GQA group, key tile, warps, stages, full tiles unmasked): the shapes an
# earlier candidates run ranked first (bench/RESULTS.md, "Prefill attention tiles"), each with and
# without the unmasked full tiles.
CANDIDATES = [
    (rows, tile_n, warps, stages, unmasked)
    for unmasked in (False, True)
    for rows, tile_n, warps, stages in [
        (64, 64, 4, 3),
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 128, 8, 2),
        (64, 128, 4, 3),
    ]
]


def report_instructions() -> None:
    """Which Hopper paths the compiled attention variants take, from their PTX: warpgroup MMAs
    (wgmma), TMA copies (cp.async.bulk.tensor), cp.async gathers, and older mma.sync."""
    from strata.kernels.paged_attention import _paged_attention_kernel

    print("\ncompiled paged-attention variants (PTX instruction counts):")
    names = _paged_attention_kernel.arg_names  # compiled constants are keyed by (argument index,)
    for cache in _paged_attention_kernel.device_caches.values():
        for kernel in cache[0].values():
            ptx = kernel.asm.get("ptx", "")
            constants = {names[k[0]] if isinstance(k, tuple) else k: v for k, v in kernel.src.constants.items()}
            shape = {name: constants.get(name) for name in ("BLOCK_M", "TILE_N", "HEAD_DIM", "FULL_TILES_UNMASKED")}
            counts = {
                op: ptx.count(op)
                for op in ("wgmma.mma_async", "cp.async.bulk.tensor", "cp.async.cg", "cp.async.ca", "mma.sync")
            }
            print(
                f"  {shape} warps={kernel.metadata.num_warps} stages={kernel.metadata.num_stages}: "
                + ", ".join(f"{op} {n}" for op, n in counts.items())
            )


def mixed_cases() -> None:
    """Decodes beside prefill chunks in one launch (a mixed step's attention): the prefill launch
    shape serves the decode rows too, one token in a block of 16; against each part alone."""
    print("\nmixed launches, Llama-3.2-1B heads, bf16: decodes over 576 cached tokens beside fresh prompts")
    for decodes, prompts, q_len in [(112, 16, 512), (224, 2, 512), (64, 2, 448)]:
        parts = {
            "both": ([1] * decodes + [q_len] * prompts, [575] * decodes + [0] * prompts),
            "decodes alone": ([1] * decodes, [575] * decodes),
            "prompts alone": ([q_len] * prompts, [0] * prompts),
        }
        times = {}
        for name, (q_lens, contexts) in parts.items():
            batch = make_paged_batch(
                q_lens, contexts, block_size=16, dtype=torch.bfloat16, device="cuda", poison_unowned=False, **LLAMA_1B
            )
            if name == "both":
                check(batch, 0.125)
            times[name] = time_ms(batch, 0.125) * 1e3
            del batch
        alone = times["decodes alone"] + times["prompts alone"]
        print(
            f"  {decodes} decodes + {prompts} x {q_len}: one launch {times['both']:7.1f} us, decodes alone "
            f"{times['decodes alone']:6.1f} + prompts alone {times['prompts alone']:6.1f} = {alone:7.1f} us "
            f"({times['both'] / alone:.2f}x)"
        )


if __name__ == "__main__":
    main()
