"""The narrow storage protocol checkpoints talk to (base.py) and its implementations: `LocalStore`
(file://, the default), `S3Store` (s3://, boto3), `MemoryStore` (the simulator's, on its virtual clock)
and `OutageGate` (the storage-outage drill). Imports nothing of the project."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from checkpointing.store.base import (AlreadyExists, NotFound, ObjectInfo, ObjectStore, StoreError, StoreOutage,
                                      StoreUnavailable, retry_unavailable)
from checkpointing.store.faults import OutageGate
from checkpointing.store.local import LocalStore
from checkpointing.store.memory import MemoryStore
from checkpointing.store.s3 import S3Store

__all__ = ["AlreadyExists", "LocalStore", "MemoryStore", "NotFound", "ObjectInfo", "ObjectStore", "OutageGate", "S3Store",
           "StoreError", "StoreOutage", "StoreUnavailable", "anchored", "open_store", "retry_unavailable"]


def anchored(uri: str, root: Path) -> str:
    """`uri` with a relative local path made absolute under `root` (file://./runs -> file://ROOT/runs);
    any other URI as it is."""
    if "://" in uri and not uri.startswith("file://"):
        return uri
    path = Path(uri.removeprefix("file://"))
    return uri if path.is_absolute() else f"file://{(root / path).resolve()}"


def open_store(uri: str, **s3_options: Any) -> ObjectStore:
    """`file://PATH`, a plain path, or `s3://bucket/prefix`. GOODPUT_S3_RETRY_BUDGET_S bounds how
    long one S3 call keeps retrying (default 30 s)."""
    if uri.startswith("s3://"):
        bucket, _, prefix = uri[len("s3://"):].partition("/")
        if not bucket:
            raise StoreError(f"checkpoint.uri {uri!r} names no bucket; use s3://BUCKET/PREFIX")
        if "GOODPUT_S3_RETRY_BUDGET_S" in os.environ:
            s3_options.setdefault("retry_budget_s", float(os.environ["GOODPUT_S3_RETRY_BUDGET_S"]))
        return S3Store(bucket, prefix, **s3_options)
    if uri.startswith("file://"):
        return LocalStore(Path(uri[len("file://"):]).resolve())
    if "://" in uri:
        raise StoreError(f"checkpoint.uri {uri!r}: use file://PATH or s3://BUCKET/PREFIX")
    return LocalStore(Path(uri).resolve())
