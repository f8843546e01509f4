"""Identities and roles on the REST API (issue 45): tokens an admin makes for a person or a team, kept
as scrypt hashes only; each route's role (403 names it); a team sees and acts on its own runs only
(an operator on any); every mutating request in the audit log; a revoked token refused at once while
its run trains on; bad input answered with what to fix."""

from __future__ import annotations

import base64
import copy
import hashlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from sqlalchemy import select

from controller.run_state import RunState
from controller.service.app import create_app
from controller.service.identity import hash_secret, secret_matches, split_token
from controller.service.registry import Registry
from controller.service.service import Service
from controller.service.tables import tokens
from controller.spec import parse_spec
from tests.unit.fakes import FakeCluster, FakeInjector, FakeWorkerGroup, ManualClock, drive

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())
ADMIN = {"Authorization": "Bearer service-admin-token"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class Shared:
    """A thread-less service with the run `tiny-gpt` of team vision training, and a token per role."""

    def __init__(self) -> None:
        raw = copy.deepcopy(BASE)
        raw["drills"] = []
        spec = parse_spec(raw)
        self.group = FakeWorkerGroup()
        self.clock = ManualClock(100.0)
        self.service = Service(Registry("sqlite://"), FakeCluster(spec.topology()), group_factory=lambda *_: self.group,
                               injector_factory=lambda _: FakeInjector(self.group), clock=self.clock, threads=False)
        self.api = TestClient(create_app(self.service, token="service-admin-token"))
        for team in ("vision", "nlp"):
            assert self.api.post("/v1/teams", json={"name": team, "gpu_quota": 8}, headers=ADMIN).status_code == 201
        self.tokens = {who: self.make(who, team, role) for who, team, role in [
            ("vic", "vision", "viewer"), ("sam", "vision", "submitter"), ("nia", "nlp", "submitter"),
            ("olga", "nlp", "operator"), ("ada", "default", "admin")]}
        self.service.add(spec, team="vision")
        self.service.schedule()
        self.controller = self.service.controller("tiny-gpt")
        drive(self.controller, RunState.RUNNING, self.step)

    def make(self, name: str, team: str, role: str) -> str:
        made = self.api.post("/v1/tokens", json={"name": name, "team": team, "role": role}, headers=ADMIN)
        assert made.status_code == 201, made.text
        return str(made.json()["token"])

    def step(self, t: float) -> None:
        self.clock.t = t
        self.service.advance("tiny-gpt", t)

    def as_(self, who: str) -> dict[str, str]:
        return bearer(self.tokens[who])


@pytest.fixture
def shared() -> Shared:
    return Shared()


def error(response: Any) -> tuple[int, str, str]:
    body = response.json()["error"]
    return response.status_code, body["code"], body["message"]


def test_a_token_is_kept_as_a_scrypt_hash_and_names_its_holder(shared: Shared) -> None:
    token = shared.tokens["sam"]
    token_id, secret = split_token(token) or ("", "")
    with shared.service.registry.reading() as conn:
        rows = {r.id: r for r in conn.execute(select(tokens))}
    kept = rows[token_id].secret_hash
    assert kept.startswith("scrypt$16384$8$1$") and secret not in kept and token not in str(dict(rows[token_id]._mapping))
    assert secret_matches(secret, kept) and not secret_matches(secret + "x", kept)
    salt = base64.urlsafe_b64decode(kept.split("$")[4] + "==")
    assert hash_secret(secret, salt=salt) == kept  # (recomputed)
    assert shared.api.get("/v1/whoami", headers=shared.as_("sam")).json() == {
        "name": "sam", "team": "vision", "role": "submitter", "token_id": token_id, "via": "token"}
    listed = shared.api.get("/v1/tokens", headers=ADMIN).json()
    assert {t["name"] for t in listed} == {"vic", "sam", "nia", "olga", "ada"} and all("token" not in t for t in listed)
    assert shared.api.get("/v1/runs/tiny-gpt", headers=bearer(f"gp_{token_id}_{'A' * 43}")).status_code == 401


def test_the_kdf_runs_once_per_token_not_per_request(shared: Shared, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = hashlib.scrypt

    def counted(*args: Any, **kwargs: Any) -> bytes:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(hashlib, "scrypt", counted)
    for _ in range(5):
        assert shared.api.get("/v1/runs", headers=shared.as_("vic")).status_code == 200
    assert len(calls) == 1


def test_a_team_sees_and_acts_on_its_own_runs_only(shared: Shared) -> None:
    assert [r["id"] for r in shared.api.get("/v1/runs", headers=shared.as_("vic")).json()] == ["tiny-gpt"]
    assert shared.api.get("/v1/runs/tiny-gpt", headers=shared.as_("vic")).json()["team"] == "vision"
    assert shared.api.get("/v1/runs", headers=shared.as_("nia")).json() == []  # another team's
    for path in ("/v1/runs/tiny-gpt", "/v1/runs/tiny-gpt/events", "/v1/runs/tiny-gpt/spec"):
        status, code, _ = error(shared.api.get(path, headers=shared.as_("nia")))
        assert (status, code) == (404, "run_not_found"), path
    status, code, _ = error(shared.api.post("/v1/runs/tiny-gpt/cancel", headers=shared.as_("nia")))
    assert (status, code) == (404, "run_not_found")
    assert [r["id"] for r in shared.api.get("/v1/runs", headers=shared.as_("olga")).json()] == ["tiny-gpt"]  # operator


def test_each_route_names_the_role_it_needs(shared: Shared) -> None:
    status, code, message = error(shared.api.post("/v1/runs/tiny-gpt/cancel", headers=shared.as_("vic")))
    assert (status, code) == (403, "forbidden") and "submitter role" in message and "vic" in message
    status, code, message = error(shared.api.post("/v1/runs/tiny-gpt/drills", json={"kind": "kill-node"},
                                                  headers=shared.as_("sam")))
    assert (status, code) == (403, "forbidden") and "operator role" in message
    status, _, message = error(shared.api.post("/v1/nodes/node-0/release", headers=shared.as_("sam")))
    assert status == 403 and "operator role" in message
    status, _, message = error(shared.api.get("/v1/audit", headers=shared.as_("sam")))
    assert status == 403 and "operator role" in message
    status, _, message = error(shared.api.get("/v1/tokens", headers=shared.as_("olga")))
    assert status == 403 and "admin role" in message
    status, _, message = error(shared.api.post("/v1/tokens", json={"name": "x"}, headers=shared.as_("olga")))
    assert status == 403 and "admin role" in message
    drill = shared.api.post("/v1/runs/tiny-gpt/drills", json={"kind": "kill-node"}, headers=shared.as_("olga"))
    assert drill.status_code == 202, drill.text  # an operator, of another team
    assert shared.api.get(f"/v1/drills/{drill.json()['id']}", headers=shared.as_("vic")).status_code == 200
    status, code, _ = error(shared.api.get(f"/v1/drills/{drill.json()['id']}", headers=shared.as_("nia")))
    assert (status, code) == (404, "drill_not_found")
    assert shared.api.get("/v1/tokens", headers=shared.as_("ada")).status_code == 200  # an admin token made by one


def test_every_mutating_request_is_in_the_audit_log(shared: Shared) -> None:
    before = shared.api.get("/v1/audit", headers=shared.as_("olga")).json()
    last = before[-1]["id"]
    shared.api.post("/v1/runs/tiny-gpt/cancel", headers=shared.as_("vic"))  # refused: 403
    shared.api.post("/v1/runs/tiny-gpt/cancel")  # no token: 401
    shared.api.get("/v1/runs", headers=shared.as_("vic"))  # a read: not audited
    shared.api.post("/v1/runs/tiny-gpt/cancel", headers=shared.as_("sam"))
    rows = shared.api.get("/v1/audit", params={"after": last}, headers=shared.as_("olga")).json()
    assert [(r["who"], r["role"], r["method"], r["path"], r["status"]) for r in rows] == [
        ("vic", "viewer", "POST", "/v1/runs/tiny-gpt/cancel", 403),
        ("(unauthenticated)", None, "POST", "/v1/runs/tiny-gpt/cancel", 401),
        ("sam", "submitter", "POST", "/v1/runs/tiny-gpt/cancel", 200),
    ]
    assert all(r["time"] == shared.clock.t and r["team"] in ("vision", None) for r in rows)
    made = [r for r in before if r["path"] == "/v1/tokens"]
    assert len(made) == 5 and all(r["who"] == "service" and r["status"] == 201 for r in made)
    assert not any(shared.tokens["sam"] in str(r) for r in before + rows), "a token never reaches the log"


def test_a_token_revoked_while_its_run_trains_is_refused_and_the_run_goes_on(shared: Shared) -> None:
    token_id = (split_token(shared.tokens["sam"]) or ("", ""))[0]
    assert shared.api.get("/v1/runs/tiny-gpt", headers=shared.as_("sam")).status_code == 200
    revoked = shared.api.post(f"/v1/tokens/{token_id}/revoke", headers=ADMIN)
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] == shared.clock.t
    status, code, message = error(shared.api.get("/v1/runs/tiny-gpt", headers=shared.as_("sam")))
    assert (status, code) == (401, "unauthorized") and "revoked" in message
    step = shared.controller.progress.step
    shared.group.finish_steps(step + 1, step + 3)
    shared.step(shared.clock.t + 1)
    assert shared.controller.state is RunState.RUNNING and shared.controller.progress.step == step + 3
    assert shared.api.get("/v1/runs/tiny-gpt", headers=shared.as_("vic")).json()["team"] == "vision"


def test_bad_input_gets_a_4xx_that_says_what_to_fix(shared: Shared) -> None:
    status, code, message = error(shared.api.post("/v1/tokens", json={"name": "z", "team": "robotics"}, headers=ADMIN))
    assert (status, code) == (422, "unknown_team") and "goodput teams create robotics" in message
    status, _, message = error(shared.api.post("/v1/tokens", json={"name": "z", "role": "boss"}, headers=ADMIN))
    assert status == 422 and "role 'boss' does not exist" in message and "operator" in message
    status, _, message = error(shared.api.post("/v1/teams", json={"name": "x", "gpu_quota": -1}, headers=ADMIN))
    assert status == 422 and "0 or more" in message
    status, code, _ = error(shared.api.post("/v1/teams", json={"name": "vision"}, headers=ADMIN))
    assert (status, code) == (409, "team_exists")
    status, _, message = error(shared.api.post("/v1/teams", json={"name": "Bad Name"}, headers=ADMIN))
    assert status == 422 and "not a valid name" in message
    status, code, _ = error(shared.api.post("/v1/tokens/0123456789ab/revoke", headers=ADMIN))
    assert (status, code) == (404, "token_not_found")
    status, _, message = error(shared.api.post("/v1/teams/vision/quota", json={"gpu_quota": -2}, headers=ADMIN))
    assert status == 422 and "0 or more" in message
    status, code, _ = error(shared.api.post("/v1/teams/robotics/quota", json={"gpu_quota": 4}, headers=ADMIN))
    assert (status, code) == (422, "unknown_team")
    status, code, message = error(shared.api.post("/v1/runs", json={**BASE, "name": "p", "priority": "urgent"},
                                                  headers=shared.as_("sam")))
    assert status == 422 and "priority" in message and "critical" in message, message
    assert shared.controller.state is RunState.RUNNING, "a run already training goes on through all of it"


def test_an_admin_changes_a_teams_quota_and_the_queue_follows(shared: Shared) -> None:
    changed = shared.api.post("/v1/teams/vision/quota", json={"gpu_quota": 2}, headers=ADMIN)
    assert changed.status_code == 200 and changed.json()["gpu_quota"] == 2
    assert {t["name"]: t["gpu_quota"] for t in shared.api.get("/v1/teams", headers=ADMIN).json()}["vision"] == 2
    assert shared.controller.state is RunState.RUNNING, "a run holding more goes on"
    status, _, message = error(shared.api.post("/v1/teams/vision/quota", json={"gpu_quota": 16},
                                               headers=shared.as_("olga")))
    assert status == 403 and "admin role" in message
    assert shared.api.post("/v1/teams/vision/quota", json={"gpu_quota": None}, headers=ADMIN).json()["gpu_quota"] is None


def test_a_run_submitted_with_a_team_token_is_that_teams() -> None:
    raw = copy.deepcopy(BASE)
    raw["drills"] = []
    spec = parse_spec(raw)
    service = Service(Registry("sqlite://"), FakeCluster(spec.topology()), group_factory=lambda *_: FakeWorkerGroup(),
                      clock=ManualClock(5.0), threads=False)
    api = TestClient(create_app(service, token="root"))
    api.post("/v1/teams", json={"name": "nlp"}, headers=bearer("root"))
    token = api.post("/v1/tokens", json={"name": "nia", "team": "nlp", "role": "submitter"},
                     headers=bearer("root")).json()["token"]
    submitted = api.post("/v1/runs", json=raw, headers=bearer(token))
    assert submitted.status_code == 201, submitted.text
    assert submitted.json()["team"] == "nlp"
    assert [r["team"] for r in service.registry.run_rows()] == ["nlp"]


def test_the_cli_makes_lists_and_revokes_tokens_on_a_real_server(shared: Shared, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from controller.cli.main import main
    from controller.service.app import serve

    def cli(*args: str) -> int:
        with pytest.raises(SystemExit) as ended:
            main(list(args))
        return int(ended.value.code or 0)

    server = serve(create_app(shared.service, token="service-admin-token"), "127.0.0.1", 0)
    try:
        monkeypatch.setenv("GOODPUT_URL", server.url)
        monkeypatch.setenv("GOODPUT_TOKEN", "service-admin-token")
        assert cli("teams", "create", "robotics", "--gpu-quota", "4") == 0
        assert "team robotics: made, with a quota of 4 GPU(s)" in capsys.readouterr().out
        assert cli("teams", "quota", "robotics", "--gpu-quota", "6") == 0
        assert "team robotics: a quota of 6 GPU(s) from now on" in capsys.readouterr().out
        assert cli("tokens", "create", "rita", "--team", "robotics", "--role", "viewer") == 0
        out = capsys.readouterr().out
        token = next(line for line in out.splitlines() if line.startswith("gp_"))
        token_id = (split_token(token) or ("", ""))[0]
        assert cli("tokens", "list") == 0
        assert any(line.split()[:4] == [token_id, "rita", "robotics", "viewer"]
                   for line in capsys.readouterr().out.splitlines())
        monkeypatch.setenv("GOODPUT_TOKEN", token)
        assert cli("list") == 0
        assert "tiny-gpt" not in capsys.readouterr().out  # vision's run: not robotics'
        assert cli("cancel", "tiny-gpt", "--no-wait") == 2  # (the role is asked first: nothing said of the run)
        assert "needs the submitter role" in capsys.readouterr().err
        assert cli("tokens", "list") == 2
        assert "needs the admin role" in capsys.readouterr().err
        monkeypatch.setenv("GOODPUT_TOKEN", "service-admin-token")
        assert cli("tokens", "revoke", token_id) == 0
        assert f"token {token_id} (rita) revoked" in capsys.readouterr().out
        assert cli("audit", "--limit", "1000") == 0
        audit = capsys.readouterr().out
        assert "POST /v1/tokens" in audit and f"POST /v1/tokens/{token_id}/revoke" in audit
        assert "(unauthenticated)" not in audit and token not in audit
    finally:
        server.stop()
