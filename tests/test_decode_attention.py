"""The one-launch decode attention (kernels/decode_attention.py) against the three steps it replaces,
in torch: rotary (after Qwen3's or Gemma 3's q/k norms, where given), the KV-cache write, paged
attention. On CPU under Triton's interpreter (float32, float16), plus its sm_90 compile: no spills,
and the cached keys' loads issued before the dependent-launch wait. bf16 on the GPU:
tests/gpu/test_decode_attention_gpu.py.

    TRITON_INTERPRET=1 python -m pytest tests/test_decode_attention.py -k splits
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from tests.triton_interpreter import can_run_interpreted_here, rerun_under_interpreter


def sm90_ptx(
    num_q_heads: int, num_kv_heads: int, head_dim: int, splits: int, qk_norm: str | None = None, batch: int = 0
) -> tuple[int, int, str]:
    """(registers, spilled bytes, PTX) of the kernel as the 1B / 8B chains launch it on an H100;
    qk_norm "qwen3" or "gemma3": with those q/k norms. batch (which picks the warps): 1 for split
    launches, 256 for unsplit ones, unless given."""

    from strata.kernels import attention_launch as launch
    from strata.kernels import compile_check
    from strata.kernels import decode_attention as da

    constexprs = dict(
        launch.decode_kernel_constants(num_q_heads, num_kv_heads, head_dim, 16, 64, splits),
        IEEE_DOT=False,
        INTERPRETED=False,
        PDL=True,
        QK_NORM=qk_norm is not None,
        NORM_UNIT_OFFSET=qk_norm == "gemma3",
    )
    signature = compile_check._signature(da._decode_attention_kernel, "bf16", constexprs)
    signature.signature["positions_ptr"] = "*i64"
    signature.signature["arrivals_ptr"] = "*i32"
    signature.signature["num_positions"] = "i32"
    compiled, registers, spills = compile_check.compile_for_sm90(
        signature, launch.decode_num_warps(head_dim, num_kv_heads * (batch or (1 if splits > 1 else 256))), 2
    )
    return registers, spills, compiled.asm["ptx"]


if not can_run_interpreted_here(
    "strata.kernels.decode_attention", "strata.kernels.paged_attention", "strata.kernels.rotary"
):

    @pytest.mark.triton_interpreter(seconds=17)  # its tests' time under the interpreter
    def test_decode_attention_under_triton_interpreter():
        rerun_under_interpreter(__file__, timeout=600)

    @pytest.mark.skipif(bool(os.environ.get("TRITON_INTERPRET")), reason="compiles the real kernel")
    @pytest.mark.parametrize(
        "shape",
        [
            (32, 8, 64, 16),
            (32, 8, 128, 16),
            (9, 3, 64, 1),
            (32, 8, 64, 1),
            (32, 8, 128, 1),
            (32, 4, 128, 16, "qwen3"),
            (32, 4, 128, 1, "qwen3"),
            (32, 16, 128, 16, "gemma3"),
            (32, 8, 128, 4, None, 16),
        ],
        ids=[
            "1b",
            "8b",
            "smol",
            "1b-unsplit",
            "8b-unsplit",
            "qwen3-30b-a3b",
            "qwen3-30b-a3b-unsplit",
            "gemma3-27b",
            "8b-batch16",
        ],
    )
    def test_compiles_for_sm90_with_the_cached_keys_loaded_before_the_wait(shape):
        registers, spills, ptx = sm90_ptx(*shape)
        splits = shape[3]
        # The 8B's batch-16 launch (4 splits, 4 warps) spills one register, 4 bytes: at 8 warps it
        # spilled none but ran 3% slower a step (bench/RESULTS.md).
        assert spills <= (4 if len(shape) > 5 else 0), (shape, registers, spills)
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
        if len(shape) > 4 and shape[4]:  # the norms' weights are read before the wait too: more loads there
            plain = sm90_ptx(*shape[:4])[2].splitlines()
            plain_wait = next(i for i, line in enumerate(plain) if "griddepcontrol.wait" in line)
            plain_loads = sum(bool(re.search(r"\bld\.global", line)) for line in plain[:plain_wait])
            assert sum(load < wait for load in loads) > plain_loads, "the norms' weights wait for qkv"

    def test_serves_the_latency_bound_batches_only():
        """The measured crossover (H200): the one launch for the 1B (D = 64) up to batch 64, the 8B
        (D = 128) up to 16 (at 32 it was 3-4% slower a step, with 8 warps and with 4); the three
        kernels above. Never for head sizes it does not take."""
        from strata.kernels.attention_launch import decode_attention_serves

        def serves(batch, head_dim, dtype=torch.bfloat16):
            return decode_attention_serves(batch, 8, head_dim, dtype, torch.device("cpu"))  # as 132 SMs

        assert [serves(b, 64) for b in (1, 64, 128, 256)] == [True, True, False, False]
        assert [serves(b, 128) for b in (1, 16, 32, 256)] == [True, True, False, False]
        assert not serves(1, 16) and not serves(1, 96) and not serves(1, 64, torch.int8)

else:
    from strata.kernels.decode_attention import _arrival_counters, decode_attention
    from strata.kernels.reference import (
        paged_attention_reference,
        rms_norm_reference,
        rotary_embedding_reference,
        write_kv_cache_reference,
    )
    from strata.kernels.rotary import rotary_embedding_
    from strata.kernels.testing import kv_by_slot, make_paged_batch

    TOLERANCE = {torch.float32: dict(atol=3e-5, rtol=3e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}

    def rope_tables(head_dim: int, positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def qk_norm_weights(head_dim, dtype, unit_offset, seed):
        """Random (q weight, k weight, eps, unit_offset) of q/k norms: Qwen3's weights around 1,
        Gemma's (scaling by 1 + weight) around 0."""
        gen = torch.Generator().manual_seed(seed + 2)
        q_weight, k_weight = (torch.randn(head_dim, generator=gen) * 0.5 + (0.0 if unit_offset else 1.0) for _ in "qk")
        return q_weight.to(dtype), k_weight.to(dtype), 1e-6, unit_offset

    def decode_batch(context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, padding_rows, seed):
        """(paged batch, qkv, positions, slots) of one decode batch, the same for the same arguments;
        the last padding_rows rows are padding (slot -1)."""
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
        slots = batch.slot_mapping.clone()
        slots[num_tokens - padding_rows :] = -1
        return batch, qkv, (batch.seq_lens - 1).long(), slots

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
        qk_norm=None,
    ):
        """(kernel output, reference output, kernel cache, reference cache) for one decode batch.
        qk_norm: as decode_attention's, each head through rms_norm_reference before rotary."""
        batch, qkv, positions, slots = decode_batch(
            context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, padding_rows, seed
        )
        num_tokens = len(context_lens)
        cos, sin = rope_tables(head_dim, 4096, dtype)
        scale = head_dim**-0.5

        cache_ref = batch.kv_cache.clone()
        q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q, k = q.view(num_tokens, num_q_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
        if qk_norm is not None:
            q_weight, k_weight, eps, unit_offset = qk_norm
            q, k = rms_norm_reference(q, q_weight, eps, unit_offset), rms_norm_reference(k, k_weight, eps, unit_offset)
        q_rot, k_rot = rotary_embedding_reference(positions, q, k, cos, sin)
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
            qk_norm=qk_norm,
        )
        return got.view(num_tokens, num_q_heads, head_dim), want, cache, cache_ref

    def assert_matches(got, want, cache, cache_ref, dtype, real_rows=None, cache_tolerance=None):
        """cache_tolerance: how far the new keys may lie from the reference's (exact by default)."""
        rows = slice(None) if real_rows is None else slice(0, real_rows)
        assert not torch.isnan(got[rows]).any(), "read a poisoned (unowned) cache slot or divided by zero"
        torch.testing.assert_close(got[rows].float(), want[rows].float(), **TOLERANCE[dtype])
        # The new keys went in rotated, the values as they are; no other slot changed.
        torch.testing.assert_close(
            kv_by_slot(cache).float(),
            kv_by_slot(cache_ref).float(),
            equal_nan=True,
            **(cache_tolerance or dict(atol=0, rtol=0)),
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

    # How far a normed key may lie from rms_norm_reference's: its mean of squares sums in another
    # order (float32: a few ulps; float16: one ulp where that flips a rounding).
    NORMED_CACHE_TOLERANCE = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.float16: dict(atol=1e-3, rtol=1e-3)}

    @pytest.mark.parametrize("splits", [1, 4], ids=["unsplit", "split"])
    @pytest.mark.parametrize("unit_offset", [False, True], ids=["qwen3", "gemma3"])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
    def test_qk_norms_match_norm_rotary_cache_write_and_paged_attention(dtype, unit_offset, splits):
        """Qwen3's and Gemma 3's per-head q/k RMSNorm before rotary, against the torch steps; the
        cache holds bit for bit the keys of kernels/rotary.py's normed path (the three kernels')."""
        num_q_heads, num_kv_heads, head_dim = (8, 2, 32) if dtype == torch.float32 else (12, 3, 64)
        context_lens = [0, 5, 70, 200]
        norms = qk_norm_weights(head_dim, dtype, unit_offset, seed=0)
        got, want, cache, cache_ref = run(
            context_lens,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            splits=splits,
            padding_rows=1,
            qk_norm=norms,
        )
        assert_matches(got, want, cache, cache_ref, dtype, real_rows=3, cache_tolerance=NORMED_CACHE_TOLERANCE[dtype])
        # The three kernels' first: rotary with the norms and the KV write, on the same inputs anew.
        batch, qkv, positions, slots = decode_batch(
            context_lens, num_q_heads, num_kv_heads, head_dim, block_size=16, dtype=dtype, padding_rows=1, seed=0
        )
        q, k, v = (
            x.view(len(context_lens), -1, head_dim)
            for x in qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        )
        cos, sin = rope_tables(head_dim, 4096, dtype)
        rotary_embedding_(
            positions, q, k, cos, sin, value=v, kv_cache=batch.kv_cache, slot_mapping=slots, qk_norm=norms
        )
        assert torch.equal(kv_by_slot(cache).nan_to_num(7.0), kv_by_slot(batch.kv_cache).nan_to_num(7.0))
