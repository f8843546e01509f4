"""Dashboards and alert rules kept as code: the checked-in JSON and rules are what dashboards/build.py
generates, they name only metrics the service exports, promtool accepts the rules and their unit
tests pass, and `goodput dashboards push` speaks Grafana's HTTP API (to a recording server on
loopback: no Grafana can be installed here)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

from controller.cli.dashboards import PushError, push
from controller.service.metrics import exported_series
from tests.support.tools import needs

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "dashboards" / "prometheus" / "goodput-alerts.yaml"


def load_build() -> Any:
    spec = importlib.util.spec_from_file_location("dashboards_build", ROOT / "dashboards" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


build = load_build()


def panel_queries() -> Iterator[tuple[str, str, str]]:
    """(dashboard uid, panel title, expr) for every query of every panel."""
    for uid in build.DASHBOARDS:
        for panel in build.dashboard_json(uid)["panels"]:
            for target in panel.get("targets") or []:
                yield uid, panel["title"], target["expr"]


def named_metrics(expr: str) -> set[str]:
    return set(re.findall(r"\bgoodput_[a-z_]+\b", expr))


def test_checked_in_files_are_what_the_code_generates() -> None:
    stale = [str(p.relative_to(ROOT)) for p, text in build.render().items() if not p.exists() or p.read_text() != text]
    assert not stale, f"run `python dashboards/build.py` and commit: {stale}"


def test_four_dashboards_with_unique_panel_ids_and_a_run_variable() -> None:
    assert set(build.DASHBOARDS) == {"goodput-run", "goodput-health", "goodput-checkpoints", "goodput-cluster"}
    for uid in build.DASHBOARDS:
        board = build.dashboard_json(uid)
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)) and board["uid"] == uid
        assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "run"}
        assert any(p.get("targets") for p in board["panels"])


def test_dashboards_and_rules_name_only_exported_metrics() -> None:
    exported = exported_series()
    queries = list(panel_queries())
    assert len(queries) >= 25
    for uid, title, expr in queries:
        names = named_metrics(expr)
        assert names, f"{uid} / {title}: {expr} names no goodput metric"
        assert names <= exported, f"{uid} / {title} names {names - exported}, which the service does not export"
    for alert in build.ALERTS:
        assert named_metrics(alert.expr) <= exported, alert.name
        assert named_metrics(alert.signal), alert.name
    # The rules file is the ALERTS above (and the provisioned dashboards folder is this one).
    assert [r["alert"] for r in build.alert_rules()["groups"][0]["rules"]] == [a.name for a in build.ALERTS]


@needs(None if shutil.which("promtool") else
       "promtool is not installed (Debian package `prometheus`; `make test` installs it)")
def test_promtool_checks_the_rules_and_runs_their_unit_tests() -> None:
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(build.ALERTS)} rules found" in check.stdout
    tests = subprocess.run(["promtool", "test", "rules", str(RULES.with_name("goodput-alerts.test.yaml"))],
                           capture_output=True, text=True)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    tested = set(re.findall(r"alertname: (\w+)", RULES.with_name("goodput-alerts.test.yaml").read_text()))
    assert tested == {a.name for a in build.ALERTS}, "every alert has a unit test"


class FakeGrafana:
    """Answers like Grafana's HTTP API for what push uses: GET/POST /api/folders, POST /api/dashboards/db,
    checking the bearer token; records every request."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.requests: list[tuple[str, str, dict[str, Any] | None]] = []
        self.folders: set[str] = set()
        self.versions: dict[str, int] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                outer.requests.append((method, self.path, body))
                if self.headers.get("Authorization") != f"Bearer {outer.token}":
                    return self._answer(401, {"message": "Invalid API key"})
                if method == "GET" and self.path.startswith("/api/folders/"):
                    uid = self.path.rsplit("/", 1)[1]
                    if uid not in outer.folders:
                        return self._answer(404, {"message": "folder not found"})
                    return self._answer(200, {"uid": uid, "title": uid})
                if method == "POST" and self.path == "/api/folders":
                    outer.folders.add(body["uid"])
                    return self._answer(200, {"uid": body["uid"], "title": body["title"]})
                if method == "POST" and self.path == "/api/dashboards/db":
                    if body["folderUid"] not in outer.folders:
                        return self._answer(400, {"message": "folder not found"})
                    uid = body["dashboard"]["uid"]
                    if uid in outer.versions and not body.get("overwrite"):
                        return self._answer(412, {"message": "version-mismatch"})
                    outer.versions[uid] = outer.versions.get(uid, 0) + 1
                    return self._answer(200, {"uid": uid, "url": f"/d/{uid}/x", "version": outer.versions[uid],
                                              "status": "success"})
                return self._answer(404, {"message": "not found"})

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def grafana() -> Iterator[FakeGrafana]:
    server = FakeGrafana("glsa_test")
    yield server
    server.server.shutdown()
    server.server.server_close()


def test_push_creates_the_folder_then_overwrites_dashboards_by_uid(grafana: FakeGrafana) -> None:
    directory = ROOT / "dashboards" / "grafana"
    first = push(grafana.url, "glsa_test", directory)
    assert {b["uid"] for b in first} == set(build.DASHBOARDS) and all(b["version"] == 1 for b in first)
    posted = [body for method, path, body in grafana.requests if path == "/api/dashboards/db"]
    assert all(b["folderUid"] == "goodput" and b["overwrite"] and b["dashboard"]["id"] is None for b in posted)
    assert posted[0]["dashboard"]["panels"] == json.loads((directory / f"{posted[0]['dashboard']['uid']}.json")
                                                          .read_text())["panels"]
    assert sum(1 for m, p, _ in grafana.requests if m == "POST" and p == "/api/folders") == 1
    again = push(grafana.url, "glsa_test", directory)  # the folder exists now; dashboards get version 2
    assert all(b["version"] == 2 for b in again)
    assert sum(1 for m, p, _ in grafana.requests if m == "POST" and p == "/api/folders") == 1


def test_push_errors_say_what_to_fix(grafana: FakeGrafana, tmp_path: Path) -> None:
    with pytest.raises(PushError, match="refused the token.*Editor"):
        push(grafana.url, "wrong", ROOT / "dashboards" / "grafana")
    with pytest.raises(PushError, match="no dashboards"):
        push(grafana.url, "glsa_test", tmp_path)
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(PushError, match="not JSON"):
        push(grafana.url, "glsa_test", tmp_path)
    grafana.server.shutdown()
    grafana.server.server_close()
    with pytest.raises(PushError, match="no Grafana answers"):
        push(grafana.url, "glsa_test", ROOT / "dashboards" / "grafana", timeout_s=2)
