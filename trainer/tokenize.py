"""`goodput tokenize`: text files to a tokenized dataset (trainer/shards.py says the format).

Reads `.txt` (a file is one document), `.jsonl` (each line's `field` is one) and `.parquet` (each
row's `field` column is one, read in record batches with pyarrow), tokenizes with Hugging Face
`tokenizers` from a local `tokenizer.json` (nothing is downloaded) in batches (its Rust encoder uses
every core), appends the end-of-sequence id after every document, and writes uint32 shards with a
document index to the store, then the manifest: a dataset is visible once whole.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from trainer.shards import MANIFEST, TOKEN_DTYPE, DatasetManifest, shard_key

EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[SEP]")
"""End-of-sequence tokens looked for when --eos is not given (Llama 3's first)."""

BATCH_DOCUMENTS = 1024


class TokenizeError(ValueError):
    """Input that cannot be tokenized as asked; the message says what to fix."""


def documents(paths: Sequence[Path], field_name: str) -> Iterator[str]:
    """The documents of every file, in order."""
    for path in paths:
        suffix = path.suffix.lower()
        if suffix == ".txt":
            yield path.read_text(encoding="utf-8")
        elif suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise TokenizeError(f"{path}:{number}: not JSON ({e.msg})") from None
                    if not isinstance(row, dict) or not isinstance(row.get(field_name), str):
                        raise TokenizeError(f"{path}:{number}: no string field {field_name!r} (use --field)")
                    yield row[field_name]
        elif suffix == ".parquet":
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(path)
            if field_name not in parquet.schema_arrow.names:
                raise TokenizeError(f"{path}: no column {field_name!r}; it has {parquet.schema_arrow.names} "
                                    "(use --field)")
            for batch in parquet.iter_batches(columns=[field_name], batch_size=BATCH_DOCUMENTS):
                yield from (text for text in batch.column(0).to_pylist() if text is not None)
        else:
            raise TokenizeError(f"{path}: use .txt, .jsonl or .parquet files")


def eos_id(tokenizer: object, eos: str | None) -> int:
    vocab_id = getattr(tokenizer, "token_to_id")
    names = [eos] if eos else list(EOS_CANDIDATES)
    for name in names:
        found = vocab_id(name)
        if found is not None:
            return int(found)
    if eos:
        raise TokenizeError(f"--eos {eos!r} is not a token of the tokenizer")
    raise TokenizeError(f"the tokenizer has none of {', '.join(EOS_CANDIDATES)}: name its end-of-sequence token "
                        "with --eos")


@dataclass
class _Writer:
    """Shards of about `shard_tokens` tokens (a document is never split), staged in a local folder
    and uploaded as each fills."""

    store: object
    staging: Path
    shard_tokens: int
    shards: list[dict] = field(default_factory=list)
    _tokens: list[np.ndarray] = field(default_factory=list)
    _starts: list[int] = field(default_factory=list)
    _count: int = 0

    def add(self, ids: np.ndarray) -> None:
        self._starts.append(self._count)
        self._tokens.append(ids)
        self._count += len(ids)
        if self._count >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._tokens:
            return
        key = shard_key(len(self.shards))
        data = np.concatenate(self._tokens).astype(TOKEN_DTYPE)
        path = self.staging / key
        data.tofile(path)
        index = self.staging / key.replace(".bin", ".idx")
        np.asarray(self._starts, dtype="<u8").tofile(index)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        self.store.put_file(key, path)  # type: ignore[attr-defined]
        self.store.put_file(index.name, index)  # type: ignore[attr-defined]
        path.unlink()
        index.unlink()
        self.shards.append({"key": key, "tokens": int(data.size), "documents": len(self._starts), "sha256": digest})
        self._tokens, self._starts, self._count = [], [], 0


def tokenize(paths: Sequence[Path], tokenizer_path: Path, out_uri: str, *, field_name: str = "text",
             eos: str | None = None, shard_tokens: int = 1 << 28,
             progress: Callable[[int, int, int], None] | None = None) -> DatasetManifest:
    """Tokenize `paths` into a dataset at `out_uri`; `progress(bytes_read, total_bytes, tokens)` after
    each batch. Refuses to write over a dataset already there."""
    from tokenizers import Tokenizer

    from checkpointing.store import open_store

    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise TokenizeError(f"no such file: {', '.join(missing)}")
    if not tokenizer_path.is_file():
        raise TokenizeError(f"no tokenizer file {tokenizer_path} (a tokenizer.json, as Hugging Face saves it)")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
    except Exception as e:  # noqa: BLE001 - the library's own message says what is wrong with the file
        raise TokenizeError(f"{tokenizer_path} is not a tokenizers file: {e}") from None
    end = eos_id(tokenizer, eos)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > np.iinfo(TOKEN_DTYPE).max:
        raise TokenizeError(f"the tokenizer's {vocab:,} tokens do not fit uint32 ids")
    store = open_store(out_uri)
    if store.list(MANIFEST):
        raise TokenizeError(f"{out_uri} already holds a tokenized dataset: write to another place")
    total = sum(p.stat().st_size for p in paths)
    read = tokens = docs = 0
    with tempfile.TemporaryDirectory(prefix="goodput-tokenize-") as tmp:
        writer = _Writer(store, Path(tmp), shard_tokens)
        batch: list[str] = []

        def encode() -> None:
            nonlocal read, tokens, docs
            for encoding, text in zip(tokenizer.encode_batch(batch, add_special_tokens=False), batch):
                ids = np.fromiter(encoding.ids, dtype=np.int64, count=len(encoding.ids))
                writer.add(np.append(ids, end))
                tokens += len(ids) + 1
                read += len(text.encode("utf-8"))
            docs += len(batch)
            batch.clear()
            if progress is not None:
                progress(min(read, total), total, tokens)

        for text in documents(paths, field_name):
            batch.append(text)
            if len(batch) >= BATCH_DOCUMENTS:
                encode()
        if batch:
            encode()
        writer.flush()
    if not tokens:
        raise TokenizeError("the files hold no documents")
    manifest = DatasetManifest(
        shards=writer.shards, documents=docs, tokens=tokens, sources=[str(p) for p in paths],
        tokenizer={"sha256": hashlib.sha256(tokenizer_path.read_bytes()).hexdigest(), "vocab_size": vocab,
                   "eos_id": end, "file": str(tokenizer_path)})
    store.put_bytes(MANIFEST, manifest.to_json().encode(), if_absent=True)
    return manifest


def progress_printer() -> Callable[[int, int, int], None]:
    """A progress line on stderr, rewritten after each batch: MB read of MB, tokens, MB/s."""
    started = time.monotonic()

    def show(read: int, total: int, tokens: int) -> None:
        elapsed = max(time.monotonic() - started, 1e-9)
        sys.stderr.write(f"\rtokenize: {read / 1e6:,.1f} / {total / 1e6:,.1f} MB ({100 * read / max(total, 1):.0f}%), "
                         f"{tokens:,} tokens, {read / 1e6 / elapsed:,.1f} MB/s")
        sys.stderr.flush()

    return show
