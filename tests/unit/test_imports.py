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
    "controller.attribution", "controller.attempt", "controller.state", "controller.events", "controller.drills",
    "checkpointing.manifest", "checkpointing.schedule", "checkpointing.store", "health.hang", "controller.cli.client",
    "health.straggler", "health.sdc", "controller.accounting", "controller.k8s.topology", "controller.errors",
    "controller.views", "controller.sim.run", "checkpointing.store.memory", "checkpointing.store.faults",
    "controller.service.scheduler", "controller.cli.render",
]


def project_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        found.update(n.split(".")[0] for n in names if n.split(".")[0] in PACKAGES)
    return found


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
