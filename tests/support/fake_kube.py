"""A stand-in for the Kubernetes API server's node endpoints, on 127.0.0.1, answering the way the
real one does for what goodput calls: GET/LIST/PATCH nodes with Status bodies, 401 without a token,
403 for a service account without RBAC, 404 for an unknown node, 409 Conflict when a patch carries a
stale metadata.resourceVersion, and injected 5xx/429. It records every request. (No API server can
run here; this is what the adapter is tested against.)"""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

ADMIN, NO_RBAC = "admin-token", "no-rbac-token"


def node(name: str, labels: dict[str, str] | None = None, *, unschedulable: bool = False,
         taints: list[dict[str, Any]] | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": dict(labels or {}), "annotations": dict(annotations or {}),
                         "resourceVersion": "1", "uid": f"uid-{name}"},
            "spec": {"unschedulable": unschedulable, "taints": list(taints or [])},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """JSON merge patch (RFC 7386), which is what a strategic merge patch of these fields amounts to:
    taints carry no patch merge key, so the list is replaced whole."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class FakeKube:
    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        self.nodes = {n["metadata"]["name"]: n for n in nodes}
        self.requests: list[dict[str, Any]] = []
        self.fail_next: list[int] = []
        """Statuses to answer the next requests with (then normal service)."""
        self.before_patch: Callable[[dict[str, Any]], None] | None = None
        """Runs once before the next PATCH is applied: another actor changing the node meanwhile."""
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer._handle(self, "GET")

            def do_PATCH(self) -> None:
                outer._handle(self, "PATCH")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def patches(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["method"] == "PATCH"]

    # -- the API -----------------------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        with self.lock:
            self.requests.append({"method": method, "path": h.path, "body": body,
                                  "content_type": h.headers.get("Content-Type"),
                                  "authorization": h.headers.get("Authorization")})
            status, answer = self._answer(h, method, body)
        data = json.dumps(answer).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _answer(self, h: BaseHTTPRequestHandler, method: str, body: Any) -> tuple[int, dict[str, Any]]:
        token = (h.headers.get("Authorization") or "").removeprefix("Bearer ")
        path = h.path.split("?", 1)[0]
        name = path.removeprefix("/api/v1/nodes").strip("/") or None
        verb = {"GET": "get" if name else "list", "PATCH": "patch"}[method]
        if not token:
            return _status(401, "Unauthorized", "Unauthorized")
        if token == NO_RBAC:
            return _status(403, "Forbidden", f'nodes{" " + repr(name) if name else ""} is forbidden: User '
                                             f'"system:serviceaccount:goodput:default" cannot {verb} resource "nodes" '
                                             'in API group "" at the cluster scope')
        if token != ADMIN:
            return _status(401, "Unauthorized", "Unauthorized")
        if self.fail_next:
            code = self.fail_next.pop(0)
            return _status(code, {429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}.get(
                code, "InternalError"), "injected")
        if not path.startswith("/api/v1/nodes"):
            return _status(404, "NotFound", "the server could not find the requested resource")
        if name is None and method == "GET":
            return 200, {"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": "100"},
                         "items": [copy.deepcopy(n) for n in self.nodes.values()]}
        current = self.nodes.get(name or "")
        if current is None:
            return _status(404, "NotFound", f'nodes "{name}" not found')
        if method == "GET":
            return 200, copy.deepcopy(current)
        if self.before_patch is not None:
            change, self.before_patch = self.before_patch, None
            change(current)
            current["metadata"]["resourceVersion"] = str(int(current["metadata"]["resourceVersion"]) + 1)
        wanted = (body or {}).get("metadata", {}).get("resourceVersion")
        if wanted is not None and wanted != current["metadata"]["resourceVersion"]:
            return _status(409, "Conflict", f'Operation cannot be fulfilled on nodes "{name}": the object has been '
                                            "modified; please apply your changes to the latest version and try again")
        patch = copy.deepcopy(body or {})
        patch.get("metadata", {}).pop("resourceVersion", None)
        _merge(current, patch)
        current["metadata"]["resourceVersion"] = str(int(current["metadata"]["resourceVersion"]) + 1)
        return 200, copy.deepcopy(current)


def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
    return code, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
                  "reason": reason, "code": code}
