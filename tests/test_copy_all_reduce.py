"""The copy-engine all-reduce of two ranks (tensor_parallel/copy_all_reduce.py,
kernels/copy_all_reduce.py) without a GPU: the group's order of all-reduces (the one-shot, then
this, then NCCL) and that it is off unless asked for, how a message is cut into pieces of whole
rows, and, under Triton's interpreter, the adds: the sum, and the sum with the residual add and
RMSNorm against rmsnorm.py's. The copies and the waits on the streams, two processes on GPUs:
tests/gpu/test_copy_all_reduce_gpu.py.

    TRITON_INTERPRET=1 python -m pytest tests/test_copy_all_reduce.py
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter

if not can_run_interpreted_here("strata.kernels.copy_all_reduce"):

    @pytest.mark.triton_interpreter(seconds=3)  # its tests' time under the interpreter
    def test_copy_all_reduce_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=600)

    class _Shot:
        """A one-shot or copy-engine all-reduce that takes messages up to `most` elements."""

        def __init__(self, most: int):
            self.most, self.took = most, []

        def __call__(self, x):
            if x.numel() > self.most:
                return False
            self.took.append(x.numel())
            return True

        def add_rms_norm(self, x, *args):
            return None if x.numel() > self.most else ("fused", x.numel())

    def test_the_group_takes_the_one_shot_then_the_copy_engine_then_nccl(monkeypatch):
        from strata.services.worker.tensor_parallel.group import TensorParallelGroup

        group = TensorParallelGroup(0, 2, torch.device("cpu"))
        group.broken = None
        group.one_shot, group.copy_engine, group.one_shot_norm = _Shot(10), _Shot(100), _Shot(10)
        nccl = []
        monkeypatch.setattr(group, "_run", lambda what, post: nccl.append(what))
        for n in (4, 50, 500):
            group.all_reduce_(torch.zeros(n))
        assert group.one_shot.took == [4] and group.copy_engine.took == [50] and nccl == ["all-reduce"]
        weight = torch.ones(4)
        assert group.all_reduce_add_norm(torch.zeros(2, 4), None, weight, 1e-5) == ("fused", 8)
        assert group.all_reduce_add_norm(torch.zeros(20, 4), None, weight, 1e-5) == ("fused", 80)
        assert group.all_reduce_add_norm(torch.zeros(200, 4), None, weight, 1e-5) is None  # NCCL, then the norm
        group.copy_engine = None
        assert group.all_reduce_add_norm(torch.zeros(20, 4), None, weight, 1e-5) is None

    def test_it_is_formed_only_when_asked_for_with_ipc_at_two_ranks(monkeypatch):
        from strata.services.worker.tensor_parallel import copy_all_reduce
        from strata.services.worker.tensor_parallel.group import TensorParallelGroup

        monkeypatch.setattr(copy_all_reduce, "CopyEngineAllReduce", lambda *args, **kw: ("built", kw["min_bytes"]))

        def formed(size=2, kind="ipc", enabled=True, one_shot=True):
            group = TensorParallelGroup(0, size, torch.device("cpu"), all_reduce=kind)
            group.copy_engine_enabled, group.one_shot = enabled, _Shot(1) if one_shot else None
            if one_shot:
                group.one_shot.capacity = 1024  # elements: past them the copy engine's
            return group._copy_engine(store=None, session=1)

        assert formed() == ("built", 1024 * 2 + 1)  # bf16 past the one-shot's 2 KiB
        assert formed(enabled=False) is None  # the default
        assert formed(size=4) is None and formed(kind="nccl") is None and formed(one_shot=False) is None

    def test_a_message_goes_in_pieces_of_whole_rows(monkeypatch):
        from strata.services.worker.tensor_parallel import copy_all_reduce
        from strata.services.worker.tensor_parallel.copy_all_reduce import CopyEngineAllReduce

        r = object.__new__(CopyEngineAllReduce)
        r.dtype = torch.float32
        assert r._bounds(4096, 1) == [(0, 4096)]  # 16 KB: one piece
        monkeypatch.setattr(copy_all_reduce, "MIN_PIECE_BYTES", 1024)
        assert r._bounds(4096, 1) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]  # at most 4
        assert r._bounds(7 * 256, 256) == [(0, 512), (512, 1024), (1024, 1536), (1536, 1792)]  # rows of 256
        assert r._bounds(2 * 256, 256) == [(0, 256), (256, 512)]  # no more pieces than rows

else:
    from strata.kernels import copy_all_reduce as ce

    @pytest.mark.parametrize("n", [3000, 8192])  # a part-filled program; two whole
    def test_the_sum_takes_the_peers_part(n):
        x = torch.arange(n, dtype=torch.float32) - 7
        peer = torch.arange(n, dtype=torch.float32) * 3
        want = x + peer
        ce.add_(x, peer)
        assert torch.equal(x, want)

    @pytest.mark.parametrize("with_residual", [True, False])
    def test_the_norm_variant_adds_and_normalises_the_sum(with_residual):
        # float32: the interpreter rounds to bfloat16 otherwise than a GPU (bf16 bits: the GPU tests)
        from strata.kernels.reference import fused_add_rms_norm_reference, rms_norm_reference

        gen = torch.Generator().manual_seed(3)
        rows, hidden, eps = 5, 96, 1e-6
        x, peer, residual = (torch.randn(rows, hidden, generator=gen) for _ in range(3))
        weight = torch.rand(hidden, generator=gen) + 0.5
        summed = x + peer
        if with_residual:
            want_out, want_res = fused_add_rms_norm_reference(summed, residual, weight, eps)
        else:
            want_out, want_res = rms_norm_reference(summed, weight, eps), summed
        out, res = torch.empty(rows, hidden), torch.empty(rows, hidden)
        ce.add_rms_norm(x, peer.view(-1), residual if with_residual else None, weight, eps, False, out, res)
        torch.testing.assert_close(out, want_out)  # (the sum of squares: numpy's order, not the warps')
        assert torch.equal(res, want_res)
