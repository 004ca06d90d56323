"""batched_linear on a real GPU: bf16 (which the CPU interpreter rounds differently) on the
Llama-3.2-1B and Llama-3.1-8B linear shapes at M = 64..512 with the heuristic's configs, forced
schedules (data parallel, split-K, stream-K; TMA and plain pointers; with and without the
dependent launch) on ragged shapes with a bias, fp16 / fp32, determinism, and CUDA-graph capture.

    python -m pytest tests/gpu/test_batched_linear_gpu.py -q

Oracle: float32 F.linear on the same inputs; cuBLAS's F.linear is held to the same tolerance,
and batched_linear's mean error may not exceed cuBLAS's by more than a rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.graph_capture import capture_graph
from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from strata.kernels.batched_linear import (  # noqa: E402
    GemmLaunchConfig,
    batched_linear,
    choose_batched_linear_config,
    use_batched_linear,
)
from tests.linear_checks import assert_close_to_reference, make_x, reference, weight_for  # noqa: E402
from tests.test_batched_linear import BATCH_SIZES, MODEL_SHAPES  # noqa: E402


@pytest.mark.parametrize("m", BATCH_SIZES)
@pytest.mark.parametrize("name,n,k", MODEL_SHAPES, ids=[s[0] for s in MODEL_SHAPES])
def test_model_shapes_bf16_match_linear(name, n, k, m):
    weight = weight_for(n, k, torch.bfloat16)
    x = make_x(m, k, torch.bfloat16, seed=m)
    assert use_batched_linear(x, weight)
    want = reference(x, weight)
    cublas = F.linear(x, weight)
    assert_close_to_reference(cublas, want, torch.bfloat16)
    assert_close_to_reference(batched_linear(x, weight), want, torch.bfloat16, baseline=cublas)


FORCED = [
    GemmLaunchConfig(128, 128, 64, num_warps=8, num_stages=4),
    GemmLaunchConfig(128, 128, 64, num_warps=8, num_stages=4, use_tma=True),
    GemmLaunchConfig(128, 64, 64, split_k=3, num_warps=4, num_stages=4),
    GemmLaunchConfig(128, 64, 64, split_k=4, num_warps=4, num_stages=4, use_tma=True, pdl=False),
    GemmLaunchConfig(64, 128, 64, stream_k=132, num_warps=4, num_stages=4, use_tma=True),
    GemmLaunchConfig(128, 128, 64, stream_k=132, num_warps=8, num_stages=4),
    GemmLaunchConfig(128, 128, 128, stream_k=264, num_warps=8, num_stages=3, use_tma=True, pdl=False),
    GemmLaunchConfig(256, 128, 64, split_k=2, num_warps=8, num_stages=3, use_tma=True),
    GemmLaunchConfig(64, 64, 64, stream_k=200, num_warps=4, num_stages=6, use_tma=True),
]


@pytest.mark.parametrize("config", FORCED, ids=lambda c: c.describe())
@pytest.mark.parametrize("bias", [False, True])
def test_forced_configs_ragged_with_bias(config, bias):
    """Schedules and load paths on a ragged N (2000) and K (1000: a masked / zero-filled last
    step), rows 1 .. 300 (partial row blocks)."""
    n, k = 2000, 1000
    weight = weight_for(n, k, torch.bfloat16)
    b = torch.randn(n, device="cuda").to(torch.bfloat16) if bias else None
    for m in (1, 17, 130, 300):
        x = make_x(m, k, torch.bfloat16, seed=m)
        want = reference(x, weight, b)
        assert_close_to_reference(batched_linear(x, weight, b, config=config), want, torch.bfloat16)


def test_unaligned_x_falls_back_from_tma():
    """x rows at an odd element offset cannot take a TMA descriptor: the pointer path serves them."""
    weight = weight_for(3072, 2048, torch.bfloat16)
    storage = make_x(64 * 2049 + 1, 1, torch.bfloat16).view(-1)
    x = storage[1:].view(64, 2049)[:, :2048]  # row stride 2049 elements, base 2 bytes off
    config = GemmLaunchConfig(128, 128, 64, stream_k=132, num_warps=8, num_stages=4, use_tma=True)
    assert_close_to_reference(batched_linear(x, weight, config=config), reference(x, weight), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes(dtype):
    weight = weight_for(1000, 1000, dtype)  # ragged K: masked last step
    b = torch.randn(1000, device="cuda").to(dtype)
    for m in (1, 64, 200):
        x = make_x(m, 1000, dtype, seed=m)
        assert_close_to_reference(batched_linear(x, weight, b), reference(x, weight, b), dtype)
    if dtype == torch.float16:
        x = make_x(256, 2048, dtype)
        w = weight_for(2048, 2048, dtype)
        for config in (choose_batched_linear_config(256, 2048, 2048, 132), FORCED[4], FORCED[2]):
            assert_close_to_reference(batched_linear(x, w, config=config), reference(x, w), dtype)


@pytest.mark.parametrize("config", [FORCED[3], FORCED[5], None], ids=["split", "stream", "heuristic"])
def test_deterministic(config):
    weight = weight_for(2048, 8192, torch.bfloat16)
    x = make_x(256, 8192, torch.bfloat16)
    first = batched_linear(x, weight, config=config)
    for _ in range(5):
        assert torch.equal(first, batched_linear(x, weight, config=config))


def test_cuda_graph_capture_and_replay():
    """Captured once, replayed on new inputs: the heuristic's configs for the 1B decode linears
    at M = 256 plus a forced split-K and stream-K (scratch buffers live in the graph's pool)."""
    calls = [
        ((3072, 2048), None),
        ((2048, 2048), None),
        ((2048, 8192), None),
        ((16384, 2048), None),
        ((2048, 8192), FORCED[3]),
        ((2048, 2048), FORCED[5]),
    ]
    m = 256
    xs = {k: make_x(m, k, torch.bfloat16) for k in (2048, 8192)}
    gen = torch.Generator(device="cuda").manual_seed(3)
    # Held here for the graph's life (weight_for's cache would let them go).
    weights = {
        shape: (torch.randn(shape, device="cuda", generator=gen) / shape[1] ** 0.5).to(torch.bfloat16)
        for shape, _ in calls
    }
    outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for (n, _), _ in calls]

    def step():
        for ((n, k), config), out in zip(calls, outs):
            batched_linear(xs[k], weights[(n, k)], out=out, config=config)

    graph, _ = capture_graph(step)
    for seed in (1, 2):
        for k, x in xs.items():
            x.copy_(make_x(m, k, torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        for ((n, k), config), out in zip(calls, outs):
            weight = weights[(n, k)]
            assert torch.equal(out, batched_linear(xs[k], weight, config=config))
            assert_close_to_reference(out, reference(xs[k], weight), torch.bfloat16)


def test_use_batched_linear_predicate():
    weight = weight_for(3072, 2048, torch.bfloat16)
    assert use_batched_linear(make_x(256, 2048, torch.bfloat16), weight)
    assert use_batched_linear(make_x(512, 2048, torch.bfloat16).view(2, 256, 2048), weight)
    assert not use_batched_linear(make_x(1, 2048, torch.float16), weight)  # dtype mismatch
    assert not use_batched_linear(make_x(1, 3072, torch.bfloat16), weight.t())  # not contiguous
    assert not use_batched_linear(make_x(1, 2048, torch.bfloat16).cpu(), weight)
