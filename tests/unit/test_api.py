"""The REST API over a service whose run is driven by a fake worker group (no threads: the test
advances the run): drills requested on a live run are injected at their step and reported, bad
requests get a JSON error that says what to fix, a token guards every call, and the CLI's client
reaches a real server on loopback."""

from __future__ import annotations

import copy
import socket
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient

from controller.cli.client import ApiClientError, Client
from controller.drills import DrillSchedule
from controller.errors import ApiBindError
from controller.run_state import RunState
from controller.service.app import ApiServer, create_app, serve
from controller.service.registry import Registry
from controller.service.service import Service
from controller.spec import parse_spec
from controller.state import RunController
from tests.unit.fakes import FakeCluster, FakeInjector, FakeWorkerGroup, ManualClock, drive

ROOT = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())


class Live:
    """One run on a thread-less service: `step(t)` advances it at time t (and saves it)."""

    def __init__(self, service: Service, clock: ManualClock) -> None:
        self.service, self.clock = service, clock

    def step(self, t: float) -> None:
        self.clock.t = t
        self.service.advance("tiny-gpt", t)


def live_run(**overrides: object) -> tuple[RunController, FakeWorkerGroup, FakeInjector, Service, Live]:
    raw = copy.deepcopy(BASE)
    raw["drills"] = []
    raw.update(overrides)
    spec = parse_spec(raw)
    group = FakeWorkerGroup()
    injector = FakeInjector(group)
    clock = ManualClock(100.0)
    service = Service(Registry("sqlite://"), FakeCluster(spec.topology()), group_factory=lambda *_: group,
                      injector_factory=lambda _: injector, clock=clock, threads=False)
    service.add(spec)
    service.schedule()
    c = service.controller("tiny-gpt")
    live = Live(service, clock)
    drive(c, RunState.RUNNING, live.step)
    return c, group, injector, service, live


def test_drill_on_a_running_run_is_injected_at_its_step_and_reported() -> None:
    c, g, injector, service, live = live_run()
    live.clock.t = 110.5
    api = TestClient(create_app(service))
    g.finish_steps(1, 3)
    live.step(110.0)
    response = api.post("/v1/runs/tiny-gpt/drills", json={"kind": "kill-rank", "target": "5", "at_step": 4})
    assert response.status_code == 202, response.text
    drill = response.json()
    assert drill["outcome"] == "scheduled" and drill["id"].startswith("drill-")
    assert api.get(f"/v1/drills/{drill['id']}").json()["outcome"] == "scheduled"
    live.step(111.0)
    assert injector.injected == [], "not before its step"
    g.finish_steps(4, 4)
    live.step(112.0)
    assert injector.injected == [("kill-rank", "5")]
    assert api.get(f"/v1/drills/{drill['id']}").json()["outcome"] == "pending"
    for t in (113.0, 117.0):  # the death is seen, then the attribution grace runs out
        live.step(t)
    live.step(118.0)
    g.finish_steps(1, 1)
    live.step(130.0)
    report = api.get(f"/v1/drills/{drill['id']}").json()
    assert report["outcome"] == "recovered", report
    assert report["cause"] == "rank_died" and report["attributed_to"]["ranks"] == [5]
    assert report["decision"] == "restart" and report["run_id"] == "tiny-gpt"
    assert report["recovery_s"] == pytest.approx(130.0 - report["injected_at"])
    kinds = [e["kind"] for e in api.get("/v1/runs/tiny-gpt/events").json()]
    assert kinds.index("drill_requested") < kinds.index("drill_injected") < kinds.index("failure_detected")


def test_drill_without_a_step_or_target_hits_the_last_rank_now() -> None:
    c, g, injector, service, live = live_run()
    live.clock.t = 104.5
    api = TestClient(create_app(service))
    assert api.post("/v1/runs/tiny-gpt/drills", json={"kind": "kill-node"}).status_code == 202
    live.step(105.0)
    assert injector.injected == [], "waits for the attempt's first step"
    g.finish_steps(1, 1)
    live.step(106.0)
    assert injector.injected == [("kill-node", c.placement.node_of_rank[-1])]  # type: ignore[union-attr]


def test_new_drill_kinds_take_a_rank_as_an_int_and_their_parameters() -> None:
    c, g, injector, service, live = live_run()
    g.finish_steps(1, 3)
    live.step(110.0)
    api = TestClient(create_app(service))
    slow = api.post("/v1/runs/tiny-gpt/drills", json={"kind": "slow-rank", "target": 2, "factor": 2.0})
    assert slow.status_code == 202 and slow.json()["target"] == "2" and slow.json()["factor"] == 2.0
    outage = api.post("/v1/runs/tiny-gpt/drills", json={"kind": "storage-outage", "at_step": 5})
    assert outage.status_code == 202 and outage.json()["seconds"] == 30.0
    live.step(111.0)
    assert injector.injected == [("slow-rank", "2")]
    report = api.get(f"/v1/drills/{slow.json()['id']}").json()
    assert report["factor"] == 2.0 and report["outcome"] == "pending", report


@pytest.mark.parametrize("body, status, says", [
    ({"kind": "melt-gpu"}, 400, "use one of kill-node, kill-rank, hang-rank, slow-rank, bitflip, storage-outage"),
    ({"kind": "kill-rank", "factor": 2.0}, 400, "factor is for slow-rank drills"),
    ({"kind": "storage-outage", "target": "3"}, 400, "give no target"),
    ({"kind": "slow-rank", "factor": 0.5}, 422, "factor"),
    ({"kind": "bitflip", "target": 9}, 400, "give a rank from 0 to 7"),
    ({"kind": "kill-rank", "target": "8"}, 400, "give a rank from 0 to 7"),
    ({"kind": "kill-node", "target": "node-4"}, 400, "runs no rank of the current attempt"),
    ({"kind": "kill-rank", "at_step": 2}, 400, "the run is at step 3"),
    ({"kind": "kill-rank", "at_step": -1}, 422, "at_step"),
    ({"kind": "kill-rank", "when": 3}, 422, "when"),
    ({"kind": "collective-fault"}, 400, "the run needs elastic.failure_domain: replica and parallelism.dp_replicas >= 2"),
    ({"kind": "kill-rank", "point": "reduce"}, 400, "point is for collective-fault drills, not kill-rank"),
])
def test_bad_drill_requests_say_what_to_fix(body: dict, status: int, says: str) -> None:
    c, g, _, service, live = live_run()
    g.finish_steps(1, 3)
    live.step(110.0)
    response = TestClient(create_app(service)).post("/v1/runs/tiny-gpt/drills", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert says in error["message"], error
    assert c.drills.pending() == [], "nothing was scheduled"


def test_unknown_run_ended_run_and_unknown_drill() -> None:
    c, g, _, service, live = live_run()
    live.clock.t = 110.0
    api = TestClient(create_app(service))
    response = api.post("/v1/runs/nope/drills", json={"kind": "kill-rank"})
    assert response.status_code == 404 and "goodput list" in response.json()["error"]["message"]
    assert api.get("/v1/drills/drill-00000000").status_code == 404
    scheduled = api.post("/v1/runs/tiny-gpt/drills", json={"kind": "kill-rank", "at_step": 50}).json()
    assert api.post("/v1/runs/tiny-gpt/cancel").json()["state"] == "running", "cancel takes effect on the next step"
    live.step(120.0)
    response = api.post("/v1/runs/tiny-gpt/drills", json={"kind": "kill-rank"})
    assert response.status_code == 409 and "cancelled" in response.json()["error"]["message"]
    assert api.get(f"/v1/drills/{scheduled['id']}").json()["outcome"] == "not_injected"


def test_a_runs_spec_is_served_as_the_service_holds_it() -> None:
    """What `goodput export/eval RUN` read: the spec, without the numbers the service asked of a
    provider (the service had them before it planned)."""
    model = {"provider": "examples.gpt2_provider:build", "args": {"n_layers": 4, "d_model": 64, "n_heads": 4},
             "vocab_size": 128, "seq_len": 32}
    c, _, _, service, _ = live_run(model=model)
    assert c.spec.model.numbers is not None and c.plan is not None
    api = TestClient(create_app(service))
    served = api.get("/v1/runs/tiny-gpt/spec").json()
    assert {k: served["model"][k] for k in model} == model and "numbers" not in served["model"]
    assert parse_spec(served).model_dump(exclude={"model": {"numbers"}}) == \
        c.spec.model_dump(exclude={"model": {"numbers"}})
    assert api.get("/v1/runs/nope/spec").status_code == 404


def test_token_guards_everything_but_healthz() -> None:
    _, _, _, service, live = live_run()
    api = TestClient(create_app(service, token="s3cret"))
    assert api.get("/healthz").status_code == 200
    response = api.get("/v1/runs/tiny-gpt")
    assert response.status_code == 401 and "Bearer" in response.json()["error"]["message"]
    assert api.get("/v1/runs/tiny-gpt", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = api.get("/v1/runs/tiny-gpt", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["state"] == "running"


def test_schedule_orders_drills_by_step_with_immediate_ones_first() -> None:
    schedule = DrillSchedule()
    late = schedule.request(0.0, "kill-rank", target=None, at_step=9, step=0, placement=None)
    now = schedule.request(0.0, "hang-rank", target=None, at_step=None, step=0, placement=None)
    early = schedule.request(0.0, "kill-node", target=None, at_step=4, step=0, placement=None)
    assert schedule.pop_due(0) == now
    assert schedule.pop_due(3) is None
    assert schedule.pop_due(5) == early
    assert schedule.find(late.id) == late and schedule.pop_due(9) == late and schedule.pending() == []


def test_client_reaches_a_real_server_and_explains_failures() -> None:
    c, _, _, service, live = live_run()
    server = ApiServer(create_app(service), "127.0.0.1", 0).start()
    try:
        client = Client(server.url)
        assert client.call("GET", "/v1/runs/tiny-gpt")["state"] == "running"
        with pytest.raises(ApiClientError, match=r"drill kind 'slow' cannot be injected.*HTTP 400"):
            client.call("POST", "/v1/runs/tiny-gpt/drills", {"kind": "slow"})
        with pytest.raises(ApiBindError, match="cannot serve the API on 127.0.0.1"):
            ApiServer(create_app(service), "127.0.0.1", server.port)
        other = serve(create_app(service), "127.0.0.1", server.port, any_port=True)
        assert other.port != server.port and Client(other.url).call("GET", "/healthz") == {"status": "ok"}
        other.stop()
        client.close()
    finally:
        server.stop()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with pytest.raises(ApiClientError, match="no goodput API answers at .* set GOODPUT_URL"):
        Client(f"http://127.0.0.1:{free}").call("GET", "/v1/runs")


def test_a_chunked_body_cannot_pass_the_size_limit() -> None:
    """No Content-Length (chunked transfer): the body is counted as it arrives and refused past the limit."""
    from controller.service.intake import MAX_SPEC_BYTES

    _, _, _, service, _ = live_run()
    api = TestClient(create_app(service))

    def chunks():  # a generator body goes out chunked, without Content-Length
        yield b'{"name": "big", "model": "'
        for _ in range(MAX_SPEC_BYTES // 1000 + 2):
            yield b"x" * 1000
        yield b'"}'

    response = api.post("/v1/runs", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "body_too_large"
    small = api.post("/v1/runs", content=iter([b'{"name": 1}']), headers={"Content-Type": "application/json"})
    assert small.status_code == 422, "a small chunked body still reaches validation"


def test_every_error_code_the_service_raises_has_its_http_status() -> None:
    """Codes live with the errors, statuses only in app.py: a new code without a status would answer 400."""
    import re

    from controller.service.app import HTTP_STATUS

    root = Path(__file__).resolve().parents[2] / "controller"
    raised = {code for path in root.rglob("*.py")
              for code in re.findall(r'ServiceError\(\s*"([a-z_]+)"', path.read_text())}
    assert raised and raised <= set(HTTP_STATUS), sorted(raised - set(HTTP_STATUS))
    assert HTTP_STATUS["run_not_found"] == 404 and HTTP_STATUS["checkpoint_mismatch"] == 409
