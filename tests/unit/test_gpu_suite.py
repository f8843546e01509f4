"""benchmarks/gpu_suite.py --dry-run: every measurement of the GPU suite runs on CPU (gloo, tiny shapes)
and the suite writes its table, its JSON and its record into the folder it is given, not over the
records the documentation is generated from."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MEASUREMENTS = {"mfu", "overhead", "d2h", "stall", "abort"}


@pytest.mark.dist
def test_dry_run_measures_everything_and_writes_into_out(tmp_path: Path) -> None:
    real = ROOT / "benchmarks" / "records" / "gpu_suite.json"
    real_before = real.stat().st_mtime_ns if real.exists() else None
    env = {k: v for k, v in os.environ.items() if k != "GOODPUT_RECORDS_DIR"}  # the suite sends it to --out itself
    proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]

    record = json.loads((tmp_path / "gpu_suite.json").read_text())  # the suite's JSON is its record
    assert record["benchmark"] == "gpu_suite" and record["dry_run"] is True
    assert set(record["measurements"]) == MEASUREMENTS
    figures = {f["figure"]: f for f in record["figures"]}
    for name, entry in record["measurements"].items():
        assert entry["status"] == "ok" and entry["error"] is None, (name, entry)
        assert entry["figures"], f"{name} has no figures"
        for figure in (figures[f] for f in entry["figures"]):
            assert figure["n"] >= 1 and len(figure["values"]) == figure["n"], figure
            numbers = [figure["median"], figure["min"], figure["max"], *figure["values"]]
            assert all(isinstance(v, (int, float)) and math.isfinite(v) for v in numbers), figure
    assert len(figures) == len(record["figures"]), "two figures share a name"

    table = (tmp_path / "gpu_suite.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert rows[0] == "| figure | median | range | n | goal |"
    for name, figure in figures.items():
        assert sum(row.startswith(f"| {name} | ") for row in rows) == 1, name
        assert any(row.startswith(f"| {name} | ") and f"| {figure['n']} |" in row for row in rows), name
    _, _, rest = table.partition("## Not measurable on one GPU\n")
    assert rest, "no 'Not measurable on one GPU' list"
    assert [line for line in rest.splitlines() if line.startswith("- ")]
    assert "NCCL refuses two ranks on one device" in rest

    assert (real.stat().st_mtime_ns if real.exists() else None) == real_before, "a dry run wrote the real record"
    assert f"record: {tmp_path.resolve() / 'gpu_suite.json'}" in proc.stdout
