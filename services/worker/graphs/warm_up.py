"""Compile at cache init the Triton kernel variants that serving would otherwise compile
mid-traffic, and warn about any that still come late.

Triton compiles a kernel per specialisation (constexprs, and runtime ints that are 1 or a
multiple of 16 unless told not to specialise on them). One first needed while serving costs a
compile of about a second (or a load from the disk cache) on the step thread, stalling every
request.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from strata.kernels.gumbel_sampling import batches_per_launch_shape
from strata.services.worker.device.host_to_device import upload
from strata.services.worker.model.attention import AttentionMetadata
from strata.services.worker.model.layers import qk_norm_weights
from strata.services.worker.model.moe import SparseMoE
from strata.services.worker.sampling.sampler import Sampler, SamplingTensors

log = logging.getLogger("strata.worker")


@torch.inference_mode()
def warm_up(
    shard,
    kv_caches: list[torch.Tensor],
    sampler: Sampler | None,
    *,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
    vocab_width: int = 0,
) -> None:
    """Runs eager steps whose token counts are odd and a multiple of 16 (Triton specialises on
    both), one of long queries only (prefill attention's larger tiles), a layer of experts at
    the token counts that launch every fused-MoE variant (warm_up_experts), and, on the last stage
    (`sampler` given), every sampler variant (filters, logprobs) and the kernels of penalised and
    constrained rows. Block 0 is read and nothing is written (slot -1). vocab_width: the logits'
    columns (a tensor-parallel rank's slice; default the vocabulary), whose ranks all run this in
    lockstep: the sampler's collectives pair up."""
    vocab_width = vocab_width or shard.config.vocab_size
    block_size = kv_caches[0].shape[3]
    for q_lens in ([3, 1, 1], [15, 1], [129, 128]):
        total = sum(q_lens)
        inputs = upload(
            {
                "input_ids": np.zeros(total, np.int64),
                "positions": np.zeros(total, np.int64),
                "query_start_loc": np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                "seq_lens": np.asarray(q_lens, np.int32),
                "block_tables": np.zeros((len(q_lens), -(-max(q_lens) // block_size)), np.int32),
                "slot_mapping": np.full(total, -1, np.int64),
            },
            device,
        )
        meta = AttentionMetadata(
            query_start_loc=inputs["query_start_loc"],
            seq_lens=inputs["seq_lens"],
            block_tables=inputs["block_tables"],
            slot_mapping=inputs["slot_mapping"],
            max_query_len=max(q_lens),
            max_seq_len=max(q_lens),
            min_query_len=min(q_lens),
        )
        hidden = residual = None
        if not shard.is_first:
            hidden = torch.zeros(total, hidden_size, dtype=dtype, device=device)
            residual = torch.zeros_like(hidden)
        hidden, residual = shard.forward(
            inputs["input_ids"] if shard.is_first else None, inputs["positions"], hidden, residual, kv_caches, meta
        )
    # Every layer has q/k norms or none: the first one's pick the one-launch decode's variant.
    qk_norm = qk_norm_weights(shard.layers[0].self_attn.qk_norms)
    shard.attn_backend.warm_up(kv_caches[0], shard.config.num_attention_heads, qk_norm)
    warm_up_experts(shard, dtype, device)
    if sampler is not None:
        head_logits = shard.compute_logits(hidden[:2], residual[:2])  # the head's path, as a step runs it
        # The draw's launch shape changes with the batch (kernels/gumbel_sampling.py): warm both.
        # (top-p alone: a tensor-parallel rank's draw over gathered whole rows)
        variants = [(0.0, 0, 1.0, -1), (1.0, 0, 1.0, -1), (1.0, 5, 1.0, -1), (1.0, 0, 1.0, 2), (1.0, 5, 1.0, 2)]
        if vocab_width != shard.config.vocab_size:
            variants.append((1.0, 0, 0.9, -1))
        for rows in batches_per_launch_shape(vocab_width, device):
            logits = torch.zeros(rows, vocab_width, dtype=dtype, device=device)
            for temperature, top_k, top_p, logprobs in variants:
                sampler(
                    logits,
                    SamplingTensors.build(
                        temperature=[temperature] * rows,
                        top_k=[top_k] * rows,
                        top_p=[top_p] * rows,
                        min_p=[0.0] * rows,
                        seeds=list(range(rows)),
                        positions=[0] * rows,
                        num_logprobs=logprobs,
                        device=device,
                    ),
                )
            # The general path's Sampler draws penalised rows from their float32 copy.
            sampler(logits.float(), _plain_settings(rows, device))
        whole = getattr(sampler, "sampler", None)  # a rank's Sampler of gathered whole rows
        if whole is not None:
            for rows in batches_per_launch_shape(shard.config.vocab_size, device):
                logits = torch.zeros(rows, shard.config.vocab_size, dtype=dtype, device=device)
                for target in (logits, logits.float()):
                    whole(target, _plain_settings(rows, device))
        warm_up_controls(shard.config.vocab_size, dtype, device)
        if vocab_width == shard.config.vocab_size:  # a rank's slices take the torch path
            warm_up_prompt_logprobs(head_logits)
    torch.cuda.synchronize(device)


def warm_up_prompt_logprobs(logits: torch.Tensor) -> None:
    """The prompt-logprob row kernels at each of their top counts, on the head's logits."""
    from strata.kernels.prompt_logprobs import K_VARIANTS, LogprobRows

    targets = torch.zeros(len(logits), dtype=torch.int64, device=logits.device)
    for k in K_VARIANTS:
        rows = LogprobRows(len(logits), logits.shape[1], k, logits.device)
        rows.fill(logits, targets, 0)
        rows.merge()


def warm_up_experts(shard, dtype: torch.dtype, device: torch.device) -> None:
    """kernels/fused_moe.py's variants (a tile table row per tokens-per-expert range, one or
    several align programs): one call of the shard's first layer of experts at each of
    warm_up_token_counts launches them all (every layer of experts has the same shape)."""
    moe = next((layer.mlp for layer in shard.layers if isinstance(layer.mlp, SparseMoE)), None)
    if moe is None:
        return
    from strata.kernels.fused_moe import warm_up_token_counts

    for tokens in warm_up_token_counts(moe.experts.num_experts, moe.top_k):
        moe(torch.zeros(tokens, shard.config.hidden_size, dtype=dtype, device=device))


def _plain_settings(rows: int, device: torch.device) -> SamplingTensors:
    return SamplingTensors.build(
        temperature=[1.0] * rows,
        top_k=[0] * rows,
        top_p=[1.0] * rows,
        min_p=[0.0] * rows,
        seeds=list(range(rows)),
        positions=[0] * rows,
        num_logprobs=-1,
        device=device,
    )


def warm_up_controls(vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    """The kernels of penalised and constrained rows (sampling_controls.py): the controlled draw
    (both launch shapes, with and without the lookahead's store), the penalty patches, and the
    general path's penalties into a float32 copy and bitmask (on the logits' dtype and on float32).
    Whether a row has a bitmask, a patch, a bias or drafts is a runtime value in each of them."""
    from strata.kernels.controlled_sampling import apply_bitmask_, controlled_draw
    from strata.kernels.penalties import apply_penalties, penalty_patches

    words = (vocab + 31) // 32
    slots, history_len = 2, 64
    state = dict(
        history=torch.zeros((slots, history_len), dtype=torch.int32, device=device),
        counts=torch.zeros((slots, vocab), dtype=torch.int32, device=device),
        seen=torch.zeros((slots, vocab), dtype=torch.bool, device=device),
        bias=torch.zeros((slots, vocab), dtype=torch.float32, device=device),
    )
    for rows in batches_per_launch_shape(vocab, device):
        logits = torch.zeros(rows, vocab, dtype=dtype, device=device)
        n = min(rows, slots)
        d = upload(
            {
                "rows": np.arange(rows, dtype=np.int64),
                "slots": np.arange(n, dtype=np.int64) % slots,
                "sample_pos": np.full(n, 3, np.int64),
                "bias_tok": np.full((n, 1), 5, np.int64),
                "drafts": np.full((n, 1), -1, np.int64),
                "n_drafts": np.zeros(n, np.int64),
                "rep": np.full(n, 1.1, np.float32),
                "freq": np.full(n, 0.1, np.float32),
                "pres": np.full(n, 0.1, np.float32),
                "seeds": np.arange(rows, dtype=np.int64),
                "positions": np.zeros(rows, np.int64),
                "inv_temperature": np.ones(rows, np.float32),
                "greedy": np.zeros(rows, np.uint8),
                "mask": np.full((rows, words), -1, np.int32),
                "mask_index": np.arange(rows, dtype=np.int32),
                "patch_index": np.where(np.arange(rows) < n, np.arange(rows), -1).astype(np.int32),
                "store_rows": np.arange(rows, dtype=np.int64),
            },
            device,
        )
        pen = (
            d["slots"],
            d["sample_pos"],
            state["history"],
            state["counts"],
            state["seen"],
            state["bias"],
            d["bias_tok"],
            d["drafts"],
            d["n_drafts"],
            d["rep"],
            d["freq"],
            d["pres"],
        )
        apply_penalties(logits, logits.float(), d["rows"][:n], *pen, 4)
        for target in (logits, logits.float()):
            apply_bitmask_(target, d["mask"], d["rows"], vocab)
        patch = penalty_patches(logits, d["rows"][:n], *pen, 4)
        tokens = torch.zeros(rows, dtype=torch.int64, device=device)
        settings = (d["seeds"], d["positions"], d["inv_temperature"], d["greedy"])
        for store in (None, (torch.zeros(rows, dtype=torch.int64, device=device), d["store_rows"])):
            controlled_draw(
                logits,
                d["rows"],
                *settings,
                tokens,
                mask=(d["mask"], d["mask_index"], vocab),
                patch=(*patch, d["patch_index"][:rows]),
                store=store,
            )


def warn_on_late_compiles() -> None:
    """From now on, log a warning for each Triton kernel variant compiled (the warm-up missed it)."""
    try:
        from triton import knobs
    except ImportError:  # CPU-only installs
        return

    def warn(*, repr: str, **_) -> None:
        log.warning("Triton kernel variant first needed while serving (stalls the step): %s", repr)

    knobs.runtime.jit_post_compile_hook = warn
