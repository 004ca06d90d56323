"""small_m_linear on a real GPU: bf16 (which the CPU interpreter cannot check) on the Llama-3.2-1B,
Llama-3.1-8B and SmolLM2-135M linear shapes at M = 1..16, the forced split-K / FMA variants,
determinism, and CUDA-graph capture.

    python -m pytest tests/gpu/test_small_m_linear_gpu.py -q

Oracle: float32 F.linear on the same bf16 inputs; cuBLAS's bf16 F.linear is held to the same
tolerance, and small_m_linear's mean error may not exceed cuBLAS's by more than a rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.graph_capture import capture_graph
from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from strata.kernels.small_m_linear import LinearLaunchConfig, small_m_linear, use_small_m_linear  # noqa: E402
from tests.linear_checks import assert_close_to_reference, make_x, reference, weight_for  # noqa: E402
from tests.test_small_m_linear import MODEL_SHAPES  # noqa: E402


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("name,n,k", MODEL_SHAPES, ids=[s[0] for s in MODEL_SHAPES])
def test_model_shapes_bf16_match_linear(name, n, k, m):
    weight = weight_for(n, k, torch.bfloat16)
    x = make_x(m, k, torch.bfloat16, seed=m)
    assert use_small_m_linear(x, weight)
    want = reference(x, weight)
    cublas = F.linear(x, weight)
    assert_close_to_reference(cublas, want, torch.bfloat16)
    assert_close_to_reference(small_m_linear(x, weight), want, torch.bfloat16, baseline=cublas)


@pytest.mark.parametrize(
    "config",
    [
        LinearLaunchConfig(block_n=16, block_k=256, split_k=1, num_stages=3),
        LinearLaunchConfig(block_n=16, block_k=128, split_k=4, num_stages=4),
        LinearLaunchConfig(block_n=32, block_k=512, split_k=2, num_stages=3),
        LinearLaunchConfig(block_n=64, block_k=256, split_k=1, num_stages=3),  # wgmma
        LinearLaunchConfig(block_n=8, block_k=512, use_dot=False, num_stages=1),
        LinearLaunchConfig(block_n=32, block_k=256, split_k=2, use_dot=False, num_warps=8, num_stages=1),
    ],
    ids=str,
)
@pytest.mark.parametrize("bias", [False, True])
def test_forced_configs_with_bias(config, bias):
    """Variants the benchmark's sweep times: every one must be right, with a ragged N (2000)."""
    n, k = 2000, 2048
    weight = weight_for(n, k, torch.bfloat16)
    b = torch.randn(n, device="cuda").to(torch.bfloat16) if bias else None
    for m in [1] if not config.use_dot else [1, 5, 16]:
        x = make_x(m, k, torch.bfloat16, seed=m)
        assert_close_to_reference(small_m_linear(x, weight, b, config=config), reference(x, weight, b), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_and_ragged_k(dtype):
    weight = weight_for(1000, 1000, dtype)  # K = 1000: masked last step
    b = torch.randn(1000, device="cuda").to(dtype)
    for m in (1, 7, 16):
        x = make_x(m, 1000, dtype, seed=m)
        assert_close_to_reference(small_m_linear(x, weight, b), reference(x, weight, b), dtype)


def test_split_k_is_deterministic():
    weight = weight_for(2048, 8192, torch.bfloat16)  # the automatic config splits this one
    x = make_x(16, 8192, torch.bfloat16)
    first = small_m_linear(x, weight)
    for _ in range(5):
        assert torch.equal(first, small_m_linear(x, weight))


def test_cuda_graph_capture_and_replay():
    """Captured once, replayed on new inputs: the split path's partials buffer lives in the graph."""
    shapes = [(3072, 2048), (2048, 2048)]  # single pass, split-K
    weights = [weight_for(n, k, torch.bfloat16) for n, k in shapes]
    x = make_x(4, 2048, torch.bfloat16)
    outs = [torch.empty(4, n, device="cuda", dtype=torch.bfloat16) for n, _ in shapes]

    def step():
        for w, out in zip(weights, outs):
            small_m_linear(x, w, out=out)

    graph, _ = capture_graph(step)
    for seed in (1, 2):
        x.copy_(make_x(4, 2048, torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        for w, out in zip(weights, outs):
            assert torch.equal(out, small_m_linear(x, w))


def test_use_small_m_linear_predicate():
    weight = weight_for(3072, 2048, torch.bfloat16)
    assert use_small_m_linear(make_x(16, 2048, torch.bfloat16), weight)
    assert use_small_m_linear(make_x(8, 2048, torch.bfloat16).view(2, 4, 2048), weight)
    assert not use_small_m_linear(make_x(17, 2048, torch.bfloat16), weight)  # too many rows
    assert not use_small_m_linear(make_x(1, 2048, torch.float16), weight)  # dtype mismatch
    assert not use_small_m_linear(make_x(1, 3072, torch.bfloat16), weight.t())  # not contiguous
    assert not use_small_m_linear(make_x(1, 2048, torch.bfloat16).cpu(), weight)
