"""The copy-engine all-reduce of two ranks (kernels/copy_all_reduce.py,
tensor_parallel/copy_all_reduce.py) without a GPU: the group's order of all-reduces (the one-shot,
then this, then NCCL), its sm_90 compile (a system-scope release and acquire), and, under Triton's
interpreter, two ranks played one launch after the other over CPU tensors standing in for the
mapped buffers:
exact sums over calls of both parities and messages past the buffer, the fused add and norm
against rmsnorm.py's, and the abort word releasing a wait. Two processes on GPUs:
tests/gpu/test_copy_all_reduce_gpu.py.

    TRITON_INTERPRET=1 python -m pytest tests/test_copy_all_reduce.py
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter


def _ranks(capacity: int, dtype=torch.float32, min_numel: int = 0):
    """Two ranks' all-reduces as CopyEngineAllReduce builds them, over CPU tensors: each rank's
    peer_recv and peer_flags are the other's recv and flags (CUDA IPC's mapping)."""
    from strata.services.worker.tensor_parallel.copy_all_reduce import PIECES, CopyEngineAllReduce

    ranks = []
    for rank in range(2):
        r = object.__new__(CopyEngineAllReduce)
        r.dtype, r.rank, r.capacity, r.min_numel, r.aborted, r.calls = dtype, rank, capacity, min_numel, False, 0
        r.recv = torch.full((2 * capacity,), float("nan"), dtype=dtype)
        r.flags = torch.zeros(2 * PIECES, dtype=torch.int32)
        r.copy_stream = None
        r.abort_word = torch.zeros(1, dtype=torch.int32)
        ranks.append(r)
    for r in ranks:
        peer = ranks[1 - r.rank]
        r.peer_recv, r.peer_flags = peer.recv, peer.flags
    return ranks


def _play(ranks, parts: list[torch.Tensor], rows: int = 0) -> torch.Tensor:
    """One all-reduce on both ranks, one launch after the other: rank 1's parts land in rank 0's
    buffers first (a peer running ahead: at most two, the parities), then rank 0's whole call
    runs, then rank 1's waits, which rank 0's copies released. With rows, rank 0's call is the
    norm variant's. Returns rank 1's sum (rank 0 sums in place, or returns its call's)."""
    from strata.kernels.copy_all_reduce import wait_add

    rank0, rank1 = ranks
    unit = parts[1].shape[-1] if rows else 1
    mine = parts[1].reshape(-1).split(rows * unit if rows else rank1.capacity)
    sent = [rank1._send(message, unit) for message in mine]
    assert len(sent) <= 2, "a peer runs at most one message ahead"
    done = rank0.add_rms_norm(*parts[0]) if rows else rank0(parts[0])
    for message, s in zip(mine, sent):
        for a, b, recv, flag in rank1._pieces(s):
            wait_add(message[a:b], recv, flag, s.call, rank1.abort_word)
    return done


if not can_run_interpreted_here("strata.kernels.copy_all_reduce"):

    @pytest.mark.triton_interpreter(seconds=10)  # its tests' time under the interpreter
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
        group.one_shot, group.copy_engine = _Shot(10), _Shot(100)
        group.one_shot_norm = _Shot(10)
        nccl = []
        monkeypatch.setattr(group, "_run", lambda what, post: nccl.append(what))
        for n in (4, 50, 500):
            group.all_reduce_(torch.zeros(n))
        assert group.one_shot.took == [4] and group.copy_engine.took == [50] and nccl == ["all-reduce"]
        weight = torch.ones(4)
        assert group.all_reduce_add_norm(torch.zeros(2, 4), None, weight, 1e-5) == ("fused", 8)
        assert group.all_reduce_add_norm(torch.zeros(20, 4), None, weight, 1e-5) == ("fused", 80)
        assert group.all_reduce_add_norm(torch.zeros(200, 4), None, weight, 1e-5) is None  # NCCL, then the norm
        group.copy_engine = None  # symm-mem, more than two ranks, or one that did not form
        assert group.all_reduce_add_norm(torch.zeros(20, 4), None, weight, 1e-5) is None

    @pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="compiles the real kernels")
    def test_it_compiles_for_sm90_with_a_system_scope_release_and_acquire():
        from triton.compiler import ASTSource

        from strata.kernels import compile_check
        from strata.kernels import copy_all_reduce as ce

        def ptx(kernel, constexprs: dict, types: dict, warps: int) -> str:
            signature = {n: "constexpr" if n in constexprs else types.get(n, "*bf16") for n in kernel.arg_names}
            # Pointers and n 16-divisible, as Triton specialises them at run time.
            aligned = {
                (i,): [["tt.divisibility", 16]]
                for i, n in enumerate(kernel.arg_names)
                if n == "n" or signature[n][0] == "*"
            }
            source = ASTSource(
                kernel,
                signature,
                constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
                attrs=aligned,
            )
            compiled, _, spills = compile_check.compile_for_sm90(source, warps)
            assert spills == 0
            return compiled.asm["ptx"]

        signal = ptx(ce._signal_kernel, {}, {"peer_flag_ptr": "*i32", "value": "i32"}, 1)
        assert re.search(r"atom\.global\.sys\.release\.exch", signal)
        waits = {"flag_ptr": "*i32", "call": "i32", "abort_address": "i64", "n": "i32"}
        summed = ptx(ce._wait_add_kernel, {"BLOCK": ce.BLOCK}, waits, ce.WARPS)
        assert re.search(r"(ld|atom)\.global\.sys\.acquire", summed)
        # The peer's part not from a stale L1 line; 16 bytes a load.
        assert "ld.global.cg.v4.b32" in summed and "ld.global.v4.b32" in summed
        normed = ptx(
            ce._wait_add_rms_norm_kernel,
            dict(HIDDEN=4096, BLOCK=4096, ADD_RESIDUAL=True, UNIT_OFFSET=False),
            waits | {"eps": "fp32"},
            8,
        )
        assert re.search(r"(ld|atom)\.global\.sys\.acquire", normed)

else:

    @pytest.mark.parametrize("n", [3000, 8192, 9000])  # a part-filled program; two whole; past the buffer
    @pytest.mark.parametrize("piece_bytes", [4 << 20, 4096], ids=["whole", "in-pieces"])
    def test_two_ranks_sum_exactly_over_calls_of_both_parities(n, piece_bytes, monkeypatch):
        from strata.services.worker.tensor_parallel import copy_all_reduce

        monkeypatch.setattr(copy_all_reduce, "MIN_PIECE_BYTES", piece_bytes)  # 8,192 floats: 4 pieces
        ranks = _ranks(capacity=8192)
        for call in range(3):
            x = [torch.arange(n, dtype=torch.float32) * (r + 1) - 7 + call for r in range(2)]
            want = x[0] + x[1]
            assert _play(ranks, x)
            assert torch.equal(x[0], want) and torch.equal(x[1], want)
        calls = 3 * -(-n // 8192)  # a message past the buffer goes in parts, a call each
        assert ranks[0].calls == ranks[1].calls == calls
        assert ranks[0].flags.tolist() == ranks[1].flags.tolist() and max(ranks[0].flags.tolist()) == calls

    def test_what_it_declines():
        r = _ranks(capacity=1024, min_numel=64)[0]
        assert not r(torch.zeros(63))  # the one-shot's
        assert not r(torch.zeros(128, dtype=torch.float16))  # another dtype
        assert not r(torch.zeros(256)[::2])  # strided
        assert not r.add_rms_norm(torch.zeros(64, 2048), None, torch.ones(2048), 1e-5)  # a row past the buffer
        r.aborted = True
        assert not r(torch.zeros(128))

    @pytest.mark.parametrize("with_residual", [True, False])
    def test_the_norm_variant_adds_and_normalises_the_sum(with_residual, monkeypatch):
        from strata.kernels.rmsnorm import fused_add_rms_norm, rms_norm
        from strata.services.worker.tensor_parallel import copy_all_reduce

        monkeypatch.setattr(copy_all_reduce, "MIN_PIECE_BYTES", 2048)  # 4 rows of 1 KB: two pieces of two rows

        hidden, rows, eps = 256, 7, 1e-5
        # float32: the interpreter rounds to bfloat16 otherwise than a GPU (bf16 bits: the GPU tests)
        ranks = _ranks(capacity=4 * hidden)  # four rows a call: 7 rows in two
        common = torch.Generator().manual_seed(3)
        weight = torch.randn(hidden, generator=common)
        residual = torch.randn(rows, hidden, generator=common)
        parts = [torch.randn(rows, hidden, generator=torch.Generator().manual_seed(r)) for r in range(2)]
        summed = parts[0] + parts[1]
        if with_residual:
            want_out, want_res = fused_add_rms_norm(summed.clone(), residual.clone(), weight, eps)
        else:
            want_out, want_res = rms_norm(summed, weight, eps), summed

        args = (parts[0].clone(), residual.clone() if with_residual else None, weight, eps)
        out, res = _play(ranks, [args, parts[1].clone()], rows=4)
        torch.testing.assert_close(out, want_out)  # (the sum of squares: numpy's order, not the warps')
        assert torch.equal(res, want_res)

    def test_a_message_goes_in_pieces_of_whole_rows(monkeypatch):
        from strata.services.worker.tensor_parallel import copy_all_reduce

        r = _ranks(capacity=1 << 20)[0]
        assert r._bounds(4096, 1) == [(0, 4096)]  # 16 KB of float32: one piece
        monkeypatch.setattr(copy_all_reduce, "MIN_PIECE_BYTES", 1024)
        assert r._bounds(4096, 1) == [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]  # at most 4
        assert r._bounds(7 * 256, 256) == [(0, 512), (512, 1024), (1024, 1536), (1536, 1792)]  # rows of 256
        assert r._bounds(2 * 256, 256) == [(0, 256), (256, 512)]  # no more pieces than rows

    def test_the_abort_word_releases_a_wait_whose_peer_never_comes():
        rank0, _ = _ranks(capacity=1024)
        rank0.abort_word[0] = 1  # set before: the wait reads it every 1,024 spins
        x = torch.ones(100)
        assert rank0(x)  # returned: the peer's part never came, so the sum is garbage
        assert rank0.calls == 1
