"""Shared inputs and oracles of the linear-kernel tests (small_m_linear, batched_linear): random
x and W ~ N(0, 1/K) so outputs are ~N(0, 1), and float32 F.linear as the reference."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# GPU tests: the 16-bit result is rounded once (bf16: 2^-9 relative); float32 differs only in
# summation order.
TOLERANCE = {
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2, mean=3e-3),
    torch.float16: dict(atol=4e-3, rtol=4e-3, mean=5e-4),
    torch.float32: dict(atol=1e-4, rtol=1e-4, mean=1e-5),
}


def inputs(m, n, k, bias, dtype=torch.float32, seed=0):
    """(x [m, k], weight [n, k], bias [n] or None), on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return x, weight, b


def assert_matches_linear(got, x, weight, bias, atol=1e-5, rtol=1e-5):
    """Interpreter tests: got equals float32 F.linear within a summation order's rounding."""
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.dtype == x.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@functools.lru_cache(maxsize=2)  # the 8B lm_head is 1 GB in bf16: keep few alive
def weight_for(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    return (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(dtype)


def make_x(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, device="cuda", generator=gen).to(dtype)


def reference(x, weight, bias=None) -> torch.Tensor:
    """float32 F.linear, in chunks of 16k rows: a float32 copy of the whole 8B lm_head would take 2 GB."""
    out = torch.cat([F.linear(x.float(), w.float()) for w in weight.split(16384)], dim=-1)
    return out if bias is None else out + bias.float()


def assert_close_to_reference(got, want, dtype, baseline=None):
    """GPU tests: within TOLERANCE of the float32 reference and, given cuBLAS's output, no further
    from it on average than cuBLAS beyond a rounding's worth."""
    tol = TOLERANCE[dtype]
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, atol=tol["atol"], rtol=tol["rtol"])
    mean_error = (got.float() - want).abs().mean().item()
    assert mean_error < tol["mean"], f"mean abs error {mean_error:.2e}"
    if baseline is not None:
        cublas_error = (baseline.float() - want).abs().mean().item()
        assert mean_error <= 1.5 * cublas_error + 1e-4, (mean_error, cublas_error)
