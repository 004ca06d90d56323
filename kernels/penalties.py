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

Two ways out: `apply_penalties` writes the values into a float32 copy of the logits (the general
path, where filters or logprobs need every value), `penalty_patches` leaves them as a sparse patch
(tokens, float32 values) per row and writes -inf at those tokens of the logits themselves, for the
controlled draw (kernels/controlled_sampling.py), which draws from the logits and the patch in one
pass: no float32 copy of [rows, V].
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover
    triton = None


def kernels_run_on(t: Tensor) -> bool:
    """Whether this module's Triton kernels run on t's device: CUDA, or the CPU interpreter."""
    return triton is not None and (t.is_cuda or isinstance(_penalties_kernel, InterpretedFunction))


def penalty_values(x, bias, counts, seen, rep, freq, pres):
    """The dense formula on float32 tensors (broadcasting): the oracle of both paths."""
    y = x + bias
    seen = seen | (counts > 0)
    y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
    c = counts.to(y.dtype)
    return y - freq * c - pres * (c > 0).to(y.dtype)


def _candidates_reference(
    src, rows, slots, sample_pos, history, counts, seen, bias, bias_tok, drafts, n_drafts, rep, freq, pres
):
    """(row index i, position among the row's candidates, token, penalised value) of every
    candidate: the history before sample_pos[i], then bias_tok[i] (-1 padding skipped)."""
    width = int(sample_pos.max().item()) if sample_pos.numel() else 0
    pos = torch.arange(width, device=src.device)
    hist = history[slots][:, :width].to(torch.int64)
    valid = pos.unsqueeze(0) < sample_pos.unsqueeze(1)
    toks = torch.cat([torch.where(valid, hist, -1), bias_tok], dim=1)  # -1: padding
    keep = toks >= 0
    r_idx = torch.arange(rows.shape[0], device=src.device).unsqueeze(1).expand_as(toks)[keep]
    t = toks[keep]
    s = slots[r_idx]
    c = counts[s, t]
    if drafts.shape[1]:
        k = torch.arange(drafts.shape[1], device=src.device)
        before = (drafts[r_idx] == t.unsqueeze(1)) & (k.unsqueeze(0) < n_drafts[r_idx].unsqueeze(1))
        c = c + before.sum(dim=1).to(c.dtype)
    b = bias[s, t] if bias is not None else torch.zeros_like(t, dtype=torch.float32)
    y = penalty_values(src[rows[r_idx], t].float(), b, c, seen[s, t].bool(), rep[r_idx], freq[r_idx], pres[r_idx])
    # A row's biased tokens follow its own history: position sample_pos[i] + j (the kernels' layout).
    col = torch.arange(toks.shape[1], device=src.device).unsqueeze(0)
    p_idx = torch.where(col < width, col, sample_pos.unsqueeze(1) + (col - width)).expand_as(toks)[keep]
    return r_idx, p_idx, t, y


def apply_penalties_reference(
    src, dst, rows, slots, sample_pos, history, counts, seen, bias, bias_tok, drafts, n_drafts, rep, freq, pres, *_
) -> None:
    """Torch reference of apply_penalties (same arguments)."""
    if rows.shape[0] == 0:
        return
    r_idx, _, t, y = _candidates_reference(
        src, rows, slots, sample_pos, history, counts, seen, bias, bias_tok, drafts, n_drafts, rep, freq, pres
    )
    dst[rows[r_idx], t] = y


def penalty_patches_reference(
    src, rows, slots, sample_pos, history, counts, seen, bias, bias_tok, drafts, n_drafts, rep, freq, pres, width
) -> tuple[Tensor, Tensor]:
    """Torch reference of penalty_patches (same arguments and results)."""
    n = rows.shape[0]
    patch_tok = torch.full((n, width), -1, dtype=torch.int32, device=src.device)
    patch_val = torch.zeros((n, width), dtype=torch.float32, device=src.device)
    if n == 0:
        return patch_tok, patch_val
    r_idx, p_idx, t, y = _candidates_reference(
        src, rows, slots, sample_pos, history, counts, seen, bias, bias_tok, drafts, n_drafts, rep, freq, pres
    )
    patch_tok[r_idx, p_idx] = t.to(torch.int32)
    patch_val[r_idx, p_idx] = y
    src[rows[r_idx], t] = float("-inf")
    return patch_tok, patch_val


if triton is not None:

    @triton.jit
    def _penalised_tl(
        x,
        t,
        ok,
        slot,
        table,
        counts_ptr,
        seen_ptr,
        bias_ptr,
        has_bias,
        drafts_ptr,
        n_drafts,
        max_drafts,
        rep,
        freq,
        pres,
    ):
        """The penalised value at candidate tokens t (lanes where ok) of penalised row i, from
        its logits x: the dense formula's operations in its order (see the module docstring)."""
        c = tl.load(counts_ptr + table + t, mask=ok, other=0)
        k = 0
        while k < n_drafts:  # the drafts before a verify row count as output tokens
            d = tl.load(drafts_ptr + k)
            c += (d == t).to(c.dtype)
            k += 1
        seen = (tl.load(seen_ptr + table + t, mask=ok, other=0) != 0) | (c > 0)
        y = x + tl.load(bias_ptr + table + t, mask=ok & (has_bias != 0), other=0.0)
        y = tl.where(seen, tl.where(y > 0, tl.math.div_rn(y, rep), y * rep), y)
        cf = c.to(tl.float32)
        return y - freq * cf - pres * (c > 0).to(tl.float32)

    @triton.jit
    def _candidate_tokens(history_ptr, history_stride, slot, num_hist, bias_tok_ptr, bias_width, i, p):
        """Row i's candidates at positions p: its history before num_hist, then its biased tokens
        (-1: padding or past the end)."""
        from_hist = p < num_hist
        from_bias = (p >= num_hist) & (p < num_hist + bias_width)
        t_hist = tl.load(history_ptr + slot * history_stride + p, mask=from_hist, other=-1).to(tl.int64)
        t_bias = tl.load(bias_tok_ptr + i * bias_width + (p - num_hist), mask=from_bias, other=-1)
        return tl.where(from_hist, t_hist, t_bias)

    # Every runtime int is left unspecialised: one compiled variant whatever the model's strides,
    # the bias width or the draft count (the worker's warm-up compiles it, kernels never compile mid-serving).
    _INTS = ["src_stride", "history_stride", "table_stride", "has_bias", "bias_width", "max_drafts"]

    @triton.jit(do_not_specialize=[*_INTS, "dst_stride"])
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
        has_bias,
        bias_tok_ptr,
        bias_width,
        drafts_ptr,
        n_drafts_ptr,
        max_drafts,
        rep_ptr,
        freq_ptr,
        pres_ptr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0)  # program (i, j): block j of penalised row i's candidates
        row = tl.load(rows_ptr + i)
        slot = tl.load(slots_ptr + i)
        num_hist = tl.load(sample_pos_ptr + i)
        p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        t = _candidate_tokens(history_ptr, history_stride, slot, num_hist, bias_tok_ptr, bias_width, i, p)
        ok = t >= 0
        t = tl.where(ok, t, 0)
        x = tl.load(src_ptr + row * src_stride + t, mask=ok, other=0.0).to(tl.float32)
        y = _penalised_tl(
            x,
            t,
            ok,
            slot,
            slot * table_stride,
            counts_ptr,
            seen_ptr,
            bias_ptr,
            has_bias,
            drafts_ptr + i * max_drafts,
            tl.load(n_drafts_ptr + i),
            max_drafts,
            tl.load(rep_ptr + i),
            tl.load(freq_ptr + i),
            tl.load(pres_ptr + i),
        )
        tl.store(dst_ptr + row * dst_stride + t, y, mask=ok)

    @triton.jit(do_not_specialize=[*_INTS, "width"])
    def _penalty_patches_kernel(
        src_ptr,
        src_stride,
        rows_ptr,
        slots_ptr,
        sample_pos_ptr,
        history_ptr,
        history_stride,
        counts_ptr,
        seen_ptr,
        table_stride,
        bias_ptr,
        has_bias,
        bias_tok_ptr,
        bias_width,
        drafts_ptr,
        n_drafts_ptr,
        max_drafts,
        rep_ptr,
        freq_ptr,
        pres_ptr,
        patch_tok_ptr,
        patch_val_ptr,
        width,
        BLOCK: tl.constexpr,
    ):
        # One program per row: every candidate's value is read from src before any of them is
        # overwritten with -inf (a token seen twice is two candidates).
        i = tl.program_id(0)
        row = tl.load(rows_ptr + i)
        slot = tl.load(slots_ptr + i)
        num_hist = tl.load(sample_pos_ptr + i)
        n_drafts = tl.load(n_drafts_ptr + i)
        rep = tl.load(rep_ptr + i)
        freq = tl.load(freq_ptr + i)
        pres = tl.load(pres_ptr + i)
        src_row = src_ptr + row.to(tl.int64) * src_stride
        # (while loops: the interpreter, triton 3.6 + numpy 2.x, cannot take tensor bounds in range())
        start = 0
        while start < width:
            p = start + tl.arange(0, BLOCK)
            t = _candidate_tokens(history_ptr, history_stride, slot, num_hist, bias_tok_ptr, bias_width, i, p)
            ok = t >= 0
            t = tl.where(ok, t, 0)
            x = tl.load(src_row + t, mask=ok, other=0.0).to(tl.float32)
            y = _penalised_tl(
                x,
                t,
                ok,
                slot,
                slot * table_stride,
                counts_ptr,
                seen_ptr,
                bias_ptr,
                has_bias,
                drafts_ptr + i * max_drafts,
                n_drafts,
                max_drafts,
                rep,
                freq,
                pres,
            )
            inside = p < width
            tl.store(patch_tok_ptr + i * width + p, tl.where(ok, t, -1).to(tl.int32), mask=inside)
            tl.store(patch_val_ptr + i * width + p, y, mask=inside)
            start += BLOCK
        tl.debug_barrier()
        start = 0
        while start < width:  # (candidates past num_hist + bias_width are -1)
            p = start + tl.arange(0, BLOCK)
            t = _candidate_tokens(history_ptr, history_stride, slot, num_hist, bias_tok_ptr, bias_width, i, p)
            ok = t >= 0
            tl.store(
                src_row + tl.where(ok, t, 0),
                tl.full((BLOCK,), float("-inf"), tl.float32).to(src_ptr.dtype.element_ty),
                mask=ok,
            )
            start += BLOCK


def _common_args(history, counts, seen, bias, bias_tok, drafts, n_drafts, rep, freq, pres):
    return (
        history,
        history.stride(0),
        counts,
        seen.view(torch.uint8),
        counts.stride(0),
        bias if bias is not None else rep,
        int(bias is not None),
        bias_tok.contiguous(),
        bias_tok.shape[1],
        drafts.contiguous(),
        n_drafts,
        drafts.shape[1],
        rep,
        freq,
        pres,
    )


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
    bound on sample_pos[i] + bias_tok.shape[1] (the grid's second axis). Whether there is a bias,
    the bias width and the draft count are runtime values: one compiled variant serves them all."""
    n = rows.shape[0]
    if n == 0:
        return
    common = _common_args(history, counts, seen, bias, bias_tok, drafts, n_drafts, rep, freq, pres)
    _penalties_kernel[(n, triton.cdiv(max(max_candidates, 1), block))](
        src,
        src.stride(0),
        dst,
        dst.stride(0),
        rows,
        slots,
        sample_pos,
        *common,
        BLOCK=block,
        enable_fp_fusion=False,  # y - freq * c rounds the product first, as the torch formula does
    )


def penalty_patches(
    src: Tensor,
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
    width: int,
    block: int = 256,
) -> tuple[Tensor, Tensor]:
    """The penalised values as a patch, without a float32 copy of the logits: returns
    (patch_tok int32 [n, width], -1 padded; patch_val float32 [n, width]), row i's candidates in
    order (the values apply_penalties writes, at the same tokens), and sets src[rows[i], t] = -inf
    at each candidate t, so a draw over src and the patch sees every token once. width: a host
    bound on sample_pos[i] + bias_tok.shape[1]. One launch, one program per row."""
    n = rows.shape[0]
    patch_tok = torch.empty((n, width), dtype=torch.int32, device=src.device)
    patch_val = torch.empty((n, width), dtype=torch.float32, device=src.device)
    if n == 0:
        return patch_tok, patch_val
    if src.stride(-1) != 1:
        raise ValueError("penalty_patches writes the logits in place: they must be contiguous by row")
    common = _common_args(history, counts, seen, bias, bias_tok, drafts, n_drafts, rep, freq, pres)
    _penalty_patches_kernel[(n,)](
        src,
        src.stride(0),
        rows,
        slots,
        sample_pos,
        *common,
        patch_tok,
        patch_val,
        width,
        BLOCK=block,
        enable_fp_fusion=False,
    )
    return patch_tok, patch_val
