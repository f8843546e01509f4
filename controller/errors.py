"""Coded errors: what went wrong as a stable, machine-readable `code` and a sentence that says what to
do. Transports choose how to show them (the REST API maps codes to HTTP statuses in service/app.py,
the CLI prints one line); nothing here knows about HTTP."""

from __future__ import annotations


class GoodputError(Exception):
    """An error with a code (snake_case, stable: clients branch on it) and a message for a person."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class ServiceError(GoodputError):
    """A request the service refuses (unknown run, bad spec, wrong state, over a limit)."""


class ClusterError(GoodputError):
    """The cluster cannot be started or reached; the message says what to fix."""

    def __init__(self, message: str) -> None:
        super().__init__("cluster_error", message)


class ClusterSilent(ClusterError):
    """The cluster did not answer within the wait its caller gave (a controller cut off from it):
    nothing was learned, and nothing should be concluded; ask again later."""


class RegistryBusy(GoodputError):
    """Another `goodput serve` drives the runs of this registry (one controller per registry)."""

    def __init__(self, message: str) -> None:
        super().__init__("registry_busy", message)


class NotLeading(GoodputError):
    """This service lost the registry's lock: another may lead now, so it writes nothing more."""

    def __init__(self, message: str) -> None:
        super().__init__("not_leading", message)


class ApiBindError(OSError):
    """The API's address cannot be bound (busy port, foreign address)."""
