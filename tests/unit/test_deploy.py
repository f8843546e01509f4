"""deploy/ rendered as a user would (`kubectl kustomize deploy/overlays/{dev,prod}`): every core kind
validates against the Kubernetes schemas (kubernetes-validate), the RayCluster against KubeRay's CRD
schema (../shared/vendor/kuberay, read in place), the PrometheusRule's groups pass promtool, and the
pieces refer to each other correctly (selectors, service accounts, config, RBAC that allows exactly
what quarantine and topology need). No API server can run here: nothing is applied."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.tools import needs, require

ROOT = Path(__file__).resolve().parents[2]
VENDOR_DIRS = [Path(p) for p in [os.environ.get("GOODPUT_VENDOR", "")] if p] + [
    base / "shared" / "vendor" for base in (ROOT.parent, ROOT)]
"""Where the workplace keeps third-party data files (../shared/vendor beside the checkout; GOODPUT_VENDOR
names another place): read in place, never copied into the tree."""


def vendored(*parts: str) -> Path:
    found = [d.joinpath(*parts) for d in VENDOR_DIRS if d.joinpath(*parts).exists()]
    return found[0] if found else VENDOR_DIRS[0].joinpath(*parts)


CRD = vendored("kuberay", "ray.io_rayclusters.yaml")
"""KubeRay's RayCluster CRD."""
CRD_MISSING = None if CRD.exists() else (
    f"KubeRay's RayCluster CRD is not at {CRD} (the workplace's ../shared/vendor/kuberay; or set GOODPUT_VENDOR)")
OVERLAYS = ["dev", "prod"]
K8S_VERSION = "1.31.0"
EXTERNAL_SECRETS = {"goodput-api-token", "goodput-s3", "goodput-db"}
"""Made by the operator (README), referenced only."""

KUBECTL_MISSING = (None if shutil.which("kubectl") else
                   "kubectl is not installed (Debian package `kubectl`; `make test` installs it)")
needs_kubectl = needs(KUBECTL_MISSING)
"""Only the tests that render deploy/ need kubectl (the Dockerfile's does not)."""
PROMETHEUS_CRDS = {kind: vendored("prometheus-operator", f"monitoring.coreos.com_{plural}.yaml")
                   for kind, plural in (("ServiceMonitor", "servicemonitors"), ("PrometheusRule", "prometheusrules"))}
"""The Prometheus Operator's CRDs."""
PROMETHEUS_CRDS_MISSING = None if all(p.exists() for p in PROMETHEUS_CRDS.values()) else (
    f"the Prometheus Operator's CRDs are not at {sorted(map(str, PROMETHEUS_CRDS.values()))} (the workplace's "
    "../shared/vendor/prometheus-operator; or set GOODPUT_VENDOR)")


def render(overlay: str) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", str(ROOT / "deploy" / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name, [d["metadata"]["name"] for d in by_kind(docs, kind)])
    return found[0]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    require(KUBECTL_MISSING)
    return request.param, render(request.param)


def test_core_kinds_validate_against_the_kubernetes_schemas(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    import kubernetes_validate

    overlay, docs = rendered
    core = [d for d in docs if "." not in d["apiVersion"].split("/")[0] or d["apiVersion"].startswith(
        ("apps/", "rbac.authorization.k8s.io/"))]
    assert {d["kind"] for d in core} >= {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                        "ConfigMap", "Deployment", "Service"} | (
        {"PersistentVolumeClaim"} if overlay == "dev" else set())  # prod's registry is in PostgreSQL
    for doc in core:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    namespace = one(docs, "Namespace")["metadata"]["name"]
    assert namespace == {"dev": "goodput-dev", "prod": "goodput"}[overlay]
    for doc in docs:
        if doc["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"].get("namespace") == namespace, doc["metadata"]


@needs_kubectl
def test_a_broken_manifest_is_caught() -> None:
    """The validator is not a rubber stamp: a typo'd field and a wrong type fail."""
    import kubernetes_validate

    deployment = one(render("dev"), "Deployment")
    typo = json.loads(json.dumps(deployment))
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, K8S_VERSION, strict=True)
    wrong = json.loads(json.dumps(deployment))
    wrong["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, K8S_VERSION, strict=True)


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


@needs(CRD_MISSING)  # under CI=true a missing CRD fails the test (tests/support/tools.py)
def test_the_raycluster_validates_against_kuberays_crd(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    import jsonschema

    overlay, docs = rendered
    ray = one(docs, "RayCluster", "goodput")
    assert ray["apiVersion"] == "ray.io/v1"
    schema = crd_schema()
    jsonschema.validate(ray, schema)
    bad = json.loads(json.dumps(ray))
    bad["spec"]["workerGroupSpecs"][0]["replicas"] = "16"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    (head,) = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    from controller.ray.cluster import DEPLOYED_HEALTH_CHECK

    health = {e["name"].removeprefix("RAY_"): int(e["value"]) for e in head["env"] if e["name"].startswith("RAY_health")}
    assert health == DEPLOYED_HEALTH_CHECK, "the head sets the health checks goodput documents"
    dead_after_s = (health["health_check_period_ms"] * health["health_check_failure_threshold"]
                    + health["health_check_timeout_ms"]) / 1000
    assert 5 <= dead_after_s <= 15, "sooner than Ray's ~30 s, not so soon that a stalled raylet is lost"
    groups = {g["groupName"]: g for g in ray["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"gpu", "spare"}
    for group in groups.values():
        assert group["rayStartParams"]["labels-file"] == "/etc/goodput/ray-labels.yaml"
        (init,) = group["template"]["spec"]["initContainers"]
        assert init["args"][0] == "k8s-node-labels" and "--spare-group=spare" in init["args"]
        env = {e["name"]: e for e in init["env"]}
        assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        assert env["RAY_GROUP"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['ray.io/group']"
        gpus = group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == group["rayStartParams"]["num-gpus"]
    replicas = (groups["gpu"]["replicas"], groups["spare"]["replicas"])
    assert replicas == {"dev": (1, 1), "prod": (16, 2)}[overlay]


@needs(PROMETHEUS_CRDS_MISSING)
def test_the_service_monitor_and_rule_validate_against_the_prometheus_operators_crds(
        rendered: tuple[str, list[dict[str, Any]]]) -> None:
    import jsonschema

    _, docs = rendered
    for kind, path in PROMETHEUS_CRDS.items():
        crd = yaml.safe_load(path.read_text())
        version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        # The CRDs' patterns are Go regexps (some start '^(?i)', which Python's re takes only at the very
        # start): validate documents against the schema without compiling every pattern up front.
        validator = jsonschema.Draft7Validator(version["schema"]["openAPIV3Schema"])
        (doc,) = by_kind(docs, kind)
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        validator.validate(doc)
        bad = json.loads(json.dumps(doc))
        if kind == "ServiceMonitor":
            bad["spec"]["endpoints"][0]["interval"] = "every minute"  # not a Prometheus duration
        else:
            bad["spec"]["groups"][0]["rules"][0]["for"] = "ten minutes"
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(bad)


def test_the_pieces_refer_to_each_other(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    overlay, docs = rendered
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    deployment = one(docs, "Deployment", "goodput-controller")
    pod = deployment["spec"]["template"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    service = one(docs, "Service", "goodput-controller")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    monitor = one(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"][0]["authorization"]["credentials"]["name"] == "goodput-api-token"
    ray = one(docs, "RayCluster")
    pods = [pod["spec"], ray["spec"]["headGroupSpec"]["template"]["spec"]] + [
        g["template"]["spec"] for g in ray["spec"]["workerGroupSpecs"]]
    for spec in pods:
        assert ("ServiceAccount", spec["serviceAccountName"]) in names
        assert spec["securityContext"]["runAsNonRoot"] is True
        for container in spec.get("initContainers", []) + spec["containers"]:
            assert container["image"].startswith("ghcr.io/goodput-dev/goodput:")
            for source in container.get("envFrom", []):
                assert ("ConfigMap", source["configMapRef"]["name"]) in names
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] in EXTERNAL_SECRETS
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in names
    args = pod["spec"]["containers"][0]["args"]
    assert args[0] == "serve" and "--kubernetes=on" in args and "--advertise-host=$(POD_IP)" in args
    config = one(docs, "ConfigMap", "goodput-config")["data"]
    # The controller joins as a node of its own (the head's GCS port), not through Ray Client.
    head_ports = {p["name"]: p["containerPort"] for p in ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    assert config["RAY_ADDRESS"] == f"{ray['metadata']['name']}-head-svc:{head_ports['gcs']}"
    assert config["RACK_LABEL"] == {"dev": "topology.kubernetes.io/zone", "prod": "example.com/rack"}[overlay]
    assert ("--db=$(GOODPUT_DB)" in args) == (overlay == "prod")
    # prod: a leader and a standby on PostgreSQL; the standby is alive but not ready (no requests).
    deployment = one(docs, "Deployment", "goodput-controller")
    assert (deployment["spec"]["replicas"], "--standby" in args) == ((2, True) if overlay == "prod" else (1, False))
    container = pod["spec"]["containers"][0]
    assert (container["readinessProbe"]["httpGet"]["path"], container["livenessProbe"]["httpGet"]["path"]) == \
        ("/readyz", "/healthz")
    assert bool(by_kind(docs, "PersistentVolumeClaim")) == (overlay == "dev"), "prod keeps no state on a volume"
    # RBAC: the controller may get/list/watch/patch nodes and nothing else; the workers only get them.
    roles = {r["metadata"]["name"]: r["rules"] for r in by_kind(docs, "ClusterRole")}
    assert roles["goodput-nodes"] == [{"apiGroups": [""], "resources": ["nodes"],
                                       "verbs": ["get", "list", "watch", "patch"]}]
    assert roles["goodput-node-reader"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    namespace = one(docs, "Namespace")["metadata"]["name"]
    bound = {(b["roleRef"]["name"], s["name"], s["namespace"]) for b in by_kind(docs, "ClusterRoleBinding")
             for s in b["subjects"]}
    assert bound == {("goodput-nodes", "goodput-controller", namespace),
                     ("goodput-node-reader", "goodput-worker", namespace)}


@needs_kubectl
@needs(None if shutil.which("promtool") else "promtool is not installed (Debian package `prometheus`)")
def test_the_prometheus_rule_and_dashboards_are_the_generated_ones(tmp_path: Path) -> None:
    docs = render("prod")
    rule = one(docs, "PrometheusRule", "goodput")
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump(rule["spec"]))
    check = subprocess.run(["promtool", "check", "rules", str(rules_file)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert rule["spec"] == yaml.safe_load((ROOT / "dashboards" / "prometheus" / "goodput-alerts.yaml").read_text())
    boards = one(docs, "ConfigMap", "goodput-dashboards")
    assert boards["metadata"]["labels"]["grafana_dashboard"] == "1"
    for name, text in boards["data"].items():
        assert json.loads(text) == json.loads((ROOT / "dashboards" / "grafana" / name).read_text())


def test_the_dockerfile_keeps_the_base_images_torch_and_runs_as_a_user() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert lines[0].startswith("ARG BASE=") and "cuda" in lines[0] and lines[1] == "FROM ${BASE}"
    assert "torch.version.cuda" in text and "-c /etc/torch-constraint.txt" in text
    assert '".[ray,k8s]"' in text
    users = [line for line in lines if line.startswith("USER ")]
    assert users == ["USER 1000"] and lines.index(users[0]) > max(i for i, line in enumerate(lines)
                                                                   if line.startswith("RUN "))
    assert 'ENTRYPOINT ["goodput"]' in lines
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored
