"""The REST API (`/v1`, DESIGN.md) over the runs this process drives.

`goodput run` serves it on loopback while its run lasts, so `goodput drill RUN KIND` (and curl) can
reach a running run; `goodput serve` will host the same app for submitted runs. The controller is
single-threaded: every read or request takes the registry's lock, which the driving loop holds
while it advances the state machine, so a handler never sees a half-made transition.

FastAPI (with uvicorn) because it gives validated bodies, JSON errors and an OpenAPI page for free,
and Ray's dashboard already brings both into a Ray install.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from typing import Any, Callable, Iterator

from contextlib import contextmanager
from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from controller.client import TOKEN_ENV
from controller.drills import DrillError, rank_target
from controller.state import RunController


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class ApiBindError(OSError):
    """The API's address cannot be bound (busy port, foreign address)."""


class RunRegistry:
    """The runs this process drives, by id, behind one lock."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._runs: dict[str, RunController] = {}

    def add(self, controller: RunController) -> None:
        with self.lock:
            self._runs[controller.run_id] = controller

    @contextmanager
    def run(self, run_id: str) -> Iterator[RunController]:
        with self.lock:
            controller = self._runs.get(run_id)
            if controller is None:
                known = ", ".join(sorted(self._runs)) or "none"
                raise ApiError(404, "run_not_found", f"no run {run_id!r} here (runs: {known})")
            yield controller

    def runs(self) -> list[RunController]:
        return list(self._runs.values())


class DrillBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: str = Field(description="kill-node, kill-rank, hang-rank, slow-rank, bitflip or storage-outage")
    target: str | int | None = Field(None, description="node name (kill-node) or rank number (an integer or a "
                                                        "string); default: the last rank")
    at_step: int | None = Field(None, ge=0, description="inject once this step is done; default: now")
    factor: float | None = Field(None, ge=1, description="slow-rank: times slower (default 1.5)")
    seconds: float | None = Field(None, gt=0, description="storage-outage: seconds the store refuses writes "
                                                          "(default 30)")


def create_app(registry: RunRegistry, *, token: str | None = None,
               clock: Callable[[], float] = time.time) -> FastAPI:
    """The `/v1` app. With a token, every call but /healthz needs `Authorization: Bearer <token>`.
    `clock` stamps requests (the controller's own clock in tests)."""
    app = FastAPI(title="goodput", version="1")

    def authorized(authorization: str | None = Header(None)) -> None:
        if token is not None and not secrets.compare_digest(authorization or "", f"Bearer {token}"):
            raise ApiError(401, "unauthorized", f"send 'Authorization: Bearer <token>' (the {TOKEN_ENV} the "
                                                "server was started with)")

    @app.exception_handler(ApiError)
    def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse({"error": {"code": e.code, "message": e.message}}, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'][1:]) or 'body'}: {err['msg']}"
                             for err in e.errors())
        return JSONResponse({"error": {"code": "invalid_request", "message": problems}}, status_code=422)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/runs", dependencies=[Depends(authorized)])
    def list_runs() -> list[dict[str, Any]]:
        with registry.lock:
            return [c.to_dict(clock(), full=False) for c in registry.runs()]

    @app.get("/v1/runs/{run_id}", dependencies=[Depends(authorized)])
    def get_run(run_id: str) -> dict[str, Any]:
        with registry.run(run_id) as c:
            return c.to_dict(clock(), full=False)

    @app.get("/v1/runs/{run_id}/events", dependencies=[Depends(authorized)])
    def get_events(run_id: str) -> list[dict[str, Any]]:
        with registry.run(run_id) as c:
            return [e.to_dict() for e in c.events]

    @app.post("/v1/runs/{run_id}/cancel", dependencies=[Depends(authorized)])
    def cancel(run_id: str) -> dict[str, Any]:
        with registry.run(run_id) as c:
            c.cancel()
            return c.to_dict(clock(), full=False)

    @app.post("/v1/runs/{run_id}/drills", status_code=202, dependencies=[Depends(authorized)])
    def request_drill(run_id: str, body: DrillBody) -> dict[str, Any]:
        with registry.run(run_id) as c:
            if c.state.terminal:
                raise ApiError(409, "run_ended", f"run {run_id!r} has {c.state.value}; drills need a live run")
            try:
                request = c.request_drill(clock(), body.kind, target=rank_target(body.target), at_step=body.at_step,
                                          factor=body.factor, seconds=body.seconds)
            except DrillError as e:
                raise ApiError(400, "drill_rejected", str(e)) from None
            return {**request.to_dict(), "run_id": run_id, "outcome": "scheduled"}

    @app.get("/v1/drills/{drill_id}", dependencies=[Depends(authorized)])
    def get_drill(drill_id: str) -> dict[str, Any]:
        with registry.lock:
            for c in registry.runs():
                report = c.drill(drill_id)
                if report is not None:
                    return {**report, "run_id": c.run_id}
        raise ApiError(404, "drill_not_found", f"no drill {drill_id!r} on the runs here")

    return app


class ApiServer:
    """uvicorn in a daemon thread on a socket bound here (so a busy port is an error in the caller,
    and port 0 picks a free one)."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        import uvicorn

        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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


def token_from_env() -> str | None:
    return os.environ.get(TOKEN_ENV) or None
