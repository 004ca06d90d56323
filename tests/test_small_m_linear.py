"""small_m_linear vs torch.nn.functional.linear, on CPU under Triton's interpreter.

As in tests/test_kernels.py: triton.jit reads TRITON_INTERPRET when the kernel is defined, so
unless this process was started with TRITON_INTERPRET=1 (and has not defined the kernel
otherwise), this module only holds two launcher tests: one re-runs this file in a fresh pytest
with TRITON_INTERPRET=1 (where the real tests below are collected), one compiles the kernel's
launch variants for sm_90 without a GPU (`python -m tests.test_small_m_linear` prints them).
To debug a single case directly:  TRITON_INTERPRET=1 python -m pytest tests/test_small_m_linear.py -k split

Float32 (and one float16 case) here: the interpreter computes bfloat16 wrongly; bf16 and the
real model shapes are in tests/gpu/test_small_m_linear_gpu.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter

REPO_ROOT = Path(__file__).resolve().parents[1]

# (name, N, K): the Llama-3.2-1B, Llama-3.1-8B and SmolLM2-135M linears.
MODEL_SHAPES = [
    ("1b.qkv", 3072, 2048),
    ("1b.o_proj", 2048, 2048),
    ("1b.gate_up", 16384, 2048),
    ("1b.down", 2048, 8192),
    ("1b.lm_head", 128256, 2048),
    ("8b.qkv", 6144, 4096),
    ("8b.o_proj", 4096, 4096),
    ("8b.gate_up", 28672, 4096),
    ("8b.down", 4096, 14336),
    ("8b.lm_head", 128256, 4096),
    ("smol.qkv", 960, 576),
    ("smol.o_proj", 576, 576),
    ("smol.gate_up", 3072, 576),
    ("smol.down", 576, 1536),
    ("smol.lm_head", 49152, 576),
]


def compile_variants() -> list:
    """Compile for sm_90 what small_m_linear launches for the 1B shapes (16- and 32-row tiles,
    split-K + reduce), a masked-K split, fp16 with bias, a 64-row tile (wgmma), the FMA path."""
    from strata.kernels import compile_check
    from strata.kernels import small_m_linear as sml

    def one(label, n, k, config, dtype="bf16", bias=False):
        steps = triton.cdiv(k, config.block_k)
        per_split = triton.cdiv(steps, config.split_k)
        constexprs = dict(
            K=k,
            BLOCK_M=16 if config.use_dot else 1,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            STEPS_PER_SPLIT=per_split,
            SPLIT_K=config.split_k,
            EVEN_K=k % config.block_k == 0 and per_split * config.split_k == steps,
            HAS_BIAS=bias,
            USE_DOT=config.use_dot,
            IEEE_DOT=False,
        )
        return compile_check._compile(
            f"small_m_linear {dtype} {label} N={n} K={k} {config}",
            sml._small_m_linear_kernel,
            dtype,
            constexprs,
            config.num_warps,
            config.num_stages,
        )

    reports = []
    for name, n, k in [
        s for s in MODEL_SHAPES if s[0] in ("1b.qkv", "1b.o_proj", "1b.gate_up", "1b.lm_head", "smol.qkv")
    ]:
        reports.append(one(name, n, k, sml.choose_linear_config(n=n, k=k, sm_count=132)))
    reports.append(one("8b.down", 4096, 14336, sml.choose_linear_config(n=4096, k=14336, sm_count=132), "fp16", True))
    reports.append(one("wgmma", 16384, 2048, sml.LinearLaunchConfig(block_n=64, block_k=256, num_stages=3)))
    reports.append(one("fma", 2048, 2048, sml.LinearLaunchConfig(block_n=16, block_k=256, use_dot=False)))
    reports.append(
        compile_check._compile(
            "small_m_linear reduce splits bf16",
            sml._reduce_splits_kernel,
            "bf16",
            dict(SPLIT_K=2, BLOCK=1024, HAS_BIAS=True),
            4,
            1,
        )
    )
    return reports


if not can_run_interpreted_here("strata.kernels.small_m_linear"):

    def test_small_m_linear_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=300)

    def test_small_m_linear_compiles_for_sm90_without_spills():
        """Compile the launch variants for an H100; fails on a spill or an unpipelined dot loop."""
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        proc = subprocess.run(
            [sys.executable, "-m", "tests.test_small_m_linear"],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        print(proc.stdout)
        assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-10000:]
        assert "1b.lm_head" in proc.stdout

else:
    from strata.kernels.small_m_linear import (
        MAX_SHARED,
        LinearLaunchConfig,
        choose_linear_config,
        small_m_linear,
        use_small_m_linear,
    )
    from tests.linear_checks import assert_matches_linear, inputs

    # --- dot path: masked K tail, N not a multiple of the tile, split-K on and off --------------

    @pytest.mark.parametrize("m", [1, 3, 16])
    @pytest.mark.parametrize("bias", [False, True])
    @pytest.mark.parametrize("split_k", [1, 3])
    def test_dot_path_matches_linear(m, bias, split_k):
        # K = 200: 4 steps of 64, the last one masked; 3 splits of 2 steps leave the last one
        # empty (all-zero partials). N = 40: the last 16-row tile is half past N.
        x, weight, b = inputs(m, 40, 200, bias)
        config = LinearLaunchConfig(block_n=16, block_k=64, split_k=split_k, num_stages=3)
        assert_matches_linear(small_m_linear(x, weight, b, config=config), x, weight, b)

    @pytest.mark.parametrize("m", [1, 16])
    def test_whole_tiles_and_wide_rows(m):
        """K a multiple of the step and the steps of the splits (unmasked loop), 32-row tiles."""
        x, weight, b = inputs(m, 80, 256, bias=True)
        config = LinearLaunchConfig(block_n=32, block_k=64, split_k=2)
        assert_matches_linear(small_m_linear(x, weight, b, config=config), x, weight, b)

    # --- FMA path (M == 1) ---------------------------------------------------------------------

    @pytest.mark.parametrize("bias", [False, True])
    @pytest.mark.parametrize("split_k,k", [(1, 200), (2, 200), (2, 256)])
    def test_fma_path_matches_linear(bias, split_k, k):
        x, weight, b = inputs(1, 40, k, bias)
        config = LinearLaunchConfig(block_n=8, block_k=64, split_k=split_k, use_dot=False)
        assert_matches_linear(small_m_linear(x, weight, b, config=config), x, weight, b)

    def test_fma_path_serves_one_row_only():
        x, weight, _ = inputs(2, 40, 64, False)
        with pytest.raises(AssertionError):
            small_m_linear(x, weight, config=LinearLaunchConfig(block_n=8, block_k=64, use_dot=False))

    # --- the automatic config, float16, the call surface ---------------------------------------

    @pytest.mark.parametrize("m", [1, 16])
    def test_automatic_config_on_smollm_qkv(m):
        """The launch small_m_linear picks itself for SmolLM2's qkv (K = 576 in steps of 64, split 4)."""
        x, weight, b = inputs(m, 960, 576, bias=m == 1)
        assert choose_linear_config(n=960, k=576, sm_count=132).split_k > 1
        assert_matches_linear(small_m_linear(x, weight, b), x, weight, b)
        single = small_m_linear(x, weight, b, split_k=1)
        assert_matches_linear(single, x, weight, b)

    def test_float16():
        x, weight, b = inputs(5, 48, 192, bias=True, dtype=torch.float16)
        got = small_m_linear(x, weight, b, config=LinearLaunchConfig(block_n=16, block_k=64, split_k=2))
        # One rounding of the float32 result to float16 (2^-11 relative).
        assert_matches_linear(got, x, weight, b, atol=2e-3, rtol=2e-3)

    def test_leading_dims_out_argument_and_no_rows():
        x, weight, b = inputs(6, 40, 96, bias=True)
        out = torch.full((2, 3, 40), float("nan"))
        got = small_m_linear(x.view(2, 3, 96), weight, b, out=out)
        assert got is out
        assert_matches_linear(got.view(6, 40), x, weight, b)
        assert small_m_linear(x[:0], weight, b).shape == (0, 40)

    def test_split_k_is_deterministic():
        x, weight, b = inputs(16, 40, 200, bias=True)
        config = LinearLaunchConfig(block_n=16, block_k=64, split_k=3)
        first = small_m_linear(x, weight, b, config=config)
        assert torch.equal(first, small_m_linear(x, weight, b, config=config))

    def test_rejects_and_predicate():
        x, weight, _ = inputs(17, 40, 64, False)
        with pytest.raises(AssertionError):
            small_m_linear(x, weight)  # 17 rows
        with pytest.raises(AssertionError):
            small_m_linear(x[:4], weight.t().contiguous().t())  # column-major weight
        assert not use_small_m_linear(x[:4], weight)  # CPU tensors (the GPU test checks the CUDA case)

    # --- launch heuristics (python only) -------------------------------------------------------

    def test_launch_config_heuristics():
        for name, n, k in MODEL_SHAPES:
            config = choose_linear_config(n=n, k=k, sm_count=132)
            programs = triton.cdiv(n, config.block_n) * config.split_k
            steps = triton.cdiv(k, config.block_k)
            assert config.use_dot and config.block_n in (16, 32), (name, config)
            assert k % config.block_k == 0, (name, config)  # each of these K divides into whole steps
            assert config.split_k & (config.split_k - 1) == 0 and steps >= 2 * config.split_k, (name, config)
            assert config.split_k == 1 or config.block_n == 16, (name, config)  # split only after narrowing
            assert programs >= 132 or steps < 4 * config.split_k, (name, config)  # fills the SMs if it can
            assert 2 <= config.num_stages <= 6, (name, config)
            assert config.num_stages * (config.block_n + 16) * config.block_k * 2 <= MAX_SHARED, (name, config)
        choose = lambda n, k, **kw: choose_linear_config(n=n, k=k, sm_count=132, **kw)  # noqa: E731
        assert choose(2048, 2048).split_k == 2  # 128 tiles of 16 rows < 132 SMs
        assert choose(2048, 8192).split_k == 2
        assert choose(4096, 4096).split_k == 1
        assert choose(16384, 2048).split_k == 1 and choose(16384, 2048).block_n == 32
        assert choose(128256, 2048).block_n == 32 and choose(6144, 4096).block_n == 16  # 192 tiles of 32 < 264
        assert choose(960, 576).block_k == 64  # 576 = 9 x 64
        assert choose(4096, 4096, element_size=4).block_k == 128  # 512 bytes of a row per step
        assert choose(2048, 2048, split_k=1).split_k == 1 and choose(4096, 4096, split_k=4).split_k == 4
        assert choose(2048, 2048, split_k=None) == choose(2048, 2048)  # a pure function of the ints
        assert choose_linear_config(n=2048, k=2048, sm_count=64).split_k == 1  # 128 tiles fill 64 SMs


if __name__ == "__main__":
    failures = []
    for report in compile_variants():
        print(report.line(), flush=True)
        if report.spill_bytes:
            failures.append(f"{report.name}: {report.spill_bytes} bytes spilled")
        if "use_dot=True" in report.name and report.async_copies == 0:
            failures.append(f"{report.name}: W loads not pipelined")
    for failure in failures:
        print("FAIL", failure)
    sys.exit(1 if failures else 0)
