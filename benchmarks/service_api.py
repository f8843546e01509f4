"""The service's API under load, and what the registry costs per event.

1. Latency: a Service with 4 live runs (fake worker groups that finish a step every poll, so each run's
   driver thread writes to the registry all the time) behind the real app on uvicorn, 127.0.0.1.
   p50/p99 of `GET /v1/runs/{id}` and `POST /v1/runs/{id}/drills`, and side by side the same client's
   `GET /healthz` (no auth, no service): the ratio is what the service itself adds.
2. Registry writes: SQLite (WAL) under a temp dir; `Registry.save` of a run with events arriving 10
   per save (as a driver saves after each poll): milliseconds per 1,000 events.

    python benchmarks/service_api.py [--requests 400]

Its record: benchmarks/records/service_api.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import httpx  # noqa: E402
import yaml  # noqa: E402

from benchmarks import records  # noqa: E402
from controller.service.app import ApiServer, create_app  # noqa: E402
from controller.service.registry import Registry, Saved, sqlite_url  # noqa: E402
from controller.service.service import Service  # noqa: E402
from controller.spec import parse_spec  # noqa: E402
from controller.attempt import GroupStatus, PollResult  # noqa: E402
from controller.topology import Topology  # noqa: E402
from tests.unit.fakes import FakeCluster, FakeInjector, FakeWorkerGroup  # noqa: E402

TOKEN = "bench"
CODE = ["controller/service/app.py", "controller/service/auth.py", "controller/service/service.py",
        "controller/service/registry.py"]
"""What the API's figures measure: the routes, their auth, the service behind them and its registry."""


class SteadyGroup(FakeWorkerGroup):
    """Finishes one step per poll, forever (a live run that keeps its driver writing)."""

    def poll(self) -> PollResult:
        if self.started:
            step = getattr(self, "_step", self.started[-1].start_step) + 1
            self._step = step
            self.finish_steps(step, step)
        result = super().poll()
        result.status = GroupStatus.RUNNING
        return result


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def latency(requests: int) -> list[dict[str, Any]]:
    """Print each route's p50 and p99; its figures."""
    root = os.path.join(os.path.dirname(__file__), "..")
    raw = yaml.safe_load(open(os.path.join(root, "examples", "tiny-gpt.yaml")).read())
    raw.update(drills=[], parallelism={"dp": 1, "tp": 2, "pp": 1})
    raw["train"]["steps"] = 10**9
    with tempfile.TemporaryDirectory() as state:
        registry = Registry(sqlite_url(state))
        service = Service(registry, FakeCluster(Topology.from_local(nodes=4, gpus_per_node=2, racks=2, spares=0)),
                          group_factory=lambda *_: SteadyGroup(),
                          injector_factory=lambda g: FakeInjector(g), poll_s=0.05)  # type: ignore[arg-type]
        service.start()
        ids = [service.add(parse_spec({**raw, "name": f"bench-{i}"}))["id"] for i in range(4)]
        server = ApiServer(create_app(service, token=TOKEN), "127.0.0.1", 0).start()
        client = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {TOKEN}"})
        deadline = time.monotonic() + 30
        while any(client.get(f"/v1/runs/{i}").json()["state"] != "running" for i in ids):
            assert time.monotonic() < deadline, "the runs did not start"
            time.sleep(0.1)
        get: list[float] = []
        post: list[float] = []
        health: list[float] = []
        for n in range(requests):
            run = ids[n % 4]
            t0 = time.perf_counter()
            client.get("/healthz").raise_for_status()
            t1 = time.perf_counter()
            client.get(f"/v1/runs/{run}").raise_for_status()
            t2 = time.perf_counter()
            if n % 4 == 0 and len(post) < 60:  # drills per run are bounded (64)
                client.post(f"/v1/runs/{run}/drills", json={"kind": "slow-rank", "at_step": 10**8}).raise_for_status()
                post.append(time.perf_counter() - t2)
            health.append(t1 - t0)
            get.append(t2 - t1)
        steps = [client.get(f"/v1/runs/{i}").json()["step"] for i in ids]
        client.close()
        server.stop()
        service.stop()
        registry.close()
    print(f"4 live runs (steps so far {steps}), {requests} requests each kind, one client, 127.0.0.1")
    figures: list[dict[str, Any]] = []
    for name, xs in (("GET /healthz", health), ("GET /v1/runs/{id}", get), ("POST /v1/runs/{id}/drills", post)):
        print(f"  {name:<28} p50 {pct(xs, 0.5) * 1e3:6.2f} ms   p99 {pct(xs, 0.99) * 1e3:6.2f} ms   (n={len(xs)})")
        figures += [records.figure(f"api: {name}", [x * 1e3 for x in xs], "ms"),
                    records.figure(f"api: {name}, p99", [pct(xs, 0.99) * 1e3], "ms")]
    ratio = statistics.median(get) / statistics.median(health)
    print(f"  GET run / GET healthz, p50: {ratio:.2f}x")
    return figures + [records.figure("api: GET run / GET healthz (medians)", [ratio], "ratio")]


def registry_cost(events: int = 5000, per_save: int = 10) -> list[dict[str, Any]]:
    """Print what the registry's writes cost; its figures."""
    with tempfile.TemporaryDirectory() as state:
        r = Registry(sqlite_url(state))
        r.add_run(run_id="r", name="r", spec={}, state="running", created_at=0.0)
        saved, hist = Saved(), []
        view = {"state": "running", "attempt": 0, "step": 0, "loss": 1.0}
        t0 = time.perf_counter()
        for i in range(events // per_save):
            rows = [{"time": float(i), "attempt": 0, "kind": "straggler", "detail": {"rank": j, "score": 1.1}}
                    for j in range(per_save)]
            hist.append({"step": i + 1, "loss": 1.0, "attempt": 0})
            r.save("r", {**view, "step": i + 1}, rows, hist, saved, float(i))
        elapsed = time.perf_counter() - t0
        r.close()
    per_thousand_ms, per_save_ms = elapsed / events * 1000 * 1e3, elapsed / (events // per_save) * 1e3
    print(f"registry (SQLite, WAL): {events} events in {events // per_save} saves of {per_save} (+1 history row "
          f"each): {per_thousand_ms:.1f} ms per 1,000 events, {per_save_ms:.2f} ms per save")
    return [records.figure("registry: per 1,000 events", [per_thousand_ms], "ms"),
            records.figure(f"registry: per save of {per_save} events", [per_save_ms], "ms")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=400)
    opts = parser.parse_args()
    figures = latency(opts.requests) + registry_cost()
    records.write("service_api", figures, code=CODE, extra={"requests": opts.requests})


if __name__ == "__main__":
    main()
