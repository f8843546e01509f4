"""schemathesis against the live OpenAPI document of a served app (uvicorn on 127.0.0.1, a service with
fake worker groups and one running run): whatever it sends, the API answers no 5xx and no status code
its document does not list. Requests without the token must get the documented 401."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance

from controller.service.app import ApiServer, create_app
from controller.service.registry import Registry
from controller.service.service import Service
from controller.spec import parse_spec
from controller.topology import Topology
from tests.unit.fakes import FakeCluster, FakeInjector, FakeWorkerGroup

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "fuzz-token"


@pytest.fixture(scope="module")
def api_url() -> Iterator[str]:
    raw = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text()))
    raw["drills"] = []
    service = Service(Registry("sqlite://"), FakeCluster(Topology.from_local(nodes=6, gpus_per_node=2, racks=2,
                                                                              spares=1)),
                      group_factory=lambda *_: FakeWorkerGroup(),
                      injector_factory=lambda g: FakeInjector(g))  # type: ignore[arg-type]
    service.start()
    service.add(parse_spec(raw))
    server = ApiServer(create_app(service, token=TOKEN), "127.0.0.1", 0).start()
    try:
        yield server.url
    finally:
        server.stop()
        service.stop()


def test_no_server_error_and_no_undocumented_status(api_url: str) -> None:
    """Every operation of the document, fuzzed by hypothesis from its own schema. (Driven from here, not
    with schemathesis's pytest plugin, which does not load under this pytest.)"""
    schema = schemathesis.openapi.from_url(f"{api_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 11
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def fuzz(case: schemathesis.Case) -> None:
            case.call_and_validate(base_url=api_url, headers={"Authorization": f"Bearer {TOKEN}"},
                                   checks=[not_a_server_error, status_code_conformance])

        fuzz()


def test_every_route_but_the_probes_needs_the_token_and_documents_401(api_url: str) -> None:
    """The kubelet's probes (/healthz, /readyz) carry no token; every other route needs it."""
    document = httpx.get(f"{api_url}/openapi.json").json()
    for path, methods in document["paths"].items():
        for method, op in methods.items():
            if path in ("/healthz", "/readyz"):
                continue
            assert "401" in op["responses"], (method, path)
            url = api_url + path.replace("{run_id}", "tiny-gpt").replace("{drill_id}", "drill-00000000")
            response = httpx.request(method, url, json={} if method == "post" else None)
            assert response.status_code == 401, (method, path, response.text)
            assert TOKEN not in response.text
    assert httpx.get(f"{api_url}/healthz").status_code == 200
    assert httpx.get(f"{api_url}/readyz").json() == {"status": "leading"}
