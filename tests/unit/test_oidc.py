"""An identity provider's bearers (issue 45): a JWT signed by a local signer (an RSA key made here, its
public half served as a JWKS behind a discovery document on loopback, as a provider serves them) is
accepted for the team and role its claims name; a wrong signature, issuer, audience or expiry, a missing
team claim or a team the service does not have are refused with what is wrong."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from fastapi.testclient import TestClient

from controller.service.app import create_app
from controller.service.oidc import OidcSettings, OidcVerifier
from tests.unit.test_roles import ADMIN, Shared


class Provider:
    """A signing key and an HTTP server on 127.0.0.1 with /.well-known/openid-configuration and /jwks."""

    def __init__(self) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
        jwks = {"keys": [{**public, "kid": "k1", "use": "sig", "alg": "RS256"}]}
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = {"/.well-known/openid-configuration": {"issuer": provider.issuer,
                                                              "jwks_uri": provider.issuer + "/jwks"},
                        "/jwks": jwks}.get(self.path)
                self.send_response(200 if body else 404)
                self.end_headers()
                self.wfile.write(json.dumps(body or {}).encode())

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.issuer = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.jwks = jwks

    def sign(self, key: Any = None, **claims: Any) -> str:
        now = int(time.time())
        body = {"iss": self.issuer, "aud": "goodput", "sub": "u-1", "email": "ana@example.org", "iat": now,
                "exp": now + 300, "goodput_team": "vision", "goodput_role": "operator", **claims}
        return jwt.encode({k: v for k, v in body.items() if v is not None}, key or self.key, algorithm="RS256",
                          headers={"kid": "k1"})

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def provider() -> Iterator[Provider]:
    p = Provider()
    yield p
    p.stop()


def test_a_providers_token_signs_in_with_its_team_and_role(provider: Provider) -> None:
    shared = Shared()
    api = TestClient(create_app(shared.service, token="service-admin-token",
                                oidc=OidcVerifier(OidcSettings(issuer=provider.issuer, audience="goodput"))))
    token = provider.sign()
    me = api.get("/v1/whoami", headers={"Authorization": f"Bearer {token}"})
    assert me.status_code == 200, me.text
    assert me.json() == {"name": "ana@example.org", "team": "vision", "role": "operator", "token_id": None,
                         "via": "oidc"}
    drill = api.post("/v1/runs/tiny-gpt/drills", json={"kind": "kill-node"}, headers={"Authorization": f"Bearer {token}"})
    assert drill.status_code == 202, drill.text
    viewer = provider.sign(goodput_role=None)  # no role claim: a viewer
    assert api.get("/v1/whoami", headers={"Authorization": f"Bearer {viewer}"}).json()["role"] == "viewer"
    refused = api.post("/v1/runs/tiny-gpt/cancel", headers={"Authorization": f"Bearer {viewer}"})
    assert refused.status_code == 403 and "submitter role" in refused.json()["error"]["message"]
    audit = api.get("/v1/audit", headers=ADMIN).json()
    assert [(r["who"], r["via"], r["status"]) for r in audit[-2:]] == [("ana@example.org", "oidc", 202),
                                                                      ("ana@example.org", "oidc", 403)]


@pytest.mark.parametrize(("why", "claims", "other_key", "expected"), [
    ("signed by someone else", {}, True, "Signature verification failed"),
    ("another issuer", {"iss": "http://127.0.0.1:1"}, False, "Invalid issuer"),
    ("another audience", {"aud": "someone-else"}, False, "Audience"),
    ("expired", {"exp": int(time.time()) - 3600, "iat": int(time.time()) - 7200}, False, "expired"),
    ("no team", {"goodput_team": None}, False, "no 'goodput_team' claim"),
    ("a role that does not exist", {"goodput_role": "root"}, False, "role 'root' does not exist"),
])
def test_a_bad_provider_token_is_refused_with_the_reason(provider: Provider, tmp_path: Path, why: str,
                                                         claims: dict[str, Any], other_key: bool, expected: str) -> None:
    shared = Shared()
    (tmp_path / "jwks.json").write_text(json.dumps(provider.jwks))  # the keys from a file this time
    api = TestClient(create_app(shared.service, token="service-admin-token", oidc=OidcVerifier(
        OidcSettings(issuer=provider.issuer, audience="goodput", jwks=str(tmp_path / "jwks.json")))))
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048) if other_key else None
    answer = api.get("/v1/runs", headers={"Authorization": f"Bearer {provider.sign(key, **claims)}"})
    assert answer.status_code == 401, why
    assert expected in answer.json()["error"]["message"], (why, answer.json())


def test_a_provider_team_the_service_does_not_have_is_forbidden(provider: Provider) -> None:
    shared = Shared()
    api = TestClient(create_app(shared.service, token="service-admin-token",
                                oidc=OidcVerifier(OidcSettings(issuer=provider.issuer, audience="goodput"))))
    answer = api.get("/v1/runs", headers={"Authorization": f"Bearer {provider.sign(goodput_team='robotics')}"})
    assert answer.status_code == 403 and "goodput teams create robotics" in answer.json()["error"]["message"]
