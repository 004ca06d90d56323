"""The IPC one-shot (kernels/one_shot_all_reduce.py) without a GPU: what its launchers give the
kernels, their sm_90 compile (no fence, 16-byte moves), and, under Triton's interpreter, the
exchange between two ranks played one launch after the other: each rank's part lands in the other's
buffer, -0.0 is sent as +0.0 (-0.0 marks an empty slot), what a rank read is marked empty again,
and calls alternate between the two sets of slots. Two processes on GPUs, waiting on each other:
tests/gpu/test_one_shot_all_reduce_gpu.py.

    TRITON_INTERPRET=1 python -m pytest tests/test_one_shot_all_reduce.py
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter


def _exchange(world: int, rank: int, capacity: int, dtype=torch.bfloat16, buffers=None):
    from strata.kernels import one_shot_all_reduce as one_shot

    if buffers is None:
        buffers = [torch.empty(2 * world * capacity, dtype=dtype) for _ in range(world)]
        for buffer in buffers:
            one_shot.mark_empty(buffer)
    programs = one_shot.sequence_words(capacity, dtype)
    sequences, abort = torch.zeros(programs, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    return one_shot.Exchange(buffers, sequences, abort, capacity, rank)


if not can_run_interpreted_here("strata.kernels.one_shot_all_reduce"):

    class _Recorded:
        """Stands in for a Triton kernel: kernel[grid](*args, **kwargs) is recorded."""

        def __init__(self):
            self.calls = []

        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))

    @pytest.mark.triton_interpreter(seconds=3)  # its tests' time under the interpreter
    def test_one_shot_all_reduce_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=600)

    def test_every_ranks_buffers_in_rank_order_the_rest_this_ranks(monkeypatch):
        import strata.kernels.one_shot_all_reduce as one_shot

        kernel = _Recorded()
        monkeypatch.setattr(one_shot, "_one_shot_all_reduce_kernel", kernel)
        exchange = _exchange(3, rank=1, capacity=4096)
        buffers = exchange.buffers
        x = torch.zeros(3000, dtype=torch.bfloat16)
        one_shot.one_shot_all_reduce(x, exchange)
        ((grid, args, kwargs),) = kernel.calls
        assert grid == (3,)  # 1,024 bf16 a program
        pointers = args[1:9]
        assert pointers[:3] == tuple(buffers) and all(p is buffers[1] for p in pointers[3:])
        assert args[9] is exchange.sequences and args[10] == exchange.abort_word.data_ptr() and args[11] == 3000
        assert kwargs["RANK"] == 1 and kwargs["WORLD"] == 3 and kwargs["BLOCK"] == 1024 and not kwargs["MAX"]
        assert kwargs["EMPTY"] == -(2**15)  # -0.0's bits, compared as int16
        assert not kwargs["LOOP"]

    def test_past_its_programs_a_launch_loops_over_blocks_it_always_owns(monkeypatch):
        import strata.kernels.one_shot_all_reduce as one_shot

        kernel, norm = _Recorded(), _Recorded()
        monkeypatch.setattr(one_shot, "_one_shot_all_reduce_kernel", kernel)
        monkeypatch.setattr(one_shot, "_one_shot_all_reduce_norm_kernel", norm)
        exchange = _exchange(2, rank=0, capacity=4 << 20)
        assert exchange.sequences.numel() == one_shot.MAX_PROGRAMS  # a word a program, not a block
        one_shot.one_shot_all_reduce(torch.zeros(300 * 1024, dtype=torch.bfloat16), exchange)
        ((grid, _, kwargs),) = kernel.calls
        assert grid == (one_shot.MAX_PROGRAMS,) and kwargs["LOOP"]
        rows = torch.zeros(512, 4096, dtype=torch.bfloat16)  # an 8B's batch-512 decode rows
        one_shot.one_shot_all_reduce_add_rms_norm(rows, None, torch.ones(4096), 1e-6, False, rows, rows, exchange)
        ((grid, args, kwargs),) = norm.calls
        assert grid == (one_shot.MAX_PROGRAMS,) and kwargs["LOOP"] and args[15] == 512  # rows, past the buffers
        assert kwargs["CHUNK"] == 2  # a program's two rows sent at once

    def test_the_norm_variant_runs_a_program_a_row(monkeypatch):
        import strata.kernels.one_shot_all_reduce as one_shot

        kernel = _Recorded()
        monkeypatch.setattr(one_shot, "_one_shot_all_reduce_norm_kernel", kernel)
        exchange = _exchange(2, rank=0, capacity=8192)
        x, residual = torch.zeros(5, 1000, dtype=torch.bfloat16), torch.zeros(5, 1000, dtype=torch.bfloat16)
        weight, out = torch.ones(1000, dtype=torch.bfloat16), torch.empty(5, 1000, dtype=torch.bfloat16)
        one_shot.one_shot_all_reduce_add_rms_norm(x, residual, weight, 1e-6, False, out, residual, exchange)
        ((grid, args, kwargs),) = kernel.calls
        assert grid == (5,)
        assert args[:5] == (x, residual, weight, out, residual)  # residual_out may be residual: in place
        assert args[5:7] == tuple(exchange.buffers)
        assert kwargs["HIDDEN"] == 1000 and kwargs["BLOCK"] == 1024 and kwargs["ADD_RESIDUAL"]
        assert kwargs["num_warps"] == 2  # rmsnorm.py's, for the same order of the sum of squares

    def test_the_empty_marks_are_what_no_message_holds():
        from strata.kernels import one_shot_all_reduce as one_shot

        bf16, keys = torch.empty(4, dtype=torch.bfloat16), torch.empty(4, dtype=torch.int64)
        one_shot.mark_empty(bf16)
        one_shot.mark_empty(keys)
        assert bf16.view(torch.int16).tolist() == [-(2**15)] * 4 and (bf16 == 0).all()  # -0.0
        assert keys.tolist() == [-1] * 4
        # No draw key is -1: its value word would be -0.0's, and the keys take -0.0 as +0.0.
        from strata.kernels.gumbel_sampling import pack_draw_keys

        tokens = torch.tensor([0, 0, 5, 0])
        packed = pack_draw_keys(torch.tensor([-0.0, 0.0, -0.0, float("nan")]), tokens)
        assert (packed != -1).all() and packed[0] == packed[1]

    @pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="compiles the real kernels")
    @pytest.mark.parametrize("loop,sent", [(False, False), (True, False), (False, True)])
    def test_it_compiles_for_sm90_without_a_fence_and_moves_16_bytes_a_thread(loop, sent):
        import triton.language as tl
        from triton.compiler import ASTSource

        from strata.kernels import compile_check
        from strata.kernels import one_shot_all_reduce as one_shot

        kernel = one_shot._one_shot_all_reduce_kernel
        types = {f"buf{i}": "*bf16" for i in range(8)} | {"x_ptr": "*bf16", "seq_ptr": "*i32", "abort_address": "i64"}
        constexprs = dict(
            RANK=1, WORLD=2, BLOCK=1024, MAX=False, BITS=tl.int16, EMPTY=-(2**15), LOOP=loop, SENT=sent, PDL=True
        )
        signature = {name: "constexpr" if name in constexprs else types.get(name, "i32") for name in kernel.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if name not in constexprs}
        source = ASTSource(
            kernel,
            signature,
            constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
            attrs=aligned,
        )
        compiled, registers, spills = compile_check.compile_for_sm90(source, one_shot.WARPS)
        ptx = compiled.asm["ptx"]
        assert spills == 0 and registers <= 64, (registers, spills)
        assert "fence" not in ptx and "membar" not in ptx  # the data is the signal
        assert "ld.volatile.global.v4.b32" in ptx and "st.global.v4.b32" in ptx

    @pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="compiles the real kernels")
    @pytest.mark.parametrize("hidden", [2048, 4096, 8192])
    def test_the_norm_variants_chunked_sends_compile_for_sm90_without_spills(hidden):
        import triton.language as tl
        from triton.compiler import ASTSource

        from strata.kernels import compile_check
        from strata.kernels import one_shot_all_reduce as one_shot
        from strata.kernels.rmsnorm import row_warps

        kernel = one_shot._one_shot_all_reduce_norm_kernel
        constexprs = dict(HIDDEN=hidden, BLOCK=hidden, ADD_RESIDUAL=True, UNIT_OFFSET=False, RANK=1, WORLD=2)
        constexprs |= dict(BITS=tl.int16, EMPTY=-(2**15), LOOP=True, CHUNK=one_shot.MAX_CHUNK_ROWS, PDL=True)
        pointers = {"seq_ptr": "*i32", "abort_address": "i64", "eps": "fp32", "rows": "i32", "capacity": "i32"}
        signature = {n: "constexpr" if n in constexprs else pointers.get(n, "*bf16") for n in kernel.arg_names}
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if signature[n][0] == "*"}
        source = ASTSource(
            kernel,
            signature,
            constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()},
            attrs=aligned,
        )
        _, registers, spills = compile_check.compile_for_sm90(source, row_warps(hidden))
        assert spills == 0, (registers, spills)

else:
    from strata.kernels import one_shot_all_reduce as one_shot

    def _slot(exchange, owner: int, parity: int, sender: int, n: int) -> torch.Tensor:
        world, capacity = len(exchange.buffers), exchange.capacity
        start = (parity * world + sender) * capacity
        return exchange.buffers[owner][start : start + n]

    def _empty(t: torch.Tensor) -> bool:
        bits = t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
        return bool((bits == one_shot.empty_mark(t.dtype)).all())

    def _ranks(dtype=torch.float32, capacity=1024, world=2):
        """`world` ranks' exchanges over buffers marked empty, as IpcAllReduce builds them."""
        buffers = [torch.empty(2 * world * capacity, dtype=dtype) for _ in range(world)]
        for buffer in buffers:
            one_shot.mark_empty(buffer)
        return [_exchange(world, rank, capacity, dtype, buffers) for rank in range(world)]

    def _play(ranks, parts, parity, launch):
        """One call on every rank, one launch after the other: before rank r launches, the ranks
        after it (not launched yet) have their parts land in its buffer by hand. Their own
        launches later store the same parts again; those are marked empty at the end."""
        n = parts[0].numel()
        for r, exchange in enumerate(ranks):
            for q in range(r + 1, len(ranks)):
                _slot(exchange, r, parity, q, n).copy_(torch.where(parts[q] == 0, 0.0, parts[q]).view(-1))
            launch(r, exchange)
        for r, exchange in enumerate(ranks):
            for q in range(r + 1, len(ranks)):
                assert torch.equal(_slot(exchange, r, parity, q, n), torch.where(parts[q] == 0, 0.0, parts[q]).view(-1))
                one_shot.mark_empty(_slot(exchange, r, parity, q, n))
            assert _empty(exchange.buffers[r])

    @pytest.mark.parametrize("n", [700, 1024])  # a part-filled program, and two whole ones
    def test_two_ranks_exchange_one_launch_after_the_other(n):
        ranks = _ranks()
        parts = [torch.arange(n, dtype=torch.float32) * (r + 1) - 50 for r in range(2)]
        parts[0][3] = parts[1][3] = -0.0  # sent as +0.0: -0.0 marks an empty slot
        for call in range(3):
            parity = (call + 1) % 2
            # Rank 1's part lands in rank 0's buffer before rank 0 launches (a peer running ahead).
            _slot(ranks[0], 0, parity, 1, n).copy_(torch.where(parts[1] == 0, 0.0, parts[1]))
            x0 = parts[0].clone()
            one_shot.one_shot_all_reduce(x0, ranks[0])
            assert torch.equal(x0, parts[0] + parts[1])
            assert not torch.signbit(x0[3])  # -0.0 + -0.0: +0.0, NCCL's -0.0 is the one difference
            assert _empty(_slot(ranks[0], 0, parity, 1, n))  # read, then marked empty again
            landed = _slot(ranks[0], 1, parity, 0, n)  # rank 0's part, in rank 1's buffer
            sent = torch.where(parts[0] == 0, 0.0, parts[0])
            assert torch.equal(landed.view(torch.int32), sent.view(torch.int32))  # bit for bit: +0.0
            x1 = parts[1].clone()
            one_shot.one_shot_all_reduce(x1, ranks[1])
            assert torch.equal(x1, x0) and not torch.signbit(x1[3])
            assert _empty(landed) and _empty(_slot(ranks[0], 1, 1 - parity, 0, n))
            # Rank 1's store into rank 0's slot repeats what landed there by hand above.
            assert torch.equal(_slot(ranks[0], 0, parity, 1, n), torch.where(parts[1] == 0, 0.0, parts[1]))
            one_shot.mark_empty(_slot(ranks[0], 0, parity, 1, n))
            assert ranks[0].sequences[: (n + 511) // 512].tolist() == [call + 1] * ((n + 511) // 512)

    def test_the_draws_maximum_takes_int64_keys_as_they_are():
        ranks = _ranks(torch.int64, capacity=256)
        # The lowest key (a slice with no column) too, and -1, the empty mark (a -0.0 value,
        # token 0): it goes as +0.0's key for token 0.
        keys = [torch.tensor([5, -(2**63), 7, 0, -1]), torch.tensor([9, -(2**63), 2, -5, -7])]
        _slot(ranks[0], 0, 1, 1, 5).copy_(keys[1])
        x0 = keys[0].clone()
        one_shot.one_shot_all_reduce(x0, ranks[0], maximum=True)
        x1 = keys[1].clone()
        one_shot.one_shot_all_reduce(x1, ranks[1], maximum=True)
        assert x0.tolist() == x1.tolist() == [9, -(2**63), 7, 0, 2**32 - 1]

    def test_the_abort_word_releases_a_wait_whose_peer_never_comes():
        (rank0, _) = _ranks()
        rank0.abort_word[0] = 1  # set before: the wait reads it every 1,024 spins
        x = torch.ones(16)
        one_shot.one_shot_all_reduce(x, rank0)  # returns (garbage) instead of spinning forever
        assert rank0.sequences[0].item() == 1

    def test_three_ranks_sum_in_rank_order_every_rank_the_same_bits():
        ranks = _ranks(capacity=2048, world=3)
        gen = torch.Generator().manual_seed(0)
        parts = [torch.randn(1500, generator=gen) * 10 ** (3 * r) for r in range(3)]  # order matters
        for call in range(2):
            sums = {}

            def launch(r, exchange):
                sums[r] = parts[r].clone()
                one_shot.one_shot_all_reduce(sums[r], exchange)

            _play(ranks, parts, (call + 1) % 2, launch)
            want = (parts[0] + parts[1]) + parts[2]
            assert all(torch.equal(sums[r], want) for r in range(3))

    def test_past_its_programs_each_sends_all_its_blocks_then_gathers_them(monkeypatch):
        monkeypatch.setattr(one_shot, "MAX_PROGRAMS", 2)  # 6 blocks of 512 float32: 3 a program
        ranks = _ranks(capacity=4096)
        gen = torch.Generator().manual_seed(2)
        for call, n in enumerate([2600, 700, 2600]):  # looping, then not, then again: one parity a call
            parts = [torch.randn(n, generator=gen) * 10 ** (3 * r) for r in range(2)]
            sums = {}

            def launch(r, exchange):
                sums[r] = parts[r].clone()
                one_shot.one_shot_all_reduce(sums[r], exchange)

            _play(ranks, parts, (call + 1) % 2, launch)
            assert torch.equal(sums[0], parts[0] + parts[1]) and torch.equal(sums[1], sums[0])
        assert ranks[0].sequences[:2].tolist() == [3, 3]

    @pytest.mark.parametrize("with_residual,max_programs", [(True, None), (False, None), (True, 2)])
    def test_the_norm_variant_sums_adds_and_normalises_each_row(with_residual, max_programs, monkeypatch):
        from strata.kernels.reference import fused_add_rms_norm_reference, rms_norm_reference

        if max_programs:  # three rows on two programs: the first loops
            monkeypatch.setattr(one_shot, "MAX_PROGRAMS", max_programs)
        ranks = _ranks(capacity=3 * 512)  # a program (and its sequence number) a row
        gen = torch.Generator().manual_seed(1)
        parts = [torch.randn(3, 96, generator=gen) for _ in range(2)]
        residual, weight = torch.randn(3, 96, generator=gen), torch.rand(96, generator=gen) + 0.5
        got = {}

        def launch(r, exchange):
            out, residual_out = torch.empty(3, 96), torch.empty(3, 96)
            add = residual.clone() if with_residual else None
            one_shot.one_shot_all_reduce_add_rms_norm(
                parts[r].clone(), add, weight, 1e-6, False, out, residual_out, exchange
            )
            got[r] = (out, residual_out)

        _play(ranks, parts, 1, launch)
        summed = parts[0] + parts[1]
        if with_residual:
            want_out, want_residual = fused_add_rms_norm_reference(summed, residual, weight, 1e-6)
        else:
            want_out, want_residual = rms_norm_reference(summed, weight, 1e-6), summed
        for out, residual_out in got.values():
            torch.testing.assert_close(out, want_out)
            assert torch.equal(residual_out, want_residual)
        assert torch.equal(got[0][0], got[1][0])

    def test_a_gemv_sends_its_rows_early_and_the_one_shot_only_gathers():
        """The decode chain's row-parallel GEMVs (kernels/decode_linear.py) send their rows as each
        program ends; the one-shot after them (sent=True) sends nothing. Between ordinary calls on
        the same buffers, so the parities of both kinds of call interleave."""
        from strata.kernels import decode_linear as dl

        ranks = _ranks(capacity=1024)  # 2 programs of 512 float32: the GEMVs' 16-row programs fall in one each
        gen = torch.Generator().manual_seed(3)
        n, k = 600, 64
        xs = [torch.randn(1, k, generator=gen) for _ in range(2)]
        ws = [torch.randn(n, k, generator=gen) for _ in range(2)]
        h = torch.randn(1, n, generator=gen)
        config = dl.DecodeLinearConfig(16)
        for call in range(3):
            if call == 1:  # an ordinary call in between: the next early call takes the other parity
                parts = [torch.randn(n, generator=gen) for _ in range(2)]
                sums = {}

                def launch(r, exchange):
                    sums[r] = parts[r].clone()
                    one_shot.one_shot_all_reduce(sums[r], exchange)

                _play(ranks, parts, 0, launch)
                assert torch.equal(sums[0], parts[0] + parts[1]) and torch.equal(sums[1], sums[0])
                continue
            # Rank 0 adds the residual in its epilogue, rank 1 only projects: each GEMV's rows
            # land in the other's buffer before either one-shot launches.
            ys = [
                dl.linear_add_residual(xs[0], ws[0], None, h, config=config, send_to=ranks[0]),
                dl.plain_linear(xs[1], ws[1], config=config, send_to=ranks[1]),
            ]
            parity = (call + 1) % 2
            for r in range(2):
                sent = _slot(ranks[1 - r], 1 - r, parity, r, n)
                assert torch.equal(sent, torch.where(ys[r] == 0, 0.0, ys[r]).view(-1))
            want = ys[0] + ys[1]
            for r in range(2):
                one_shot.one_shot_all_reduce(ys[r].view(-1), ranks[r], sent=True)
                assert torch.equal(ys[r], want)
                assert _empty(ranks[r].buffers[r])  # read, marked empty, and nothing sent twice
        assert ranks[0].sequences[:2].tolist() == ranks[1].sequences[:2].tolist() == [3, 3]

    def test_early_sends_take_one_launch_that_does_not_loop():
        (rank0, _) = _ranks(capacity=4096)  # 8 blocks of 512 float32
        assert rank0.takes_early_sends(4096, torch.float32)
        assert not rank0.takes_early_sends(4097, torch.float32)  # past the buffer
        assert not rank0.takes_early_sends(64, torch.bfloat16)  # not the buffers' dtype
        with pytest.raises(AssertionError):
            one_shot.one_shot_all_reduce(torch.ones(16), rank0, maximum=True, sent=True)
