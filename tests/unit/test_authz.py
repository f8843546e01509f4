"""Every route of the REST API tried with every role, generated from the OpenAPI schema (issue 45): a
token below the route's role gets 403 naming the role it needs, no token gets 401, a token at or above
it never gets either. The roles expected are this file's own table (the schema must list exactly its
routes, and document each one's role as the table says), so a route whose dependency is wrong fails
here rather than agreeing with itself."""

from __future__ import annotations

import copy
import itertools
from typing import Any

from controller.run_state import RunState
from tests.unit.test_roles import ADMIN, BASE, Shared

EXPECTED = {
    ("GET", "/healthz"): "none",
    ("GET", "/readyz"): "none",
    ("GET", "/metrics"): "viewer",
    ("GET", "/v1/whoami"): "any token",
    ("GET", "/v1/runs"): "viewer",
    ("POST", "/v1/runs"): "submitter",
    ("GET", "/v1/runs/{run_id}"): "viewer",
    ("GET", "/v1/runs/{run_id}/spec"): "viewer",
    ("GET", "/v1/runs/{run_id}/events"): "viewer",
    ("GET", "/v1/runs/{run_id}/history"): "viewer",
    ("GET", "/v1/runs/{run_id}/attempts"): "viewer",
    ("GET", "/v1/runs/{run_id}/checkpoints"): "viewer",
    ("POST", "/v1/runs/{run_id}/cancel"): "submitter",
    ("POST", "/v1/runs/{run_id}/resume"): "submitter",
    ("POST", "/v1/runs/{run_id}/drills"): "operator",
    ("GET", "/v1/drills/{drill_id}"): "viewer",
    ("GET", "/v1/nodes"): "viewer",
    ("POST", "/v1/nodes/{name}/release"): "operator",
    ("POST", "/v1/nodes/{name}/drain"): "operator",
    ("GET", "/v1/cluster"): "viewer",
    ("GET", "/v1/audit"): "operator",
    ("GET", "/v1/teams"): "viewer",
    ("POST", "/v1/teams"): "admin",
    ("POST", "/v1/teams/{name}/quota"): "admin",
    ("GET", "/v1/tokens"): "admin",
    ("POST", "/v1/tokens"): "admin",
    ("POST", "/v1/tokens/{token_id}/revoke"): "admin",
}
"""(method, path) -> the least role that may call it ("none": no token needed; "any token": any valid one)."""

LADDER = ["viewer", "submitter", "operator", "admin"]
WHO = {"viewer": "vic", "submitter": "sam", "operator": "olga", "admin": "ada"}
"""A token of each role (test_roles.Shared: vic and sam are vision's, whose run tiny-gpt is; olga is nlp's
operator; ada an admin of the default team)."""


def allowed(role: str | None, needed: str) -> bool:
    if needed == "none":
        return True
    if role is None:
        return False
    return needed == "any token" or LADDER.index(role) >= LADDER.index(needed)


def test_the_schema_documents_each_routes_role_as_the_table_says() -> None:
    schema = Shared().api.app.openapi()
    found = {(m.upper(), p): op.get("x-goodput-role") for p, ops in schema["paths"].items() for m, op in ops.items()}
    assert set(found) == set(EXPECTED), f"routes not in the table: {set(found) - set(EXPECTED)}; gone: " \
                                        f"{set(EXPECTED) - set(found)}"
    assert found == EXPECTED
    for path, ops in schema["paths"].items():
        for op in ops.values():
            assert "Role: " in op["description"], (path, op)


def test_every_route_with_every_role_nothing_beyond_its_role_succeeds() -> None:
    shared = Shared()
    drill = shared.api.post("/v1/runs/tiny-gpt/drills", json={"kind": "kill-node", "at_step": 10**6},
                            headers=shared.as_("olga")).json()["id"]
    names = itertools.count()

    def params(path: str) -> str:
        token = shared.api.post("/v1/tokens", json={"name": f"x{next(names)}"}, headers=ADMIN).json()["id"]
        return path.format(run_id="tiny-gpt", drill_id=drill, name="vision" if path.startswith("/v1/teams") else
                           "node-0", token_id=token)

    def body(method: str, path: str) -> Any:
        n = next(names)
        spec = copy.deepcopy(BASE)
        spec.update(name=f"run-{n}", drills=[])
        return {("POST", "/v1/runs"): spec, ("POST", "/v1/runs/{run_id}/drills"): {"kind": "kill-node", "at_step": 10**6},
                ("POST", "/v1/teams"): {"name": f"team-{n}"}, ("POST", "/v1/teams/{name}/quota"): {"gpu_quota": 8},
                ("POST", "/v1/tokens"): {"name": f"t{n}"}}.get((method, path))

    schema = shared.api.app.openapi()
    tried = 0
    for path, ops in schema["paths"].items():
        for method in ops:
            method = method.upper()
            needed = EXPECTED[(method, path)]
            for role in [None, *LADDER]:  # lowest first: a refused mutation is tried before an allowed one
                headers = shared.as_(WHO[role]) if role is not None else {}
                answer = shared.api.request(method, params(path), json=body(method, path), headers=headers)
                tried += 1
                where = f"{method} {path} as {role or 'no token'}: {answer.status_code} {answer.text[:200]}"
                if allowed(role, needed):
                    assert answer.status_code not in (401, 403), where
                elif role is None:
                    assert answer.status_code == 401, where
                else:
                    assert answer.status_code == 403, where
                    error = answer.json()["error"]
                    assert error["code"] == "forbidden" and f"{needed} role" in error["message"], where
                if role == "viewer" and (method, path) == ("POST", "/v1/runs/{run_id}/cancel"):
                    assert shared.controller.state is RunState.RUNNING and not shared.controller.cancel_requested
    assert tried == 5 * len(EXPECTED)
