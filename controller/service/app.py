"""The REST API (`/v1`, DESIGN.md) over a `Service`: `goodput serve` hosts it for submitted runs,
`goodput run` for its one run (submissions refused there).

FastAPI (with uvicorn) because it gives validated bodies, JSON errors and an OpenAPI document for free,
and Ray's dashboard already brings both into a Ray install. Every 4xx a route can answer is in that
document with the error envelope `{"error": {"code", "message"}}`.
"""

from __future__ import annotations

import asyncio
import datetime
import socket
import sys
import threading
import time
from typing import Any

from fastapi import Body, Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from controller.service.accounts import MAX_AUDIT_PAGE, Accounts, BearerVerifier
from controller.service.identity import DEFAULT_TEAM, Principal, Role
from controller.service.metrics import ServiceCollector
from controller.drills import DrillKind, rank_target
from controller.errors import ApiBindError, ServiceError
from controller.service.intake import MAX_EVENTS_PAGE, MAX_HISTORY_PAGE, MAX_SPEC_BYTES
from controller.service.service import Service
from controller.spec import RunSpec
from trainer.protocol import PROTOCOL_POINTS

RUN_ID = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
DRILL_ID = r"^drill-[0-9a-f]{8}$"
NODE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"
"""A Kubernetes node name (DNS subdomain) or a Ray node's `node` label."""


class ErrorBody(BaseModel):
    code: str
    message: str


class ErrorEnvelope(BaseModel):
    error: ErrorBody


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {400: "Rejected request", 401: "Missing or wrong token", 403: "Outside the token's role",
            404: "No such run, drill or token",
            409: "Conflicts with the run's state", 413: "Body too large", 422: "Invalid input",
            429: "Too many"}
    return {c: {"model": ErrorEnvelope, "description": text[c]} for c in codes}


class DrillBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: str = Field(description=DrillKind.names(),
                      max_length=32)
    target: str | int | None = Field(None, description="node name (kill-node, the silent faults) or rank number (an integer or a "
                                                        "string); default: the last rank")
    at_step: int | None = Field(None, ge=0, le=10**9, description="inject once this step is done; default: now")
    factor: float | None = Field(None, ge=1, le=1000, description="slow-rank: times slower (default 1.5)")
    seconds: float | None = Field(None, gt=0, le=86400, description="storage-outage: seconds the store refuses "
                                  "writes (default 30); partition, freeze-node: seconds until it heals (default: never); "
                                  "collective-fault: seconds the collective starts late (default: it fails)")
    delay_ms: float | None = Field(None, gt=0, le=60000, description="slow-link: milliseconds added to what the node "
                                                                      "sends (default 50)")
    loss: float | None = Field(None, gt=0, le=100, description="lossy-link: percent of the node's packets dropped "
                                                               "(default 5)")
    point: str | None = Field(None, max_length=16, description="collective-fault: the point of the replica protocol "
                              f"that fails ({', '.join(PROTOCOL_POINTS)}; default reduce)")


class TokenBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128, description="who it is for: a person or a team's automation")
    team: str = Field(DEFAULT_TEAM, max_length=63, description="the team whose runs it submits and sees")
    role: str = Field("submitter", max_length=16, description="viewer, submitter, operator or admin")


class DrainBody(BaseModel):
    by: datetime.datetime | None = Field(None, description="when the node goes (ISO 8601 or Unix seconds): shown "
                                                           "with the node, and a drain that ends later says so")


class QuotaBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gpu_quota: int | None = Field(description="GPUs the team's runs may hold at once (null: no limit)")


class TeamBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=63, description="lowercase letters, digits and '-'")
    gpu_quota: int | None = Field(None, description="GPUs its runs may hold at once (default: no limit)")


class ResumeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int | None = Field(None, ge=0, le=10**9, description="committed step to start from (default: the latest); "
                                                               "newer commits are discarded")
    steps: int | None = Field(None, gt=0, le=10**9, description="train to this many steps (default: the spec's)")


class _Audited:
    """Every mutating request (POST, PUT, PATCH, DELETE) into the audit log once answered: who (the
    principal the route's dependency found, or unauthenticated), the method and path, the status."""

    def __init__(self, app: Any, *, accounts: Accounts) -> None:
        self.app, self.accounts = app, accounts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH", "DELETE"):
            await self.app(scope, receive, send)
            return
        status = 500

        async def answered(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, answered)
        finally:
            principal = (scope.get("state") or {}).get("principal")
            try:
                await asyncio.to_thread(self.accounts.record, principal, scope["method"], scope["path"], status)
            except Exception as e:  # (a registry that cannot be written must not turn an answer into an error)
                print(f"goodput: audit record of {scope['method']} {scope['path']} failed: {e}", file=sys.stderr)


class _BoundedBody:
    """Request bodies of at most `limit` bytes, however they are sent: a Content-Length over it is
    refused before reading, and a chunked body (no Content-Length) is counted as it arrives and
    refused once it passes the limit (413 either way)."""

    def __init__(self, app: Any, *, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = f"request bodies are at most {self.limit} bytes"
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            await _envelope(413, "body_too_large", too_large)(scope, receive, send)
            return
        received = 0

        async def counted() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise StarletteHTTPException(413, too_large)
            return message

        await self.app(scope, counted, send)


def create_app(service: Service, *, token: str | None = None, oidc: BearerVerifier | None = None) -> FastAPI:
    """The `/v1` app. With a token, every call but /healthz and /readyz needs `Authorization: Bearer
    <token>`: the service's own `token` (admin), a registry token (`goodput tokens create`: its role
    and team), or an identity provider's JWT (`oidc`). Each route names the role it needs (403 names
    it too), a team sees its own runs only (an operator any), and every mutating request is written
    to the audit log (GET /v1/audit)."""
    app = FastAPI(title="goodput", version="1",
                  description="Fault-tolerant orchestration of LLM training runs (DESIGN.md, REST /v1).")
    accounts = Accounts(service.registry, service_token=token, clock=service.clock, oidc=oidc)
    app.state.accounts = accounts

    def principal(request: Request, authorization: str | None = Header(None, include_in_schema=False)) -> Principal:
        found = accounts.authenticate(authorization)
        request.state.principal = found  # (the audit log's who)
        return found

    def need(role: Role) -> Any:
        def allowed(p: Principal = Depends(principal)) -> Principal:
            if not p.may(role):
                raise ServiceError("forbidden", f"this needs the {role.label} role or above; {p.name} (team {p.team}) "
                                                f"is a {p.role.label}: ask an admin for a token with that role")
            return p
        allowed.role = role  # type: ignore[attr-defined]  # (the schema names it: _document_roles)
        return Depends(allowed)

    def seen(p: Principal, run_id: str) -> str:
        """`run_id`, when `p` may see it: another team's run is not found, as if it did not exist."""
        if not p.sees(service.team_of(run_id)):
            raise ServiceError("run_not_found", f"no run {run_id!r} on this service (`goodput list` shows its runs)")
        return run_id

    viewer, submitter, operator, admin = (need(r) for r in (Role.VIEWER, Role.SUBMITTER, Role.OPERATOR, Role.ADMIN))

    app.add_middleware(_BoundedBody, limit=MAX_SPEC_BYTES)
    app.add_middleware(_Audited, accounts=accounts)

    @app.exception_handler(ServiceError)
    def _service_error(_: Request, e: ServiceError) -> JSONResponse:
        return _envelope(HTTP_STATUS.get(e.code, 400), e.code, e.message)

    @app.exception_handler(RequestValidationError)
    def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'][1:]) or 'body'}: {err['msg']}"
                             for err in e.errors())
        return _envelope(422, "invalid_request", problems[:2000])

    @app.exception_handler(StarletteHTTPException)
    def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _envelope(e.status_code, "body_too_large" if e.status_code == 413 else "http_error", str(e.detail))

    run_id_param = Path(pattern=RUN_ID, description="run id")

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> dict[str, str]:
        return {"status": "leading"}

    metrics_registry = CollectorRegistry(auto_describe=False)
    metrics_registry.register(ServiceCollector(service))
    ProcessCollector(registry=metrics_registry)

    @app.get("/metrics", dependencies=[viewer], responses={**_errors(401, 403), 200: {
        "content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}, "description": "Prometheus text format"}},
        response_class=PlainTextResponse)
    def metrics() -> Response:
        """Every goodput_* metric (controller/service/metrics.py) for Prometheus to scrape."""
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/whoami", responses=_errors(401))
    def whoami(p: Principal = Depends(principal)) -> dict[str, Any]:
        """The principal the token names: name, team, role."""
        return p.to_dict()

    @app.post("/v1/runs", status_code=201, responses=_errors(401, 403, 409, 413, 422, 429))
    def submit(spec: RunSpec = Body(description="the run spec (DESIGN.md)"), p: Principal = submitter) -> dict[str, Any]:
        """A new run of the token's team."""
        return service.submit(spec.model_dump(mode="json", exclude_unset=True), team=p.team)

    @app.get("/v1/runs", responses=_errors(401, 403))
    def list_runs(p: Principal = viewer) -> list[dict[str, Any]]:
        """The runs the token's team may see (an operator's: every team's)."""
        return [r for r in service.runs() if p.sees(r.get("team", DEFAULT_TEAM))]

    @app.get("/v1/runs/{run_id}", responses=_errors(401, 403, 404, 422))
    def get_run(run_id: str = run_id_param, p: Principal = viewer) -> dict[str, Any]:
        return service.run(seen(p, run_id))

    @app.get("/v1/runs/{run_id}/spec", responses=_errors(401, 403, 404, 422))
    def get_spec(run_id: str = run_id_param, p: Principal = viewer) -> dict[str, Any]:
        """The run's spec as the service holds it (a resume's, if one changed it)."""
        return service.spec(seen(p, run_id))

    @app.get("/v1/runs/{run_id}/events", responses=_errors(401, 403, 404, 422))
    def get_events(run_id: str = run_id_param,
                   after: int = Query(-1, ge=-1, le=2**31, description="events after this seq"),
                   limit: int = Query(MAX_EVENTS_PAGE, ge=1, le=MAX_EVENTS_PAGE),
                   p: Principal = viewer) -> list[dict[str, Any]]:
        return service.events(seen(p, run_id), after=after, limit=limit)

    @app.get("/v1/runs/{run_id}/history", responses=_errors(401, 403, 404, 422))
    def get_history(run_id: str = run_id_param,
                    after: int = Query(-1, ge=-1, le=2**31, description="steps after this one"),
                    limit: int = Query(MAX_HISTORY_PAGE, ge=1, le=MAX_HISTORY_PAGE),
                    p: Principal = viewer) -> list[dict[str, Any]]:
        """Every kept step: loss, attempt, and when it ran (start and end, Unix seconds)."""
        return service.history(seen(p, run_id), after=after, limit=limit)

    @app.get("/v1/runs/{run_id}/attempts", responses=_errors(401, 403, 404, 422))
    def get_attempts(run_id: str = run_id_param, p: Principal = viewer) -> list[dict[str, Any]]:
        return service.attempts(seen(p, run_id))

    @app.get("/v1/runs/{run_id}/checkpoints", responses=_errors(401, 403, 404, 422))
    def get_checkpoints(run_id: str = run_id_param, p: Principal = viewer) -> list[dict[str, Any]]:
        return service.checkpoints(seen(p, run_id))

    @app.post("/v1/runs/{run_id}/cancel", responses=_errors(401, 403, 404, 422))
    def cancel(run_id: str = run_id_param, p: Principal = submitter) -> dict[str, Any]:
        return service.cancel(seen(p, run_id))

    @app.post("/v1/runs/{run_id}/resume", responses=_errors(401, 403, 404, 409, 413, 422))
    def resume(run_id: str = run_id_param, body: ResumeBody | None = Body(None), p: Principal = submitter) -> dict[str, Any]:
        return service.resume(seen(p, run_id), step=body.step if body else None, steps=body.steps if body else None)

    @app.post("/v1/runs/{run_id}/drills", status_code=202,
              responses=_errors(400, 401, 403, 404, 409, 413, 422, 429))
    def request_drill(body: DrillBody, run_id: str = run_id_param, p: Principal = operator) -> dict[str, Any]:
        request = service.request_drill(run_id, body.kind, target=rank_target(body.target), at_step=body.at_step,
                                        factor=body.factor, seconds=body.seconds, delay_ms=body.delay_ms,
                                        loss=body.loss, point=body.point)
        return {**request.to_dict(), "run_id": run_id, "outcome": "scheduled"}

    @app.get("/v1/drills/{drill_id}", responses=_errors(401, 403, 404, 422))
    def get_drill(drill_id: str = Path(pattern=DRILL_ID, description="drill id"), p: Principal = viewer) -> dict[str, Any]:
        report = service.drill(drill_id)
        if not p.sees(service.team_of(report["run_id"])):
            raise ServiceError("drill_not_found", f"no drill {drill_id!r} on this service")
        return report

    @app.get("/v1/nodes", dependencies=[viewer], responses=_errors(401, 403))
    def nodes() -> dict[str, Any]:
        """Every node with its state for the service (healthy, spare, quarantined, lost) and the run on it."""
        return service.cluster_view()

    @app.post("/v1/nodes/{name}/release", dependencies=[operator], responses=_errors(401, 403, 404, 422))
    def release_node(name: str = Path(pattern=NODE_NAME, description="node name")) -> dict[str, Any]:
        """An operator's release of a quarantined or drained node: new runs may use it again; on Kubernetes
        its goodput taint goes, and its cordon if goodput made it."""
        return service.release_node(name)

    @app.post("/v1/nodes/{name}/drain", status_code=202, responses=_errors(401, 403, 404, 409, 422))
    def drain_node(name: str = Path(pattern=NODE_NAME, description="node name"), body: DrainBody | None = Body(None),
                   p: Principal = operator) -> dict[str, Any]:
        """A planned departure (maintenance, a node a cloud will reclaim): no new rank goes to the node, and
        every run on it moves off at its next peer snapshot step (a spare takes its ranks, else the mesh
        shrinks; 0 steps redone, nothing read from the store when its peers hold the step). The node is
        then `drained` (GET /v1/nodes) until released."""
        deadline = body.by.timestamp() if body is not None and body.by is not None else None
        return service.drain_node(name, deadline=deadline, by=p.name)

    @app.get("/v1/cluster", dependencies=[viewer], responses=_errors(401, 403))
    def cluster() -> dict[str, Any]:
        return service.cluster_view()

    @app.get("/v1/audit", dependencies=[operator], responses=_errors(401, 403, 422))
    def get_audit(after: int = Query(0, ge=0, le=2**62, description="rows after this id"),
                  limit: int = Query(MAX_AUDIT_PAGE, ge=1, le=MAX_AUDIT_PAGE)) -> list[dict[str, Any]]:
        """Every mutating request: who (name, team, role, how they signed in), what (method, path), when,
        and the answer's HTTP status."""
        return accounts.audit(after=after, limit=limit)

    @app.get("/v1/teams", dependencies=[viewer], responses=_errors(401, 403))
    def list_teams() -> list[dict[str, Any]]:
        """Each team: its GPU quota, the GPUs its runs hold now, its runs queued and the longest wait."""
        return service.teams_view()

    @app.post("/v1/teams", status_code=201, dependencies=[admin], responses=_errors(401, 403, 409, 422))
    def create_team(body: TeamBody) -> dict[str, Any]:
        return accounts.add_team(body.name, gpu_quota=body.gpu_quota)

    @app.post("/v1/teams/{name}/quota", dependencies=[admin], responses=_errors(401, 403, 422))
    def set_quota(body: QuotaBody, name: str = Path(max_length=63, description="team name")) -> dict[str, Any]:
        """The team's GPU quota from now on (null: no limit). Its runs already holding more go on; its
        next runs wait until its runs hold less."""
        return accounts.set_quota(name, body.gpu_quota)

    @app.get("/v1/tokens", dependencies=[admin], responses=_errors(401, 403))
    def list_tokens() -> list[dict[str, Any]]:
        """Every token made (never the token itself: only its hash is kept)."""
        return accounts.tokens()

    @app.post("/v1/tokens", status_code=201, responses=_errors(401, 403, 422))
    def create_token(body: TokenBody, p: Principal = admin) -> dict[str, Any]:
        """A new token; the answer is the only place the token is ever shown."""
        return accounts.create_token(name=body.name, team=body.team, role=body.role, by=p)

    @app.post("/v1/tokens/{token_id}/revoke", dependencies=[admin], responses=_errors(401, 403, 404, 422))
    def revoke_token(token_id: str = Path(pattern=r"^[0-9a-f]{12}$", description="token id")) -> dict[str, Any]:
        """The token is refused from now on; the runs it submitted go on."""
        return accounts.revoke(token_id)

    _document_roles(app, principal)
    return app


def _document_roles(app: FastAPI, principal: Any) -> None:
    """Each operation of the OpenAPI schema says the role it needs (`x-goodput-role`, and a line of its
    description), read from its dependencies: a route's role is documented as it is enforced."""
    def found(dependant: Any) -> str | None:
        for dep in dependant.dependencies:
            role = getattr(dep.call, "role", None)
            if role is not None:
                return str(role.label)
            if dep.call is principal:
                return "any token"
            deeper = found(dep)
            if deeper is not None:
                return deeper
        return None

    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        role = found(route.dependant) or "none"
        route.openapi_extra = {**(route.openapi_extra or {}), "x-goodput-role": role}
        said = {"none": "Role: none (no token).", "any token": "Role: any valid token."}.get(role, f"Role: {role} or above.")
        route.description = f"{route.description}\n\n{said}" if route.description else said


HTTP_STATUS = {
    "drill_rejected": 400, "invalid_request": 422, "invalid_spec": 422, "does_not_fit": 422,
    "no_such_checkpoint": 422, "spec_too_large": 413, "unauthorized": 401,
    "run_not_found": 404, "drill_not_found": 404, "node_not_quarantined": 404, "node_not_found": 404,
    "node_out_of_use": 409, "token_not_found": 404,
    "forbidden": 403, "unknown_team": 422, "team_exists": 409, "over_quota": 422,
    "run_ended": 409, "run_not_ended": 409, "submissions_closed": 409, "checkpoint_mismatch": 409,
    "too_many_drills": 429, "too_many_runs": 429, "not_leading": 503,
}
"""The HTTP status of each error code (the only place a status is chosen; the codes are in the errors)."""


def _envelope(status: int, code: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status)


def standby_app() -> FastAPI:
    """What a standby service answers: /healthz (alive), and 503 for everything else, /readyz included,
    so that a Kubernetes Service sends requests to the leader only."""
    app = FastAPI(title="goodput (standby)", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "standby"}

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    def standing_by(path: str) -> JSONResponse:
        return _envelope(503, "standby", "this goodput serve is a standby: another one leads the registry "
                                         "(a Kubernetes Service sends requests to the leader)")

    return app


class ApiServer:
    """uvicorn in a daemon thread on a socket bound here (so a busy port is an error in the caller,
    and port 0 picks a free one)."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        import uvicorn

        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted connections inherit it: a response's headers and body go out at once, instead of the
        # body waiting ~40 ms for the client's delayed ACK of the headers (Nagle).
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._socket.bind((host, port))
        except OSError as e:
            self._socket.close()
            raise ApiBindError(e.errno, f"cannot serve the API on {host}:{port}: {e.strerror}") from None
        self.host, self.port = host, self._socket.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="goodput-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> "ApiServer":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._socket.close()


def serve(app: FastAPI, host: str, port: int, *, any_port: bool = False) -> ApiServer:
    """Serve `app` on host:port, or on a free port of host if that one is taken and `any_port`."""
    try:
        return ApiServer(app, host, port).start()
    except ApiBindError:
        if not any_port:
            raise
        return ApiServer(app, host, 0).start()
