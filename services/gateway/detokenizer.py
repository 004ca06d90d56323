"""Turn a child's stream of token ids into a stream of text, and cut it at stop strings.

IncrementalDetokenizer: token ids -> text, never emitting half a UTF-8 character.
StopChecker: text -> text truncated before the first stop string.
OutputTextStream: both, plus min_tokens, for one child request.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decode output tokens a few at a time with the prefix/read-offset method.

    Each push decodes only a small window: the tokens of the previous emitted piece (the
    "prefix", whose own decoding is subtracted) plus the tokens not yet emitted. Decoding the
    prefix along with the new tokens keeps word-initial spaces right for tokenizers that strip
    a leading space, and a window ending in U+FFFD (a character whose bytes are split across
    tokens) is held until later tokens complete it.

    For byte-level BPE tokenizers (the default model, Llama 3, Qwen2) the pieces concatenated,
    after push(..., finished=True), equal tokenizer.decode(output_ids, skip_special_tokens=...).
    The prompt's last tokens serve as the first prefix, so with SentencePiece tokenizers the
    first output word keeps its leading space, as in vLLM.
    """

    # vLLM uses 5; a few more are harmless and help tokenizers with long merged pieces.
    PROMPT_CONTEXT_TOKENS = 6

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer
        # A fast tokenizer's Rust backend decodes the same text (cleanup off, below) without
        # transformers' per-call argument conversion, which costs more than the decode itself
        # for the few tokens of a streamed step.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-self.PROMPT_CONTEXT_TOKENS :])
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: decoding it with the output would glue the
            # prompt's bytes onto the output's. Start from the output alone.
            context, context_text = [], ""
        self._ids: list[int] = context  # only the window still needed, not the whole output
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = context_text

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special_tokens,
            # Cleanup rewrites text around punctuation depending on what follows, which would
            # make the pieces disagree with decoding the whole output.
            clean_up_tokenization_spaces=False,
        )

    def push(self, new_token_ids: Sequence[int], *, finished: bool = False) -> str:
        """Add the next output tokens; return the text that is now certain ("" if none).

        With finished=True, whatever is held back (an incomplete character) is emitted too.
        """
        self._ids.extend(new_token_ids)
        if len(self._ids) == self._read_offset:
            return ""
        text = self._decode(self._ids[self._prefix_offset :])
        complete = len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT_CHAR)
        if not (complete or finished):
            return ""
        new_text = text[len(self._prefix_text) :]
        # The unread tokens become the next prefix; drop what is no longer in any window.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return new_text

    def flush(self) -> str:
        """Emit whatever is held back; call once when the output has finished."""
        return self.push((), finished=True)


class StopChecker:
    """Find stop strings in streamed text, including ones split across pushes.

    Returns text truncated before the stop string (which is not included, as in vLLM by
    default). While the end of the text could be the start of a stop string, that tail is held
    back (at most len(longest stop) - 1 characters) until the next push resolves it.

    When two stop strings match, the one that ends first wins (it is the one a
    character-by-character stream would complete first), so the result does not depend on how
    the text was split into pushes. Stop strings apply once the output has min_tokens tokens;
    text emitted before then is never matched afterwards.
    """

    def __init__(self, stop_strings: Sequence[str], min_tokens: int = 0):
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stop_strings))
        self._min_tokens = min_tokens
        # Every proper prefix of a stop string: a tail equal to one of these must wait.
        self._held = ""
        self.matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def check(self, new_text: str, num_output_tokens: int) -> tuple[str, str | None]:
        """Add `new_text` (the output now has `num_output_tokens` tokens).

        Returns (text to emit, matched stop string or None). After a match, returns ("", None).
        """
        if self.stopped:
            return "", None
        text = self._held + new_text
        self._held = ""
        if not self._stops or num_output_tokens < self._min_tokens:
            return text, None
        match = self._earliest_match(text)
        if match is not None:
            start, stop = match
            self.matched = stop
            return text[:start], stop
        hold = self._undecided_tail_len(text)
        if hold:
            self._held = text[-hold:]
            text = text[:-hold]
        return text, None

    def flush(self) -> str:
        """The held-back tail: the output ended before it could become a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                # Ends first; on a tie (one stop is a suffix of another) the longer, earlier one.
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _undecided_tail_len(self, text: str) -> int:
        """The longest end of `text` that is a proper prefix of a stop string. Only positions
        where a stop string's first character occurs are tried, each with one C-level compare,
        and no prefix is ever built (a long stop string costs its length, not its square)."""
        longest = 0
        for stop in self._stops:
            tail = text[len(text) - min(len(text), len(stop) - 1) :]
            start = tail.find(stop[0])
            while start >= 0 and len(tail) - start > longest:
                if stop.startswith(tail[start:]):
                    longest = len(tail) - start
                    break
                start = tail.find(stop[0], start + 1)
        return longest


class OutputTextStream:
    """The text of one child request: detokenize, then apply stop strings and min_tokens.

    push() takes each EngineOutput's new token ids and returns (text, matched stop string, tokens
    kept). On a match the caller finishes the output with finish_reason "stop" and the stop
    string, keeps only the tokens up to the one that completed it (what a token-by-token stream
    would have kept, however many tokens a step brought), and aborts the child in the scheduler;
    later pushes return ("", None, 0).
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
    ):
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._stop_checker = StopChecker(stop, min_tokens)
        self._has_stops = bool(stop)
        self.num_tokens = 0

    @property
    def stopped(self) -> bool:
        return self._stop_checker.stopped

    def push(
        self,
        new_token_ids: Sequence[int],
        *,
        finished: bool = False,
        ends_with_stop_token: bool = False,
    ) -> tuple[str, str | None, int]:
        """Add new output tokens. `finished`: the scheduler finished this child, so flush.

        `ends_with_stop_token`: the last id is the EOS or stop token that finished it; as in
        vLLM it counts as a token but is kept out of the text.
        """
        if self.stopped:
            return "", None, 0
        ids = list(new_token_ids)
        text_ids = ids[:-1] if ends_with_stop_token and ids else ids
        pieces: list[str] = []
        # With stop strings, one token at a time: a match ends the output at the token that
        # completed it, and min_tokens applies from the right token on.
        chunks = [(t,) for t in text_ids] if self._has_stops else [text_ids]
        for i, chunk in enumerate(chunks):
            self.num_tokens += len(chunk)
            text, matched = self._stop_checker.check(self._detokenizer.push(chunk), self.num_tokens)
            pieces.append(text)
            if matched is not None:
                return "".join(pieces), matched, i + 1
        self.num_tokens += len(ids) - len(text_ids)
        if finished:
            text, matched = self._stop_checker.check(self._detokenizer.flush(), self.num_tokens)
            pieces.append(text)
            if matched is not None:
                return "".join(pieces), matched, len(ids)
            pieces.append(self._stop_checker.flush())
        return "".join(pieces), None, len(ids)
