"""Data sources a user might write (`data: {kind: python, source: "tests.support.sources:Copy"}`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


class Copy:
    """A copy task: each sample is random tokens seeded by (seed, sample id), its second half a copy of
    the first (learnable: the second half is predictable). Pure."""

    def __init__(self, *, seed: int, seq_len: int, vocab_size: int, low: int = 0) -> None:
        self.seed, self.length, self.vocab, self.low = seed, seq_len + 1, vocab_size, low

    def batch(self, sample_ids: Sequence[int]) -> np.ndarray:
        rows = []
        for i in sample_ids:
            half = np.random.default_rng([self.seed, i]).integers(self.low, self.vocab, (self.length + 1) // 2)
            rows.append(np.concatenate([half, half])[:self.length])
        return np.stack(rows).astype(np.int64)


class Stateful(Copy):
    """Not pure: it draws from one generator across calls (the next batch depends on the last)."""

    def __init__(self, **kw: int) -> None:
        super().__init__(**kw)
        self.rng = np.random.default_rng(self.seed)

    def batch(self, sample_ids: Sequence[int]) -> np.ndarray:
        return self.rng.integers(0, self.vocab, (len(sample_ids), self.length))


def short(*, seed: int, seq_len: int, vocab_size: int) -> Copy:
    """A function is a source too; this one returns rows one token short."""
    source = Copy(seed=seed, seq_len=seq_len - 1, vocab_size=vocab_size)
    return source
