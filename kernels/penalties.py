"""Sparse penalties and logit bias: presence, frequency and repetition penalties and logit bias
applied at the tokens a row has seen (or biases), O(context) per row instead of O(vocab).

Each penalised row r reads its sequence's tokens by position, history[slot, 0 : P) (P: the
position it samples: prompt, output and the drafts before it), and its biased tokens. At each such
token t it writes

    y = src[r, t] + bias[slot, t]
    y = y / rep if y > 0 else y * rep          where t is seen (in the prompt or counted)
    y = y - freq * c - pres * (c > 0)          c = counts[slot, t] + drafts before the row equal to t

into dst[r, t] (dst: the float32 copy of src the sampler draws from). Every other token keeps its
value: the same arithmetic there is the identity. A token seen several times is written several
times with the same value (each write reads src, never dst), so no deduplication is needed. The
operations are those of the dense torch formula (penalties.py before), in the same order, with
the Triton kernel compiled without FMA contraction and with IEEE division: the values, hence the
tokens, are bit-identical.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def penalty_values(x, bias, counts, seen, rep, freq, pres):
    """The dense formula on float32 tensors (broadcasting): the oracle of both paths."""
    y = x + bias
    seen = seen | (counts > 0)
    y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
    c = counts.to(y.dtype)
    return y - freq * c - pres * (c > 0).to(y.dtype)


def apply_penalties_reference(
    src, dst, rows, slots, sample_pos, history, counts, seen, bias, bias_tok, drafts, n_drafts, rep, freq, pres, *_
) -> None:
    """Torch reference of apply_penalties (same arguments)."""
    n = rows.shape[0]
    if n == 0:
        return
    width = int(sample_pos.max().item()) if sample_pos.numel() else 0
    pos = torch.arange(width, device=src.device)
    hist = history[slots][:, :width].to(torch.int64)
    valid = pos.unsqueeze(0) < sample_pos.unsqueeze(1)
    toks = torch.cat([torch.where(valid, hist, -1), bias_tok], dim=1)  # -1: padding
    keep = toks >= 0
    r_idx = torch.arange(n, device=src.device).unsqueeze(1).expand_as(toks)[keep]
    t = toks[keep]
    s = slots[r_idx]
    c = counts[s, t]
    if drafts.shape[1]:
        k = torch.arange(drafts.shape[1], device=src.device)
        before = (drafts[r_idx] == t.unsqueeze(1)) & (k.unsqueeze(0) < n_drafts[r_idx].unsqueeze(1))
        c = c + before.sum(dim=1).to(c.dtype)
    b = bias[s, t] if bias is not None else torch.zeros_like(t, dtype=torch.float32)
    y = penalty_values(src[rows[r_idx], t].float(), b, c, seen[s, t].bool(), rep[r_idx], freq[r_idx], pres[r_idx])
    dst[rows[r_idx], t] = y


if triton is not None:

    @triton.jit
    def _penalties_kernel(
        src_ptr,
        src_stride,
        dst_ptr,
        dst_stride,
        rows_ptr,
        slots_ptr,
        sample_pos_ptr,
        history_ptr,
        history_stride,
        counts_ptr,
        seen_ptr,
        table_stride,
        bias_ptr,
        bias_tok_ptr,
        bias_width,
        drafts_ptr,
        n_drafts_ptr,
        rep_ptr,
        freq_ptr,
        pres_ptr,
        HAS_BIAS: tl.constexpr,
        MAX_DRAFTS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0)  # program (i, j): block j of penalised row i's candidates
        row = tl.load(rows_ptr + i)
        slot = tl.load(slots_ptr + i)
        num_hist = tl.load(sample_pos_ptr + i)
        rep = tl.load(rep_ptr + i)
        freq = tl.load(freq_ptr + i)
        pres = tl.load(pres_ptr + i)
        n_drafts = tl.load(n_drafts_ptr + i)
        offs = tl.arange(0, BLOCK)
        table = slot * table_stride
        # Candidates: the history's positions, then the biased tokens (padding -1).
        total = num_hist + bias_width
        p = tl.program_id(1) * BLOCK + offs
        from_hist = p < num_hist
        from_bias = (p >= num_hist) & (p < total)
        t_hist = tl.load(history_ptr + slot * history_stride + p, mask=from_hist, other=-1).to(tl.int64)
        t_bias = tl.load(bias_tok_ptr + i * bias_width + (p - num_hist), mask=from_bias, other=-1)
        t = tl.where(from_hist, t_hist, t_bias)
        ok = t >= 0
        t = tl.where(ok, t, 0)
        x = tl.load(src_ptr + row * src_stride + t, mask=ok, other=0.0).to(tl.float32)
        c = tl.load(counts_ptr + table + t, mask=ok, other=0)
        for k in tl.static_range(MAX_DRAFTS):
            d = tl.load(drafts_ptr + i * MAX_DRAFTS + k)
            c += ((d == t) & (k < n_drafts)).to(c.dtype)
        seen = (tl.load(seen_ptr + table + t, mask=ok, other=0) != 0) | (c > 0)
        y = x
        if HAS_BIAS:
            y = x + tl.load(bias_ptr + table + t, mask=ok, other=0.0)
        y = tl.where(seen, tl.where(y > 0, tl.math.div_rn(y, rep), y * rep), y)
        cf = c.to(tl.float32)
        y = y - freq * cf - pres * (c > 0).to(tl.float32)
        tl.store(dst_ptr + row * dst_stride + t, y, mask=ok)


def apply_penalties(
    src: Tensor,
    dst: Tensor,
    rows: Tensor,
    slots: Tensor,
    sample_pos: Tensor,
    history: Tensor,
    counts: Tensor,
    seen: Tensor,
    bias: Tensor | None,
    bias_tok: Tensor,
    drafts: Tensor,
    n_drafts: Tensor,
    rep: Tensor,
    freq: Tensor,
    pres: Tensor,
    max_candidates: int,
    block: int = 256,
) -> None:
    """Writes the penalised values of rows[i] (logits row) of sequence slots[i] into dst, at the
    tokens of history[slot, :sample_pos[i]] and bias_tok[i] (-1 padded); drafts[i, :n_drafts[i]]
    count as output tokens too. One launch, one program per row; nothing reads back to the host.
    src: the logits (any float dtype), dst: float32 [R, V]; counts int32 and seen bool/uint8
    [slots, V]; bias float32 [slots, V] or None; rep/freq/pres float32 [n]; max_candidates: a host
    bound on sample_pos[i] + bias_tok.shape[1] (the grid's second axis)."""
    n = rows.shape[0]
    if n == 0:
        return
    _penalties_kernel[(n, triton.cdiv(max(max_candidates, 1), block))](
        src,
        src.stride(0),
        dst,
        dst.stride(0),
        rows,
        slots,
        sample_pos,
        history,
        history.stride(0),
        counts,
        seen.view(torch.uint8),
        counts.stride(0),
        bias if bias is not None else rep,
        bias_tok.contiguous(),
        bias_tok.shape[1],
        drafts.contiguous(),
        n_drafts,
        rep,
        freq,
        pres,
        HAS_BIAS=bias is not None,
        MAX_DRAFTS=drafts.shape[1],
        BLOCK=block,
        enable_fp_fusion=False,  # y - freq * c rounds the product first, as the torch formula does
    )
