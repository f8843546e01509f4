"""`MemoryStore`: an ObjectStore in memory, with the caller's clock for mtimes (the simulator's virtual
clock). For a 54-day simulated run: no files, no I/O."""

from __future__ import annotations

import bisect
import sys
from pathlib import Path
from typing import Callable

from checkpointing.store.base import AlreadyExists, ObjectInfo


class MemoryStore:
    """An ObjectStore in memory, with the virtual clock's mtimes."""

    def __init__(self, clock: Callable[[], float], uri: str = "sim://checkpoints") -> None:
        self.uri = uri
        self.clock = clock
        self._objects: dict[str, tuple[bytes, ObjectInfo]] = {}
        self._keys: list[str] = []  # sorted: a listing or a prefix's delete is a range, not a scan

    def put_file(self, key: str, path: Path) -> None:
        self.put_bytes(key, path.read_bytes())

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        if if_absent and key in self._objects:
            raise AlreadyExists(key)
        if key not in self._objects:
            bisect.insort(self._keys, key)
        self._objects[key] = (bytes(data), ObjectInfo(key=key, size=len(data), mtime=self.clock()))

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        data = self._objects[key][0]
        return data[start or 0:end]

    def download(self, key: str, path: Path) -> None:
        path.write_bytes(self._objects[key][0])

    def _range(self, prefix: str) -> tuple[int, int]:
        """The slice of the sorted keys that start with `prefix`: from it up to the first string past every
        one that does (its last character's successor), both found by bisection."""
        lo = bisect.bisect_left(self._keys, prefix)
        if not prefix or prefix[-1] == chr(sys.maxunicode):
            hi = lo
            while hi < len(self._keys) and self._keys[hi].startswith(prefix):
                hi += 1
            return lo, hi
        return lo, bisect.bisect_left(self._keys, prefix[:-1] + chr(ord(prefix[-1]) + 1), lo)

    def list(self, prefix: str, *, start_after: str = "") -> list[ObjectInfo]:
        lo, hi = self._range(prefix)
        if start_after:
            lo = max(lo, bisect.bisect_right(self._keys, start_after, lo, hi))
        return [self._objects[k][1] for k in self._keys[lo:hi]]

    def has(self, key: str) -> bool:
        return key in self._objects

    def delete_prefix(self, prefix: str) -> None:
        lo, hi = self._range(prefix)
        for key in self._keys[lo:hi]:
            del self._objects[key]
        del self._keys[lo:hi]

    def local_path(self, key: str) -> Path | None:
        return None
