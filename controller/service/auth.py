"""The API's bearer token: where it comes from, where it is kept, and when serving without one is refused.

Order: an explicit token (`GOODPUT_TOKEN`), else the token file under the state dir, made on first start
with owner-only permissions (0600). Only the file's path is ever printed or logged, never the token.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import stat
from pathlib import Path

TOKEN_FILE = "api-token"
TOKEN_ENV = "GOODPUT_TOKEN"
STATE_DIR_ENV = "GOODPUT_STATE_DIR"


def default_state_dir() -> str:
    """Where a service (and `goodput run`) keeps its state and token: $GOODPUT_STATE_DIR, else ~/.goodput."""
    return os.environ.get(STATE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".goodput")


class AuthConfigError(Exception):
    """The service cannot be started safely as asked; the message says what to change."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def token_path(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / TOKEN_FILE


def read_token_file(path: Path) -> str | None:
    """The token in `path`, refusing a file others can read (someone may have copied it)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthConfigError(f"{path} is readable by others (mode {stat.S_IMODE(mode):o}); run `chmod 600 {path}`")
    token = path.read_text().strip()
    if not token:
        raise AuthConfigError(f"{path} is empty; delete it to have a new token made")
    return token


def ensure_token(state_dir: str | os.PathLike[str], explicit: str | None) -> tuple[str, Path | None, bool]:
    """(token, file it is kept in or None when explicit, made now)."""
    if explicit:
        return explicit, None, False
    path = token_path(state_dir)
    existing = read_token_file(path)
    if existing is not None:
        return existing, path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path, True


def check_bind(host: str, token: str | None) -> None:
    """Serving beyond this machine without a token would hand the cluster to anyone who can reach it."""
    if token is None and not is_loopback(host):
        raise AuthConfigError(f"refusing to serve on {host} without a token: set GOODPUT_TOKEN, or bind 127.0.0.1")
