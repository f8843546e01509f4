"""The storage protocol, its errors, and the retry and back-off rules every store and caller share."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, TypeVar

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
    def list(self, prefix: str, *, start_after: str = "") -> list[ObjectInfo]:
        """The objects under `prefix` in key order; with `start_after`, only those whose key sorts after it
        (S3's StartAfter: a reader that needs the newest few of many records lists only those)."""
        ...
    def delete_prefix(self, prefix: str) -> None: ...
    def local_path(self, key: str) -> Path | None:
        """Where the key lives on this machine's filesystem, if it does (lets DCP write in place)."""
        ...


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
