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
from strata.services.worker.attention import AttentionMetadata
from strata.services.worker.host_to_device import upload
from strata.services.worker.sampler import Sampler, SamplingTensors

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
) -> None:
    """Runs eager steps whose token counts are odd and a multiple of 16 (Triton specialises on
    both), one of long queries only (prefill attention's larger tiles), and, on the last stage
    (`sampler` given), every sampler variant (filters, logprobs). Block 0 is read and nothing is
    written (slot -1)."""
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
    shard.attn_backend.warm_up(kv_caches[0], shard.config.num_attention_heads)
    if sampler is not None:
        shard.compute_logits(hidden[:2], residual[:2])  # the head's path, as a step runs it
        # The draw's launch shape changes with the batch (kernels/gumbel_sampling.py): warm both.
        for rows in batches_per_launch_shape(shard.config.vocab_size, device):
            logits = torch.zeros(rows, shard.config.vocab_size, dtype=dtype, device=device)
            for temperature, top_k, logprobs in [(0.0, 0, -1), (1.0, 0, -1), (1.0, 5, -1), (1.0, 0, 2), (1.0, 5, 2)]:
                sampler(
                    logits,
                    SamplingTensors.build(
                        temperature=[temperature] * rows,
                        top_k=[top_k] * rows,
                        top_p=[1.0] * rows,
                        min_p=[0.0] * rows,
                        seeds=list(range(rows)),
                        positions=[0] * rows,
                        num_logprobs=logprobs,
                        device=device,
                    ),
                )
    torch.cuda.synchronize(device)


def warn_on_late_compiles() -> None:
    """From now on, log a warning for each Triton kernel variant compiled (the warm-up missed it)."""
    try:
        from triton import knobs
    except ImportError:  # CPU-only installs
        return

    def warn(*, repr: str, **_) -> None:
        log.warning("Triton kernel variant first needed while serving (stalls the step): %s", repr)

    knobs.runtime.jit_post_compile_hook = warn
