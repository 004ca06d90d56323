"""Prompt logprobs on the last stage (StepPlan.prompt_logprob_*): at each prompt position a plan
asks for, the log-softmax of the raw logits there (no temperature, penalties, bias or masks, as
the sampler's logprobs and vLLM's), the next prompt token's logprob and rank, and the top k
tokens of the sequence's SamplingOptions.prompt_logprobs.

Only the asked rows' hidden states go through the final norm and lm_head, a chunk of rows at a
time, so a long prompt never holds its [T, vocab] logits at once. The runner calls in only when a
plan asks: a step without an asking sequence launches nothing here and copies nothing back.

Each row's logprob is its logit minus the row's logsumexp, and each top entry's the same: when
the prompt token is among the top k, its logprob and its top entry are the same float (a client
such as lm-eval calls a position greedy by comparing them). The rank counts the tokens whose
logit is at least the prompt token's (vLLM counts on logprobs; equal but for ties that the
subtraction would create). On CUDA one kernel reads each chunk's logits once for all of it
(kernels/prompt_logprobs.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.kernels.gumbel_sampling import HAVE_TRITON
from strata.kernels.prompt_logprobs import LogprobRows, logprob_rows_reference
from strata.services.worker.device.host_to_device import upload
from strata.services.worker.step.sequence_table import PlanError

# Logits one chunk of rows holds at most (rows x vocabulary elements).
CHUNK_ELEMENTS = 1 << 25
# The lm_head's GEMM tiles the rows by up to 128: a chunk of whole tiles wastes none.
GEMM_ROWS = 128


def chunk_rows(vocab_size: int) -> int:
    """Rows per chunk: as many as CHUNK_ELEMENTS allows, in whole GEMM tiles where that is one or more."""
    rows = max(1, CHUNK_ELEMENTS // vocab_size)
    return rows - rows % GEMM_ROWS if rows >= GEMM_ROWS else rows


@dataclass
class PromptRows:
    """A step's asked prompt positions, in plan order (the host half)."""

    token_index: np.ndarray  # int64 [R]: each row's token in the step's flat batch
    targets: np.ndarray  # int64 [R]: the prompt token after it, whose logprob the row gives
    num_top: np.ndarray  # int64 [R]: its sequence's k

    @property
    def max_top(self) -> int:
        return int(self.num_top.max(initial=0))


def asked_rows(plan, query_start_loc: np.ndarray, top_of_rows: np.ndarray, vocab_size: int) -> PromptRows | None:
    """The plan's asked rows, checked against the step's layout; None when nothing is asked.
    query_start_loc: [B + 1] each sequence's first token in the flat batch; top_of_rows: [B] each
    sequence's SamplingOptions.prompt_logprobs (-1: it never asked)."""
    if not plan.prompt_logprob_counts:
        return None
    n = len(query_start_loc) - 1
    counts = np.asarray(plan.prompt_logprob_counts, dtype=np.int64)
    offsets = np.asarray(plan.prompt_logprob_offsets, dtype=np.int64)
    if counts.shape != (n,) or offsets.shape != (n,):
        raise PlanError("prompt_logprob_offsets and prompt_logprob_counts need one entry per sequence")
    if (offsets + counts > np.diff(query_start_loc)).any():
        raise PlanError("prompt logprob rows past a sequence's scheduled tokens")
    if (top_of_rows[counts > 0] < 0).any():
        raise PlanError("prompt logprob rows for a sequence whose options do not ask for them")
    total = int(counts.sum())
    targets = np.asarray(plan.prompt_logprob_token_ids, dtype=np.int64)
    if len(targets) != total:
        raise PlanError(f"prompt_logprob_token_ids holds {len(targets)} ids for {total} rows")
    if total == 0:
        return None
    if targets.min() < 0 or targets.max() >= vocab_size:
        raise PlanError(f"prompt_logprob_token_ids must be in [0, {vocab_size})")
    first = query_start_loc[:-1] + offsets  # each sequence's first asked token
    before = np.cumsum(counts) - counts  # rows of the sequences before it
    index = np.repeat(first - before, counts) + np.arange(total)
    return PromptRows(index, targets, np.repeat(top_of_rows, counts))


def fused(device: torch.device) -> bool:
    """Whether the rows' kernel serves this device (else its torch reference)."""
    return device.type == "cuda" and HAVE_TRITON


def prompt_logprobs(
    compute_logits, hidden: torch.Tensor, residual: torch.Tensor, rows: PromptRows, vocab_size: int, sharded=None
) -> list[torch.Tensor]:
    """[logprobs float32 [R], ranks int64 [R], top ids int64 [R, K], top logprobs float32 [R, K]]
    on the device, K the most any row asks. compute_logits(hidden, residual): the shard's final
    norm and lm_head over some rows. On CUDA each chunk's logits are read once, by one kernel,
    and the chunks' statistics merged once (kernels/prompt_logprobs.py); elsewhere the torch
    reference takes each chunk. sharded: a tensor-parallel rank's ShardedSampler, whose
    compute_logits gives its slice of the vocabulary: each chunk's statistics are the slices'
    combined (its logprob_rows), in the same chunks on every rank."""
    d = upload({"index": rows.token_index, "targets": rows.targets}, hidden.device)
    k, total = rows.max_top, len(rows.targets)
    chunk = chunk_rows(vocab_size)
    stats = LogprobRows(total, vocab_size, k, hidden.device) if fused(hidden.device) and sharded is None else None
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, total, chunk):
        index, targets = d["index"][start : start + chunk], d["targets"][start : start + chunk]
        logits = compute_logits(hidden[index], residual[index])
        if stats is not None:
            stats.fill(logits, targets, start)
        elif sharded is not None:
            parts.append(sharded.logprob_rows(logits, targets, k))
        else:
            parts.append(logprob_rows_reference(logits, targets, k))
    if stats is not None:
        log_norm, ranks, target, top_values, top_ids = stats.merge()
    else:
        log_norm, ranks, target, top_values, top_ids = (torch.cat(x) for x in zip(*parts))
    # The token's logprob and its top entry: the same logit minus the same logsumexp.
    return [target - log_norm, ranks, top_ids, top_values - log_norm.unsqueeze(1)]


def add_to_result(result, host: list[torch.Tensor], num_top: np.ndarray) -> None:
    """The rows (copied to the host) into a StepResult, each row's top entries cut to its own k."""
    logprobs, ranks, top_ids, top_lps = (x.numpy() for x in host)
    result.prompt_logprobs.extend(logprobs.tolist())
    result.prompt_logprob_ranks.extend(ranks.tolist())
    keep = np.arange(top_ids.shape[1]) < num_top[:, None]
    result.prompt_top_token_ids.extend(top_ids[keep].tolist())
    result.prompt_top_logprobs.extend(top_lps[keep].tolist())
