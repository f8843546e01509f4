"""Samples as a pure function of (seed, global sample index); the data state of a run is one cursor.

Step s of a run consumes global samples [cursor, cursor + global_batch). How those are split over dp
ranks and micro-batches is `local_sample_ids`; changing dp changes the split, never the set, so an
elastic shrink neither skips nor repeats a sample. No torch here: workers turn arrays into tensors.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

from trainer.config import DataConfig, ModelConfig


def local_sample_ids(
    *, cursor: int, global_batch: int, dp: int, dp_rank: int, micro_batch: int
) -> list[int]:
    """Global sample ids of one dp rank's local batch, micro-batch after micro-batch.

    Micro-batch m of dp rank d holds ids cursor + (m*dp + d)*micro_batch + [0, micro_batch).
    """
    if global_batch % (dp * micro_batch):
        raise ValueError(
            f"global_batch = {global_batch} is not divisible by dp * micro_batch = {dp * micro_batch}"
        )
    num_micro = global_batch // (dp * micro_batch)
    ids: list[int] = []
    for m in range(num_micro):
        start = cursor + (m * dp + dp_rank) * micro_batch
        ids.extend(range(start, start + micro_batch))
    return ids


class DataSource(Protocol):
    def batch(self, sample_ids: Sequence[int]) -> np.ndarray:
        """Token rows of shape (len(sample_ids), seq_len + 1), int64."""
        ...


@dataclass(frozen=True)
class MarkovChain:
    """An order-1 Markov chain over the vocabulary whose entropy rate is known exactly.

    Each token has `branching` successors with Dirichlet(1) probabilities. Sequences start from a
    stationary distribution, so every target position has conditional entropy exactly
    `entropy_rate()` given its prefix: the best possible mean cross-entropy.
    """

    transition: np.ndarray
    stationary: np.ndarray

    @staticmethod
    def from_seed(seed: int, vocab_size: int, branching: int) -> "MarkovChain":
        rng = np.random.default_rng([seed, 0x4D41524B])
        transition = np.zeros((vocab_size, vocab_size))
        for token in range(vocab_size):
            successors = rng.choice(vocab_size, size=branching, replace=False)
            transition[token, successors] = rng.dirichlet(np.ones(branching))
        # The lazy chain (I + P) / 2 has the same stationary distributions and no periodicity.
        lazy = 0.5 * (np.eye(vocab_size) + transition)
        pi = np.full(vocab_size, 1.0 / vocab_size)
        for _ in range(10_000):
            nxt = pi @ lazy
            if np.abs(nxt - pi).max() < 1e-15:
                break
            pi = nxt
        return MarkovChain(transition=transition, stationary=pi / pi.sum())

    def entropy_rate(self) -> float:
        """Nats per token: sum_i pi_i * H(P_i)."""
        p = self.transition
        with np.errstate(divide="ignore", invalid="ignore"):
            row_h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
        return float(self.stationary @ row_h)


class SyntheticSource:
    def __init__(self, *, seed: int, vocab_size: int, seq_len: int, branching: int) -> None:
        self.seed = seed
        self.seq_len = seq_len
        self.chain = MarkovChain.from_seed(seed, vocab_size, branching)
        self._cum_transition = np.cumsum(self.chain.transition, axis=1)
        self._cum_stationary = np.cumsum(self.chain.stationary)
        self._last = vocab_size - 1

    def batch(self, sample_ids: Sequence[int]) -> np.ndarray:
        n, length = len(sample_ids), self.seq_len + 1
        u = np.stack([np.random.default_rng([self.seed, i]).random(length) for i in sample_ids])
        out = np.empty((n, length), dtype=np.int64)
        out[:, 0] = np.minimum(np.searchsorted(self._cum_stationary, u[:, 0], side="right"), self._last)
        for t in range(1, length):
            rows = self._cum_transition[out[:, t - 1]]
            out[:, t] = np.minimum((rows <= u[:, t, None]).sum(axis=1), self._last)
        return out


class TokenFileSource:
    """A flat file of uint16 token ids (nanoGPT's format), memory-mapped, cut in seq_len+1 windows.

    Sample i is window perm_e[i mod N] where e = i // N and perm_e is a seeded shuffle per epoch.
    """

    def __init__(self, *, path: str, seed: int, seq_len: int, vocab_size: int) -> None:
        self.tokens = np.memmap(path, dtype=np.uint16, mode="r")
        self.seed = seed
        self.seq_len = seq_len
        self.num_windows = (len(self.tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(
                f"{path} holds {len(self.tokens)} tokens, fewer than one sample of seq_len + 1 = "
                f"{seq_len + 1}"
            )
        self.vocab_size = vocab_size

    @functools.lru_cache(maxsize=4)
    def _perm(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def batch(self, sample_ids: Sequence[int]) -> np.ndarray:
        rows = []
        for i in sample_ids:
            epoch, j = divmod(i, self.num_windows)
            start = int(self._perm(epoch)[j]) * self.seq_len
            rows.append(np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        out = np.stack(rows)
        if out.max() >= self.vocab_size:
            raise ValueError(
                f"token id {int(out.max())} in the token file is >= model.vocab_size = {self.vocab_size}"
            )
        return out


SYNTHETIC_MAX_VOCAB = 16384
"""The synthetic chain's dense table is 2 GiB at this vocabulary."""


def build_source(data: DataConfig, model: ModelConfig) -> DataSource:
    if data.kind == "synthetic":
        if model.vocab_size > SYNTHETIC_MAX_VOCAB:
            raise ValueError(f"data.kind synthetic keeps a vocab_size x vocab_size transition table: at model.vocab_size "
                             f"= {model.vocab_size:,} that is {8 * model.vocab_size**2 / 2**30:,.0f} GiB. Use it with "
                             f"a vocabulary of at most {SYNTHETIC_MAX_VOCAB:,}, or train on text (data.kind shards)")
        return SyntheticSource(
            seed=data.seed, vocab_size=model.vocab_size, seq_len=model.seq_len, branching=data.branching
        )
    if data.kind == "tokens":
        assert data.path is not None
        return TokenFileSource(
            path=data.path, seed=data.seed, seq_len=model.seq_len, vocab_size=model.vocab_size
        )
    if data.kind == "shards":
        from trainer.shards import ShardSource

        return ShardSource(data.datasets, seed=data.seed, seq_len=model.seq_len, vocab_size=model.vocab_size)
    if data.kind == "python":
        assert data.source is not None
        return python_source(data.source, dict(data.args), seed=data.seed, seq_len=model.seq_len,
                             vocab_size=model.vocab_size)
    raise ValueError(f"data.kind = {data.kind!r}; use 'synthetic', 'tokens', 'shards' or 'python'")


def python_source(name: str, args: dict, *, seed: int, seq_len: int, vocab_size: int) -> DataSource:
    """A user's data source (`data: {kind: python, source: "package.module:Class", args: {...}}`): a
    class (or function) installed in the image, called with seed, seq_len, vocab_size and `args`,
    whose `batch(sample_ids)` returns (len(sample_ids), seq_len + 1) token ids and is a pure function
    of (seed, sample id): `check_pure` holds it to that at every launch."""
    import importlib

    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"data.source = {name!r}: write it as package.module:Name")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"data.source = {name!r} cannot be imported here ({e}): install it in the image") from None
    return factory(seed=seed, seq_len=seq_len, vocab_size=vocab_size, **args)


def check_pure(source: DataSource, *, seq_len: int, vocab_size: int, probe: Sequence[int] = (0, 1, 7, 1000, 123457),
               what: str = "the data source") -> None:
    """Every sample must be a pure function of (seed, global sample id), whatever batch it is asked
    in and however often (a resume, a shrink or a grow asks for the same ids in other groupings):
    ValueError saying what differs. Also the shape and the id range."""
    ids = list(probe)
    first = np.asarray(source.batch(ids))
    if first.shape != (len(ids), seq_len + 1):
        raise ValueError(f"{what}: batch({ids}) has shape {first.shape}; it must be (len(sample_ids), "
                         f"seq_len + 1) = ({len(ids)}, {seq_len + 1})")
    if first.min() < 0 or first.max() >= vocab_size:
        raise ValueError(f"{what}: token ids in [{int(first.min())}, {int(first.max())}] but model.vocab_size = "
                         f"{vocab_size}")
    again = np.asarray(source.batch(ids[::-1]))[::-1]
    single = np.stack([np.asarray(source.batch([i]))[0] for i in ids])
    for label, other in (("asked again in reverse order", again), ("asked one by one", single)):
        if not np.array_equal(first, other):
            bad = [i for i, a, b in zip(ids, first, other) if not np.array_equal(a, b)]
            raise ValueError(f"{what} is not a pure function of the sample id: samples {bad} differ when "
                             f"{label} (resume and dp changes would not see the same data)")


def uniform_entropy(vocab_size: int) -> float:
    """Cross-entropy of a model that knows nothing: log(vocab)."""
    return math.log(vocab_size)
