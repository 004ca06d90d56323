"""The small-batch GEMM (kernels/small_batch_linear.py) against F.linear on CPU under Triton's
interpreter, which batches it takes, and its sm_90 compile (no spills, the weight prefetch issued
before the dependent-launch wait, the K loop pipelined) without a GPU.

    TRITON_INTERPRET=1 python -m pytest tests/test_small_batch_linear.py
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter

# (N, K) of the 8B's linears at one GPU and at a TP2 rank: qkv, o_proj, gate_up, down.
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
SHAPES_8B_RANK = [(3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)]

if not can_run_interpreted_here("strata.kernels.small_batch_linear"):

    @pytest.mark.triton_interpreter(seconds=4)  # its tests' time under the interpreter
    def test_small_batch_linear_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=600)

    def test_it_takes_2_to_16_rows_only_when_switched_on(monkeypatch):
        from strata.kernels import small_batch_linear as sbl

        w = torch.empty(64, 1024, dtype=torch.bfloat16)
        x = torch.empty(16, 1024, dtype=torch.bfloat16)
        monkeypatch.setattr(sbl, "_INTERPRETED", True)  # (CPU tensors stand in for CUDA ones)
        assert not sbl.serves(x, w)  # off by default
        monkeypatch.setattr(sbl, "enabled", True)
        assert sbl.serves(x, w) and sbl.serves(x[:2], w)
        assert not sbl.serves(x[:1], w)  # batch 1: the decode chain's GEMVs
        assert not sbl.serves(torch.empty(17, 1024, dtype=torch.bfloat16), w)
        assert not sbl.serves(x.float(), w.float())  # float32 would take TF32 dots
        assert not sbl.serves(torch.empty(4, 576, dtype=torch.bfloat16), torch.empty(64, 576, dtype=torch.bfloat16))
        assert not sbl.serves(x, w.t().contiguous().t())

    @pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="compiles the real kernels")
    @pytest.mark.parametrize("n,k", SHAPES_8B + SHAPES_8B_RANK)
    def test_it_compiles_for_sm90_with_the_weights_loaded_before_the_wait(n, k):
        from triton.compiler import ASTSource

        from strata.kernels import compile_check
        from strata.kernels import small_batch_linear as sbl

        kernel = sbl._small_batch_linear_kernel
        c = sbl.choose_config(n=n, k=k)
        constexprs = dict(K=k, BLOCK_M=sbl.MAX_ROWS, BLOCK_N=c.block_n, BLOCK_K=c.block_k, FIRST_K=c.first_k)
        constexprs |= dict(HAS_BIAS=False, NUM_STAGES=c.num_stages, PDL=True)
        ints = {"M": "i32", "N": "i32", "stride_x": "i32"}
        signature = {a: "constexpr" if a in constexprs else ints.get(a, "*bf16") for a in kernel.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names) if a not in constexprs}
        aligned.pop((kernel.arg_names.index("M"),))
        aligned.pop((kernel.arg_names.index("N"),))
        source = ASTSource(
            kernel,
            signature,
            constexprs={(kernel.arg_names.index(a),): v for a, v in constexprs.items()},
            attrs=aligned,
        )
        compiled, registers, spills = compile_check.compile_for_sm90(source, c.num_warps, c.num_stages)
        assert spills == 0, (registers, spills)
        assert "async_copy_global_to_local" in compiled.asm["ttgir"]  # the K loop's W tiles pipelined
        lines = compiled.asm["ptx"].splitlines()
        wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
        launch = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
        loads_before = [i for i, line in enumerate(lines[:wait]) if re.search(r"\bld\.global", line)]
        # The successor may start at once; the first FIRST_K columns of W (16 bytes a load) stream before the wait.
        assert launch < loads_before[0] and len(loads_before) == c.block_n * c.first_k * 2 // 16 // (32 * c.num_warps)

else:
    import torch.nn.functional as F

    from strata.kernels.small_batch_linear import SmallBatchConfig, small_batch_linear

    @pytest.mark.parametrize("rows", [2, 5, 16])
    @pytest.mark.parametrize("first_k", [0, 128])
    @pytest.mark.parametrize("bias", [False, True])
    def test_it_equals_f_linear(rows, first_k, bias):
        # N = 40: a part-filled last program; K = 384: the first 128 columns before the wait, then two steps.
        gen = torch.Generator().manual_seed(rows + first_k)
        n, k = 40, 384
        w = (torch.randn(n, k, generator=gen) / 16).to(torch.float16)
        x = torch.randn(rows, k, generator=gen).to(torch.float16)
        b = torch.randn(n, generator=gen).to(torch.float16) if bias else None
        config = SmallBatchConfig(block_n=16, block_k=128, first_k=first_k, num_stages=2)
        got = small_batch_linear(x, w, b, config=config)
        want = F.linear(x.float(), w.float(), None if b is None else b.float())
        assert got.shape == (rows, n) and got.dtype == torch.float16
        torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)

    def test_strided_rows_are_read_where_they_are():
        # A view of every other row of a wider buffer (as a batch's rows may be): x.stride(0) > K.
        gen = torch.Generator().manual_seed(7)
        w = (torch.randn(16, 256, generator=gen) / 16).to(torch.float16)
        wide = torch.randn(6, 512, generator=gen).to(torch.float16)
        x = wide[:, :256]
        got = small_batch_linear(x, w, config=SmallBatchConfig(block_n=16, block_k=128, first_k=128, num_stages=2))
        torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), atol=2e-3, rtol=2e-3)
