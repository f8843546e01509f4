"""The REST API (`/v1`, DESIGN.md) over a `Service`: `goodput serve` hosts it for submitted runs,
`goodput run` for its one run (submissions refused there).

FastAPI (with uvicorn) because it gives validated bodies, JSON errors and an OpenAPI document for free,
and Ray's dashboard already brings both into a Ray install. Every 4xx a route can answer is in that
document with the error envelope `{"error": {"code", "message"}}`.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from typing import Any

from fastapi import Body, Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from controller.service.auth import TOKEN_ENV
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
    text = {400: "Rejected request", 401: "Missing or wrong token", 404: "No such run or drill",
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


class ResumeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    step: int | None = Field(None, ge=0, le=10**9, description="committed step to start from (default: the latest); "
                                                               "newer commits are discarded")
    steps: int | None = Field(None, gt=0, le=10**9, description="train to this many steps (default: the spec's)")


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


def create_app(service: Service, *, token: str | None = None) -> FastAPI:
    """The `/v1` app. With a token, every call but /healthz and /readyz needs `Authorization: Bearer <token>`."""
    app = FastAPI(title="goodput", version="1",
                  description="Fault-tolerant orchestration of LLM training runs (DESIGN.md, REST /v1).")

    def authorized(authorization: str | None = Header(None, include_in_schema=False)) -> None:
        if token is not None and not secrets.compare_digest((authorization or "").encode(),
                                                            f"Bearer {token}".encode()):
            raise ServiceError("unauthorized", f"send 'Authorization: Bearer <token>' (the {TOKEN_ENV} or "
                                                    "token file the service was started with)")

    app.add_middleware(_BoundedBody, limit=MAX_SPEC_BYTES)

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

    auth = [Depends(authorized)]
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

    @app.get("/metrics", dependencies=auth, responses={**_errors(401), 200: {
        "content": {CONTENT_TYPE_LATEST.split(";")[0]: {}}, "description": "Prometheus text format"}},
        response_class=PlainTextResponse)
    def metrics() -> Response:
        """Every goodput_* metric (controller/service/metrics.py) for Prometheus to scrape."""
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/runs", status_code=201, dependencies=auth, responses=_errors(401, 409, 413, 422, 429))
    def submit(spec: RunSpec = Body(description="the run spec (DESIGN.md)")) -> dict[str, Any]:
        return service.submit(spec.model_dump(mode="json", exclude_unset=True))

    @app.get("/v1/runs", dependencies=auth, responses=_errors(401))
    def list_runs() -> list[dict[str, Any]]:
        return service.runs()

    @app.get("/v1/runs/{run_id}", dependencies=auth, responses=_errors(401, 404, 422))
    def get_run(run_id: str = run_id_param) -> dict[str, Any]:
        return service.run(run_id)

    @app.get("/v1/runs/{run_id}/spec", dependencies=auth, responses=_errors(401, 404, 422))
    def get_spec(run_id: str = run_id_param) -> dict[str, Any]:
        """The run's spec as the service holds it (a resume's, if one changed it)."""
        return service.spec(run_id)

    @app.get("/v1/runs/{run_id}/events", dependencies=auth, responses=_errors(401, 404, 422))
    def get_events(run_id: str = run_id_param,
                   after: int = Query(-1, ge=-1, le=2**31, description="events after this seq"),
                   limit: int = Query(MAX_EVENTS_PAGE, ge=1, le=MAX_EVENTS_PAGE)) -> list[dict[str, Any]]:
        return service.events(run_id, after=after, limit=limit)

    @app.get("/v1/runs/{run_id}/history", dependencies=auth, responses=_errors(401, 404, 422))
    def get_history(run_id: str = run_id_param,
                    after: int = Query(-1, ge=-1, le=2**31, description="steps after this one"),
                    limit: int = Query(MAX_HISTORY_PAGE, ge=1, le=MAX_HISTORY_PAGE)) -> list[dict[str, Any]]:
        """Every kept step: loss, attempt, and when it ran (start and end, Unix seconds)."""
        return service.history(run_id, after=after, limit=limit)

    @app.get("/v1/runs/{run_id}/attempts", dependencies=auth, responses=_errors(401, 404, 422))
    def get_attempts(run_id: str = run_id_param) -> list[dict[str, Any]]:
        return service.attempts(run_id)

    @app.get("/v1/runs/{run_id}/checkpoints", dependencies=auth, responses=_errors(401, 404, 422))
    def get_checkpoints(run_id: str = run_id_param) -> list[dict[str, Any]]:
        return service.checkpoints(run_id)

    @app.post("/v1/runs/{run_id}/cancel", dependencies=auth, responses=_errors(401, 404, 422))
    def cancel(run_id: str = run_id_param) -> dict[str, Any]:
        return service.cancel(run_id)

    @app.post("/v1/runs/{run_id}/resume", dependencies=auth, responses=_errors(401, 404, 409, 413, 422))
    def resume(run_id: str = run_id_param, body: ResumeBody | None = Body(None)) -> dict[str, Any]:
        return service.resume(run_id, step=body.step if body else None, steps=body.steps if body else None)

    @app.post("/v1/runs/{run_id}/drills", status_code=202, dependencies=auth,
              responses=_errors(400, 401, 404, 409, 413, 422, 429))
    def request_drill(body: DrillBody, run_id: str = run_id_param) -> dict[str, Any]:
        request = service.request_drill(run_id, body.kind, target=rank_target(body.target), at_step=body.at_step,
                                        factor=body.factor, seconds=body.seconds, delay_ms=body.delay_ms,
                                        loss=body.loss, point=body.point)
        return {**request.to_dict(), "run_id": run_id, "outcome": "scheduled"}

    @app.get("/v1/drills/{drill_id}", dependencies=auth, responses=_errors(401, 404, 422))
    def get_drill(drill_id: str = Path(pattern=DRILL_ID, description="drill id")) -> dict[str, Any]:
        return service.drill(drill_id)

    @app.get("/v1/nodes", dependencies=auth, responses=_errors(401))
    def nodes() -> dict[str, Any]:
        """Every node with its state for the service (healthy, spare, quarantined, lost) and the run on it."""
        return service.cluster_view()

    @app.post("/v1/nodes/{name}/release", dependencies=auth, responses=_errors(401, 404, 422))
    def release_node(name: str = Path(pattern=NODE_NAME, description="node name")) -> dict[str, Any]:
        """An operator's release of a quarantined node: new runs may use it again; on Kubernetes its
        goodput taint goes, and its cordon if goodput made it."""
        return service.release_node(name)

    @app.get("/v1/cluster", dependencies=auth, responses=_errors(401))
    def cluster() -> dict[str, Any]:
        return service.cluster_view()

    return app


HTTP_STATUS = {
    "drill_rejected": 400, "invalid_request": 422, "invalid_spec": 422, "does_not_fit": 422,
    "no_such_checkpoint": 422, "spec_too_large": 413, "unauthorized": 401,
    "run_not_found": 404, "drill_not_found": 404, "node_not_quarantined": 404,
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
