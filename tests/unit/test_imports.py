"""The house rules on imports: controller -> trainer -> {checkpointing, health}; pure modules load
without torch, ray or boto3; the CLI (its API client included) starts without Ray, torch or the web stack."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("controller", "trainer", "checkpointing", "health")
ALLOWED = {
    "controller": {"controller", "trainer", "checkpointing", "health"},
    "trainer": {"trainer", "checkpointing", "health"},
    "checkpointing": {"checkpointing"},
    "health": {"health"},
}
PURE_MODULES = [
    "trainer.config", "trainer.report", "trainer.data", "controller.spec", "controller.progress", "controller.cli",
    "controller.topology", "controller.planner", "controller.placement", "controller.failure_policy",
    "controller.attribution", "controller.attempt", "controller.run_state", "controller.state", "controller.events", "controller.drills",
    "controller.drill_reports", "controller.run_drills",
    "checkpointing.manifest", "checkpointing.schedule", "checkpointing.store", "checkpointing.staging", "health.hang", "controller.cli.client",
    "health.straggler", "health.sdc", "controller.accounting", "controller.k8s.topology", "controller.errors",
    "controller.views", "controller.sim.run", "checkpointing.store.memory", "checkpointing.store.faults",
    "controller.service.scheduler", "controller.cli.render", "controller.checkpoints", "trainer.shards",
    "trainer.presets", "trainer.tokenize", "controller.providers", "trainer.protocol", "controller.service.identity",
    "controller.user_errors", "trainer.stop", "controller.boundary_stop",
]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports by absolute name."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def project_imports(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path) if name.split(".")[0] in PACKAGES}


@pytest.mark.parametrize("package", PACKAGES)
def test_import_direction(package: str) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = project_imports(path) - ALLOWED[package]
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}, against the import direction"


def test_pure_modules_load_without_heavy_libraries() -> None:
    code = (
        "import sys\n"
        f"for m in {PURE_MODULES!r}: __import__(m)\n"
        "heavy = sorted(m for m in ('torch', 'ray', 'boto3', 'fastapi', 'uvicorn', 'httpx', 'kubernetes', 'prometheus_client', "
        "'matplotlib') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0, proc.stderr


EDGES = ("controller.ray", "controller.service", "controller.cli", "controller.k8s")
EDGE_IMPORTS_ALLOWED = {
    # The one place Ray (and Kubernetes) are wired into the service: `goodput serve` and `goodput run`.
    "controller.service.main": ("controller.ray", "controller.k8s"),
    # The CLI is the composition root of its commands: it calls the service's entry points (serve, run),
    # reads the token file the service writes, and runs the Kubernetes label helper of the deployment.
    "controller.cli": ("controller.service.main", "controller.service.auth", "controller.k8s.labels",
                       "controller.k8s.nodes"),
}


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def test_the_core_imports_no_edge_and_edges_import_each_other_only_through_the_wiring() -> None:
    """The core (controller/*.py: state machine, policy, planner, views, …) imports no edge; controller/ray
    imports neither the service nor the CLI; an edge imports another only where EDGE_IMPORTS_ALLOWED says."""
    bad = []
    for path in sorted((ROOT / "controller").rglob("*.py")):
        module = _module_of(path)
        if module == "controller.__main__":
            continue  # `python -m controller` is the CLI
        mine = next((e for e in EDGES if _within(module, e)), None)
        allowed = next((v for k, v in EDGE_IMPORTS_ALLOWED.items() if _within(module, k)), ())
        for name in imported_modules(path):
            edge = next((e for e in EDGES if _within(name, e)), None)
            if edge is not None and edge != mine and not any(_within(name, a) for a in allowed):
                bad.append(f"{module} ({mine or 'core'}) imports {name}")
    assert not bad, bad


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> modules it imports), or None: a depth-first walk that
    meets a module still on its path."""
    done: set[str] = set()
    path: list[str] = []

    def walk(module: str) -> list[str] | None:
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return None
        path.append(module)
        for name in sorted(graph.get(module, ())):
            if (found := walk(name)) is not None:
                return found
        path.pop()
        done.add(module)
        return None

    return next((c for m in sorted(graph) if (c := walk(m)) is not None), None)


def test_cycle_finder_finds_a_cycle_through_three_modules_and_none_in_a_chain() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("package", ["trainer", "checkpointing", "health"])
def test_no_two_modules_of_the_package_import_each_other(package: str) -> None:
    """Each concept has one home and the lower module never imports the upper one, not even inside a
    function (a lazy import only hides the circle): the package's modules import one another acyclically."""
    modules = {_module_of(p): p for p in sorted((ROOT / package).rglob("*.py"))}
    graph = {m: {n for n in imported_modules(p) if n in modules and n != m} for m, p in modules.items()}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"
