"""Penalties and biases on the last stage, beside the sampler: presence, frequency and repetition
penalties, logit bias, bad words and allowed tokens, with vLLM's semantics.

State lives on the device, one *slot* per penalised sequence (rows without penalties have none
and pay nothing; a step without penalised rows does no work here):

- counts [slots, V] int32: how often each token occurs in the sequence's output so far;
- prompt_seen [slots, V] bool: the prompt's tokens (repetition penalty only);
- history [slots, max_model_len] int32: the sequence's tokens by position, for bad words of
  several tokens (only allocated once such a word is used).

They are updated from each step's *input* tokens, by scatter-add (never a loop over tokens):
every token of a sequence is an input of some step before it is sampled from, so the counts a
sample row reads cover exactly the tokens before its position. Tokens the worker never sees as
input (cached prefix blocks, output recomputed after a preemption) come with the admission
(NewSequence.history_token_ids). Decode lookahead's placeholders are resolved on the device from
the tokens last sampled.

Speculation: the drafts of a verifying sequence are not counted at input; verify row j (which
samples the position after draft j - 1) reads the counts plus drafts 0 .. j-1, as a plain decode
there would. After the draw, the drafts accepted (each equal to the target's own draw, all before
it too) are committed to the counts on the device; rejected ones never were, so there is nothing
to roll back. The history buffer is written by position, drafts included: a rejected draft's
entry is overwritten by the token that later takes its position.
"""

from __future__ import annotations

import numpy as np
import torch

from strata.kernels.gumbel_sampling import HAVE_TRITON
from strata.kernels.penalties import (
    apply_penalties,
    apply_penalties_reference,
    kernels_run_on,
    penalty_patches,
    penalty_patches_reference,
)
from strata.protocol import PLACEHOLDER_TOKEN
from strata.sampling_rules import MAX_LOGIT_BIAS, uses_penalties
from strata.services.worker.device.host_to_device import upload

_NEG_INF = float("-inf")


class _Row:
    """A penalised sequence's settings (host)."""

    __slots__ = (
        "slot",
        "presence",
        "frequency",
        "repetition",
        "bias_ids",
        "bias_values",
        "allowed",
        "single_bad",
        "multi_bad",
        "prompt_len",
        "pending_history",
    )


class PenaltyState:
    def __init__(self, max_seqs: int, vocab_size: int, max_model_len: int, device: torch.device):
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.device = device
        self.rows: dict[int, _Row] = {}
        self.capacity = 0
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.prompt_seen = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        # By position, for the sparse penalties' candidates and bad words of several tokens.
        self.history = torch.zeros((0, max_model_len), dtype=torch.int32, device=device)
        self.bias: torch.Tensor | None = None  # [slots, V] float32 once a row uses logit bias
        self.free_slots: list[int] = []
        self.has_row = np.zeros(max_seqs + 1, dtype=bool)
        self.pending: set[int] = set()  # rows whose admission history is not counted yet
        # The same settings by state row, so a step gathers them with numpy, not a loop over rows.
        n = max_seqs + 1
        self.slot_of = np.zeros(n, np.int64)
        self.prompt_len_of = np.zeros(n, np.int64)
        self.rep_of, self.freq_of, self.pres_of = (
            np.ones(n, np.float32),
            np.zeros(n, np.float32),
            np.zeros(n, np.float32),
        )
        self.bias_tok_of = np.full((n, 0), -1, np.int64)  # each row's biased tokens, -1 padded
        self.values_only = np.zeros(n, bool)  # no allowed tokens, no bad words

    # ------------------------------------------------------------ admission

    def _grow(self) -> None:
        new = max(8, 2 * self.capacity)
        counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
        seen = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
        counts[: self.capacity] = self.counts
        seen[: self.capacity] = self.prompt_seen
        self.counts, self.prompt_seen = counts, seen
        history = torch.zeros((new, self.max_model_len), dtype=torch.int32, device=self.device)
        history[: self.capacity] = self.history
        self.history = history
        if self.bias is not None:
            bias = torch.zeros((new, self.vocab_size), dtype=torch.float32, device=self.device)
            bias[: self.capacity] = self.bias
            self.bias = bias
        self.free_slots.extend(range(new - 1, self.capacity - 1, -1))
        self.capacity = new

    def add(self, row: int, s, num_prompt_tokens: int, history_start: int, history) -> bool:
        """Admits a sequence; False (and nothing kept) when its options use no penalty."""
        if not uses_penalties(s):
            return False
        if not self.free_slots:
            self._grow()
        r = _Row()
        r.slot = self.free_slots.pop()
        self.counts[r.slot].zero_()
        self.prompt_seen[r.slot].zero_()
        r.presence, r.frequency = float(s.presence_penalty), float(s.frequency_penalty)
        r.repetition = float(s.repetition_penalty) if s.repetition_penalty else 1.0
        r.bias_ids = np.asarray(s.logit_bias_token_ids, dtype=np.int64)
        r.bias_values = np.clip(np.asarray(s.logit_bias_values, dtype=np.float32), -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        r.allowed = np.asarray(s.allowed_token_ids, dtype=np.int64) if s.allowed_token_ids else None
        words = [list(w.ids) for w in s.bad_words]
        r.single_bad = np.asarray([w[0] for w in words if len(w) == 1], dtype=np.int64)
        r.multi_bad = [w for w in words if len(w) > 1]
        if r.bias_ids.size:
            if self.bias is None:
                self.bias = torch.zeros((self.capacity, self.vocab_size), dtype=torch.float32, device=self.device)
            self.bias[r.slot].zero_()
            ids = upload({"ids": r.bias_ids, "values": r.bias_values}, self.device)
            self.bias[r.slot, ids["ids"]] = ids["values"]
        r.prompt_len = int(num_prompt_tokens)
        r.pending_history = (int(history_start), np.asarray(history, dtype=np.int64))
        self.slot_of[row], self.prompt_len_of[row] = r.slot, r.prompt_len
        self.rep_of[row], self.freq_of[row], self.pres_of[row] = r.repetition, r.frequency, r.presence
        if r.bias_ids.size > self.bias_tok_of.shape[1]:
            wider = np.full((self.bias_tok_of.shape[0], r.bias_ids.size), -1, np.int64)
            wider[:, : self.bias_tok_of.shape[1]] = self.bias_tok_of
            self.bias_tok_of = wider
        self.bias_tok_of[row] = -1
        self.bias_tok_of[row, : r.bias_ids.size] = r.bias_ids
        self.values_only[row] = r.allowed is None and not words
        self.rows[row] = r
        self.has_row[row] = True
        self.pending.add(row)
        return True

    def release(self, row: int) -> None:
        r = self.rows.pop(row, None)
        if r is not None:
            self.free_slots.append(r.slot)
            self.has_row[row] = False
            self.pending.discard(row)

    # ------------------------------------------------------------ each step's inputs

    def count_inputs(self, h, plan_tokens: np.ndarray, draft: np.ndarray, num_computed: dict, last_sampled) -> None:
        """Counts the step's input tokens of penalised sequences (drafts excepted) and, for
        sequences admitted since, their history before the step; writes the history buffer.
        draft: [T] whether each input token is a draft; num_computed: {row: the step's
        num_computed} of the step's rows."""
        sel = np.nonzero(self.has_row[h.token_rows])[0]
        slots, positions, tokens, is_draft, token_rows = [], [], [], [], []
        if sel.size:
            rows = h.token_rows[sel]
            slots.append(self.slot_of[rows])
            positions.append(h.positions[sel])
            tokens.append(plan_tokens[sel])
            is_draft.append(draft[sel])
            token_rows.append(rows)
        for row in [row for row in self.pending if row in num_computed]:  # admitted since: their history
            r = self.rows[row]
            self.pending.discard(row)
            start, ids = r.pending_history
            r.pending_history = None
            n = max(0, min(num_computed[row] - start, ids.size))
            if n:
                slots.append(np.full(n, r.slot, np.int64))
                positions.append(np.arange(start, start + n, dtype=np.int64))
                tokens.append(ids[:n])
                is_draft.append(np.zeros(n, bool))
                token_rows.append(np.full(n, row, np.int64))
        if not slots:
            return
        slots, positions, tokens = np.concatenate(slots), np.concatenate(positions), np.concatenate(tokens)
        is_draft, token_rows = np.concatenate(is_draft), np.concatenate(token_rows)
        prompt_len = self.prompt_len_of[token_rows]
        output = (positions >= prompt_len) & ~is_draft
        prompt = positions < prompt_len
        # (Everything that can be is derived here, on the host: each torch call costs the step
        # thread tens of microseconds on a slow host.)
        arrays = {
            "slots": slots,
            "positions": np.minimum(positions, self.max_model_len - 1),
            "tokens": tokens,
            "output": output.astype(np.int32),
        }
        placeholders = bool((tokens == PLACEHOLDER_TOKEN).any())
        if placeholders:
            arrays["rows"] = token_rows
        prompt_idx = np.nonzero(prompt)[0]
        if prompt_idx.size:
            arrays["prompt_idx"] = prompt_idx
        d = upload(arrays, self.device)
        tok = d["tokens"]
        if placeholders:  # decode lookahead: the token this stage sampled last
            tok = torch.where(tok == PLACEHOLDER_TOKEN, last_sampled[d["rows"]], tok)
        self.counts.index_put_((d["slots"], tok), d["output"], accumulate=True)
        if prompt_idx.size:
            i = d["prompt_idx"]
            self.prompt_seen[d["slots"][i], tok[i]] = True
        self.history[d["slots"], d["positions"]] = tok.to(torch.int32)

    # ------------------------------------------------------------ at the draw

    def sample_rows(self, h) -> np.ndarray:
        """Indices of the step's sample rows whose sequence is penalised."""
        return np.nonzero(self.has_row[h.sample_rows])[0]

    def masks_only_counts(self, row: int) -> bool:
        """Whether a penalised sequence's controls are values only (penalties, logit bias), which
        the controlled draw applies as a patch; allowed tokens and bad words take the general path."""
        return bool(self.values_only[row])

    def _inputs(self, h, idx: np.ndarray) -> tuple[dict, dict]:
        """(host arrays, host flags) of sample rows idx, for apply() and patches()."""
        state_rows = h.sample_rows[idx]
        if self.values_only[state_rows].all():  # gathered by row, no loop over rows
            rep, freq, pres = self.rep_of[state_rows], self.freq_of[state_rows], self.pres_of[state_rows]
            bias_tok = self.bias_tok_of[state_rows]
            width = int((bias_tok >= 0).sum(axis=1).max(initial=0))
            arrays = {"idx": idx.astype(np.int64), "slots": self.slot_of[state_rows], "rep": rep, "freq": freq}
            arrays["pres"] = pres
            arrays.update(self._sparse_inputs(h, idx, bias_tok[:, :width]))
            flags = dict(values=True, bias=width > 0, allow=0, ban=False, multi=False)
            flags["width"] = int(arrays["sample_pos"].max()) + arrays["bias_tok"].shape[1]
            return arrays, flags
        rows = [self.rows[r] for r in state_rows]
        n = len(rows)
        slots = np.fromiter((r.slot for r in rows), np.int64, n)
        arrays = {"idx": idx.astype(np.int64), "slots": slots}
        bias_rows = [i for i, r in enumerate(rows) if r.bias_ids.size]  # (their values: self.bias)
        ban_rows = [i for i, r in enumerate(rows) if r.single_bad.size]
        if ban_rows:
            arrays["ban_row"] = np.repeat(ban_rows, [rows[i].single_bad.size for i in ban_rows])
            arrays["ban_tok"] = np.concatenate([rows[i].single_bad for i in ban_rows])
        allow_rows = [i for i, r in enumerate(rows) if r.allowed is not None]
        if allow_rows:
            arrays["allow_rows"] = np.asarray(allow_rows, np.int64)
            arrays["allow_row"] = np.repeat(allow_rows, [rows[i].allowed.size for i in allow_rows])
            arrays["allow_tok"] = np.concatenate([rows[i].allowed for i in allow_rows])
        multi = [(i, w) for i, r in enumerate(rows) for w in r.multi_bad]
        if multi:
            width = max(len(w) for _, w in multi) - 1
            prefix = np.full((len(multi), width), -1, np.int64)
            for p, (_, w) in enumerate(multi):  # right-aligned: the tail just before the sampled position
                prefix[p, width - len(w) + 1 :] = w[:-1]
            positions = h.sample_positions[idx]
            arrays["multi_row"] = np.asarray([i for i, _ in multi], np.int64)
            arrays["multi_last"] = np.asarray([w[-1] for _, w in multi], np.int64)
            arrays["multi_prefix"] = prefix
            starts = np.asarray([positions[i] - len(w) + 1 for i, w in multi], np.int64)
            arrays["multi_ok"] = starts >= np.asarray([rows[i].prompt_len for i, _ in multi])  # within the output
            arrays["multi_pos"] = (
                np.asarray([positions[i] for i, _ in multi], np.int64)[:, None] - width + np.arange(width)
            )
        rep = np.fromiter((r.repetition for r in rows), np.float32, n)
        freq = np.fromiter((r.frequency for r in rows), np.float32, n)
        pres = np.fromiter((r.presence for r in rows), np.float32, n)
        any_rep, any_count = bool((rep != 1).any()), bool((freq != 0).any() or (pres != 0).any())
        arrays.update(rep=rep, freq=freq, pres=pres)
        flags = dict(
            values=any_rep or any_count or bool(bias_rows),
            bias=bool(bias_rows),
            allow=len(allow_rows),
            ban=bool(ban_rows),
            multi=bool(multi),
            width=0,
        )
        if flags["values"]:
            width = max((r.bias_ids.size for r in rows), default=0)
            arrays.update(self._sparse_inputs(h, idx, self.bias_tok_of[state_rows, :width]))
            flags["width"] = int(arrays["sample_pos"].max()) + arrays["bias_tok"].shape[1]
        return arrays, flags

    def _kernel_args(self, d: dict, flags: dict) -> tuple:
        return (
            d["slots"],
            d["sample_pos"],
            self.history,
            self.counts,
            self.prompt_seen,
            self.bias if flags["bias"] else None,
            d["bias_tok"],
            d["drafts"],
            d["n_drafts"],
            d["rep"],
            d["freq"],
            d["pres"],
        )

    def apply(self, logits: torch.Tensor, h, idx: np.ndarray) -> torch.Tensor:
        """The float32 logits of sample rows idx (of logits [R, V]) with every penalty and bias
        applied, in vLLM's order: allowed tokens, bad words, logit bias, then the repetition,
        frequency and presence penalties over the counts as they are at each row's position."""
        V = self.vocab_size
        arrays, flags = self._inputs(h, idx)
        d = upload(arrays, self.device)

        # Penalties and bias at the row's seen and biased tokens only (kernels/penalties.py), from
        # the logits into their float32 copy; then the masks (-inf whatever came before).
        out = logits.float() if logits.dtype != torch.float32 else logits.clone()
        if flags["values"]:
            apply = apply_penalties if (logits.is_cuda and HAVE_TRITON) else apply_penalties_reference
            apply(logits, out, d["idx"], *self._kernel_args(d, flags), flags["width"])
        if flags["allow"]:
            rows_t = d["idx"][d["allow_rows"]]
            keep = torch.zeros((flags["allow"], V), dtype=torch.bool, device=out.device)
            local = torch.searchsorted(d["allow_rows"], d["allow_row"])
            keep[local, d["allow_tok"]] = True
            out[rows_t] = out[rows_t].masked_fill(~keep, _NEG_INF)
        if flags["ban"]:
            out[d["idx"][d["ban_row"]], d["ban_tok"]] = _NEG_INF
        if flags["multi"]:
            slot = d["slots"][d["multi_row"]]
            tail = self.history[slot.unsqueeze(1), d["multi_pos"].clamp_min(0)]
            prefix = d["multi_prefix"]
            match = ((tail == prefix) | (prefix < 0)).all(dim=1) & d["multi_ok"]
            ban = torch.where(match, _NEG_INF, 0.0)
            out.index_put_((d["idx"][d["multi_row"]], d["multi_last"]), ban, accumulate=True)
        return out

    def patch_inputs(self, h, idx: np.ndarray, logits_rows: np.ndarray) -> tuple[dict, dict]:
        """The host half of patches(): arrays to upload (with the caller's other arrays) and
        flags. Sample rows idx must all pass masks_only_counts(); logits_rows: their rows in the
        logits the patch kernel reads."""
        arrays, flags = self._inputs(h, idx)
        arrays["idx"] = np.asarray(logits_rows, np.int64)
        return arrays, flags

    def patches(self, logits: torch.Tensor, d: dict, flags: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The penalised values of the rows patch_inputs() described (d: those arrays on the
        device) as a sparse patch (kernels/penalties.penalty_patches), their tokens set to -inf
        in the logits in place; None when no row has penalties or a bias."""
        if not flags["values"]:
            return None
        patch = penalty_patches if kernels_run_on(logits) else penalty_patches_reference
        return patch(logits, d["idx"], *self._kernel_args(d, flags), flags["width"])

    def _sparse_inputs(self, h, idx: np.ndarray, bias_tok: np.ndarray) -> dict:
        """Per penalised sample row: the position it samples (its history before it is the
        candidates), its biased tokens (bias_tok, -1 padded) and the drafts before it (verify
        rows), padded."""
        n = len(idx)
        sample_pos = np.minimum(h.sample_positions[idx].astype(np.int64), self.max_model_len)
        # At least one column (-1): a kernel's pointer into an empty array could point past its allocation.
        bias_tok = np.ascontiguousarray(bias_tok) if bias_tok.shape[1] else np.full((n, 1), -1, np.int64)
        drafts, n_drafts = np.full((n, 1), -1, np.int64), np.zeros(n, np.int64)
        if h.verify is not None:
            per_seq = h.verify.rows_per_seq
            first = np.repeat(np.cumsum(per_seq) - per_seq, per_seq)
            j = (np.arange(first.size) - first)[idx]  # drafts before each row
            if j.max(initial=0) > 0:
                k = np.arange(j.max())
                at = np.minimum(first[idx][:, None] + k, len(h.verify.drafts) - 1)
                drafts = np.where(k < j[:, None], h.verify.drafts[at], -1).astype(np.int64)
                n_drafts = j.astype(np.int64)
        return {"sample_pos": sample_pos, "bias_tok": bias_tok, "drafts": drafts, "n_drafts": n_drafts}

    def commit_drafts(self, h, token_ids: torch.Tensor) -> None:
        """After a verify step's draw: adds each penalised sequence's accepted drafts to its
        counts, on the device (a draft is accepted when it and every draft before it equal the
        target's draws)."""
        v = h.verify
        counts_per_seq = v.rows_per_seq
        first = np.cumsum(counts_per_seq) - counts_per_seq
        seq_rows = h.sample_rows[first]
        keep = np.nonzero(self.has_row[seq_rows] & (counts_per_seq > 1))[0]
        if not keep.size:
            return
        width = int(counts_per_seq[keep].max()) - 1
        index = first[keep][:, None] + np.arange(width)  # [S, width] draft rows
        valid = np.arange(width) < (counts_per_seq[keep] - 1)[:, None]
        index = np.where(valid, index, first[keep][:, None])
        slots = np.fromiter((self.rows[r].slot for r in seq_rows[keep]), np.int64, keep.size)
        drafts = np.where(valid, v.drafts[index], 0)
        d = upload({"index": index, "valid": valid, "drafts": drafts, "slots": slots}, self.device)
        match = (token_ids[d["index"]] == d["drafts"]) & d["valid"]
        accepted = torch.cumprod(match.to(torch.int32), dim=1).to(torch.int32)
        slot = d["slots"].unsqueeze(1).expand_as(accepted)
        self.counts.index_put_((slot.reshape(-1), d["drafts"].reshape(-1)), accepted.reshape(-1), accumulate=True)
