"""Speculative decoding's per-step bookkeeping on the last stage's device: verification of the
step's draws against the drafts, the commit of what it accepted, and the moves of a plan sent
before an earlier verification of the same sequence came back.

Per sampling sequence i of a step, a row of `meta` (int64, columns below) says where it is:

    ROW      its state row
    FIRST_ROW    index of its first sample row among the step's sample rows (its d + 1 rows
                 are consecutive): where `draws` holds it when the sampler drew the rows
    FIRST_TOKEN  the same row's token index in the step (padded) layout: where `draws` holds
                 it when a graph drew every token
    DRAFTS   d: the draft tokens it verifies this step (0: a plain sample; -1: samples nothing,
             left alone)
    POS      the position its first sample row draws, as the plan has it
    KNOWN    rejected drafts the plan's num_computed accounts for (-1: the plan is exact)
    DEVICE   where its drafts are: 0 the plan carried them; on this device, 1 its prompt lookup's
             (num_valid of them real), 2 a draft worker's, handed over the draft link (all real)
    PROPOSE  drafts to propose after this step (the n-gram kernel reads it)
    HOST     the plan's drafts (when DEVICE is 0), HOST + max_k columns
    ROUNDS   (the last column) verification rounds left in this step, this one included
             (StepPlan.verify_rounds; advance_round counts them down)

A sequence's shift is rejected[row] - KNOWN (0 when KNOWN < 0): how many of the drafts that the
plan assumed accepted were rejected since. commit() then, per sequence, in one program:

    a      = leading drafts j < min(d, valid) whose draw equals the draft (valid: how many of the
             lookup's proposals are real; all of the plan's and the draft worker's)
    emits draws[FIRST .. FIRST + a]: positions POS - shift .. + a of history, last_sampled[row]
    rejected[row] += d - a ; hist_len[row] = POS - shift + a + 1 ; packed[i, 0] = a + 1

shift_positions() applies the shifts to a step's inputs before its forward: positions, sample
positions and sequence lengths move back, and each written slot is recomputed from the block
table at the moved position. It runs inside the verification graphs (a sequence's tokens are
`query_len` consecutive rows there); the eager path calls the reference on its tensors.

advance_round() moves a step's inputs on to its next verification round, after a commit: each
sequence with rounds left starts again at its last emitted token (hist_len - 1, read from
last_sampled as a placeholder), its drafts the ones just proposed; the others sit out (no KV
written, nothing committed or proposed).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

ROW, FIRST_ROW, FIRST_TOKEN, DRAFTS, POS, KNOWN, DEVICE, PROPOSE, HOST = range(9)
LOOKUP_DRAFTS, LINKED_DRAFTS = 1, 2  # DEVICE's values for drafts on this device


def meta_columns(max_k: int) -> int:
    return HOST + max_k + 1  # ... the drafts, then ROUNDS


ROUNDS = -1  # the last column


def shifts_reference(meta: Tensor, rejected: Tensor) -> Tensor:
    """Per meta row: rejected[row] - KNOWN, or 0 where KNOWN < 0."""
    known = meta[:, KNOWN]
    total = rejected[meta[:, ROW].clamp(min=0)]
    return torch.where(known >= 0, total - known, torch.zeros_like(known))


def commit_reference(
    draws: Tensor,
    meta: Tensor,
    rejected: Tensor,
    num_valid: Tensor,
    draft_area: Tensor,
    draft_base: int,
    last_sampled: Tensor,
    history: Tensor,
    hist_len: Tensor,
    packed: Tensor,
    max_k: int,
    first_col: int = FIRST_ROW,
    enabled: Tensor | None = None,
) -> None:
    """Torch reference of commit() (same arguments); draws are int64 token ids."""
    if enabled is not None and int(enabled.reshape(-1)[0]) <= 0:
        return
    index = torch.nonzero(meta[:, DRAFTS] >= 0).squeeze(1)
    meta = meta[index]  # sequences that sample
    n = meta.shape[0]
    if n == 0:
        return
    dev = meta.device
    row, first, d = meta[:, ROW], meta[:, first_col], meta[:, DRAFTS]
    shift = shifts_reference(meta, rejected)
    pos = meta[:, POS] - shift
    width = max_k + 1
    j = torch.arange(width, device=dev)
    jk = j[:max_k]
    valid = torch.where(meta[:, DEVICE] == LOOKUP_DRAFTS, torch.minimum(num_valid[row].long(), d), d)
    device_drafts = draft_area[draft_base + row.unsqueeze(1) * max_k + jk]
    drafts = torch.where(meta[:, DEVICE].unsqueeze(1) > 0, device_drafts, meta[:, HOST : HOST + max_k])
    rows_drawn = draws[(first.unsqueeze(1) + j).clamp(max=draws.shape[0] - 1)]  # [n, max_k + 1]
    match = (jk.unsqueeze(0) < valid.unsqueeze(1)) & (rows_drawn[:, :max_k] == drafts)
    accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    last_sampled[row] = rows_drawn.gather(1, accepted.unsqueeze(1)).squeeze(1)
    rejected[row] += d - accepted
    emit = j.unsqueeze(0) <= accepted.unsqueeze(1)
    at = (pos.unsqueeze(1) + j).clamp(min=0, max=history.shape[1] - 1)
    history[row.unsqueeze(1).expand(-1, width)[emit], at[emit]] = rows_drawn[emit].to(history.dtype)
    hist_len[row] = pos + accepted + 1
    packed[index, 0] = accepted + 1


def shift_positions_reference(
    meta: Tensor,
    rejected: Tensor,
    positions: Tensor,
    sample_positions: Tensor | None,
    slot_mapping: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    token_seq: Tensor,
    block_size: int,
) -> None:
    """Moves a step's tokens back by their sequence's shift, in place. token_seq: each token's
    index in meta (= in the step's sequences); sample_positions: per token, or None."""
    shift = shifts_reference(meta, rejected)
    tok = shift[token_seq]
    positions.sub_(tok).clamp_(min=0)  # (>= 0 unless a bug)
    if sample_positions is not None:
        sample_positions -= tok
    seq_lens -= shift[: seq_lens.shape[0]].to(seq_lens.dtype)
    blocks = block_tables[token_seq, (positions // block_size).clamp(min=0)].to(torch.int64)
    moved = blocks * block_size + positions % block_size
    slot_mapping.copy_(torch.where(slot_mapping >= 0, moved, slot_mapping))


def advance_round(
    meta: Tensor,
    hist_len: Tensor,
    positions: Tensor,
    slot_mapping: Tensor,
    seq_lens: Tensor,
    input_ids: Tensor | None,
    block_tables: Tensor,
    token_seq: Tensor,
    first_token: Tensor,
    block_size: int,
    scratch_row: int,
) -> Tensor:
    """After a round's commit, the step's inputs for its next round, in place (module
    docstring). meta: the step's len(seq_lens) sequences' rows (a graph's padding rows sit out);
    token_seq: each token's sequence; first_token: each sequence's first token. Returns each
    token's move, for the sample positions (per token in a graph, per sample row eagerly). Torch
    ops on fixed shapes only, so that a graph can capture it."""
    n = seq_lens.shape[0]
    m = meta[:n]
    goes_on = (m[:, ROUNDS] > 1) & (m[:, DRAFTS] >= 0)
    row = m[:, ROW].clamp(min=0)
    start = hist_len[row] - 1  # its last emitted token's position: the next round's first input
    delta = torch.where(goes_on, start - positions[first_token], torch.zeros_like(start))
    moves = delta[token_seq]
    positions += moves
    seq_lens += delta.to(seq_lens.dtype)
    width = block_tables.shape[1]
    blocks = block_tables[token_seq, (positions // block_size).clamp(0, width - 1)].to(torch.int64)
    moved = blocks * block_size + positions % block_size
    writes = goes_on[token_seq] & (slot_mapping >= 0)  # (a padded verification's pads write nothing)
    slot_mapping.copy_(torch.where(writes, moved, torch.full_like(slot_mapping, -1)))
    if input_ids is not None:  # the token it emitted last, on the device
        input_ids[first_token] = torch.where(goes_on, torch.full_like(start, -1), input_ids[first_token])
    m[:, POS] = torch.where(goes_on, start + 1, m[:, POS])
    m[:, KNOWN] = -1  # exact from here on (and no shift of those sitting out)
    m[:, ROW] = torch.where(goes_on, m[:, ROW], torch.full_like(start, scratch_row))
    m[:, DRAFTS] = torch.where(goes_on, m[:, DRAFTS], torch.full_like(start, -1))
    m[:, PROPOSE] = torch.where(goes_on, m[:, PROPOSE], torch.zeros_like(start))
    m[:, ROUNDS] = (m[:, ROUNDS] - 1).clamp(min=0)
    return moves


if triton is not None:
    # Step-dependent counts are not specialised on (1 and multiples of 16 would each compile a
    # variant mid-serving).
    @triton.jit(do_not_specialize=["num_draws"])
    def _commit_kernel(
        draws_ptr,
        num_draws,
        meta_ptr,
        meta_stride,
        rejected_ptr,
        num_valid_ptr,
        area_ptr,
        draft_base,
        last_sampled_ptr,
        history_ptr,
        hist_stride,
        hist_width,
        hist_len_ptr,
        packed_ptr,
        packed_stride,
        enabled_ptr,
        FIRST_COL: tl.constexpr,
        MAX_K: tl.constexpr,
        BLOCK: tl.constexpr,
        GATED: tl.constexpr,
    ):
        # Columns as ROW .. HOST above.
        i = tl.program_id(0)
        m = meta_ptr + i * meta_stride
        d = tl.load(m + 3)
        active = d >= 0  # the sequence samples this step (else it is left alone)
        if GATED:  # a graph's commit, which this step's draws may not feed (enabled[0] = 0)
            active = active & (tl.load(enabled_ptr) > 0)
        d = tl.maximum(d, 0)
        row = tl.load(m + 0)
        first = tl.load(m + FIRST_COL)
        pos = tl.load(m + 4)
        known = tl.load(m + 5)
        device = tl.load(m + 6)
        total = tl.load(rejected_ptr + row)
        shift = tl.where(known >= 0, total - known, 0)
        pos = pos - shift
        valid = tl.where(device == 1, tl.minimum(tl.load(num_valid_ptr + row).to(tl.int64), d), d)  # (LOOKUP_DRAFTS)
        j = tl.arange(0, BLOCK).to(tl.int64)
        in_k = j < MAX_K
        device_draft = tl.load(area_ptr + draft_base + row * MAX_K + j, mask=in_k & (device > 0), other=-1)
        host_draft = tl.load(m + 8 + j, mask=in_k & (device == 0), other=-1)
        draft = tl.where(device > 0, device_draft, host_draft)
        last_draw = num_draws - 1
        drawn = tl.load(draws_ptr + tl.minimum(tl.maximum(first + j, 0), last_draw), mask=j <= MAX_K, other=-2)
        match = (j < valid) & (drawn == draft)
        accepted = tl.min(tl.where(match, BLOCK, j), axis=0)  # the first mismatch (at valid at most)
        last = tl.load(draws_ptr + tl.minimum(tl.maximum(first + accepted, 0), last_draw))
        tl.store(last_sampled_ptr + row, last, mask=active)
        tl.store(rejected_ptr + row, total + d - accepted, mask=active)
        at = tl.minimum(tl.maximum(pos + j, 0), hist_width - 1)
        tl.store(history_ptr + row * hist_stride + at, drawn.to(tl.int32), mask=active & (j <= accepted))
        tl.store(hist_len_ptr + row, pos + accepted + 1, mask=active)
        tl.store(packed_ptr + i * packed_stride, accepted + 1, mask=active)

    @triton.jit(do_not_specialize=["num_tokens", "num_seqs"])
    def _shift_positions_kernel(
        meta_ptr,
        meta_stride,
        rejected_ptr,
        positions_ptr,
        sample_positions_ptr,
        slot_mapping_ptr,
        seq_lens_ptr,
        block_tables_ptr,
        table_stride,
        num_tokens,
        num_seqs,
        QUERY_LEN: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = t < num_tokens
        s = t // QUERY_LEN
        known = tl.load(meta_ptr + s * meta_stride + 5, mask=mask, other=-1)
        row = tl.load(meta_ptr + s * meta_stride + 0, mask=mask, other=0)
        total = tl.load(rejected_ptr + tl.maximum(row, 0), mask=mask, other=0)
        shift = tl.where(known >= 0, total - known, 0)
        pos = tl.maximum(tl.load(positions_ptr + t, mask=mask, other=0) - shift, 0)  # (>= 0 unless a bug)
        tl.store(positions_ptr + t, pos, mask=mask)
        spos = tl.load(sample_positions_ptr + t, mask=mask, other=0)
        tl.store(sample_positions_ptr + t, spos - shift, mask=mask)
        slot = tl.load(slot_mapping_ptr + t, mask=mask, other=-1)
        block = tl.load(block_tables_ptr + s * table_stride + tl.maximum(pos, 0) // BLOCK_SIZE, mask=mask, other=0)
        moved = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        tl.store(slot_mapping_ptr + t, tl.where(slot >= 0, moved, slot), mask=mask)
        # Each sequence's length, once (program 0's first num_seqs lanes; num_seqs <= BLOCK).
        first_program = tl.program_id(0) == 0
        seq = tl.arange(0, BLOCK)
        smask = (seq < num_seqs) & first_program
        sknown = tl.load(meta_ptr + seq * meta_stride + 5, mask=smask, other=-1)
        srow = tl.load(meta_ptr + seq * meta_stride + 0, mask=smask, other=0)
        stotal = tl.load(rejected_ptr + tl.maximum(srow, 0), mask=smask, other=0)
        sshift = tl.where(sknown >= 0, stotal - sknown, 0)
        length = tl.load(seq_lens_ptr + seq, mask=smask, other=0)
        tl.store(seq_lens_ptr + seq, (length - sshift).to(length.dtype), mask=smask)


def commit(
    draws: Tensor,
    meta: Tensor,
    rejected: Tensor,
    num_valid: Tensor,
    draft_area: Tensor,
    draft_base: int,
    last_sampled: Tensor,
    history: Tensor,
    hist_len: Tensor,
    packed: Tensor,
    max_k: int,
    first_col: int = FIRST_ROW,
    use_triton: bool | None = None,
    enabled: Tensor | None = None,
) -> None:
    """Verifies and commits each sequence of `meta` (see the module docstring); packed[i, 0]:
    the tokens sequence i emits. enabled: a device scalar that, when 0, makes the call do
    nothing (a verification graph's commit, captured once, on a step whose draws it must not
    take); None: always on."""
    if use_triton is None:
        use_triton = triton is not None and draws.is_cuda
    args = (draws, meta, rejected, num_valid, draft_area, draft_base, last_sampled, history, hist_len, packed)
    if not use_triton:
        commit_reference(*args, max_k, first_col, enabled)
        return
    n = meta.shape[0]
    if n == 0:
        return
    _commit_kernel[(n,)](
        draws,
        draws.shape[0],
        meta,
        meta.stride(0),
        rejected,
        num_valid,
        draft_area,
        draft_base,
        last_sampled,
        history,
        history.stride(0),
        history.shape[1],
        hist_len,
        packed,
        packed.stride(0),
        meta if enabled is None else enabled,
        FIRST_COL=first_col,
        MAX_K=max_k,
        BLOCK=triton.next_power_of_2(max_k + 1),
        GATED=enabled is not None,
        num_warps=1,
    )


def shift_positions_in_graph(
    meta: Tensor,
    rejected: Tensor,
    positions: Tensor,
    sample_positions: Tensor,
    slot_mapping: Tensor,
    seq_lens: Tensor,
    block_tables: Tensor,
    query_len: int,
    block_size: int,
    use_triton: bool | None = None,
) -> None:
    """shift_positions for a graph's static buffers: len(positions) tokens, query_len per
    sequence, len(seq_lens) sequences (their meta rows, padding with KNOWN = -1)."""
    num_tokens, num_seqs = positions.shape[0], seq_lens.shape[0]
    if use_triton is None:
        use_triton = triton is not None and positions.is_cuda
    if not use_triton:
        token_seq = torch.arange(num_tokens, device=positions.device) // query_len
        shift_positions_reference(
            meta[:num_seqs],
            rejected,
            positions,
            sample_positions,
            slot_mapping,
            seq_lens,
            block_tables,
            token_seq,
            block_size,
        )
        return
    block = max(256, triton.next_power_of_2(num_seqs))
    _shift_positions_kernel[(triton.cdiv(num_tokens, block),)](
        meta,
        meta.stride(0),
        rejected,
        positions,
        sample_positions,
        slot_mapping,
        seq_lens,
        block_tables,
        block_tables.stride(0),
        num_tokens,
        num_seqs,
        QUERY_LEN=query_len,
        BLOCK_SIZE=block_size,
        BLOCK=block,
        num_warps=4,
    )
