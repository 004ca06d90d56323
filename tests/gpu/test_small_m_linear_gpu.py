"""small_m_linear on a real GPU: bf16 (which the CPU interpreter cannot check) on the Llama-3.2-1B,
Llama-3.1-8B and SmolLM2-135M linear shapes at M = 1..16, the forced split-K / FMA variants,
determinism, and CUDA-graph capture.

    python -m pytest tests/gpu/test_small_m_linear_gpu.py -q

Oracle: float32 F.linear on the same bf16 inputs; cuBLAS's bf16 F.linear is held to the same
tolerance, and small_m_linear's mean error may not exceed cuBLAS's by more than a rounding.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from strata.kernels.small_m_linear import LinearLaunchConfig, small_m_linear, use_small_m_linear  # noqa: E402
from tests.test_small_m_linear import MODEL_SHAPES  # noqa: E402

# Outputs are ~N(0, 1) (x ~ N(0, 1), W ~ N(0, 1/K)); the bf16 result is rounded once (2^-9 relative).
TOLERANCE = {
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2, mean=3e-3),
    torch.float16: dict(atol=4e-3, rtol=4e-3, mean=5e-4),
    torch.float32: dict(atol=1e-4, rtol=1e-4, mean=1e-5),
}


@functools.lru_cache(maxsize=2)  # the 8B lm_head is 1 GB in bf16: keep few alive
def weight_for(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    return (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(dtype)


def make_x(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, device="cuda", generator=gen).to(dtype)


def reference(x, weight, bias=None) -> torch.Tensor:
    # In chunks of 16k rows: a float32 copy of the whole 8B lm_head would take 2 GB.
    out = torch.cat([F.linear(x.float(), w.float()) for w in weight.split(16384)], dim=-1)
    return out if bias is None else out + bias.float()


def assert_close_to_reference(got, want, dtype, baseline=None):
    tol = TOLERANCE[dtype]
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, atol=tol["atol"], rtol=tol["rtol"])
    mean_error = (got.float() - want).abs().mean().item()
    assert mean_error < tol["mean"], f"mean abs error {mean_error:.2e}"
    if baseline is not None:  # no worse than cuBLAS beyond a rounding's worth
        cublas_error = (baseline.float() - want).abs().mean().item()
        assert mean_error <= 1.5 * cublas_error + 1e-4, (mean_error, cublas_error)


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


@pytest.mark.parametrize("config", [
    LinearLaunchConfig(block_n=16, block_k=256, split_k=1, num_stages=3),
    LinearLaunchConfig(block_n=16, block_k=128, split_k=4, num_stages=4),
    LinearLaunchConfig(block_n=32, block_k=512, split_k=2, num_stages=3),
    LinearLaunchConfig(block_n=64, block_k=256, split_k=1, num_stages=3),  # wgmma
    LinearLaunchConfig(block_n=8, block_k=512, use_dot=False, num_stages=1),
    LinearLaunchConfig(block_n=32, block_k=256, split_k=2, use_dot=False, num_warps=8, num_stages=1),
], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_forced_configs_with_bias(config, bias):
    """Variants the benchmark's sweep times: every one must be right, with a ragged N (2000)."""
    n, k = 2000, 2048
    weight = weight_for(n, k, torch.bfloat16)
    b = torch.randn(n, device="cuda").to(torch.bfloat16) if bias else None
    for m in ([1] if not config.use_dot else [1, 5, 16]):
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
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile outside the capture
        for w, out in zip(weights, outs):
            small_m_linear(x, w, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w, out in zip(weights, outs):
            small_m_linear(x, w, out=out)
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
