"""The decode chain's GEMV kernels (kernels/decode_linear.py) vs their torch references, on CPU
under Triton's interpreter, and their sm_90 compile (registers, spills, the weight prefetch
issued before the dependent-launch wait) without a GPU.

This process holds launcher tests only unless it was started with TRITON_INTERPRET=1 (triton.jit
reads it when a kernel is defined; tests/triton_interpreter.py); float32 (and float16) here, bf16
and the model shapes in tests/gpu/test_decode_linear_gpu.py.
    TRITON_INTERPRET=1 python -m pytest tests/test_decode_linear.py -k norm
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import triton

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter

# (name, N, K, prologue, epilogue adds the residual, sends early): the chain's launches for
# Llama-3.2-1B and 8B, and a TP2 rank's row-parallel ones, which send their rows to the peer.
CHAIN_SHAPES = [
    ("1b.qkv", 3072, 2048, 1, False, False),
    ("1b.o_proj", 2048, 2048, 0, True, False),
    ("1b.gate_up", 16384, 2048, 1, False, False),
    ("1b.down", 2048, 8192, 2, True, False),
    ("1b.lm_head", 128256, 2048, 1, False, False),
    ("8b.qkv", 6144, 4096, 1, False, False),
    ("8b.down", 4096, 14336, 2, True, False),
    ("8b.tp2.o_proj", 4096, 2048, 0, True, True),
    ("8b.tp2.down", 4096, 7168, 2, False, True),
]


def sm90_launches(shapes=CHAIN_SHAPES):
    """(name, registers, spilled bytes, ptx) of what the chain launches for each shape on an H100."""

    from strata.kernels import compile_check
    from strata.kernels import decode_linear as dl
    from strata.kernels import one_shot_all_reduce as one_shot

    out = []
    for name, n, k, prologue, epilogue, send in shapes:
        config = dl.choose_decode_linear_config(n=n, k=k)
        exchange = (
            one_shot.Exchange([torch.empty(0, dtype=torch.bfloat16)] * 2, None, None, 1 << 20, 1) if send else None
        )
        dummy = torch.empty(0, dtype=torch.bfloat16)
        send_constexprs = one_shot.send_part_args(exchange, torch.bfloat16, dummy)[1]
        constexprs = dict(
            K=k,
            K_PADDED=triton.next_power_of_2(k),
            BLOCK_N=config.block_n,
            PROLOGUE=prologue,
            ADD_RESIDUAL=prologue == 1,
            EPILOGUE_RESIDUAL=epilogue,
            HAS_BIAS=False,
            **send_constexprs,
            PDL=True,
        )
        source = compile_check._signature(dl._decode_linear_kernel, "bf16", constexprs)
        compiled, registers, spills = compile_check.compile_for_sm90(source, config.num_warps)
        out.append((f"{name} {config}", registers, spills, compiled.asm["ptx"]))
    return out


if not can_run_interpreted_here("strata.kernels.decode_linear"):

    @pytest.mark.triton_interpreter(seconds=3)  # its tests' time under the interpreter
    def test_decode_linear_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=600)

    @pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="compiles the real kernels")
    def test_chain_compiles_for_sm90_with_the_prefetch_before_the_wait():
        for name, registers, spills, ptx in sm90_launches():
            assert spills == 0, (name, registers, spills)
            lines = ptx.splitlines()
            wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
            launch = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
            first_load = next(i for i, line in enumerate(lines) if re.search(r"\bld\.global", line))
            # The successor may start at once, and the weight stream starts before the wait.
            assert launch < first_load < wait, (name, launch, first_load, wait)
            # The early sends read their call's number from L2 and send without a fence (the data is the signal).
            assert ("ld.volatile" in ptx) == (".tp2." in name) and "fence" not in ptx and "membar" not in ptx, name

else:
    import torch.nn.functional as F

    from strata.kernels import decode_linear as dl
    from strata.kernels.decode_linear import DecodeLinearConfig

    # Ragged on purpose: K = 200 pads to 256, N = 42 leaves a part-filled last program.
    CONFIGS = [(42, 200, DecodeLinearConfig(4)), (48, 256, DecodeLinearConfig(16, 8)), (40, 96, DecodeLinearConfig(1))]

    def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    def assert_close(got, want, atol=2e-5, rtol=2e-5):
        assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)

    def weights(n, k, bias, dtype=torch.float32):
        return rand(n, k, dtype=dtype, seed=n + k, scale=k**-0.5), (rand(n, dtype=dtype, seed=3) if bias else None)

    @pytest.mark.parametrize("bias", [False, True])
    @pytest.mark.parametrize("n,k,config", CONFIGS)
    def test_plain_and_silu_mul(bias, n, k, config):
        m = 1
        w, b = weights(n, k, bias=bias)
        x, gate_up = rand(m, k, seed=1), rand(m, 2 * k, seed=2, scale=3.0)
        assert_close(dl.plain_linear(x, w, b, config=config), F.linear(x, w, b))
        assert_close(dl.silu_mul_linear(gate_up, w, b, config=config), dl.silu_mul_linear_reference(gate_up, w, b))

    @pytest.mark.parametrize("n,k,config", CONFIGS)
    def test_norm_with_and_without_residual(n, k, config):
        m = 1
        w, b = weights(n, k, bias=True)
        x, residual = rand(m, k, seed=1, scale=4.0), rand(m, k, seed=2)
        norm_weight = rand(k, seed=4).abs() + 0.5
        got, summed = dl.norm_linear(x, w, b, norm_weight, 1e-5, residual=residual, config=config)
        want, want_sum = dl.norm_linear_reference(x, w, b, norm_weight, 1e-5, residual=residual)
        assert_close(got, want)
        assert_close(summed, want_sum)
        got, passed = dl.norm_linear(x, w, None, norm_weight, 1e-5, config=config)
        assert passed is x  # later layers: x is the residual stream, added already
        assert_close(got, dl.norm_linear_reference(x, w, None, norm_weight, 1e-5)[0])

    @pytest.mark.parametrize("silu_mul", [False, True])
    @pytest.mark.parametrize("n,k,config", CONFIGS)
    def test_residual_epilogue(silu_mul, n, k, config):
        m = 1
        w, b = weights(n, k, bias=silu_mul)
        x = rand(m, 2 * k if silu_mul else k, seed=1, scale=2.0)
        residual = rand(m, n, seed=2)
        got = dl.linear_add_residual(x, w, b, residual, silu_mul=silu_mul, config=config)
        assert_close(got, dl.linear_add_residual_reference(x, w, b, residual, silu_mul=silu_mul))

    def test_float16_and_the_automatic_config():
        m, n, k = 1, 200, 576  # SmolLM2's K: pads to 1024
        w, b = weights(n, k, bias=True, dtype=torch.float16)
        x, residual = rand(m, k, dtype=torch.float16, seed=1), rand(m, k, dtype=torch.float16, seed=2)
        norm_weight = (rand(k, seed=4).abs() + 0.5).to(torch.float16)
        got, summed = dl.norm_linear(x, w, b, norm_weight, 1e-5, residual=residual)
        want, want_sum = dl.norm_linear_reference(
            x.float(), w.float(), b.float(), norm_weight.float(), 1e-5, residual=residual.float()
        )
        assert got.dtype == torch.float16
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)  # float16 roundings at each step
        torch.testing.assert_close(summed.float(), want_sum, atol=2e-3, rtol=1e-3)

    def test_rejects():
        w, _ = weights(40, 64, bias=False)
        assert dl.use_decode_linear(rand(1, 64), w)
        assert not dl.use_decode_linear(rand(2, 64), w)  # the batched GEMMs take over
        assert not dl.use_decode_linear(rand(1, 64), w.t().contiguous().t()[:, :64])  # column-major weight
        assert not dl.use_decode_linear(rand(1, 64).to(torch.float16), w)  # mixed dtypes
        with pytest.raises(AssertionError):
            dl.plain_linear(rand(2, 64), w)

    def test_launch_heuristics():
        choose = dl.choose_decode_linear_config
        assert choose(n=3072, k=2048) == DecodeLinearConfig(16, 8)  # 64 KB of W a program
        assert choose(n=2048, k=8192) == DecodeLinearConfig(4, 8)
        assert choose(n=4096, k=14336) == DecodeLinearConfig(2, 8)  # 32 KB padded rows
        assert choose(n=576, k=576) == DecodeLinearConfig(16, 8)  # at most 16 rows
        assert choose(n=2048, k=2048, element_size=4) == DecodeLinearConfig(8, 8)
        assert choose(n=40, k=96) == DecodeLinearConfig(16, 4)  # 3 KB tiles: 4 warps
