"""Piecewise CUDA graphs (services/worker/graphs/piecewise_graphs.py) replayed against the eager forward
on mixed steps: a prefill of several prompts, then decodes beside a new prompt's chunk over the
cache the first step wrote, with a decode-lookahead placeholder, on one stage and split over two;
and the worker's ModelRunner taking them for mixed steps.

    python -m pytest tests/gpu/test_piecewise_graphs_gpu.py -q

The pieces run the GEMMs over the padded token count, where cuBLAS may pick other kernels than
for the real count, so activations and caches are compared to bf16 rounding, not bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from strata.services.worker.model.shard import CausalLMShard  # noqa: E402
from tests.gpu_shards import llama_1b_like, random_bf16_shard  # noqa: E402
from tests.piecewise_steps import run_mixed_steps  # noqa: E402


def split(whole: CausalLMShard) -> list[CausalLMShard]:
    """The layers of `whole` as two stages (2 + the rest), sharing its weights."""
    config = whole.config
    first = CausalLMShard(config, 0, 2, device="cuda", dtype=torch.bfloat16, attn_backend=whole.attn_backend)
    second = CausalLMShard(
        config, 2, config.num_hidden_layers, device="cuda", dtype=torch.bfloat16, attn_backend=whole.attn_backend
    )
    first.embed_tokens, first.layers = whole.embed_tokens, torch.nn.ModuleList(whole.layers[:2])
    second.layers = torch.nn.ModuleList(whole.layers[2:])
    return [first, second]


@pytest.mark.parametrize("two_stages", [False, True], ids=["one-stage", "two-stages"])
def test_replayed_pieces_match_the_eager_forward_on_mixed_steps(two_stages):
    whole = random_bf16_shard(llama_1b_like(num_layers=3))
    stages = split(whole) if two_stages else [whole]
    run = dict(num_blocks=64, max_tokens=256, capture=True, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        eager, eager_caches = run_mixed_steps(stages, piecewise=False, **run)
        pieces, piece_caches = run_mixed_steps(stages, piecewise=True, **run)
    for got, want in [pair for step in zip(pieces, eager) for pair in zip(*step)] + [
        pair for stage in zip(piece_caches, eager_caches) for pair in zip(*stage)
    ]:
        assert got.shape == want.shape
        # bf16 rounding of values up to max |want| (a sum of larger terms can round to a small one).
        torch.testing.assert_close(got.float(), want.float(), atol=0.02 * want.abs().max().item(), rtol=0)
    for stage_caches in piece_caches:
        assert not any(cache[:, 24:].any() for cache in stage_caches), "a padding row wrote the KV cache"
