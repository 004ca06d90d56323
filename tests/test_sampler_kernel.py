"""The sampler's Triton kernel (kernels/gumbel_sampling.py) draws the torch sampler's tokens, on CPU
under Triton's interpreter: greedy ties across blocks and splits, seeded draws with and without
filters, logprobs, other launch shapes, the store into last_sampled, the arrival counters.

It shares the session's interpreted processes with the other kernel files (tests/triton_interpreter.py;
tests/test_sampler.py ran it as a script in a process of its own). The sampler's torch path and
its draws: tests/test_sampler.py; on a GPU: tests/gpu/.
"""

from __future__ import annotations

import pytest

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter

if not can_run_interpreted_here("strata.kernels.gumbel_sampling"):

    @pytest.mark.triton_interpreter(seconds=10)  # its tests' time under the interpreter
    def test_sampler_kernel_under_triton_interpreter():
        pytest.importorskip("triton")
        rerun_under_interpreter(__file__, timeout=300)

else:
    import numpy as np
    import torch

    from strata.kernels.arrival_counters import arrival_counters
    from strata.kernels.gumbel_sampling import gumbel_argmax
    from strata.services.worker.sampling.sampler import Sampler, SamplingTensors

    def test_triton_kernel_matches_torch():
        n, vocab = 6, 9000  # three splits of 4096, the last one ragged
        rng = np.random.default_rng(0)
        for case in range(4):
            logits = torch.from_numpy(rng.normal(size=(n, vocab)).astype(np.float32))
            logits[0, [123, 2000, 8500]] = 50.0  # greedy ties across blocks and splits: the first wins
            temperature = [0.0, 1.0, 0.5, 1.0, 2.0, 0.8] if case < 3 else [0.0] * n
            st = SamplingTensors.build(
                temperature=temperature,
                top_k=[0, 0, 0, 40, 0, 3000] if case else [0] * n,
                top_p=[1.0, 1.0, 1.0, 1.0, 0.9, 1.0] if case == 2 else [1.0] * n,
                min_p=[0.0, 0.0, 0.1, 0.0, 0.0, 0.0] if case else [0.0] * n,
                seeds=rng.integers(-(2**63), 2**63 - 1, n),
                positions=rng.integers(0, 2**40, n),
                num_logprobs=case - 1,
                device="cpu",
            )
            a = Sampler("triton")(logits, st)
            b = Sampler("torch")(logits, st)
            assert torch.equal(a.token_ids, b.token_ids), (case, a.token_ids, b.token_ids)
            assert a.token_ids[0].item() == 123
            if case > 0:
                torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)
                assert torch.equal(a.top_ids, b.top_ids)
                torch.testing.assert_close(a.top_logprobs, b.top_logprobs, rtol=0, atol=1e-5)
        # Other launch shapes (more splits, one split, the plain loop) draw the same tokens; the row's
        # last split merges in the kernel and leaves its arrival counter at 0.
        keys = (st.seeds, st.positions, st.inv_temperature, st.greedy, None, True)
        tokens, log_norm = gumbel_argmax(logits, *keys)
        for launch in [(1024, 512, 4, False), (16384, 1024, 4, True)]:
            other, other_norm = gumbel_argmax(logits, *keys, launch=launch)
            assert torch.equal(other, tokens), (launch, other, tokens)
            torch.testing.assert_close(other_norm, log_norm, rtol=0, atol=1e-5)
        torch.testing.assert_close(log_norm, torch.logsumexp(logits, dim=1), rtol=0, atol=1e-5)
        kept = torch.full((n + 4,), -1, dtype=torch.int64)  # store=: the graphs' copy into last_sampled
        rows = torch.tensor([5, 0, 9, 2, 7, 1])
        assert torch.equal(gumbel_argmax(logits, *keys, store=(kept, rows))[0], tokens)
        assert torch.equal(kept[rows], tokens) and (kept[[3, 4, 6, 8]] == -1).all()
        assert not arrival_counters(logits.device, n, "gumbel_argmax").any()

    def test_triton_slice_draws_combine_to_the_whole_rows_draw():
        """Tensor parallelism: the kernel on a rank's slice of the columns (vocab_offset, keys)
        draws with the global index's noise, and the max of the slices' packed keys is the whole
        row's token; a greedy row's key packs its raw logit as pack_draw_keys does."""
        from strata.kernels.gumbel_sampling import pack_draw_keys, unpack_draw_tokens
        from strata.services.worker.tensor_parallel.vocab import VocabShard

        n, vocab = 5, 9000
        rng = np.random.default_rng(1)
        logits = torch.from_numpy(rng.normal(size=(n, vocab)).astype(np.float32))
        logits[0, [100, 4600, 8999]] = 30.0  # a greedy tie across slices: the first wins
        logits[1, 7000] = -0.0  # a greedy row whose max is -0.0
        logits[1, :7000] = -1.0
        logits[1, 7001:] = -1.0
        st = SamplingTensors.build(
            temperature=[0.0, 0.0, 1.0, 0.7, 1.5],
            top_k=[0] * n,
            top_p=[1.0] * n,
            min_p=[0.0] * n,
            seeds=rng.integers(-(2**63), 2**63 - 1, n),
            positions=rng.integers(0, 2**40, n),
            num_logprobs=-1,
            device="cpu",
        )
        args = (st.seeds, st.positions, st.inv_temperature, st.greedy, None, False)
        whole, _ = gumbel_argmax(logits, *args)
        assert whole[0].item() == 100 and whole[1].item() == 7000
        for size in (2, 3):
            keys = []
            for rank in range(size):
                v = VocabShard(vocab, rank, size)
                k = torch.empty(n, dtype=torch.int64)
                tokens, _ = gumbel_argmax(
                    logits[:, v.offset : v.offset + v.valid], *args, vocab_offset=v.offset, keys=k
                )
                assert torch.equal(unpack_draw_tokens(k), tokens)
                assert ((tokens >= v.offset) & (tokens < v.offset + v.valid)).all()
                greedy_rows = torch.tensor([0, 1])
                expected = pack_draw_keys(logits[greedy_rows, tokens[greedy_rows]], tokens[greedy_rows])
                assert torch.equal(k[greedy_rows], expected)
                keys.append(k)
            combined = unpack_draw_tokens(torch.stack(keys).amax(dim=0))
            assert torch.equal(combined, whole), (size, combined, whole)
