"""Prompt lookup (n-gram) proposals over a whole batch, on the device where the tokens are.

Each proposing sequence has its tokens by position in a row of `history` (int32 [rows, L]), the
first `hist_len[row]` of them valid. Its proposal: the longest suffix of n tokens (ngram_max down
to ngram_min) that also occurs earlier; at its latest earlier occurrence that k tokens follow (or,
if none does, its latest), the up to k tokens that followed it. Computed per row as

    m(p) = consecutive matches of the row's suffix ending at position p (at most ngram_max)
    full(p) = at least k tokens follow p (p + k <= L - 1)
    best = max over p <= L - 2 of (m(p), full(p), p) where m(p) >= ngram_min
    drafts = history[best.p + 1 : best.p + 1 + k]

The scheduler's `ngram_proposer.propose_from` takes the latest occurrence whatever follows it;
the two differ only where that one is too close to the end, as in a loop of a few tokens
("a b a b a b": the latest "a b" is followed by one token, the one before it by k).

so a row is one pass over its positions (a block of positions at a time, ngram_max loads each),
never a loop over candidate n-grams. One Triton program per sequence; the torch reference does
the same arithmetic vectorised over the rows (CPU, and the oracle of the kernel).

Outputs: the drafts go to `out[out_base + row * max_k + j]` (0 past the count: an input id must be
a token), the count to `num_valid[row]`, and, per sequence i, `packed[i, 1]` the count and
`packed[i, 2 : 2 + max_k]` the drafts (what the step's result returns).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs run the reference
    triton = None

_KEY = 1 << 33  # (match length, k tokens follow, position) packed into one int64, in that order
_FULL = 1 << 32


def ngram_propose_reference(
    history: Tensor,
    hist_len: Tensor,
    rows: Tensor,
    num: Tensor,
    out: Tensor,
    out_base: int,
    num_valid: Tensor,
    packed: Tensor,
    ngram_min: int,
    ngram_max: int,
    max_k: int,
    enabled: Tensor | None = None,
) -> None:
    """Torch reference of ngram_propose (same arguments)."""
    if enabled is not None and int(enabled.reshape(-1)[0]) <= 0:
        return
    n = rows.shape[0]
    if n == 0:
        return
    rows = rows.long()
    length = hist_len[rows].long()  # [n]
    width = max(int(length.max().item()), 1)
    hist = history[rows, :width].long()  # [n, width]
    p = torch.arange(width, device=history.device)
    alive = p.unsqueeze(0) <= (length - 2).unsqueeze(1)
    m = torch.zeros(n, width, dtype=torch.int64, device=history.device)
    for j in range(ngram_max):
        suffix_at = length - 1 - j  # [n]
        q = p - j
        ok = alive & (q >= 0).unsqueeze(0) & (suffix_at >= 0).unsqueeze(1)
        token = hist.gather(1, q.clamp(min=0).unsqueeze(0).expand(n, -1))
        suffix = hist.gather(1, suffix_at.clamp(min=0).unsqueeze(1))
        alive = ok & (token == suffix)
        m += alive.to(torch.int64)
    k = num.long()
    full = (p.unsqueeze(0) + k.unsqueeze(1) <= (length - 1).unsqueeze(1)).to(torch.int64)
    key = torch.where(m >= ngram_min, m * _KEY + full * _FULL + p.unsqueeze(0), torch.full_like(m, -1))
    best = key.max(dim=1).values
    start = best % _FULL + 1
    count = torch.where(best >= 0, torch.minimum(k, length - start), torch.zeros_like(k)).clamp(min=0)
    j = torch.arange(max_k, device=history.device)
    index = (start.unsqueeze(1) + j).clamp(max=width - 1)
    drafts = torch.where(j.unsqueeze(0) < count.unsqueeze(1), hist.gather(1, index), torch.zeros_like(index))
    out[out_base + rows.unsqueeze(1) * max_k + j] = drafts.to(out.dtype)
    num_valid[rows] = count.to(num_valid.dtype)
    packed[:n, 1] = count
    packed[:n, 2 : 2 + max_k] = drafts


if triton is not None:

    @triton.jit
    def _ngram_propose_kernel(
        history_ptr,
        hist_stride,
        hist_len_ptr,
        rows_ptr,
        rows_stride,
        num_ptr,
        num_stride,
        out_ptr,
        out_base,
        num_valid_ptr,
        packed_ptr,
        packed_stride,
        enabled_ptr,
        NGRAM_MIN: tl.constexpr,
        NGRAM_MAX: tl.constexpr,
        MAX_K: tl.constexpr,
        K_BLOCK: tl.constexpr,
        BLOCK: tl.constexpr,
        GATED: tl.constexpr,
    ):
        i = tl.program_id(0)
        gate = tl.full((), 1, tl.int64)
        if GATED:  # a graph's proposal, off on steps that propose nothing (enabled[0] = 0)
            gate = tl.load(enabled_ptr).to(tl.int64)
        on = gate > 0
        row = tl.load(rows_ptr + i * rows_stride).to(tl.int64)
        k = tl.where(on, tl.load(num_ptr + i * num_stride).to(tl.int64), 0)
        length = tl.load(hist_len_ptr + row).to(tl.int64)
        base = history_ptr + row * hist_stride
        offs = tl.arange(0, BLOCK).to(tl.int64)
        best = tl.full([BLOCK], -1, tl.int64)
        if k > 0:
            start = 0
            while start < length - 1:  # candidate end positions p <= length - 2 (a while: the
                p = start + offs  # interpreter takes no tensor bounds in range())
                alive = p <= length - 2
                m = tl.zeros([BLOCK], tl.int64)
                for j in tl.static_range(NGRAM_MAX):
                    suffix_at = length - 1 - j
                    suffix = tl.load(base + tl.maximum(suffix_at, 0))
                    q = p - j
                    ok = alive & (q >= 0) & (suffix_at >= 0)
                    token = tl.load(base + q, mask=ok, other=-1)
                    alive = ok & (token == suffix)
                    m += alive.to(tl.int64)
                full = (p + k <= length - 1).to(tl.int64)
                key = m * 8589934592 + full * 4294967296 + p
                best = tl.maximum(best, tl.where(m >= NGRAM_MIN, key, -1))
                start += BLOCK
        top = tl.max(best, axis=0)
        first = top % 4294967296 + 1  # (top >= 0: the position bits)
        count = tl.where(top >= 0, tl.minimum(k, length - first), 0)
        count = tl.maximum(count, 0)
        j = tl.arange(0, K_BLOCK).to(tl.int64)
        in_k = j < MAX_K
        drafts = tl.load(base + first + j, mask=j < count, other=0).to(tl.int64)
        tl.store(out_ptr + out_base + row * MAX_K + j, drafts, mask=in_k & on)
        tl.store(num_valid_ptr + row, count.to(tl.int32), mask=on)
        tl.store(packed_ptr + i * packed_stride + 1, count, mask=on)
        tl.store(packed_ptr + i * packed_stride + 2 + j, drafts, mask=in_k & on)


def ngram_propose(
    history: Tensor,
    hist_len: Tensor,
    rows: Tensor,
    num: Tensor,
    out: Tensor,
    out_base: int,
    num_valid: Tensor,
    packed: Tensor,
    ngram_min: int,
    ngram_max: int,
    max_k: int,
    use_triton: bool | None = None,
    enabled: Tensor | None = None,
) -> None:
    """Proposes up to num[i] (<= max_k) drafts for each sequence i at state row rows[i] (1-D,
    any stride); see the module docstring for where they go. use_triton None: on CUDA tensors
    when Triton is there. enabled: a device scalar that, when 0, makes the call do nothing (a
    verification graph's proposal on a step that proposes nothing); None: always on."""
    if use_triton is None:
        use_triton = triton is not None and history.is_cuda
    if not use_triton:
        ngram_propose_reference(
            history, hist_len, rows, num, out, out_base, num_valid, packed, ngram_min, ngram_max, max_k, enabled
        )
        return
    n = rows.shape[0]
    if n == 0:
        return
    _ngram_propose_kernel[(n,)](
        history,
        history.stride(0),
        hist_len,
        rows,
        rows.stride(0),
        num,
        num.stride(0),
        out,
        out_base,
        num_valid,
        packed,
        packed.stride(0),
        history if enabled is None else enabled,
        NGRAM_MIN=ngram_min,
        NGRAM_MAX=ngram_max,
        MAX_K=max_k,
        K_BLOCK=triton.next_power_of_2(max_k),
        BLOCK=1024,
        GATED=enabled is not None,
        num_warps=4,
    )
