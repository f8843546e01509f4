"""Who is asking, and what they may do: roles, API tokens and their hashes. Pure (hashlib, secrets).

A request carries a bearer token. It names a principal: a person or a team's automation, of one team,
with one role. Roles are ordered, each allowing what the one below it does:

- viewer: reads its team's runs (and the cluster's nodes);
- submitter: submits runs for its team, cancels and resumes them;
- operator: drills, node releases, the audit log, and any team's runs;
- admin: tokens and teams.

A goodput token is `gp_<id>_<secret>`: the id finds its registry row, the secret is checked against
the row's scrypt hash (hashlib's, a standard memory-hard KDF; the registry never holds a token). A
verified token is remembered by a SHA-256 of it, so scrypt runs once per token and process, not per
request; its row (role, team, revoked) is read on every request, so a revocation holds at once in every
service of the registry.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

TOKEN_PATTERN = re.compile(r"gp_([0-9a-f]{12})_([A-Za-z0-9_-]{43})")
TEAM_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
DEFAULT_TEAM = "default"
"""The team of runs submitted before teams existed, and of tokens made without one."""

_SCRYPT = {"n": 2**14, "r": 8, "p": 1}
"""scrypt's cost: ~16 MiB and tens of milliseconds per check (once per token and process)."""


class Role(enum.IntEnum):
    VIEWER = 1
    SUBMITTER = 2
    OPERATOR = 3
    ADMIN = 4

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> "Role":
        try:
            return cls[text.upper()]
        except KeyError:
            raise ValueError(f"role {text!r} does not exist: one of {', '.join(r.label for r in cls)}") from None


@dataclass(frozen=True)
class Principal:
    name: str
    team: str
    role: Role
    token_id: str | None = None
    """The registry token it came from (None: the service's own admin token, or an OIDC bearer)."""
    via: str = "token"
    """token (a registry token), service (the admin token of the state dir or GOODPUT_TOKEN), oidc."""

    def may(self, role: Role) -> bool:
        return self.role >= role

    def sees(self, team: str) -> bool:
        """Whether this principal may see (and, as a submitter, act on) a run of `team`."""
        return self.role >= Role.OPERATOR or team == self.team

    def to_dict(self) -> dict[str, str | None]:
        return {"name": self.name, "team": self.team, "role": self.role.label, "token_id": self.token_id,
                "via": self.via}


def check_team(team: str) -> str:
    if not TEAM_PATTERN.fullmatch(team):
        raise ValueError(f"team {team!r} is not a valid name: lowercase letters, digits and '-', at most 63, "
                         "starting with a letter or digit")
    return team


def new_token() -> tuple[str, str, str]:
    """(id, the token to hand out once, its secret's hash to keep)."""
    token_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(32)
    return token_id, f"gp_{token_id}_{secret}", hash_secret(secret)


def split_token(token: str) -> tuple[str, str] | None:
    """(id, secret) of a goodput token, None for anything else."""
    m = TOKEN_PATTERN.fullmatch(token)
    return (m.group(1), m.group(2)) if m else None


def hash_secret(secret: str, *, salt: bytes | None = None) -> str:
    """`scrypt$n$r$p$salt$hash`, salt and hash in unpadded base64."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = hashlib.scrypt(secret.encode(), salt=salt, dklen=32, **_SCRYPT)
    return "$".join(["scrypt", str(_SCRYPT["n"]), str(_SCRYPT["r"]), str(_SCRYPT["p"]), _b64(salt), _b64(digest)])


def secret_matches(secret: str, stored: str) -> bool:
    """Whether `secret` hashes to `stored` (with the cost and salt `stored` names)."""
    try:
        kind, n, r, p, salt, digest = stored.split("$")
        if kind != "scrypt":
            return False
        want = _unb64(digest)
        got = hashlib.scrypt(secret.encode(), salt=_unb64(salt), n=int(n), r=int(r), p=int(p), dklen=len(want))
    except (ValueError, TypeError):
        return False
    return hmac.compare_digest(got, want)


def fingerprint(token: str) -> str:
    """A fast, one-way name for a token already verified (the in-memory cache's key; never stored)."""
    return hashlib.sha256(token.encode()).hexdigest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
