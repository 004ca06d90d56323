"""The one-launch decode attention (kernels/decode_attention.py) against the three steps it replaces,
in torch: rotary, the KV-cache write, paged attention. On CPU under Triton's interpreter (float32,
float16), plus its sm_90 compile: no spills, and the cached keys' loads issued before the
dependent-launch wait. bf16 on the GPU: tests/gpu/test_decode_attention_gpu.py.

    TRITON_INTERPRET=1 python -m pytest tests/test_decode_attention.py -k splits
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import triton

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter


def sm90_ptx(num_q_heads: int, num_kv_heads: int, head_dim: int, splits: int) -> tuple[int, int, str]:
    """(registers, spilled bytes, PTX) of the kernel as the 1B / 8B chains launch it on an H100."""
    from triton.backends.compiler import GPUTarget

    from strata.kernels import compile_check
    from strata.kernels import decode_attention as da

    constexprs = dict(
        da.kernel_constants(num_q_heads, num_kv_heads, head_dim, 16, 64, splits),
        IEEE_DOT=False,
        INTERPRETED=False,
        PDL=True,
    )
    signature = compile_check._signature(da._decode_attention_kernel, "bf16", constexprs)
    signature.signature["positions_ptr"] = "*i64"
    signature.signature["arrivals_ptr"] = "*i32"
    signature.signature["num_positions"] = "i32"
    compiled = triton.compile(
        signature,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": da.num_warps(head_dim, splits), "num_stages": 2},
    )
    registers, spills = compile_check._ptxas_stats(compiled.asm["ptx"])
    return registers, spills, compiled.asm["ptx"]


if not can_run_interpreted_here(
    "strata.kernels.decode_attention", "strata.kernels.paged_attention", "strata.kernels.rotary"
):

    @pytest.mark.triton_interpreter(seconds=11)  # its tests' time under the interpreter
    def test_decode_attention_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=600)

    @pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="compiles the real kernel")
    @pytest.mark.parametrize(
        "shape",
        [(32, 8, 64, 16), (32, 8, 128, 16), (9, 3, 64, 1), (32, 8, 64, 1), (32, 8, 128, 1)],
        ids=["1b", "8b", "smol", "1b-unsplit", "8b-unsplit"],
    )
    def test_compiles_for_sm90_with_the_cached_keys_loaded_before_the_wait(shape):
        registers, spills, ptx = sm90_ptx(*shape)
        splits = shape[3]
        assert spills == 0, (shape, registers, spills)
        lines = ptx.splitlines()
        wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
        launch = next(i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line)
        loads = [i for i, line in enumerate(lines) if re.search(r"\bld\.global", line)]
        # Successors may start at once; split launches stream the block table and the first K/V
        # tile before the wait. Unsplit ones (full waves) stream every tile through the pipelined
        # loop and hold the new token's K/V only after it: registers no higher than the paged
        # kernel's (118 at D = 64) by much, or fewer programs stay resident.
        assert launch < loads[0] < wait, (launch, loads[:3], wait)
        if splits > 1:
            assert sum(load < wait for load in loads) >= 8, "the cached K/V tile is not prefetched"
            assert re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx), "the arrival count must release"
        else:
            assert registers <= 128, f"{registers} registers a thread in an unsplit launch"

    def test_serves_the_latency_bound_batches_only():
        """The measured crossover (H200): the one launch for the 1B (D = 64) up to batch 64, the 8B
        (D = 128) up to 16; the three kernels above. Never for head sizes it does not take."""
        from strata.kernels.decode_attention import decode_attention_serves

        def serves(batch, head_dim, dtype=torch.bfloat16):
            return decode_attention_serves(batch, 8, head_dim, dtype, torch.device("cpu"))  # as 132 SMs

        assert [serves(b, 64) for b in (1, 64, 128, 256)] == [True, True, False, False]
        assert [serves(b, 128) for b in (1, 16, 32, 256)] == [True, True, False, False]
        assert not serves(1, 16) and not serves(1, 96) and not serves(1, 64, torch.int8)

else:
    from strata.kernels.decode_attention import _arrival_counters, decode_attention
    from strata.kernels.reference import paged_attention_reference, rotary_embedding_reference, write_kv_cache_reference
    from strata.kernels.testing import kv_by_slot, make_paged_batch

    TOLERANCE = {torch.float32: dict(atol=3e-5, rtol=3e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}

    def rope_tables(head_dim: int, positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def run(
        context_lens,
        *,
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size=16,
        dtype=torch.float32,
        splits=None,
        padding_rows=0,
        seed=0,
    ):
        """(kernel output, reference output, kernel cache, reference cache) for one decode batch."""
        batch = make_paged_batch(
            [1] * len(context_lens),
            context_lens,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            seed=seed,
        )
        num_tokens = len(context_lens)
        gen = torch.Generator().manual_seed(seed + 1)
        qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
        positions = (batch.seq_lens - 1).long()
        slots = batch.slot_mapping.clone()
        slots[num_tokens - padding_rows :] = -1
        cos, sin = rope_tables(head_dim, 4096, dtype)
        scale = head_dim**-0.5

        cache_ref = batch.kv_cache.clone()
        q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q_rot, k_rot = rotary_embedding_reference(
            positions, q.view(num_tokens, num_q_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim), cos, sin
        )
        write_kv_cache_reference(k_rot, v.view(num_tokens, num_kv_heads, head_dim), cache_ref, slots)
        want = paged_attention_reference(
            q_rot.to(dtype),
            cache_ref,
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_tables,
            1,
            batch.max_seq_len,
            scale,
        )

        cache = batch.kv_cache
        got = decode_attention(
            qkv,
            positions,
            cos,
            sin,
            cache,
            batch.seq_lens,
            batch.block_tables,
            slots,
            num_q_heads=num_q_heads,
            scale=scale,
            max_seq_len=batch.max_seq_len,
            num_kv_splits=splits,
        )
        return got.view(num_tokens, num_q_heads, head_dim), want, cache, cache_ref

    def assert_matches(got, want, cache, cache_ref, dtype, real_rows=None):
        rows = slice(None) if real_rows is None else slice(0, real_rows)
        assert not torch.isnan(got[rows]).any(), "read a poisoned (unowned) cache slot or divided by zero"
        torch.testing.assert_close(got[rows].float(), want[rows].float(), **TOLERANCE[dtype])
        # The new keys went in rotated, the values as they are; no other slot changed.
        torch.testing.assert_close(
            kv_by_slot(cache).float(), kv_by_slot(cache_ref).float(), equal_nan=True, atol=0, rtol=0
        )
        assert not _arrival_counters(got.device, 1).any(), "an arrival counter was left non-zero"

    GQA4, MHA, GQA4X3 = (8, 2, 32), (4, 4, 64), (12, 3, 64)

    @pytest.mark.parametrize(
        "heads,splits",
        [
            # Every head layout and every split count (the automatic choice, one, a few, many).
            (GQA4X3, None),
            (GQA4, 1),
            (MHA, 2),
            (GQA4, 8),
            (MHA, None),
            # The rest of the cross product, behind the slow marker: the head layouts and split
            # counts above cover the same kernel paths.
            *(
                pytest.param(heads, splits, marks=pytest.mark.slow)
                for heads, splits in [
                    (GQA4, None),
                    (GQA4, 2),
                    (MHA, 1),
                    (MHA, 8),
                    (GQA4X3, 1),
                    (GQA4X3, 2),
                    (GQA4X3, 8),
                ]
            ),
        ],
        ids=lambda v: {GQA4: "gqa4", MHA: "mha", GQA4X3: "gqa4x3"}.get(v, str(v)),
    )
    def test_matches_rotary_cache_write_and_paged_attention(heads, splits):
        num_q_heads, num_kv_heads, head_dim = heads
        # 0 cached keys (the new one only), part of a tile, several tiles and pages, ragged ends.
        got, want, cache, cache_ref = run(
            [0, 5, 70, 200], num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, splits=splits
        )
        assert_matches(got, want, cache, cache_ref, torch.float32)

    @pytest.mark.parametrize("splits", [3, 16])  # more splits than tiles: empty splits still arrive
    def test_empty_splits_and_small_pages(splits):
        got, want, cache, cache_ref = run(
            [1, 63, 64, 129], num_q_heads=8, num_kv_heads=2, head_dim=32, block_size=4, splits=splits
        )
        assert_matches(got, want, cache, cache_ref, torch.float32)

    def test_float16_and_repeated_launches_reuse_the_counters():
        for seed in range(3):  # every launch must find its counters back at 0
            got, want, cache, cache_ref = run(
                [33, 300], num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.float16, splits=4, seed=seed
            )
            assert_matches(got, want, cache, cache_ref, torch.float16)

    def test_padding_rows_store_nothing():
        got, want, cache, cache_ref = run(
            [40, 7, 7], num_q_heads=8, num_kv_heads=2, head_dim=32, splits=2, padding_rows=2
        )
        assert_matches(got, want, cache, cache_ref, torch.float32, real_rows=1)
