"""Cascade attention on a real GPU: bf16 (which the CPU interpreter cannot check) over random
ragged runs of 1 to 64 members with prefixes that end mid-block, beside ungrouped sequences,
decodes and prefill chunks; and a CUDA-graph replay with padding runs, as the worker runs it.

    python -m pytest tests/gpu/test_cascade_attention_gpu.py -q

Oracle: the float32 paged-attention reference on the same (bf16-rounded) inputs.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.graph_capture import capture_graph
from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from strata.kernels.cascade_attention import PrefixLaunchConfig, cascade_attention  # noqa: E402
from strata.kernels.reference import paged_attention_reference  # noqa: E402
from strata.kernels.shared_kv_runs import SharedKVRuns  # noqa: E402
from strata.kernels.testing import make_paged_batch, share_prefixes  # noqa: E402
from tests.gpu.test_kernels_gpu import assert_close_to_reference  # noqa: E402


def random_grouped_case(seed: int):
    """Ungrouped sequences first, then runs of 1..64 members; prefixes of any length (mostly
    mid-block); members decode or compute a chunk past the prefix."""
    rng = random.Random(seed)
    block_size = rng.choice([16, 16, 8, 32])
    query_lens, context_lens = [], []
    for _ in range(rng.randint(0, 5)):
        query_lens.append(rng.choice([1, 1, rng.randint(2, 200)]))
        context_lens.append(rng.randint(0, 1500))
    sizes, prefixes = [], []
    for _ in range(rng.randint(1, 6)):
        size = rng.choice([1, 2, 3, 16, 17, rng.randint(1, 64), 64])
        prefix = rng.randint(1, 2500)
        sizes.append(size)
        prefixes.append(prefix)
        for _ in range(size):
            query_lens.append(rng.choice([1, 1, 1, rng.randint(2, 40)]))
            context_lens.append(prefix + rng.randint(0, 300))
    heads = rng.choice([(32, 8, 64), (32, 8, 128), (9, 3, 64), (8, 8, 128), (64, 8, 128)])
    batch = make_paged_batch(
        query_lens,
        context_lens,
        num_q_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=heads[2],
        block_size=block_size,
        dtype=torch.bfloat16,
        device="cuda",
        seed=seed,
    )
    first = len(query_lens) - sum(sizes)
    return batch, share_prefixes(batch, sizes, prefixes, first_seq=first)


@pytest.mark.parametrize("seed", range(24))
def test_random_ragged_groups_bf16(seed):
    batch, runs = random_grouped_case(seed)
    scale = batch.query.shape[2] ** -0.5
    want = paged_attention_reference(*batch.attention_args(), scale)
    got = cascade_attention(*batch.attention_args()[:5], runs, batch.max_query_len, batch.max_seq_len, scale)
    assert_close_to_reference(got, want, torch.bfloat16)
    forced = cascade_attention(
        *batch.attention_args()[:5],
        runs,
        batch.max_query_len,
        batch.max_seq_len,
        scale,
        prefix_config=PrefixLaunchConfig(
            block_t=max(1, 64 // (batch.query.shape[1] // batch.kv_cache.shape[2])), prefix_splits=8
        ),
    )
    assert_close_to_reference(forced, want, torch.bfloat16)


def test_cuda_graph_replay_with_padding_groups():
    """Captured once for 48 sequences and 24 runs, replayed on two different group layouts
    written into the same buffers (the worker's cascade decode graphs)."""
    num_seqs, most = 48, 24
    contexts = [700 + 13 * i for i in range(num_seqs)]

    def fresh(seed: int):
        return make_paged_batch(
            [1] * num_seqs,
            contexts,
            num_q_heads=32,
            num_kv_heads=8,
            head_dim=64,
            block_size=16,
            dtype=torch.bfloat16,
            device="cuda",
            seed=seed,
        )

    batch = fresh(3)
    scale = 0.125
    buffers = SharedKVRuns(
        token_start=torch.zeros(most + 1, dtype=torch.int32, device="cuda"),
        prefix_lens=torch.zeros(most, dtype=torch.int32, device="cuda"),
        table_rows=torch.zeros(most, dtype=torch.int32, device="cuda"),
        seq_prefix_lens=torch.zeros(num_seqs, dtype=torch.int32, device="cuda"),
        max_run_tokens=num_seqs,
        max_prefix_len=4096,
    )
    out = torch.empty_like(batch.query)

    def step():
        cascade_attention(*batch.attention_args()[:5], buffers, 1, 4096, scale, out=out)

    graph, _ = capture_graph(step)
    for seed, sizes, prefixes, first in [
        (4, [16, 16], [640, 333], 8),
        (5, [2] * 20 + [1], [700 - i for i in range(21)], 7),
    ]:
        step_batch = fresh(seed)
        layout = share_prefixes(step_batch, sizes, prefixes, first_seq=first)
        for name in ("query", "kv_cache", "block_tables"):  # into the captured tensors
            getattr(batch, name).copy_(getattr(step_batch, name))
        r = layout.num_runs
        buffers.token_start.copy_(torch.cat([layout.token_start, layout.token_start[-1:].repeat(most - r)]))
        buffers.prefix_lens.zero_()[:r] = layout.prefix_lens
        buffers.table_rows.zero_()[:r] = layout.table_rows
        buffers.seq_prefix_lens.copy_(layout.seq_prefix_lens)
        graph.replay()
        want = paged_attention_reference(*batch.attention_args(), scale)
        assert_close_to_reference(out, want, torch.bfloat16)
