"""`LocalStore` (`file://PATH`, the default): plain files; an if-absent put is an atomic hard link."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from checkpointing.store.base import AlreadyExists, NotFound, ObjectInfo


class LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.uri = f"file://{root}"

    def _path(self, key: str) -> Path:
        return self.root / key

    def put_file(self, key: str, path: Path) -> None:
        dest = self._path(key)
        if dest.resolve() == path.resolve():
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if if_absent:
                try:
                    os.link(tmp, dest)  # atomic, and fails if dest exists
                except FileExistsError:
                    raise AlreadyExists(f"{self.uri}/{key} already exists") from None
            else:
                os.replace(tmp, dest)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                if start is not None:
                    f.seek(start)
                    return f.read((end - start) if end is not None else -1)
                return f.read()
        except FileNotFoundError:
            raise NotFound(f"{self.uri}/{key} does not exist") from None

    def download(self, key: str, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self._path(key), path)

    def list(self, prefix: str, *, start_after: str = "") -> list[ObjectInfo]:
        base = self._path(prefix)
        if not base.exists():
            return []
        out = []
        for p in base.rglob("*") if base.is_dir() else [base]:
            key = str(p.relative_to(self.root))
            if key > start_after and p.is_file() and not p.name.startswith(".tmp-"):
                st = p.stat()
                out.append(ObjectInfo(key, st.st_size, st.st_mtime))
        return sorted(out, key=lambda o: o.key)

    def delete_prefix(self, prefix: str) -> None:
        path = self._path(prefix)
        if path.is_file():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)

    def local_path(self, key: str) -> Path | None:
        return self._path(key)
