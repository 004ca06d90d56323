"""batched_linear vs torch.nn.functional.linear, on CPU under Triton's interpreter.

As in tests/test_small_m_linear.py: triton.jit reads TRITON_INTERPRET when the kernel is defined,
so unless this process was started with TRITON_INTERPRET=1 (and has not defined the kernel
otherwise), this module only holds two launcher tests: one re-runs this file in a fresh pytest
with TRITON_INTERPRET=1 (where the real tests below are collected), one compiles the heuristic's
launch variants for sm_90 without a GPU (`python -m tests.test_batched_linear` prints them).
To debug a single case directly:  TRITON_INTERPRET=1 python -m pytest tests/test_batched_linear.py -k stream

Float32 with ieee dots (tight tolerance), float16, and bfloat16 (the kernel's interpreted dot
upcasts to float32, but the interpreter's float32 -> bfloat16 conversion truncates, so bf16 is
held to one ulp here; round-to-nearest and the real model shapes are in
tests/gpu/test_batched_linear_gpu.py). The heuristic's configs for the real shapes run on small
stand-ins with the same tiles and schedule.
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

# (name, N, K): the Llama-3.2-1B and Llama-3.1-8B per-layer linears; decode batch sizes.
MODEL_SHAPES = [
    ("1b.qkv", 3072, 2048),
    ("1b.o_proj", 2048, 2048),
    ("1b.gate_up", 16384, 2048),
    ("1b.down", 2048, 8192),
    ("8b.qkv", 6144, 4096),
    ("8b.o_proj", 4096, 4096),
    ("8b.gate_up", 28672, 4096),
    ("8b.down", 4096, 14336),
]
BATCH_SIZES = [64, 128, 256, 512]
SM_COUNTS = [132, 114, 78]  # H100/H200 SXM, H100 PCIe, an H20-sized part


def heuristic_configs() -> dict:
    """config -> the first (name, M) it serves, over the model shapes x batch sizes on 132 SMs."""
    from strata.kernels.batched_linear import choose_batched_linear_config

    configs = {}
    for name, n, k in MODEL_SHAPES:
        for m in BATCH_SIZES:
            configs.setdefault(choose_batched_linear_config(m, n, k, 132), (name, m))
    return configs


def compile_variants() -> list:
    """Compile for sm_90 every GEMM variant the heuristic launches for the model shapes (bf16),
    one with a bias and a ragged K (fp16), float32, and the reduce and fixup kernels."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.kernels import batched_linear as bl
    from strata.kernels import compile_check

    def one(label, kernel, dtype, constexprs, num_warps, num_stages, descriptors=None):
        signature, attrs = {}, {}
        for index, name in enumerate(kernel.arg_names):
            if name in constexprs:
                signature[name] = "constexpr"
            elif descriptors and name in descriptors:
                signature[name] = f"tensordesc<{dtype}[{descriptors[name][0]},{descriptors[name][1]}]>"
            elif name == "scratch_ptr":
                signature[name] = "*fp32"
            elif name.endswith("_ptr") or name in ("x_in", "w_in"):
                signature[name] = "*" + dtype
            else:
                signature[name] = "i32"
            if signature[name].startswith("*") or name in ("N", "K", "stride_xm", "stride_om"):
                attrs[(index,)] = [["tt.divisibility", 16]]  # as the launches specialise them
        source = ASTSource(
            kernel, signature, attrs=attrs, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()}
        )
        compiled = triton.compile(
            source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages}
        )
        registers, spills = compile_check._ptxas_stats(compiled.asm["ptx"])
        ttgir = compiled.asm["ttgir"]
        pipelined = ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy_global_to_local")
        return compile_check.CompileReport(
            f"{label} wgmma={'warp_group_dot' in ttgir}", registers, spills, compiled.metadata.shared, pipelined
        )

    def gemm(label, config, dtype="bf16", bias=False, even_k=True):
        schedule = 2 if config.stream_k else 1 if config.split_k > 1 else 0
        constexprs = dict(
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=config.block_k,
            GROUP_M=config.group_m,
            SCHEDULE=schedule,
            EVEN_K=even_k,
            HAS_BIAS=bias,
            USE_TMA=config.use_tma,
            IEEE_DOT=dtype == "fp32",
            LAUNCH_DEPENDENTS=config.pdl and schedule > 0,
            INTERPRETED=False,
        )
        descriptors = dict(x_in=(config.block_m, config.block_k), w_in=(config.block_n, config.block_k))
        return one(
            f"batched_linear {dtype} {label} {config.describe()}",
            bl._batched_linear_kernel,
            dtype,
            constexprs,
            config.num_warps,
            config.num_stages,
            descriptors if config.use_tma else None,
        )

    reports = [gemm(f"{name} M={m}", config) for config, (name, m) in heuristic_configs().items()]
    reports.append(
        gemm(
            "bias, ragged K",
            bl.GemmLaunchConfig(128, 64, 64, stream_k=132, num_warps=4),
            "fp16",
            bias=True,
            even_k=False,
        )
    )
    reports.append(gemm("fp32", bl.choose_batched_linear_config(256, 2048, 2048, 132, element_size=4), "fp32"))
    reports.append(
        one(
            "reduce splits bf16",
            bl._reduce_splits_kernel,
            "bf16",
            dict(BLOCK=bl.REDUCE_BLOCK, HAS_BIAS=True, WAIT=True),
            4,
            1,
        )
    )
    reports.append(
        one(
            "stream-K fixup bf16",
            bl._stream_k_fixup_kernel,
            "bf16",
            dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, ROWS=bl.FIXUP_ROWS, HAS_BIAS=True, WAIT=True),
            4,
            1,
        )
    )
    return reports


if not can_run_interpreted_here("strata.kernels.batched_linear"):
    # batched_linear serves no step (cuBLAS does): its 20 s of interpreter cases run with the slow
    # tests (STRATA_SLOW_TESTS=1) and on GPUs, keeping the default run under its 15 minutes.
    @pytest.mark.slow
    def test_batched_linear_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=300)

    def test_batched_linear_compiles_for_sm90_without_spills():
        """Compile the heuristic's launch variants for an H100/H200; fails on a spill, a dot that is
        not wgmma, or an unpipelined loop."""
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        proc = subprocess.run(
            [sys.executable, "-m", "tests.test_batched_linear"],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        print(proc.stdout)
        assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-10000:]
        assert "1b.qkv" in proc.stdout and "fixup" in proc.stdout

else:
    import strata.kernels.batched_linear as bl
    from strata.kernels.batched_linear import (
        MAX_SHARED,
        GemmLaunchConfig,
        batched_linear,
        choose_batched_linear_config,
        use_batched_linear,
    )
    from tests.linear_checks import assert_matches_linear, inputs

    SMALL = GemmLaunchConfig(block_m=64, block_n=32, block_k=32, num_warps=4, num_stages=3)

    # --- data parallel: ragged rows, N and K off the tiles, bias --------------------------------

    @pytest.mark.parametrize("m", [1, 3, 17, 64, 130])
    def test_ragged_rows_match_linear(m):
        # N = 72: the last 32-column tile is a quarter full; K = 200: 7 steps of 32, the last masked.
        x, weight, b = inputs(m, 72, 200, bias=m % 2 == 1)
        assert_matches_linear(batched_linear(x, weight, b, config=SMALL), x, weight, b)

    def test_whole_tiles_and_wide_tiles():
        """K a multiple of the step (unmasked loop), a 128 x 64 tile over 2 ragged row blocks."""
        x, weight, b = inputs(130, 96, 256, bias=True)
        config = GemmLaunchConfig(block_m=128, block_n=64, block_k=64, num_warps=4)
        assert_matches_linear(batched_linear(x, weight, b, config=config), x, weight, b)

    # --- split-K and stream-K ------------------------------------------------------------------

    @pytest.mark.parametrize("split_k", [2, 3, 4])
    @pytest.mark.parametrize("bias", [False, True])
    def test_split_k_matches_linear(split_k, bias):
        # 7 steps: 3 splits of 3 leave the last one a single (masked) step; 4 of 2, the last one.
        x, weight, b = inputs(70, 72, 200, bias)
        config = GemmLaunchConfig(block_m=64, block_n=32, block_k=32, split_k=split_k, num_warps=4)
        assert_matches_linear(batched_linear(x, weight, b, config=config), x, weight, b)

    @pytest.mark.parametrize("programs", [1, 2, 5, 8, 13, 1000])
    def test_stream_k_matches_linear(programs):
        """6 tiles x 7 steps = 42 units over P programs: whole tiles stored directly, pieces
        starting and ending inside tiles, a tile shared by up to 8 programs (P = 42: one step
        each, P = 1000 is capped to 42), and a single program walking everything (P = 1)."""
        x, weight, b = inputs(70, 72, 200, bias=programs % 2 == 1)
        config = GemmLaunchConfig(block_m=64, block_n=32, block_k=32, stream_k=programs, num_warps=4)
        assert_matches_linear(batched_linear(x, weight, b, config=config), x, weight, b)
        assert bl.launch_grid(config, 70, 72, 200)[1] == min(programs, 42)

    @pytest.mark.parametrize(
        "config",
        [
            GemmLaunchConfig(block_m=64, block_n=32, block_k=32, split_k=3, num_warps=4),
            GemmLaunchConfig(block_m=64, block_n=32, block_k=32, stream_k=13, num_warps=4),
        ],
        ids=["split", "stream"],
    )
    def test_split_and_stream_k_are_deterministic(config):
        x, weight, b = inputs(70, 72, 200, bias=True, dtype=torch.float16)
        first = batched_linear(x, weight, b, config=config)
        assert torch.equal(first, batched_linear(x, weight, b, config=config))

    @pytest.mark.parametrize(
        "config",
        [
            GemmLaunchConfig(block_m=64, block_n=32, block_k=32, num_warps=4, use_tma=True),
            GemmLaunchConfig(block_m=64, block_n=32, block_k=32, stream_k=5, num_warps=4, use_tma=True),
        ],
        ids=["dp", "stream"],
    )
    def test_tma_descriptor_path(config, monkeypatch):
        """The TMA path (sm_90 only on a GPU) forced under the interpreter, which takes host tensor
        descriptors: the descriptors' zero-filled edges stand in for the masks."""
        monkeypatch.setattr(bl, "_tma_available", lambda device: True)
        x, weight, b = inputs(70, 72, 200, bias=True)
        assert_matches_linear(batched_linear(x, weight, b, config=config), x, weight, b)

    # --- 16-bit inputs --------------------------------------------------------------------------

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_16_bit_vs_float32_reference(dtype):
        x, weight, b = inputs(70, 72, 200, bias=True, dtype=dtype)
        for config in (SMALL, GemmLaunchConfig(block_m=64, block_n=32, block_k=32, stream_k=9, num_warps=4)):
            got = batched_linear(x, weight, b, config=config)
            # bf16: one ulp (the interpreter truncates to bf16); fp16: one rounding (2^-11 relative).
            tol = 2**-7 if dtype == torch.bfloat16 else 2e-3
            assert_matches_linear(got, x, weight, b, atol=tol, rtol=tol)

    # --- the heuristic's configs for the real shapes, on small stand-ins ------------------------

    def stand_in(config: GemmLaunchConfig) -> tuple[int, int, int]:
        """(M, N, K) with the config's tiles: two row blocks (the second ragged), two and a half
        column blocks, enough K steps for every split to own at least two."""
        steps = 2 * max(config.split_k, 2) + 1
        return config.block_m + 3, config.block_n * 5 // 2, config.block_k * steps

    @pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
    @pytest.mark.parametrize(
        "config,where",
        list(heuristic_configs().items()),
        ids=[f"{name}-M{m}" for name, m in heuristic_configs().values()],
    )
    def test_heuristic_configs_on_stand_ins(config, where, tma, monkeypatch):
        """Each config on its stand-in, through the pointer path (what the interpreter takes) and
        the TMA descriptors (what an sm_90 GPU takes), forced here."""
        monkeypatch.setattr(bl, "_tma_available", lambda device: tma)
        m, n, k = stand_in(config)
        x, weight, b = inputs(m, n, k, bias=True, dtype=torch.float16)
        assert_matches_linear(batched_linear(x, weight, b, config=config), x, weight, b, atol=2e-3, rtol=2e-3)

    # --- the call surface -----------------------------------------------------------------------

    def test_leading_dims_out_argument_and_no_rows():
        x, weight, b = inputs(6, 40, 96, bias=True)
        out = torch.full((2, 3, 40), float("nan"))
        got = batched_linear(x.view(2, 3, 96), weight, b, out=out, config=SMALL)
        assert got is out
        assert_matches_linear(got.view(6, 40), x, weight, b)
        assert batched_linear(x[:0], weight, b).shape == (0, 40)

    def test_automatic_config_float32():
        x, weight, b = inputs(20, 40, 96, bias=True)
        assert choose_batched_linear_config(20, 40, 96, 132, element_size=4).block_k == 32
        assert_matches_linear(batched_linear(x, weight, b), x, weight, b)

    def test_rejects_and_predicate():
        x, weight, _ = inputs(4, 40, 64, False)
        with pytest.raises(AssertionError):
            batched_linear(x, weight.t().contiguous().t())  # column-major weight
        with pytest.raises(AssertionError):
            batched_linear(x, weight.to(torch.float16))  # dtype mismatch
        assert not use_batched_linear(x, weight)  # CPU tensors (the GPU test checks the CUDA case)

    # --- launch heuristic (python only) ---------------------------------------------------------

    def test_heuristic_invariants():
        for name, n, k in MODEL_SHAPES:
            for sm_count in SM_COUNTS:
                for m in [1, 16, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512, 1024]:
                    config = choose_batched_linear_config(m, n, k, sm_count)
                    where = (name, m, sm_count, config)
                    assert config == choose_batched_linear_config(m, n, k, sm_count), where  # pure
                    assert (config.block_m, config.block_n, config.num_warps) == (64, 128, 4), where
                    assert config.use_tma and config.pdl and config.stream_k == 0, where
                    assert k % config.block_k == 0, where  # whole steps for these shapes
                    assert config.shared_bytes() <= MAX_SHARED, where
                    tiles = triton.cdiv(m, 64) * triton.cdiv(n, 128)
                    steps = k // config.block_k
                    if tiles > sm_count:  # several waves: data parallel, 64-wide K steps
                        assert config.block_k == 64 and config.split_k == 1, where
                    else:  # one wave: 128-wide K steps, split while it fits and keeps >= 4 steps
                        assert config.block_k == 128, where
                        assert tiles * config.split_k <= sm_count, where
                        assert config.split_k == 1 or steps >= 4 * config.split_k, where
                        more = config.split_k + 1
                        assert tiles * more > sm_count or steps < 4 * more, where  # the largest such
        choose = lambda m, n, k: choose_batched_linear_config(m, n, k, 132)  # noqa: E731
        assert choose(256, 2048, 8192).split_k == 2  # 1B down: 64 tiles x 2
        assert choose(64, 2048, 8192).split_k == 8  # 16 tiles x 8, 8 steps each
        assert choose(256, 3072, 2048).split_k == 1  # 1B qkv: 96 tiles
        assert choose(64, 2048, 2048).split_k == 4  # 16 tiles, 16 steps: 4 splits of 4
        assert choose(128, 16384, 2048).block_k == 64  # 1B gate_up: 256 tiles, two waves
        assert choose_batched_linear_config(256, 2048, 2048, 132, element_size=4).block_k == 32

    def test_heuristic_fills_the_sms_on_the_small_1b_shapes():
        """The point of the kernel: at M = 256 the 1B qkv / o_proj / down make 32-48 128 x 128
        tiles; the chosen schedule must give at least ~3/4 of the SMs work."""
        for n, k in ((3072, 2048), (2048, 2048), (2048, 8192)):
            config = choose_batched_linear_config(256, n, k, 132)
            tiles = triton.cdiv(256, config.block_m) * triton.cdiv(n, config.block_n)
            busy = config.stream_k or tiles * config.split_k
            assert busy >= 96, (n, k, config)


if __name__ == "__main__":
    failures = []
    for report in compile_variants():
        print(report.line(), flush=True)
        if report.spill_bytes:
            failures.append(f"{report.name}: {report.spill_bytes} bytes spilled")
        if report.name.startswith("batched_linear") and "fp32" not in report.name.split()[1]:
            if "wgmma=True" not in report.name:
                failures.append(f"{report.name}: the dot is not wgmma")
        if report.name.startswith("batched_linear") and report.async_copies == 0:
            failures.append(f"{report.name}: operand loads not pipelined")
    for failure in failures:
        print("FAIL", failure)
    sys.exit(1 if failures else 0)
