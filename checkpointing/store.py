"""The narrow storage protocol checkpoints talk to, and its two implementations.

- `LocalStore` (`file://PATH`, the default): plain files; an if-absent put is an atomic hard link.
- `S3Store` (`s3://bucket/prefix`) on boto3: endpoint and credentials from the standard AWS
  environment/config (so MinIO, Ceph RGW and real S3 all work), managed multipart uploads with
  parallel parts, ranged reads, conditional puts (If-None-Match: *) for the manifest, and retries
  with exponential backoff on throttling, 5xx and connection errors through tenacity, bounded by a
  time budget so an outage ends in a clear error instead of a hang.
Imports nothing of the project; boto3 is imported only when an S3 store is opened.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar

T = TypeVar("T")


class StoreError(Exception):
    """A storage operation failed for good (after retries); the message names the key and why."""


class StoreUnavailable(StoreError):
    """The store refuses requests for now (an outage); the same request may succeed later."""


class StoreOutage:
    """A store that does not answer, seen from its caller: when to try again (a backoff doubling from
    0.5 s up to `max_backoff_s`), and whether the outage has outlasted the retry budget (said once)."""

    def __init__(self, budget_s: float, *, max_backoff_s: float = 30.0) -> None:
        self.budget_s = budget_s
        self.max_backoff_s = max_backoff_s
        self.since: float | None = None
        """When the store stopped answering (None: it answers)."""
        self.backoff_s = 0.0
        self.retry_at = float("-inf")
        self.announced = False

    def due(self, now: float) -> bool:
        """Whether to try the store now."""
        return now >= self.retry_at

    def failed(self, now: float) -> bool:
        """The store did not answer: back off. True the first time the outage outlasts the budget."""
        if self.since is None:
            self.since, self.backoff_s = now, 0.5
        else:
            self.backoff_s = min(2 * self.backoff_s, self.max_backoff_s)
        self.retry_at = now + self.backoff_s
        if not self.announced and now - self.since >= self.budget_s:
            self.announced = True
            return True
        return False

    def answered(self, now: float) -> float | None:
        """The store answered: how long it had been down, if the outage was announced."""
        down = now - self.since if self.announced and self.since is not None else None
        self.since, self.announced, self.retry_at = None, False, float("-inf")
        return down


class NotFound(StoreError):
    """The key does not exist (a definite answer, unlike an outage)."""


class AlreadyExists(StoreError):
    """An if-absent put found the key already there (another writer committed first)."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    """Key relative to the store's root."""
    size: int
    """Bytes."""
    mtime: float
    """Unix seconds of the last write."""


class ObjectStore(Protocol):
    uri: str

    def put_file(self, key: str, path: Path) -> None: ...
    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None: ...
    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes: ...
    def download(self, key: str, path: Path) -> None: ...
    def list(self, prefix: str) -> list[ObjectInfo]: ...
    def delete_prefix(self, prefix: str) -> None: ...
    def local_path(self, key: str) -> Path | None:
        """Where the key lives on this machine's filesystem, if it does (lets DCP write in place)."""
        ...


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

    def list(self, prefix: str) -> list[ObjectInfo]:
        base = self._path(prefix)
        if not base.exists():
            return []
        out = []
        for p in sorted(base.rglob("*")) if base.is_dir() else [base]:
            if p.is_file() and not p.name.startswith(".tmp-"):
                st = p.stat()
                out.append(ObjectInfo(str(p.relative_to(self.root)), st.st_size, st.st_mtime))
        return out

    def delete_prefix(self, prefix: str) -> None:
        path = self._path(prefix)
        if path.is_file():
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)

    def local_path(self, key: str) -> Path | None:
        return self._path(key)


_RETRYABLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                    "InternalError", "ServiceUnavailable", "RequestTimeout", "500", "502", "503", "504"}


class S3Store:
    def __init__(self, bucket: str, prefix: str, *, retry_budget_s: float = 30.0,
                 part_size: int = 16 * 2**20, max_concurrency: int = 8) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.retry_budget_s = retry_budget_s
        # tenacity owns retries (one budget for every call); botocore tries once per call.
        self.client = boto3.client("s3", config=Config(
            retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=5, read_timeout=30,
            max_pool_connections=max(10, max_concurrency * 2)))
        self.transfer = TransferConfig(multipart_threshold=part_size, multipart_chunksize=part_size,
                                       max_concurrency=max_concurrency, use_threads=True)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import ClientError, ConnectionError as BotoConnectionError
        from tenacity import (
            RetryError, Retrying, retry_if_exception, stop_after_delay, wait_exponential_jitter,
        )

        def retryable(e: BaseException | None) -> bool:
            if isinstance(e, ClientError):
                err = e.response.get("Error", {})
                status = str(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
                return err.get("Code") in _RETRYABLE_CODES or status in _RETRYABLE_CODES
            if isinstance(e, S3UploadFailedError):  # managed transfers wrap the ClientError
                return retryable(e.__cause__ or e.__context__) or any(
                    f"({code})" in str(e) for code in _RETRYABLE_CODES)
            return isinstance(e, BotoConnectionError)

        started = time.monotonic()
        try:
            for attempt in Retrying(retry=retry_if_exception(retryable), reraise=False,
                                    stop=stop_after_delay(self.retry_budget_s),
                                    wait=wait_exponential_jitter(multiplier=0.2, max=5.0)):
                with attempt:
                    return fn()
        except RetryError as e:
            cause = e.last_attempt.exception()
            raise StoreError(f"{what} on {self.uri} failed for {time.monotonic() - started:.1f} s "
                             f"(retried within a {self.retry_budget_s:.0f} s budget): {cause}") from None
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code == "PreconditionFailed":
                raise AlreadyExists(f"{what}: {self.uri} already has it") from None
            if code in ("NoSuchKey", "404", "NotFound"):
                raise NotFound(f"{what}: {self.uri} has no such key") from None
            raise StoreError(f"{what} on {self.uri} failed: {e}") from None
        except (S3UploadFailedError, BotoConnectionError) as e:
            raise StoreError(f"{what} on {self.uri} failed: {e}") from None
        raise AssertionError("unreachable")

    def put_file(self, key: str, path: Path) -> None:
        self._call(f"upload of {key}", lambda: self.client.upload_file(
            str(path), self.bucket, self._key(key), Config=self.transfer))

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if if_absent else {}
        self._call(f"put of {key}", lambda: self.client.put_object(
            Bucket=self.bucket, Key=self._key(key), Body=data, **extra))

    def get_bytes(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        extra: dict[str, Any] = {}
        if start is not None:
            extra["Range"] = f"bytes={start}-{'' if end is None else end - 1}"

        def get() -> bytes:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key), **extra)["Body"].read()

        return self._call(f"get of {key}", get)

    def download(self, key: str, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._call(f"download of {key}", lambda: self.client.download_file(
            self.bucket, self._key(key), str(path), Config=self.transfer))

    def list(self, prefix: str) -> list[ObjectInfo]:
        def run() -> list[ObjectInfo]:
            out = []
            paginator = self.client.get_paginator("list_objects_v2")
            strip = len(self._key(""))
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix)):
                for obj in page.get("Contents", []):
                    out.append(ObjectInfo(obj["Key"][strip:], obj["Size"], obj["LastModified"].timestamp()))
            return out

        return self._call(f"list of {prefix}", run)

    def delete_prefix(self, prefix: str) -> None:
        keys = [self._key(o.key) for o in self.list(prefix)]
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True}
            self._call(f"delete under {prefix}", lambda: self.client.delete_objects(Bucket=self.bucket, Delete=batch))

    def local_path(self, key: str) -> Path | None:
        return None


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

    def list(self, prefix: str) -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def delete_prefix(self, prefix: str) -> None:
        self._check("delete", prefix)
        self.inner.delete_prefix(prefix)

    def local_path(self, key: str) -> Path | None:
        """In place only while writes are allowed: during an outage, shards wait in staging."""
        return None if self.until() > time.time() else self.inner.local_path(key)


def retry_unavailable(what: str, fn: Callable[[], T], *, budget_s: float) -> T:
    """Call `fn`, retrying with backoff while the store is unavailable, for at most `budget_s`;
    past it a StoreError says how long it tried."""
    from tenacity import RetryError, Retrying, retry_if_exception_type, stop_after_delay, wait_exponential_jitter

    started = time.monotonic()
    try:
        for attempt in Retrying(retry=retry_if_exception_type(StoreUnavailable), stop=stop_after_delay(budget_s),
                                wait=wait_exponential_jitter(initial=0.2, max=2.0), reraise=False):
            with attempt:
                return fn()
    except RetryError as e:
        raise StoreError(f"{what} failed for {time.monotonic() - started:.1f} s (retried within a {budget_s:.0f} s "
                         f"budget): {e.last_attempt.exception()}") from None
    raise AssertionError("unreachable")


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
