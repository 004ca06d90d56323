"""A rank's slice of the vocabulary: the columns of the logits (and rows of the embedding and
lm_head) that tensor-parallel rank `rank` of `size` holds.

The vocabulary is padded to a multiple of 64 x size, so every rank holds the same number of
columns and a rank's slice of a grammar's token bitmask (32 tokens a word) is whole words (vLLM
pads its vocab-parallel embedding the same way). Columns at or past `valid` are padding: their
logits are never drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

# Columns per rank are a multiple of this: whole 32-bit words of a grammar bitmask, twice over.
VOCAB_PAD_MULTIPLE = 64


@dataclass(frozen=True)
class VocabShard:
    vocab_size: int  # V, the model's
    rank: int
    size: int

    @property
    def padded(self) -> int:
        """V rounded up to a multiple of 64 x size (V itself on one rank)."""
        if self.size == 1:
            return self.vocab_size
        step = VOCAB_PAD_MULTIPLE * self.size
        return -(-self.vocab_size // step) * step

    @property
    def local(self) -> int:
        """Columns every rank holds (padding included)."""
        return self.padded // self.size

    @property
    def offset(self) -> int:
        """The global index of this rank's first column."""
        return self.rank * self.local

    @property
    def valid(self) -> int:
        """This rank's columns that are real tokens (the rest is padding)."""
        return max(0, min(self.vocab_size - self.offset, self.local))

    @property
    def sharded(self) -> bool:
        return self.size > 1

    @staticmethod
    def whole(vocab_size: int) -> VocabShard:
        return VocabShard(vocab_size, 0, 1)
