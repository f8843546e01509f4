"""`MemoryStore`: an ObjectStore in memory, with the caller's clock for mtimes (the simulator's virtual
clock). For a 54-day simulated run: no files, no I/O."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from checkpointing.store.base import AlreadyExists, ObjectInfo


class MemoryStore:
    """An ObjectStore in memory, with the virtual clock's mtimes."""

    def __init__(self, clock: Callable[[], float], uri: str = "sim://checkpoints") -> None:
        self.uri = uri
        self.clock = clock
        self._objects: dict[str, tuple[bytes, float]] = {}

    def put_file(self, key: str, path: Path) -> None:
        self.put_bytes(key, path.read_bytes())

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        if if_absent and key in self._objects:
            raise AlreadyExists(key)
        self._objects[key] = (bytes(data), self.clock())

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        data = self._objects[key][0]
        return data[start or 0:end]

    def download(self, key: str, path: Path) -> None:
        path.write_bytes(self._objects[key][0])

    def list(self, prefix: str) -> list[ObjectInfo]:
        return [ObjectInfo(key=k, size=len(v[0]), mtime=v[1])
                for k, v in sorted((k, v) for k, v in self._objects.items() if k.startswith(prefix))]

    def has(self, key: str) -> bool:
        return key in self._objects

    def delete_prefix(self, prefix: str) -> None:
        for key in [k for k in self._objects if k.startswith(prefix)]:
            del self._objects[key]

    def local_path(self, key: str) -> Path | None:
        return None
