"""The service's accounts, in its registry: teams, API tokens (their hashes) and the audit log.

`authenticate` turns a bearer into a `Principal`: the service's own admin token (the state dir's
api-token file or GOODPUT_TOKEN, compared in constant time), a registry token (`gp_<id>_<secret>`:
its row by id, its secret against the row's scrypt hash once per process, the row's role, team and
revocation read on every request), or an OIDC JWT when the service was given an issuer
(controller/service/oidc.py). `record` writes one audit row per mutating request.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any, Callable, Protocol

from sqlalchemy import insert, select, update

from controller.errors import ServiceError
from controller.service.identity import (
    DEFAULT_TEAM, Principal, Role, check_team, fingerprint, new_token, secret_matches, split_token,
)
from controller.service.registry import Registry
from controller.service.tables import audit, teams, tokens

MAX_AUDIT_PAGE = 1000


class BearerVerifier(Protocol):
    """An identity provider's verifier (controller/service/oidc.py): the principal, or ServiceError."""

    def __call__(self, bearer: str) -> Principal: ...


class Accounts:
    def __init__(self, registry: Registry, *, service_token: str | None, clock: Callable[[], float] = time.time,
                 oidc: BearerVerifier | None = None) -> None:
        self.registry = registry
        self.service_token = service_token
        """The admin token the service was started with (None: no token, loopback only: every caller is admin)."""
        self.clock = clock
        self.oidc = oidc
        self._verified: dict[str, str] = {}
        """fingerprint of a registry token whose secret matched -> its id (scrypt once per token and process)."""
        self._lock = threading.Lock()

    # -- who is asking ------------------------------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> Principal:
        """The principal an `Authorization` header names; ServiceError `unauthorized` (401) otherwise."""
        if self.service_token is None:
            return Principal("local", DEFAULT_TEAM, Role.ADMIN, via="service")
        scheme, _, bearer = (authorization or "").partition(" ")
        bearer = bearer.strip()
        if scheme.lower() != "bearer" or not bearer:
            raise ServiceError("unauthorized", "send 'Authorization: Bearer <token>': a token from `goodput tokens "
                                               "create`, or the service's own (its api-token file or GOODPUT_TOKEN)")
        if secrets.compare_digest(bearer.encode(), self.service_token.encode()):
            return Principal("service", DEFAULT_TEAM, Role.ADMIN, via="service")
        parts = split_token(bearer)
        if parts is not None:
            return self._registry_token(bearer, *parts)
        if self.oidc is not None and bearer.count(".") == 2:
            principal = self.oidc(bearer)
            if principal.team not in {t["name"] for t in self.teams()}:
                raise ServiceError("forbidden", f"{principal.name}'s team {principal.team!r} (from the identity "
                                                f"provider) is not a team of this service: an admin makes it with "
                                                f"`goodput teams create {principal.team}`")
            return principal
        raise ServiceError("unauthorized", "the token is not one this service knows: a token from `goodput tokens "
                                           "create`, the service's own, or an identity provider's it was told of")

    def _registry_token(self, bearer: str, token_id: str, secret: str) -> Principal:
        with self.registry.reading() as conn:
            row = conn.execute(select(tokens).where(tokens.c.id == token_id)).first()
        if row is None:
            raise ServiceError("unauthorized", f"token {token_id} does not exist on this service")
        if row.revoked_at is not None:
            raise ServiceError("unauthorized", f"token {token_id} ({row.name}) was revoked at "
                                               f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(row.revoked_at))}")
        key = fingerprint(bearer)
        with self._lock:
            known = self._verified.get(key) == token_id
        if not known:
            if not secret_matches(secret, row.secret_hash):
                raise ServiceError("unauthorized", f"token {token_id}: the secret does not match")
            with self._lock:
                self._verified[key] = token_id
        return Principal(row.name, row.team, Role.parse(row.role), token_id=token_id)

    # -- teams --------------------------------------------------------------------------------------------
    def add_team(self, name: str, *, gpu_quota: int | None = None) -> dict[str, Any]:
        try:
            check_team(name)
        except ValueError as e:
            raise ServiceError("invalid_request", str(e)) from None
        if gpu_quota is not None and gpu_quota < 0:
            raise ServiceError("invalid_request", f"a GPU quota is 0 or more (got {gpu_quota}); leave it out for none")
        with self.registry.transaction() as conn:
            if conn.execute(select(teams.c.name).where(teams.c.name == name)).first() is not None:
                raise ServiceError("team_exists", f"team {name!r} exists already")
            conn.execute(insert(teams).values(name=name, gpu_quota=gpu_quota, created_at=self.clock()))
        return self.team(name)

    def set_quota(self, name: str, gpu_quota: int | None) -> dict[str, Any]:
        """A team's GPU quota from now on (None: no limit). Runs already holding more go on; the team's
        next runs wait until its runs hold less."""
        if gpu_quota is not None and gpu_quota < 0:
            raise ServiceError("invalid_request", f"a GPU quota is 0 or more (got {gpu_quota}); give none for no limit")
        self.team(name)  # (unknown_team when it does not exist)
        with self.registry.transaction() as conn:
            conn.execute(update(teams).where(teams.c.name == name).values(gpu_quota=gpu_quota))
        return self.team(name)

    def team(self, name: str) -> dict[str, Any]:
        with self.registry.reading() as conn:
            row = conn.execute(select(teams).where(teams.c.name == name)).first()
        if row is None:
            known = ", ".join(t["name"] for t in self.teams())
            raise ServiceError("unknown_team", f"team {name!r} does not exist (teams: {known}); an admin makes it "
                                               f"with `goodput teams create {name}`")
        return dict(row._mapping)

    def teams(self) -> list[dict[str, Any]]:
        return team_rows(self.registry)

    # -- tokens -------------------------------------------------------------------------------------------
    def create_token(self, *, name: str, team: str, role: str, by: Principal) -> dict[str, Any]:
        """A new token: its row, and the token itself (shown this once: only its hash is kept)."""
        try:
            parsed = Role.parse(role)
        except ValueError as e:
            raise ServiceError("invalid_request", str(e)) from None
        if not name.strip() or len(name) > 128:
            raise ServiceError("invalid_request", "a token's name (who it is for) is 1 to 128 characters")
        self.team(team)  # (unknown_team when it does not exist)
        token_id, token, hashed = new_token()
        with self.registry.transaction() as conn:
            conn.execute(insert(tokens).values(id=token_id, name=name, team=team, role=parsed.label,
                                               secret_hash=hashed, created_at=self.clock(), created_by=by.name))
        return {**self.token(token_id), "token": token}

    def token(self, token_id: str) -> dict[str, Any]:
        with self.registry.reading() as conn:
            row = conn.execute(select(tokens).where(tokens.c.id == token_id)).first()
        if row is None:
            raise ServiceError("token_not_found", f"no token {token_id!r} on this service (goodput tokens list)")
        return _token_row(row._mapping)

    def tokens(self) -> list[dict[str, Any]]:
        with self.registry.reading() as conn:
            return [_token_row(r._mapping) for r in conn.execute(select(tokens).order_by(tokens.c.created_at))]

    def revoke(self, token_id: str) -> dict[str, Any]:
        """From now on the token is refused (by every service of this registry: each request reads its
        row); runs it submitted go on."""
        row = self.token(token_id)
        if row["revoked_at"] is None:
            with self.registry.transaction() as conn:
                conn.execute(update(tokens).where(tokens.c.id == token_id).values(revoked_at=self.clock()))
        with self._lock:
            self._verified = {k: v for k, v in self._verified.items() if v != token_id}
        return self.token(token_id)

    # -- the audit log ------------------------------------------------------------------------------------
    def record(self, principal: Principal | None, method: str, path: str, status: int,
               detail: dict[str, Any] | None = None) -> None:
        values = dict(time=self.clock(), method=method, path=path[:2000], status=status, detail=detail or {},
                      who=principal.name if principal else "(unauthenticated)")
        if principal is not None:
            values.update(team=principal.team, role=principal.role.label, via=principal.via)
        with self.registry.transaction() as conn:
            conn.execute(insert(audit).values(**values))

    def audit(self, *, after: int = 0, limit: int = MAX_AUDIT_PAGE) -> list[dict[str, Any]]:
        """Audit rows after id `after`, oldest first."""
        with self.registry.reading() as conn:
            rows = conn.execute(select(audit).where(audit.c.id > after).order_by(audit.c.id).limit(limit))
            return [dict(r._mapping) for r in rows]


def _token_row(row: Any) -> dict[str, Any]:
    return {k: row[k] for k in ("id", "name", "team", "role", "created_at", "created_by", "revoked_at")}


def team_rows(registry: Registry) -> list[dict[str, Any]]:
    """Every team: name, gpu_quota, created_at."""
    with registry.reading() as conn:
        return [dict(r._mapping) for r in conn.execute(select(teams).order_by(teams.c.name))]


def team_quotas(registry: Registry) -> dict[str, int | None]:
    """team -> the GPUs its runs may hold at once (None: no limit), for the scheduler."""
    with registry.reading() as conn:
        return {r.name: r.gpu_quota for r in conn.execute(select(teams.c.name, teams.c.gpu_quota))}
