"""A small client of the goodput REST API for the CLI: `GOODPUT_URL` (default the port `goodput serve`
and `goodput run` serve on) and `GOODPUT_TOKEN`, else the token file of a service on this machine
(under `GOODPUT_STATE_DIR`, default ~/.goodput); every failure becomes one line that says what to do."""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlparse

from controller.service.auth import STATE_DIR_ENV, TOKEN_ENV, default_state_dir, token_path

URL_ENV = "GOODPUT_URL"
DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8470
"""Where `goodput run` serves its API unless told otherwise, and where this client looks first."""
DEFAULT_URL = f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"


def local_token() -> str | None:
    """The token file a service on this machine made (only used for loopback URLs)."""
    from controller.service.auth import AuthConfigError, read_token_file, token_path

    try:
        return read_token_file(token_path(default_state_dir()))
    except (AuthConfigError, OSError):
        return None


class ApiClientError(Exception):
    """The API could not be reached or refused the call; the message is for the user."""


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.url = (url or os.environ.get(URL_ENV) or DEFAULT_URL).rstrip("/")
        host = urlparse(self.url).hostname or ""
        token = token or os.environ.get(TOKEN_ENV) or (local_token() if host in ("127.0.0.1", "localhost", "::1")
                                                       else None)
        import httpx  # here, not at import: the CLI and the server import this module for its names

        self._http = httpx.Client(
            base_url=self.url, timeout=timeout_s,
            headers={"Authorization": f"Bearer {token}"} if token else {},
            # a proxy from the environment must not capture calls to this machine
            trust_env=host not in ("127.0.0.1", "localhost", "::1"),
        )

    def call(self, method: str, path: str, body: dict[str, Any] | None = None,
             params: dict[str, Any] | None = None) -> Any:
        import httpx

        try:
            response = self._http.request(method, path, json=body, params=params)
        except httpx.TransportError as e:
            raise ApiClientError(f"no goodput API answers at {self.url} ({type(e).__name__}); start `goodput serve` "
                                 f"(or `goodput run` serves one while its run lasts), or set {URL_ENV}") from None
        if response.status_code == 401:
            where = token_path(default_state_dir())
            found = "" if where.exists() else ", not found there"
            raise ApiClientError(f"{self.url} refused the token (HTTP 401); set {TOKEN_ENV} to the service's token. "
                                 f"A service on this machine keeps it in its --state-dir as api-token; this client "
                                 f"looked in {where}{found}: set {STATE_DIR_ENV} to the service's --state-dir")
        if response.is_success:
            return response.json()
        try:
            error = response.json()["error"]
            message = f"{error['message']} ({error['code']}, HTTP {response.status_code})"
        except (ValueError, KeyError, TypeError):
            message = f"HTTP {response.status_code} from {self.url}{path}: {response.text[:200]}"
        raise ApiClientError(message)

    def close(self) -> None:
        self._http.close()
