"""Piecewise graphs' pieces (services/worker/graphs/piecewise_graphs.py), run eagerly on their buffers
before any capture, against the shard's own forward on CPU in float32: the cut at attention, the
residual stream added in place, the shared qkv buffer, padding rows and placeholders. The GPU test
(tests/gpu/test_piecewise_graphs_gpu.py) replays the same steps from captured graphs.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import write_tiny_model

from strata.services.worker.graphs.piecewise_graphs import piece_token_counts
from strata.services.worker.model.weights import load_shard
from tests.piecewise_steps import run_mixed_steps

NUM_BLOCKS = 32


@pytest.mark.parametrize("num_stages", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])  # llama3 RoPE, a sliding window, biases
def test_pieces_equal_the_eager_forward_on_mixed_steps(tmp_path, arch, num_stages):
    path = write_tiny_model(tmp_path / arch, arch, seed=5)
    stages = [load_shard(path, s, num_stages, torch.float32, "cpu")[0] for s in range(num_stages)]
    run = dict(num_blocks=NUM_BLOCKS, max_tokens=256, capture=False, device="cpu", dtype=torch.float32)
    with torch.inference_mode():
        eager, eager_caches = run_mixed_steps(stages, piecewise=False, **run)
        pieces, piece_caches = run_mixed_steps(stages, piecewise=True, **run)
    for (h_e, r_e), (h_p, r_p) in zip(eager, pieces):
        torch.testing.assert_close(h_p, h_e, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r_p, r_e, atol=1e-5, rtol=1e-5)
    for stage_e, stage_p in zip(eager_caches, piece_caches):
        for cache_e, cache_p in zip(stage_e, stage_p):
            torch.testing.assert_close(cache_p, cache_e, atol=1e-5, rtol=1e-5)
            assert not cache_p[:, 24:].any(), "a padding row wrote the KV cache"
    # The placeholder (second step, token 38) stands for last_sampled's token: not token 0's row.
    second_hidden = eager[1][0]
    assert not torch.allclose(second_hidden[38], second_hidden[37])


def test_padded_sizes_cover_every_step_up_to_the_largest():
    sizes = piece_token_counts(16384)
    assert sizes[0] == 64 and sizes[-1] == 16384 and sizes == sorted(set(sizes))
    assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:]))
    assert all(b <= 1.5 * a for a, b in zip(sizes, sizes[1:]) if a >= 512)
    assert piece_token_counts(1000)[-1] == 1000 and piece_token_counts(48) == [48]
