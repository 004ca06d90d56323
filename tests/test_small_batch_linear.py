"""The small-batch GEMM (kernels/small_batch_linear.py) against F.linear on CPU under Triton's
interpreter (split-K merged by the last program, SiLU-and-mul in the epilogue, bias, strided
rows), which batches and shapes it takes, and its sm_90 compile at every tuned shape (no spills,
the first weight tile loaded before the dependent-launch wait, the K loop pipelined) without a GPU.

    TRITON_INTERPRET=1 python -m pytest tests/test_small_batch_linear.py
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter

if not can_run_interpreted_here("strata.kernels.small_batch_linear"):
    from strata.kernels.small_batch_linear import TUNED

    @pytest.mark.triton_interpreter(seconds=6)  # its tests' time under the interpreter
    def test_small_batch_linear_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=600)

    def test_it_takes_2_to_16_rows_of_a_tuned_shape_only(monkeypatch):
        from strata.kernels import small_batch_linear as sbl

        w = torch.empty(3072, 4096, dtype=torch.bfloat16)  # a TP2 rank's qkv of the 8B
        x = torch.empty(16, 4096, dtype=torch.bfloat16)
        monkeypatch.setattr(sbl, "_INTERPRETED", True)  # (CPU tensors stand in for CUDA ones)
        assert sbl.serves(x, w) and sbl.serves(x[:2], w)
        assert not sbl.serves(x[:1], w)  # batch 1: the decode chain's GEMVs
        assert not sbl.serves(torch.empty(17, 4096, dtype=torch.bfloat16), w)
        assert not sbl.serves(x.float(), w.float())  # float32 would take TF32 dots
        assert not sbl.serves(x, w, silu_mul=True)  # tuned as a plain projection only
        assert not sbl.serves(torch.empty(4, 576, dtype=torch.bfloat16), torch.empty(64, 576, dtype=torch.bfloat16))
        assert not sbl.serves(x, w.t().contiguous().t())
        assert sbl.serves(x, torch.empty(14336, 4096, dtype=torch.bfloat16), silu_mul=True)
        monkeypatch.setattr(sbl, "enabled", False)  # benchmarks' A/B
        assert not sbl.serves(x, w)

    @pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="compiles the real kernels")
    @pytest.mark.parametrize("shape", sorted(TUNED))
    def test_it_compiles_for_sm90_with_the_first_weights_before_the_wait(shape):
        from triton.compiler import ASTSource

        from strata.kernels import compile_check
        from strata.kernels import small_batch_linear as sbl

        rows, k, silu = shape
        c = sbl.TUNED[shape]
        kernel = sbl._small_batch_linear_kernel
        constexprs = dict(N=rows // 2 if silu else rows, K=k, BLOCK_M=sbl.MAX_ROWS, BLOCK_N=c.block_n)
        constexprs |= dict(BLOCK_K=c.block_k, SPLIT_K=c.split_k, SILU_MUL=silu, HAS_BIAS=False)
        constexprs |= dict(NUM_STAGES=c.num_stages, PDL=True)
        types = {"M": "i32", "stride_x": "i32", "stride_out": "i32", "partial_ptr": "*fp32", "arrivals_ptr": "*i32"}
        signature = {a: "constexpr" if a in constexprs else types.get(a, "*bf16") for a in kernel.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names) if a not in constexprs}
        aligned.pop((kernel.arg_names.index("M"),))
        source = ASTSource(
            kernel,
            signature,
            constexprs={(kernel.arg_names.index(a),): v for a, v in constexprs.items()},
            attrs=aligned,
        )
        compiled, registers, spills = compile_check.compile_for_sm90(source, c.num_warps, c.num_stages)
        assert spills == 0, (registers, spills)
        if k // c.split_k // c.block_k > 2:  # the K loop's tiles pipelined (a loop of one step is not)
            assert "async_copy_global_to_local" in compiled.asm["ttgir"]
        lines = compiled.asm["ptx"].splitlines()
        wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
        launch = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
        loads_before = [i for i, line in enumerate(lines[:wait]) if re.search(r"\bld\.global", line)]
        # The successor may start at once; the first W tile (gate's and up's) streams before the wait.
        tiles = 2 if silu else 1
        assert launch < loads_before[0]
        assert len(loads_before) == tiles * c.block_n * c.block_k * 2 // 16 // (32 * c.num_warps)

else:
    import torch.nn.functional as F

    from strata.kernels.small_batch_linear import SmallBatchConfig, small_batch_linear

    def _reference(x, w, b, silu_mul):
        y = F.linear(x.float(), w.float(), None if b is None else b.float())
        if not silu_mul:
            return y
        n = w.shape[0] // 2
        return F.silu(y[:, :n].to(x.dtype).float()) * y[:, n:].to(x.dtype).float()

    @pytest.mark.parametrize("rows", [2, 5, 16])
    @pytest.mark.parametrize("split_k", [1, 3])
    @pytest.mark.parametrize("silu_mul", [False, True])
    def test_it_equals_f_linear(rows, split_k, silu_mul):
        # 40 output columns: a part-filled last program; K = 384: three steps of 128, one or three splits.
        gen = torch.Generator().manual_seed(rows + split_k)
        n, k = 40, 384
        w = (torch.randn(2 * n if silu_mul else n, k, generator=gen) / 16).to(torch.float16)
        x = torch.randn(rows, k, generator=gen).to(torch.float16)
        b = torch.randn(w.shape[0], generator=gen).to(torch.float16)
        config = SmallBatchConfig(block_n=16, block_k=128, split_k=split_k, num_stages=2)
        got = small_batch_linear(x, w, b, silu_mul=silu_mul, config=config)
        assert got.shape == (rows, n) and got.dtype == torch.float16
        torch.testing.assert_close(got.float(), _reference(x, w, b, silu_mul), atol=4e-3, rtol=4e-3)
        # The arrival counters were left at zero: the next launch merges its splits again.
        again = small_batch_linear(x, w, b, silu_mul=silu_mul, config=config)
        assert torch.equal(again, got)

    def test_strided_rows_are_read_where_they_are():
        # A view of the first K columns of a wider buffer (as a batch's rows may be): x.stride(0) > K.
        gen = torch.Generator().manual_seed(7)
        w = (torch.randn(32, 256, generator=gen) / 16).to(torch.float16)
        x = torch.randn(6, 512, generator=gen).to(torch.float16)[:, :256]
        got = small_batch_linear(x, w, config=SmallBatchConfig(block_n=16, block_k=128, split_k=2, num_stages=2))
        torch.testing.assert_close(got.float(), F.linear(x.float(), w.float()), atol=2e-3, rtol=2e-3)

    def test_an_mlp_of_a_tuned_shape_takes_silu_in_gate_ups_epilogue(monkeypatch):
        # The MLP's path (services/worker/model/layers.py) with a config tuned for its gate_up: one
        # launch gives silu(gate) * up, and the output equals the torch path's.
        from types import SimpleNamespace

        from strata.kernels import small_batch_linear as sbl
        from strata.services.worker.model.layers import MLP

        hidden, inter = 64, 128
        config = SimpleNamespace(hidden_size=hidden, intermediate_size=inter, mlp_bias=False, hidden_act="silu")
        mlp = MLP(config, "cpu", torch.float16)
        gen = torch.Generator().manual_seed(3)
        for p in mlp.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) / 8).to(torch.float16))
        x = torch.randn(4, hidden, generator=gen).to(torch.float16)
        monkeypatch.setitem(sbl.TUNED, (2 * inter, hidden, True), SmallBatchConfig(16, 32, 2, 2))
        calls = []
        real = sbl.small_batch_linear
        monkeypatch.setattr(sbl, "small_batch_linear", lambda *a, **k: calls.append(k) or real(*a, **k))
        mlp.fused_kernels = True
        got = mlp(x)
        mlp.fused_kernels = False
        want = mlp(x)
        assert [c.get("silu_mul") for c in calls] == [True]
        torch.testing.assert_close(got.float(), want.float(), atol=4e-3, rtol=4e-3)
