"""Tokenized text as goodput keeps it: uint32 token shards in an object store, and the samples read
from them. Pure: numpy and the store, no torch, no tokenizer (`goodput tokenize` writes them:
trainer/tokenize.py).

A dataset lives under one prefix of a store (file://, s3://, as checkpoints do):

    shard-00000.bin ...   the tokens, little-endian uint32, documents one after another, each ending
                          with the tokenizer's end-of-sequence token
    shard-00000.idx ...   where each document starts in its shard (uint64 token offsets)
    manifest.json         written last: the shards (tokens and sha256 each), the tokenizer (its
                          file's sha256, vocabulary size, eos id), documents and tokens in all

A dataset without its manifest does not exist (a tokenize that died half-way is invisible), and a
shard whose size is not what the manifest says is refused at open.

Samples: the shards read as one stream of tokens cut into windows of seq_len + 1; sample i is window
perm_e[i mod N] with e = i // N and perm_e a shuffle seeded by (seed, e): a pure function of (seed,
global sample id), so a resume, a shrink or a grow of dp keeps the exact data position (one cursor).
Several datasets mix by weight: sample i comes from the dataset a uniform draw seeded by (seed, i)
picks, and within it from window perm_e[i mod N_d] of that dataset's own shuffle.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

FORMAT = "goodput-tokens/1"
MANIFEST = "manifest.json"
TOKEN_DTYPE = np.dtype("<u4")


def shard_key(index: int) -> str:
    return f"shard-{index:05d}.bin"


@dataclass(frozen=True)
class DatasetManifest:
    shards: list[dict[str, Any]]
    """[{key, tokens, documents, sha256}] in stream order."""
    tokenizer: dict[str, Any]
    """{sha256, vocab_size, eos_id}."""
    documents: int
    tokens: int
    sources: list[str]

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "shards": self.shards, "tokenizer": self.tokenizer,
                           "documents": self.documents, "tokens": self.tokens, "sources": self.sources}, indent=1)

    @staticmethod
    def read(store: Any) -> "DatasetManifest":
        from checkpointing.store import NotFound

        try:
            raw = json.loads(store.get_bytes(MANIFEST))
        except NotFound:
            raise ValueError(f"no tokenized dataset at {store.uri} (no {MANIFEST}: "
                             "`goodput tokenize` writes one, last)") from None
        if raw.get("format") != FORMAT:
            raise ValueError(f"{store.uri}/{MANIFEST} is format {raw.get('format')!r}, not {FORMAT!r}")
        return DatasetManifest(shards=raw["shards"], tokenizer=raw["tokenizer"], documents=raw["documents"],
                               tokens=raw["tokens"], sources=raw.get("sources", []))


class _Shard:
    """One shard's tokens: memory-mapped where the store is a local folder, else read by byte range."""

    def __init__(self, store: Any, key: str, tokens: int) -> None:
        self.store, self.key, self.tokens = store, key, tokens
        path = store.local_path(key)
        self.array: np.ndarray | None = None
        if path is not None:
            size = path.stat().st_size if path.is_file() else -1
            if size != tokens * TOKEN_DTYPE.itemsize:
                raise ValueError(f"{path} holds {size} bytes; the manifest says {tokens} tokens "
                                 f"({tokens * TOKEN_DTYPE.itemsize} bytes): the dataset is damaged")
            self.array = np.memmap(path, dtype=TOKEN_DTYPE, mode="r") if tokens else np.zeros(0, TOKEN_DTYPE)

    def read(self, start: int, end: int) -> np.ndarray:
        if self.array is not None:
            return np.asarray(self.array[start:end])
        data = self.store.get_bytes(self.key, start * TOKEN_DTYPE.itemsize, end * TOKEN_DTYPE.itemsize)
        if len(data) != (end - start) * TOKEN_DTYPE.itemsize:
            raise ValueError(f"data error: {self.store.uri}/{self.key} gave {len(data)} bytes for tokens {start}..{end} "
                             f"({(end - start) * TOKEN_DTYPE.itemsize} expected): the shard is damaged or was replaced")
        return np.frombuffer(data, dtype=TOKEN_DTYPE)


class TokenDataset:
    """One tokenized dataset as one stream of tokens, cut in windows of seq_len + 1."""

    def __init__(self, uri: str, *, seq_len: int, store_options: dict[str, Any] | None = None) -> None:
        from checkpointing.store import open_store

        self.uri = uri
        self.store = open_store(uri, **(store_options or {}))
        self.manifest = DatasetManifest.read(self.store)
        self.shards = [_Shard(self.store, s["key"], int(s["tokens"])) for s in self.manifest.shards]
        self.starts = np.cumsum([0] + [s.tokens for s in self.shards])
        self.seq_len = seq_len
        self.num_windows = (int(self.starts[-1]) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"{uri} holds {int(self.starts[-1])} tokens, fewer than one sample of seq_len + 1 = "
                             f"{seq_len + 1}")

    def tokens(self, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) of the whole stream, across shard boundaries."""
        out = []
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        for i in range(first, len(self.shards)):
            lo, hi = int(self.starts[i]), int(self.starts[i + 1])
            if lo >= end:
                break
            out.append(self.shards[i].read(max(start, lo) - lo, min(end, hi) - lo))
        return np.concatenate(out) if out else np.zeros(0, TOKEN_DTYPE)

    def window(self, index: int, vocab_size: int | None = None) -> np.ndarray:
        """Sample `index`'s tokens; with `vocab_size`, a token id outside it is a data error naming the shard."""
        start = index * self.seq_len
        out = self.tokens(start, start + self.seq_len + 1).astype(np.int64)
        if vocab_size is not None and out.size and int(out.max()) >= vocab_size:
            at = start + int(np.argmax(out >= vocab_size))
            shard = self.shards[int(np.searchsorted(self.starts, at, side="right")) - 1]
            raise ValueError(f"data error: {self.uri}/{shard.key} holds token id {int(out.max())} (at token {at} of "
                             f"the dataset) but model.vocab_size = {vocab_size}: the shard is damaged or was "
                             "tokenized with another tokenizer")
        return out


class ShardSource:
    """Samples from one or more tokenized datasets (`data.kind: shards`): a pure function of (seed,
    global sample id)."""

    def __init__(self, datasets: Sequence[tuple[str, float]], *, seed: int, seq_len: int, vocab_size: int) -> None:
        self.sets = [TokenDataset(uri, seq_len=seq_len) for uri, _ in datasets]
        weights = np.array([w for _, w in datasets], dtype=np.float64)
        self.cumulative = np.cumsum(weights / weights.sum())
        self.seed = seed
        self.vocab_size = vocab_size
        for ds in self.sets:
            vocab = int(ds.manifest.tokenizer["vocab_size"])
            if vocab > vocab_size:
                raise ValueError(f"{ds.uri} was tokenized with a vocabulary of {vocab:,} tokens but model.vocab_size "
                                 f"= {vocab_size:,}: use a model of at least {vocab:,} (or that tokenizer's size)")

    @functools.lru_cache(maxsize=8)
    def _perm(self, which: int, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, which, epoch]).permutation(self.sets[which].num_windows)

    def dataset_of(self, sample_id: int) -> int:
        if len(self.sets) == 1:
            return 0
        u = np.random.default_rng([self.seed, 0x4D4958, sample_id]).random()
        return min(int(np.searchsorted(self.cumulative, u, side="right")), len(self.sets) - 1)

    def batch(self, sample_ids: Sequence[int]) -> np.ndarray:
        rows = []
        for i in sample_ids:
            which = self.dataset_of(i)
            ds = self.sets[which]
            epoch, j = divmod(i, ds.num_windows)
            rows.append(ds.window(int(self._perm(which, epoch)[j]), self.vocab_size))
        return np.stack(rows)
