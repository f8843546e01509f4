"""`S3Store` (`s3://bucket/prefix`) on boto3: endpoint and credentials from the standard AWS
environment/config (so MinIO, Ceph RGW and real S3 all work), managed multipart uploads with parallel
parts, ranged reads, conditional puts (If-None-Match: *) for the manifest, and retries with exponential
backoff on throttling, 5xx and connection errors through tenacity, bounded by a time budget so an outage
ends in a clear error instead of a hang. boto3 is imported only when an S3 store is opened."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from checkpointing.store.base import AlreadyExists, NotFound, ObjectInfo, StoreError, T


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

    def list(self, prefix: str, *, start_after: str = "") -> list[ObjectInfo]:
        def run() -> list[ObjectInfo]:
            out = []
            paginator = self.client.get_paginator("list_objects_v2")
            strip = len(self._key(""))
            after = {"StartAfter": self._key(start_after)} if start_after else {}
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._key(prefix), **after):
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
