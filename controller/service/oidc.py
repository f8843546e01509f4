"""Bearers from an identity provider: an OIDC ID or access token (a signed JWT) that names a person,
their team and their role in claims. PyJWT verifies it: the signature against the provider's keys
(its JWKS, found through the issuer's discovery document or given as a URL or a file), the issuer,
the audience and the expiry. Then the claims give the principal: its name (`email`, else `sub`), its
team (`goodput_team` by default) and its role (`goodput_role`; a token without one is a viewer).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.errors import ServiceError
from controller.service.identity import Principal, Role

ALGORITHMS = ["RS256", "RS384", "RS512", "ES256", "ES384", "PS256"]
"""Asymmetric only: a shared secret (HS256) would let anyone who verifies also sign."""


@dataclass(frozen=True)
class OidcSettings:
    issuer: str
    audience: str
    jwks: str | None = None
    """A JWKS URL or file; None: the issuer's discovery document names it (jwks_uri)."""
    team_claim: str = "goodput_team"
    role_claim: str = "goodput_role"
    leeway_s: float = 30.0
    """Clock skew allowed on exp/nbf/iat."""


class OidcVerifier:
    """`verifier(bearer)`: the principal a provider's JWT names, or ServiceError `unauthorized` saying why not."""

    def __init__(self, settings: OidcSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._client: Any = None
        self._keys: Any = None

    def __call__(self, bearer: str) -> Principal:
        import jwt

        s = self.settings
        try:
            key = self._signing_key(bearer)
            claims = jwt.decode(bearer, key, algorithms=ALGORITHMS, audience=s.audience, issuer=s.issuer,
                                leeway=s.leeway_s, options={"require": ["exp", "iss", "aud", "sub"]})
        except jwt.PyJWTError as e:
            raise ServiceError("unauthorized", f"the identity provider's token was refused: {e}") from None
        name = str(claims.get("email") or claims["sub"])
        team = claims.get(s.team_claim)
        if not isinstance(team, str) or not team:
            raise ServiceError("unauthorized", f"the identity provider's token for {name} has no {s.team_claim!r} "
                                               "claim: the provider must say which team it is of")
        role = claims.get(s.role_claim, "viewer")
        try:
            parsed = Role.parse(str(role))
        except ValueError as e:
            raise ServiceError("unauthorized", f"the identity provider's token for {name}: {e}") from None
        return Principal(name, team, parsed, via="oidc")

    def _signing_key(self, bearer: str) -> Any:
        import jwt

        with self._lock:
            source = self.settings.jwks or self._discovered()
            if source.startswith(("http://", "https://")):
                if self._client is None:
                    self._client = jwt.PyJWKClient(source, cache_keys=True, lifespan=300)
                return self._client.get_signing_key_from_jwt(bearer).key
            if self._keys is None:
                self._keys = jwt.PyJWKSet.from_json(Path(source).read_text())
        kid = jwt.get_unverified_header(bearer).get("kid")
        for key in self._keys.keys:
            if kid is None or key.key_id == kid:
                return key.key
        raise jwt.PyJWKClientError(f"no key {kid!r} in {source}")

    def _discovered(self) -> str:
        """The jwks_uri of the issuer's discovery document (read once)."""
        import httpx

        if self.settings.jwks is not None:
            return self.settings.jwks
        url = self.settings.issuer.rstrip("/") + "/.well-known/openid-configuration"
        try:
            document = httpx.get(url, timeout=10.0).raise_for_status().json()
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            raise ServiceError("unauthorized", f"the identity provider's discovery document {url} could not be read: "
                                               f"{e}") from None
        uri = document.get("jwks_uri")
        if not isinstance(uri, str):
            raise ServiceError("unauthorized", f"{url} names no jwks_uri")
        self.settings = OidcSettings(**{**self.settings.__dict__, "jwks": uri})
        return uri
