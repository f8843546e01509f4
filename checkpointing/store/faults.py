"""Stores that fail on purpose: the storage-outage drill's gate."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from checkpointing.store.base import ObjectInfo, ObjectStore, StoreUnavailable


class OutageGate:
    """An ObjectStore that refuses writes while `until()` (unix seconds) lies ahead: the storage-outage
    drill. Reads go through; while the gate is shut nothing is written, so nothing partial appears."""

    def __init__(self, inner: ObjectStore, until: Callable[[], float]) -> None:
        self.inner = inner
        self.until = until
        self.uri = inner.uri

    def _check(self, what: str, key: str) -> None:
        left = self.until() - time.time()
        if left > 0:
            raise StoreUnavailable(f"{what} of {key} refused by {self.uri}: storage outage for another {left:.1f} s")

    def put_file(self, key: str, path: Path) -> None:
        self._check("upload", key)
        self.inner.put_file(key, path)

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._check("put", key)
        self.inner.put_bytes(key, data, if_absent=if_absent)

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.inner.get_bytes(key, start, end)

    def download(self, key: str, path: Path) -> None:
        self.inner.download(key, path)

    def list(self, prefix: str, *, start_after: str = "") -> list[ObjectInfo]:
        return self.inner.list(prefix, start_after=start_after)

    def delete_prefix(self, prefix: str) -> None:
        self._check("delete", prefix)
        self.inner.delete_prefix(prefix)

    def local_path(self, key: str) -> Path | None:
        """In place only while writes are allowed: during an outage, shards wait in staging."""
        return None if self.until() > time.time() else self.inner.local_path(key)
