"""The one-launch decode attention (kernels/decode_attention.py) on a real GPU: bf16 on the Llama-3.2-1B,
3.1-8B and SmolLM2 head shapes against the three kernels it replaces (rotary + KV write, paged
attention, merge) and float32 math, Qwen3's and Gemma 3's q/k norms on Qwen3-30B-A3B's heads, many
splits racing on their arrival counters, and graph replays with programmatic dependent launches
equal to eager runs.

    python -m pytest tests/gpu/test_decode_attention_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from tests.graph_capture import capture_graph
from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from strata.kernels.decode_attention import _arrival_counters, decode_attention  # noqa: E402
from strata.kernels.paged_attention import paged_attention  # noqa: E402
from strata.kernels.reference import (  # noqa: E402
    paged_attention_reference,
    rms_norm_reference,
    rotary_embedding_reference,
    write_kv_cache_reference,  # noqa: E402
)
from strata.kernels.rotary import rotary_embedding_  # noqa: E402
from strata.kernels.testing import kv_by_slot, make_paged_batch  # noqa: E402

# (name, query heads, KV heads, head dim)
HEADS = [("1b", 32, 8, 64), ("8b", 32, 8, 128), ("smol", 9, 3, 64)]


def rope_tables(head_dim: int, positions: int = 8192):
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda", dtype=torch.float32) / head_dim))
    freqs = torch.arange(positions, device="cuda", dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos().to(torch.bfloat16), freqs.sin().to(torch.bfloat16)


def decode_batch(context_lens, num_q_heads, num_kv_heads, head_dim, seed=0):
    batch = make_paged_batch(
        [1] * len(context_lens),
        context_lens,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        seed=seed,
    )
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    qkv = torch.randn(len(context_lens), (num_q_heads + 2 * num_kv_heads) * head_dim, device="cuda", generator=gen).to(
        torch.bfloat16
    )
    return batch, qkv, (batch.seq_lens - 1).long()


def three_kernels(batch, qkv, positions, cos, sin, num_q_heads, num_kv_heads, head_dim, cache, qk_norm=None):
    """What the chain ran before: rotary (and q/k norms) + KV write in place, then paged attention
    (and its merge)."""
    qkv = qkv.clone()
    t = qkv.shape[0]
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q, k, v = (x.view(t, -1, head_dim) for x in (q, k, v))
    rotary_embedding_(
        positions, q, k, cos, sin, value=v, kv_cache=cache, slot_mapping=batch.slot_mapping, qk_norm=qk_norm
    )
    return paged_attention(
        q, cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 1, batch.max_seq_len, head_dim**-0.5
    ).view(t, -1)


def one_launch(batch, qkv, positions, cos, sin, num_q_heads, head_dim, qk_norm=None):
    return decode_attention(
        qkv,
        positions,
        cos,
        sin,
        batch.kv_cache,
        batch.seq_lens,
        batch.block_tables,
        batch.slot_mapping,
        num_q_heads=num_q_heads,
        scale=head_dim**-0.5,
        max_seq_len=batch.max_seq_len,
        qk_norm=qk_norm,
    )


def assert_as_close_as_three_kernels(got, want, batch, qkv, positions, cos, sin, heads, old_cache, qk_norm=None):
    """got (one launch) against float32 math on the (normed and) rotated inputs: within bf16
    rounding, and no further from it than want (the three kernels). heads: (q, kv, D)."""
    num_q_heads, num_kv_heads, head_dim = heads
    t = qkv.shape[0]
    q, k, _ = (
        x.view(t, -1, head_dim)
        for x in qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    )
    if qk_norm is not None:
        q_weight, k_weight, eps, unit_offset = qk_norm
        q, k = rms_norm_reference(q, q_weight, eps, unit_offset), rms_norm_reference(k, k_weight, eps, unit_offset)
    q_rot, _ = rotary_embedding_reference(positions, q, k, cos, sin)
    exact = paged_attention_reference(
        q_rot.float(),
        old_cache.float(),
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        1,
        batch.max_seq_len,
        head_dim**-0.5,
    ).view(t, -1)
    torch.testing.assert_close(got.float(), exact, atol=2e-2, rtol=2e-2)
    assert (got.float() - exact).abs().mean() <= 1.5 * (want.float() - exact).abs().mean() + 1e-5
    assert not _arrival_counters(qkv.device, 1).any()


@pytest.mark.parametrize("name,num_q_heads,num_kv_heads,head_dim", HEADS, ids=[h[0] for h in HEADS])
@pytest.mark.parametrize("context_lens", [[575], [0, 17, 300, 4000]], ids=["batch1-576", "ragged"])
def test_bf16_equals_three_kernels_within_rounding(name, num_q_heads, num_kv_heads, head_dim, context_lens):
    batch, qkv, positions = decode_batch(context_lens, num_q_heads, num_kv_heads, head_dim)
    cos, sin = rope_tables(head_dim)
    old_cache = batch.kv_cache.clone()
    want = three_kernels(batch, qkv, positions, cos, sin, num_q_heads, num_kv_heads, head_dim, old_cache)
    got = one_launch(batch, qkv, positions, cos, sin, num_q_heads, head_dim)
    # The cache gets the same rotated keys and values, bit for bit (same rounding as kernels/rotary.py).
    assert torch.equal(kv_by_slot(batch.kv_cache).nan_to_num(7.0), kv_by_slot(old_cache).nan_to_num(7.0))
    heads = (num_q_heads, num_kv_heads, head_dim)
    assert_as_close_as_three_kernels(got, want, batch, qkv, positions, cos, sin, heads, old_cache)


@pytest.mark.parametrize("unit_offset", [False, True], ids=["qwen3", "gemma3"])
@pytest.mark.parametrize("context_lens", [[575], [0, 17, 300, 4000]], ids=["batch1-576", "ragged"])
def test_bf16_qk_norms_equal_three_kernels_within_rounding(context_lens, unit_offset):
    """Per-head q/k RMSNorm before rotary (Qwen3's weight, Gemma 3's 1 + weight) on Qwen3-30B-A3B's
    heads (32 query, 4 KV, D = 128): the cache as the rotary kernel's normed path stores it, the
    output as close to float32 math on the normed, rotated inputs as the three kernels'."""
    num_q_heads, num_kv_heads, head_dim = 32, 4, 128
    batch, qkv, positions = decode_batch(context_lens, num_q_heads, num_kv_heads, head_dim)
    cos, sin = rope_tables(head_dim)
    gen = torch.Generator(device="cuda").manual_seed(7)
    q_weight, k_weight = (
        (torch.randn(head_dim, device="cuda", generator=gen) * 0.5 + (0.0 if unit_offset else 1.0)).to(torch.bfloat16)
        for _ in "qk"
    )
    norms = (q_weight, k_weight, 1e-6, unit_offset)
    old_cache = batch.kv_cache.clone()
    want = three_kernels(batch, qkv, positions, cos, sin, num_q_heads, num_kv_heads, head_dim, old_cache, norms)
    got = one_launch(batch, qkv, positions, cos, sin, num_q_heads, head_dim, norms)
    # The same normed, rotated keys as the rotary kernel's (both sum each head's squares in float32,
    # in their own orders: at most one bf16 step apart, and rarely).
    new_keys, old_keys = (kv_by_slot(cache).nan_to_num(7.0).float() for cache in (batch.kv_cache, old_cache))
    torch.testing.assert_close(new_keys, old_keys, atol=1.6e-2, rtol=8e-3)
    assert (new_keys != old_keys).float().mean() <= 1e-3
    heads = (num_q_heads, num_kv_heads, head_dim)
    assert_as_close_as_three_kernels(got, want, batch, qkv, positions, cos, sin, heads, old_cache, norms)


def test_many_splits_race_and_graph_replays_equal_eager():
    """64 splits per (sequence, KV head) over 64 sequences arrive in any order; a captured graph
    replayed ten times (PDL on sm_90) gives the eager result each time and leaves the counters at 0."""
    num_q_heads, num_kv_heads, head_dim = 32, 8, 64
    batch, qkv, positions = decode_batch([4000 + 37 * i for i in range(64)], num_q_heads, num_kv_heads, head_dim)
    cos, sin = rope_tables(head_dim)
    before = batch.kv_cache.clone()

    def call():
        return decode_attention(
            qkv,
            positions,
            cos,
            sin,
            batch.kv_cache,
            batch.seq_lens,
            batch.block_tables,
            batch.slot_mapping,
            num_q_heads=num_q_heads,
            scale=head_dim**-0.5,
            max_seq_len=batch.max_seq_len,
            num_kv_splits=64,
        )

    eager = call()
    graph, captured = capture_graph(call)
    for _ in range(10):
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
    assert not _arrival_counters(qkv.device, 1).any()
    # Every launch stored the same rotated keys and values: those of the torch references.
    t = qkv.shape[0]
    q, k, v = (
        x.view(t, -1, head_dim)
        for x in qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    )
    write_kv_cache_reference(rotary_embedding_reference(positions, q, k, cos, sin)[1], v, before, batch.slot_mapping)
    # Close, not bit-equal: on the GPU the compiler contracts rotary's multiply-adds into FMAs, as in
    # tests/gpu/test_fused_kernels_gpu.py's rotary tests (the first test here checks bit equality
    # with the rotary kernel).
    torch.testing.assert_close(
        kv_by_slot(batch.kv_cache).nan_to_num(7.0).float(),
        kv_by_slot(before).nan_to_num(7.0).float(),
        atol=1e-2,
        rtol=1.6e-2,
    )
