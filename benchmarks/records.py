"""Benchmark records: every benchmark ends by writing one JSON record of what it measured, and
`python benchmarks/figures.py` writes the documentation's figures from those records alone (no
figure is typed in by hand).

A record (benchmarks/records/NAME.json):

    benchmark   the script's name (drain, preemption, ...)
    command     how it was run (the script and its arguments)
    code        the files whose behaviour the figures measure: a figure measured before the last
                commit that touched one of them is marked as older than its code
    figures     [{figure, unit, n, median, min, max, values, goal?}]
    machine     platform, processor, CPU count (and the GPU, where one was used)
    torch, ray  the versions measured with
    git_commit  HEAD when it ran; git_dirty: whether the tree had uncommitted changes
    date        when it ran (UTC)

GOODPUT_RECORDS_DIR (or `directory=`) sends records elsewhere: a dry run in the tests never
overwrites what the documentation is generated from.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
RECORDS = REPO / "benchmarks" / "records"
ENV_DIR = "GOODPUT_RECORDS_DIR"


def figure(name: str, values: Sequence[float], unit: str, *, goal: str | None = None) -> dict[str, Any]:
    """One measured figure: its values and their spread. `goal`: what it should be, in words
    (`<= 1`, `0`), shown beside it."""
    if not values:
        raise ValueError(f"figure {name!r} has no values")
    out: dict[str, Any] = {"figure": name, "unit": unit, "n": len(values), "median": statistics.median(values),
                           "min": min(values), "max": max(values), "values": list(values)}
    if goal is not None:
        out["goal"] = goal
    return out


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment() -> dict[str, Any]:
    """The machine, the versions and the commit a measurement was taken on."""
    versions: dict[str, Any] = {}
    for module in ("torch", "ray"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            versions[module] = None
    machine: dict[str, Any] = {"platform": platform.platform(),
                               "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count()}
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        machine["gpu"] = torch.cuda.get_device_name(0)
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"machine": machine, **versions, "git_commit": _git("rev-parse", "HEAD"),
            "git_dirty": bool(status) if status is not None else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def write(benchmark: str, figures: list[dict[str, Any]], *, code: Sequence[str], extra: dict[str, Any] | None = None,
          directory: str | Path | None = None) -> Path:
    """Write the record of one run of `benchmark` (its latest: the file is replaced); its path."""
    missing = [path for path in code if not (REPO / path).exists()]
    if missing:
        raise ValueError(f"{benchmark}: code paths {missing} do not exist (paths from the repository root)")
    folder = Path(directory or os.environ.get(ENV_DIR) or RECORDS)
    folder.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": benchmark, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
              "code": list(code), "figures": figures, **environment(), **(extra or {})}
    path = folder / f"{benchmark}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"record: {path}")
    return path


def load(directory: str | Path = RECORDS) -> dict[str, dict[str, Any]]:
    """Every record in `directory`: benchmark name -> record."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(Path(directory).glob("*.json"))}
