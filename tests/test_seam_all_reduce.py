"""The decode chain's all-reduce at its seams (kernels/seam_all_reduce.py): a row-parallel GEMV
sends this rank's rows in its epilogue, the next GEMV sums every rank's in its prologue. Under
Triton's interpreter the ranks are played one launch after the other (every rank's sending GEMV,
then every rank's summing one), over CPU buffers as IpcAllReduce("seams") lays them out; the
launcher checks what the chain may send and the sm_90 compile. Two GPUs, the whole chain against
HF and against one rank: tests/gpu/test_tensor_parallel_gpu.py.

    TRITON_INTERPRET=1 python -m pytest tests/test_seam_all_reduce.py
"""

from __future__ import annotations

import os

import pytest
import torch
import triton

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter

_KERNELS = ("strata.kernels.decode_linear", "strata.kernels.seam_all_reduce", "strata.kernels.one_shot_all_reduce")

if not can_run_interpreted_here(*_KERNELS):

    @pytest.mark.triton_interpreter(seconds=4)  # its tests' time under the interpreter
    def test_seam_all_reduce_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=600)

    def test_what_the_chain_may_send():
        from strata.kernels import decode_linear as dl
        from strata.kernels.seam_all_reduce import sendable, words_for

        # The 8B's rank of two: o_proj (16 rows a program) and down (4): whole words of bf16.
        assert dl.can_send(torch.empty(4096, 2048, dtype=torch.bfloat16, device="meta"))
        assert dl.can_send(torch.empty(4096, 7168, dtype=torch.bfloat16, device="meta"))
        # A row of 32,768 bf16 fills 64 KB: one row a program, half a word.
        assert not dl.can_send(torch.empty(4096, 32768, dtype=torch.bfloat16, device="meta"))
        assert sendable(1, torch.float32) and not sendable(1, torch.float16)
        assert not sendable(2, torch.float64)
        assert words_for(4096, torch.bfloat16) == 2048 and words_for(96, torch.float32) == 96

    @pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="compiles the real kernels")
    @pytest.mark.parametrize("role", ["send", "sum"])
    def test_both_ends_compile_for_sm90_without_a_fence_or_a_spill(role):
        from strata.kernels import compile_check
        from strata.kernels import decode_linear as dl

        n, k = (4096, 7168) if role == "send" else (14336, 4096)  # the 8B rank's down, then gate_up
        config = dl.choose_decode_linear_config(n=n, k=k)
        constexprs = dict(
            K=k,
            K_PADDED=triton.next_power_of_2(k),
            BLOCK_N=config.block_n,
            PROLOGUE=2 if role == "send" else 1,
            ADD_RESIDUAL=False,
            EPILOGUE_RESIDUAL=role == "send",
            HAS_BIAS=False,
            SEND=role == "send",
            SUM_RANKS=role == "sum",
            ELEMENT_BITS=16,
            RANK=1,
            WORLD=2,
            PDL=True,
        )
        source = compile_check._signature(dl._decode_linear_kernel, "bf16", constexprs)
        compiled, registers, spills = compile_check.compile_for_sm90(source, config.num_warps)
        ptx = compiled.asm["ptx"]
        assert spills == 0, (registers, spills)
        assert "fence" not in ptx and "membar" not in ptx  # the flag travels in the word
        assert ("st.global.v2.b64" in ptx or "st.global.b64" in ptx) if role == "send" else "ld.volatile" in ptx

else:
    from strata.kernels import decode_linear as dl
    from strata.kernels import one_shot_all_reduce as one_shot
    from strata.kernels.seam_all_reduce import Seam, words_for

    def _ranks(world: int, capacity: int) -> list:
        """Each rank's exchange over `world` buffers of words marked empty (as IpcAllReduce("seams"))."""
        buffers = [torch.full((2 * world * capacity,), -1, dtype=torch.int64) for _ in range(world)]
        return [
            one_shot.Exchange(
                buffers, torch.zeros(capacity, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), capacity, rank
            )
            for rank in range(world)
        ]

    def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    def _layer(hidden, inner, dtype, seed):
        """A rank's o_proj slice [hidden, inner] and the next norm + gate_up [up, hidden]."""
        return (
            rand(hidden, inner, dtype=dtype, seed=seed, scale=inner**-0.5),
            rand(3 * hidden, hidden, dtype=dtype, seed=seed + 50, scale=hidden**-0.5),
            (rand(hidden, seed=seed + 7).abs() + 0.5).to(dtype),
        )

    def _play(world, dtype, hidden, inner, calls, sites=2, silu_mul=False):
        """`calls` steps of `sites` seams each on `world` ranks: every rank's sending GEMV, then every
        rank's summing one, site after site. Returns each call's and site's outputs per rank, with
        the torch reference of the same sum."""
        per_site = words_for(hidden, dtype)
        ranks = _ranks(world, capacity=sites * per_site + 5)
        seams = [[Seam(ex, site * per_site) for site in range(sites)] for ex in ranks]
        layers = [[_layer(hidden, inner, dtype, 10 * site + r) for r in range(world)] for site in range(sites)]
        norm_w = [layers[site][0][2] for site in range(sites)]
        gate_up = [layers[site][0][1] for site in range(sites)]  # replicated: every rank's the same
        results = []
        for call in range(calls):
            h = rand(1, hidden, dtype=dtype, seed=100 + call)
            for site in range(sites):
                x = [
                    rand(1, 2 * inner if silu_mul else inner, dtype=dtype, seed=1000 * call + 10 * site + r)
                    for r in range(world)
                ]
                parts = []
                for r in range(world):
                    o_proj = layers[site][r][0]
                    parts.append(
                        dl.row_parallel_send(
                            x[r], o_proj, None, seams[r][site], residual=h if r == 0 else None, silu_mul=silu_mul
                        )
                    )
                outs = [
                    dl.norm_linear(parts[r], gate_up[site], None, norm_w[site], 1e-5, seam=seams[r][site])
                    for r in range(world)
                ]
                total = parts[0].float()
                for part in parts[1:]:
                    total = total + part.float()
                summed = total.to(dtype)
                want, _ = dl.norm_linear(summed, gate_up[site], None, norm_w[site], 1e-5)
                results.append((outs, summed, want, parts))
                h = summed
        return ranks, results

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    def test_two_ranks_sum_at_the_seam_as_the_one_shot_then_the_norm_would(dtype):
        # hidden 96 pads to 128 (masked words); inner 200: 16-row programs with a part-filled last
        ranks, results = _play(2, dtype, hidden=96, inner=200, calls=3)
        for outs, summed, want, _ in results:
            for out, h in outs:
                assert torch.equal(h, summed)  # the residual stream: the parts' sum, every rank the same bits
                assert torch.equal(out, want)  # then exactly the unfused norm_linear of that sum
        # Every sending program counted three calls at both sites (offsets 0 and 48 or 96 words).
        per_site = words_for(96, dtype)
        for ex in ranks:
            assert ex.sequences[0].item() == 3 and ex.sequences[per_site].item() == 3

    def test_down_with_silu_mul_and_three_ranks_in_rank_order():
        _, results = _play(3, torch.float32, hidden=64, inner=96, calls=2, silu_mul=True)
        for outs, summed, want, parts in results:
            assert torch.equal(summed, ((parts[0] + parts[1]) + parts[2]))  # rank order, float32
            assert all(torch.equal(h, summed) and torch.equal(out, want) for out, h in outs)

    def test_the_words_carry_the_payload_and_this_calls_flag():
        ranks, results = _play(2, torch.float16, hidden=64, inner=64, calls=3, sites=1)
        # Call 3 (odd): rank 0's part in rank 1's buffer, parity 1, slot 0.
        parts = results[-1][3]
        capacity = ranks[1].capacity
        words = ranks[1].buffers[1][(1 * 2 + 0) * capacity :][:32]
        assert ((words >> 32) == 3).all()
        payload = (words & 0xFFFFFFFF).to(torch.int32)
        lo, hi = (payload & 0xFFFF).to(torch.int16), ((payload >> 16) & 0xFFFF).to(torch.int16)
        assert torch.equal(torch.stack([lo, hi], 1).view(-1), parts[0].view(-1).view(torch.int16))
        # Call 2's words (parity 0) are still there, flagged 2: a later call never reads them.
        assert ((ranks[1].buffers[1][:32] >> 32) == 2).all()

    def test_the_abort_word_releases_a_sum_whose_peer_never_sent():
        (rank0, _) = _ranks(2, capacity=64)
        seam = Seam(rank0, 0)
        gate_up, norm_w = rand(40, 64), rand(64).abs() + 0.5
        part = dl.row_parallel_send(rand(1, 32), rand(64, 32), None, seam)
        rank0.abort_word[0] = 1  # read every 1,024 spins
        out, h = dl.norm_linear(part, gate_up, None, norm_w, 1e-5, seam=seam)  # garbage, but it returns
        assert out.shape == (1, 40) and h.shape == (1, 64)
