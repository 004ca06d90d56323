"""Speculative verification's rows and outcome (the speculation room's __init__ says why a draft
is accepted exactly when it equals the target's own (seed, position) draw).

A sequence verifying d drafts (its last d input tokens) samples d + 1 rows: the token before
each draft and the last one (add_verification). Row j draws the token at position
seq_len - d + j, from (seed, that position) as a plain decode there would, and is compared with
draft j; the last row's draw is the bonus token. When the draws come back, accepted_rows keeps
each sequence's drafts left to right while they equal the draws, plus the draw at the first
mismatch (or the bonus draw); a device's commit (kernels/spec_decode.py) does the same on the GPU,
and emitted_rows / round_tokens read its outcome.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.services.worker.step.sequence_table import PlanError
from strata.v1 import engine_pb2


@dataclass
class DraftLayout:
    """Where a step's drafts sit, worked out once (build) for the verification rows, the device
    drafts' sources and the speculation's meta rows and history (device_speculation.py)."""

    per_seq: np.ndarray  # [B] drafts of each sequence: its last per_seq input tokens
    index: np.ndarray  # [T] each token's index among its sequence's drafts; < 0: not a draft


@dataclass
class Verification:
    """Speculative verification rows: which sample rows belong to which sequence, and the draft
    token each row's draw is compared with (-1 for a sequence's last row, the bonus draw)."""

    rows_per_seq: np.ndarray  # [S] d + 1 for a sequence verifying d drafts, else 1
    drafts: np.ndarray  # [R]


def add_verification(
    h, plan: engine_pb2.StepPlan, q_lens: np.ndarray, sample_idx: np.ndarray, rows: np.ndarray
) -> np.ndarray:
    """A sequence verifying d drafts (its last d input tokens) samples d + 1 rows: the token
    before each draft and the last one. Row j draws the token at position seq_len - d + j,
    from (seed, that position) as a plain decode there would, and is compared with draft j.
    Returns each sequence's d (checked)."""
    drafts = np.asarray(plan.num_draft_tokens, dtype=np.int64)
    sampling = np.zeros(len(q_lens), dtype=bool)
    sampling[sample_idx] = True
    if drafts.shape != q_lens.shape or (drafts >= q_lens).any() or (drafts[~sampling] > 0).any():
        raise PlanError("num_draft_tokens must be below num_scheduled, and only on sampling sequences")
    d = drafts[sample_idx]
    counts = d + 1
    first_row = np.cumsum(counts) - counts
    offset = np.arange(int(counts.sum())) - np.repeat(first_row, counts)  # j = 0 .. d per sequence
    start = np.repeat(h.sample_token_index - d, counts)
    h.sample_token_index = start + offset
    h.sample_positions = np.repeat(h.sample_positions - d, counts) + offset
    h.sample_rows = np.repeat(rows[sample_idx], counts)
    tokens = np.asarray(plan.input_token_ids, dtype=np.int64)
    if tokens.shape[0] != int(h.query_start_loc[-1]):
        raise PlanError("a plan with drafts must carry every input token")
    following = np.minimum(h.sample_token_index + 1, tokens.shape[0] - 1)
    h.verify = Verification(counts, np.where(offset < np.repeat(d, counts), tokens[following], -1))
    return drafts


def seq_row_index(verify: Verification) -> np.ndarray:
    """[n, width]: each verifying step's sequence's sample rows in order (its d + 1 consecutive
    rows; past them, the next sequence's, which callers mask), width the most rows of any."""
    counts = verify.rows_per_seq
    first_row = np.cumsum(counts) - counts
    return first_row[:, None] + np.arange(int(counts.max()))


def emitted_rows(num_tokens: np.ndarray, verify: Verification) -> np.ndarray:
    """The sample rows a verify step emits, in order: each sequence's first num_tokens rows."""
    index = seq_row_index(verify)
    return index[np.arange(index.shape[1]) < num_tokens[:, None]]


def round_tokens(tokens: np.ndarray, counts: np.ndarray, verify: Verification) -> tuple[np.ndarray, np.ndarray]:
    """Several verification rounds' emitted tokens: tokens [rounds, rows] (each round's draws
    per sample row), counts [rounds, n] (tokens each sequence emitted per round, its first
    rows'). Returns (tokens per sequence, the tokens flat: sequence by sequence, round by round)."""
    index = np.minimum(seq_row_index(verify), tokens.shape[1] - 1)  # [n, width]
    gathered = tokens[:, index]  # [rounds, n, width]
    emitted = np.arange(index.shape[1]) < counts[:, :, None]
    order = (1, 0, 2)  # sequence-major
    return counts.sum(axis=0), gathered.transpose(order)[emitted.transpose(order)]


def accepted_rows(tokens: np.ndarray, verify: Verification) -> tuple[np.ndarray, np.ndarray]:
    """Speculative verification of one step's draws: a sequence's drafts are accepted left to
    right while each equals the target's own draw at its position, and the draw at the first
    mismatch (or the bonus draw after every draft) is emitted too. Since each draw comes from
    (seed, position), the tokens are those plain decoding would give.

    Returns (tokens emitted per sequence, the emitted rows in order)."""
    counts = verify.rows_per_seq
    index = seq_row_index(verify)  # [S, width]
    width = index.shape[1]
    valid = np.arange(width) < counts[:, None]
    match = np.zeros(index.shape, dtype=bool)
    match[valid] = tokens[index[valid]] == verify.drafts[index[valid]]  # the bonus row's draft is -1
    num_tokens = np.cumprod(match, axis=1).sum(axis=1) + 1
    return num_tokens, index[np.arange(width) < num_tokens[:, None]]
