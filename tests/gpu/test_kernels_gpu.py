"""Triton kernels on a real GPU: bf16 (which the CPU interpreter cannot check), many random
ragged shapes, long contexts through split-KV, and CUDA-graph capture of a decode step.

    python -m pytest tests/gpu/test_kernels_gpu.py -q

Oracle: the float32 torch reference on the same (bf16-rounded) inputs.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.graph_capture import capture_graph
from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from strata.kernels.attention_launch import choose_launch_config  # noqa: E402
from strata.kernels.kv_cache_write import write_kv_cache  # noqa: E402
from strata.kernels.paged_attention import paged_attention  # noqa: E402
from strata.kernels.reference import paged_attention_reference, write_kv_cache_reference  # noqa: E402
from strata.kernels.testing import kv_by_slot, make_paged_batch  # noqa: E402

# bf16 inputs are identical for kernel and reference; the differences are P rounded to bf16
# before P @ V and the bf16 output itself (relative 2^-9).
TOLERANCE = {
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2, mean=2e-3),
    torch.float16: dict(atol=4e-3, rtol=4e-3, mean=4e-4),
    torch.float32: dict(atol=1e-4, rtol=1e-4, mean=1e-5),
}


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    assert torch.isfinite(got).all(), "NaN/inf: a poisoned (unowned) cache slot was read"
    torch.testing.assert_close(got.float(), want.float(), atol=tol["atol"], rtol=tol["rtol"])
    # Aggregate check: catches a small systematic bias the elementwise tolerance would let through.
    mean_error = (got.float() - want.float()).abs().mean().item()
    assert mean_error < tol["mean"], f"mean abs error {mean_error:.2e}"


def random_case(seed: int) -> dict:
    """A ragged mixed batch: decodes (some on block edges), prefills, and chunks over a cache."""
    rng = random.Random(seed)
    block_size = rng.choice([16, 16, 32, 8])
    query_lens, context_lens = [], []
    for _ in range(rng.randint(1, 20)):
        kind = rng.choice(["decode", "decode", "edge", "prefill", "chunk"])
        if kind == "decode":
            query_lens.append(1)
            context_lens.append(rng.randint(0, 3000))
        elif kind == "edge":  # new token lands on the first/last slot of a block
            query_lens.append(1)
            context_lens.append(rng.randint(1, 100) * block_size - rng.choice([0, 1]))
        elif kind == "prefill":
            query_lens.append(rng.randint(1, 700))
            context_lens.append(0)
        else:
            query_lens.append(rng.randint(2, 300))
            context_lens.append(rng.randint(1, 2000))
    return dict(
        query_lens=query_lens,
        context_lens=context_lens,
        head_dim=rng.choice([64, 128]),
        group=rng.choice([1, 4, 8]),
        num_kv_heads=rng.choice([1, 2, 8]),
        block_size=block_size,
        sliding_window=rng.choice([None, None, None, rng.randint(1, 1500)]),
    )


def build(case: dict, dtype: torch.dtype, seed: int):
    return make_paged_batch(
        case["query_lens"],
        case["context_lens"],
        num_q_heads=case["num_kv_heads"] * case["group"],
        num_kv_heads=case["num_kv_heads"],
        head_dim=case["head_dim"],
        block_size=case["block_size"],
        dtype=dtype,
        device="cuda",
        seed=seed,
    )


@pytest.mark.parametrize("seed", range(40))
def test_random_mixed_batches_bf16(seed):
    case = random_case(seed)
    batch = build(case, torch.bfloat16, seed)
    scale = case["head_dim"] ** -0.5
    got = paged_attention(*batch.attention_args(), scale, sliding_window=case["sliding_window"])
    want = paged_attention_reference(*batch.attention_args(), scale, sliding_window=case["sliding_window"])
    assert_close_to_reference(got, want, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("seed", [100, 101, 102])
def test_random_mixed_batches_other_dtypes(dtype, seed):
    case = random_case(seed)
    batch = build(case, dtype, seed)
    scale = case["head_dim"] ** -0.5
    got = paged_attention(*batch.attention_args(), scale, sliding_window=case["sliding_window"])
    want = paged_attention_reference(*batch.attention_args(), scale, sliding_window=case["sliding_window"])
    assert_close_to_reference(got, want, dtype)


@pytest.mark.parametrize("seed", [200, 201, 202, 203])
def test_random_mixed_batches_forced_split_kv(seed):
    """The split path also serves prefill chunks and windows (not chosen automatically for them)."""
    case = random_case(seed)
    batch = build(case, torch.bfloat16, seed)
    scale = case["head_dim"] ** -0.5
    got = paged_attention(*batch.attention_args(), scale, sliding_window=case["sliding_window"], num_kv_splits=4)
    want = paged_attention_reference(*batch.attention_args(), scale, sliding_window=case["sliding_window"])
    assert_close_to_reference(got, want, torch.bfloat16)


@pytest.mark.parametrize(
    "num_seqs,context,head_dim,group,num_kv_heads",
    [
        (1, 32768, 128, 4, 8),
        (2, 16000, 64, 4, 8),
        (4, 9000, 128, 8, 2),
        (3, 20001, 128, 1, 4),
    ],
)
def test_long_context_decode_uses_split_kv(num_seqs, context, head_dim, group, num_kv_heads):
    contexts = [context - 977 * i for i in range(num_seqs)]
    batch = make_paged_batch(
        [1] * num_seqs,
        contexts,
        num_q_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        seed=context,
    )
    chosen = choose_launch_config(
        num_seqs=num_seqs,
        num_q_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        max_query_len=1,
        max_seq_len=batch.max_seq_len,
        sm_count=torch.cuda.get_device_properties(0).multi_processor_count,
    )
    assert chosen.num_kv_splits > 1, "automatic choice should split this small long-context batch"
    scale = head_dim**-0.5
    want = paged_attention_reference(*batch.attention_args(), scale)
    got_auto = paged_attention(*batch.attention_args(), scale)
    got_single = paged_attention(*batch.attention_args(), scale, num_kv_splits=1)
    assert_close_to_reference(got_auto, want, torch.bfloat16)
    assert_close_to_reference(got_single, want, torch.bfloat16)


def test_large_mixed_step_llama_1b_shapes():
    """One engine step: a 2048-token prefill chunk over a cache, a fresh prompt, 200 decodes."""
    rng = random.Random(7)
    query_lens = [2048, 333] + [1] * 200
    context_lens = [1500, 0] + [rng.randint(1, 1200) for _ in range(200)]
    batch = make_paged_batch(
        query_lens,
        context_lens,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=64,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        seed=7,
    )
    got = paged_attention(*batch.attention_args(), 0.125)
    want = paged_attention_reference(*batch.attention_args(), 0.125)
    assert_close_to_reference(got, want, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(8, 64), (2, 128), (5, 128)])
def test_write_kv_cache_bf16_exact(dtype, num_kv_heads, head_dim):
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    tokens, num_blocks, block_size = 3000, 400, 16
    cache = torch.randn(2, num_blocks, num_kv_heads, block_size, head_dim, device="cuda", generator=gen).to(dtype)
    expected = cache.clone()
    key = torch.randn(tokens, num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    value = torch.randn(tokens, num_kv_heads, head_dim, device="cuda", generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=gen)[:tokens]
    slots[::7] = -1
    write_kv_cache(key, value, cache, slots)
    write_kv_cache_reference(key, value, expected, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("num_kv_splits", [1, 8])
def test_decode_step_is_cuda_graph_capturable(num_kv_splits):
    """Capture KV write + attention once; replays with new inputs must match the reference.

    Capture fails on any host synchronisation (.item(), .tolist(), data-dependent shapes).
    """
    num_seqs, group, num_kv_heads, head_dim, max_seq_len_bound = 8, 4, 2, 128, 4096
    contexts = [17, 400, 1023, 2000, 1, 64, 999, 3000]
    batch = make_paged_batch(
        [1] * num_seqs,
        contexts,
        num_q_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=16,
        dtype=torch.bfloat16,
        device="cuda",
        seed=3,
        poison_unowned=False,
    )
    scale = head_dim**-0.5
    key = torch.randn(num_seqs, num_kv_heads, head_dim, device="cuda").to(torch.bfloat16)
    value = torch.randn_like(key)
    out = torch.empty_like(batch.query)

    def step():
        write_kv_cache(key, value, batch.kv_cache, batch.slot_mapping)
        paged_attention(
            batch.query,
            batch.kv_cache,
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_tables,
            1,
            max_seq_len_bound,
            scale,
            out=out,
            num_kv_splits=num_kv_splits,
        )

    graph, _ = capture_graph(step)

    for replay in range(3):
        # New tokens: different queries/keys and shorter contexts (slots inside the same blocks).
        shrink = torch.tensor([replay * 3 % (c + 1) for c in contexts], dtype=torch.int32, device="cuda")
        seq_lens = torch.tensor(contexts, dtype=torch.int32, device="cuda") + 1 - shrink
        positions = (seq_lens - 1).long()
        rows = torch.arange(num_seqs, device="cuda")
        batch.seq_lens.copy_(seq_lens)
        batch.slot_mapping.copy_(batch.block_tables[rows, positions // 16].long() * 16 + positions % 16)
        batch.query.copy_(torch.randn_like(batch.query))
        key.copy_(torch.randn_like(key))
        value.copy_(torch.randn_like(value))
        graph.replay()
        torch.cuda.synchronize()
        flat = kv_by_slot(batch.kv_cache)
        assert torch.equal(flat[0, batch.slot_mapping], key) and torch.equal(flat[1, batch.slot_mapping], value)
        want = paged_attention_reference(
            batch.query,
            batch.kv_cache,
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_tables,
            1,
            max_seq_len_bound,
            scale,
        )
        assert_close_to_reference(out, want, torch.bfloat16)
