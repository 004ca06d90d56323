"""Running a model shard directly in tests: one step's sequences flattened into model inputs and
paged-attention metadata, and the switch between the shard's fused kernels and its torch path."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from strata.services.worker.model.attention import AttentionMetadata
from strata.services.worker.model.layers import FusedKernelSwitch


@dataclass
class SequenceChunk:
    """The tokens one sequence computes this step (a prefill chunk, a decode token, ...)."""

    token_ids: Sequence[int]  # new tokens, at positions num_computed, num_computed + 1, ...
    num_computed: int  # tokens of this sequence already in the KV cache
    block_ids: Sequence[int]  # block table; must cover num_computed + len(token_ids) tokens


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [B]: each sequence's last new token in the flat batch


def build_step_inputs(
    chunks: Sequence[SequenceChunk],
    block_size: int,
    device: torch.device | str = "cpu",
    max_blocks_per_seq: int | None = None,
) -> StepInputs:
    """Build the flat batch for `chunks`; positions and slots are computed vectorised."""
    if not chunks:
        raise ValueError("a step needs at least one sequence")
    q_lens = torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.int64)
    if bool((q_lens == 0).any()):
        raise ValueError("every sequence must compute at least one token")
    computed = torch.tensor([c.num_computed for c in chunks], dtype=torch.int64)
    seq_lens = computed + q_lens
    width = max(len(c.block_ids) for c in chunks)
    if max_blocks_per_seq is not None:
        width = max(width, max_blocks_per_seq)
    block_tables = torch.zeros(len(chunks), width, dtype=torch.int64)
    for row, chunk in enumerate(chunks):
        if len(chunk.block_ids) * block_size < chunk.num_computed + len(chunk.token_ids):
            raise ValueError(f"sequence {row}: block table too short for its tokens")
        block_tables[row, : len(chunk.block_ids)] = torch.as_tensor(chunk.block_ids, dtype=torch.int64)

    query_start_loc = torch.zeros(len(chunks) + 1, dtype=torch.int64)
    torch.cumsum(q_lens, 0, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), q_lens)
    positions = computed[seq_of_token] + torch.arange(num_tokens) - query_start_loc[seq_of_token]
    blocks = block_tables[seq_of_token, positions // block_size]
    slot_mapping = blocks * block_size + positions % block_size
    input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64)

    meta = AttentionMetadata(
        query_start_loc=query_start_loc.to(device=device, dtype=torch.int32),
        seq_lens=seq_lens.to(device=device, dtype=torch.int32),
        block_tables=block_tables.to(device=device, dtype=torch.int32),
        slot_mapping=slot_mapping.to(device),
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        min_query_len=int(q_lens.min()),  # as the worker passes it: long prompts take 128-row tiles
    )
    return StepInputs(
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        meta=meta,
        logits_indices=(query_start_loc[1:] - 1).to(device),
    )


def set_fused_kernels(model: nn.Module, enabled: bool | None) -> None:
    """Force the fused kernels on (True) or off (False) in every module of `model`; None: by device."""
    for module in model.modules():
        if isinstance(module, FusedKernelSwitch):
            module.fused_kernels = enabled
