"""Write the documentation's figures from the benchmark records (benchmarks/records/*.json): the
benchmarks page (docs/benchmarks.md) and the README's headline figures, between its
`<!-- figures:begin -->` and `<!-- figures:end -->` lines. Nothing else writes a figure.

    python benchmarks/figures.py           rewrite both
    python benchmarks/figures.py --check   exit 1 when either is not what the records say

A record measured before the last commit that changed one of its `code` files is marked "older than
its code" (with that commit); --check ignores those marks, which follow from git history alone.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from records import RECORDS, REPO, load  # noqa: E402

PAGE = REPO / "docs" / "benchmarks.md"
README = REPO / "README.md"
BEGIN, END = "<!-- figures:begin -->", "<!-- figures:end -->"
FRESHNESS = re.compile(r"<!-- freshness -->.*?<!-- /freshness -->", re.S)

HEADLINES = [
    ("drain", "drain: steps redone", "Steps redone when a node is drained"),
    ("drain", "drain: bytes read from the store", "Bytes read from the store when a node is drained"),
    ("drain", "drain: request -> the run off the node", "Drain request -> the run off the node"),
    ("preemption", "preemption: low run steps redone", "Steps a preempted run redoes"),
    ("preemption", "preemption: high run submission -> its first step end",
     "Preemption -> the high-priority run's first step"),
    ("trainer_overhead", "dp2 pp2 tp2: goodput step / bare torch step", "goodput step / bare torch step, dp2 pp2 tp2 (CPU)"),
    ("startup", "startup badput, make run's mesh", "make run's startup badput: first attempt -> first step, fresh cluster"),
    # one GPU (benchmarks/gpu_suite.py): its names carry the model's width, so they are matched by prefix
    ("gpu_suite", "mfu: goodput step, eager*", None),
    ("gpu_suite", "mfu: goodput step, compiled*", None),
    ("gpu_suite", "overhead: goodput step (*", None),
    ("gpu_suite", "d2h: peer snapshot / plain copy", None),
    ("gpu_suite", "stall: async save stall / synchronous save", None),
]
"""(benchmark, figure, label) of the few figures the README shows; the rest are on the page. A figure
ending in `*` matches every figure that starts so; a label None shows the figure's own name."""

INTRO = """# Benchmarks

Every figure on this page is read from a benchmark's record (`benchmarks/records/NAME.json`), which
the benchmark writes when it runs; `python benchmarks/figures.py` writes this page and the README's
headline figures from them. A record measured before the last change to the code it measures is
marked **older than its code**: run its command again to refresh it.

These machines are noisy: where a benchmark compares two paths, it runs both side by side in one
process and reports their ratio.

On a machine with one CUDA GPU, `python benchmarks/gpu_suite.py --out DIR` runs every single-device
measurement (MFU eager and compiled, the step's overhead with probes, checkpoints and peer snapshots,
the snapshot's device-to-host bandwidth, the async checkpoint's stall, NCCL groups aborted) in under
8 minutes and writes its record (`gpu_suite`).
"""


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def changed_since(record: dict[str, Any]) -> str | None:
    """The newest commit after the record's that changed one of its code files; None when there is
    none. A record whose commit this repository does not know is older than its code ("unknown")."""
    commit = record.get("git_commit")
    known = commit and subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO,
                                      capture_output=True).returncode == 0
    if not known:
        return "unknown"
    return _git("log", "-1", "--format=%h", f"{commit}..HEAD", "--", *record.get("code", [])) or None


def number(value: float, unit: str) -> str:
    if unit in ("steps", "bytes", "count") or float(value).is_integer():
        return f"{int(round(value)):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def _unit(unit: str) -> str:
    return "" if unit in ("ratio", "count") else f" {unit}"


def _freshness(record: dict[str, Any]) -> str:
    changed = changed_since(record)
    text = "" if changed is None else f" **Older than its code** (changed at `{changed}`)."
    return f"<!-- freshness -->{text}<!-- /freshness -->"


def page(records: dict[str, dict[str, Any]]) -> str:
    lines = [INTRO]
    if not records:
        lines.append("No benchmark has written a record yet.\n")
    if "gpu_suite" not in records:
        lines.append("## gpu_suite\n\nNo record yet: the GPU suite has not run on this code.\n")
    for name, record in sorted(records.items()):
        commit = (record.get("git_commit") or "unknown")[:7] + (" (with uncommitted changes)" if record.get("git_dirty") else "")
        machine = record.get("machine", {})
        where = machine.get("gpu") or f"{machine.get('cpu_count')} CPUs ({machine.get('processor')})"
        lines += [f"## {name}", "",
                  f"`python benchmarks/{record['command']}` on {where}, torch {record.get('torch')}, "
                  f"Ray {record.get('ray')}; commit `{commit}`, {record.get('date', '')[:10]}.{_freshness(record)}",
                  "", "Measures: " + ", ".join(f"`{path}`" for path in record.get("code", [])) + ".", "",
                  "| Figure | Median | Range | n | Goal |", "|---|---|---|---|---|"]
        for f in record["figures"]:
            u = _unit(f["unit"])
            lines.append(f"| {f['figure']} | {number(f['median'], f['unit'])}{u} | "
                         f"{number(f['min'], f['unit'])} – {number(f['max'], f['unit'])}{u} | {f['n']} | "
                         f"{f.get('goal', '')} |")
        lines.append("")
        if record.get("not_measurable"):  # (the GPU suite: what one device cannot show)
            lines += ["Not measurable on one GPU:", ""] + [f"- {why}" for why in record["not_measurable"]] + [""]
    return "\n".join(lines)


def headlines(records: dict[str, dict[str, Any]]) -> str:
    rows = ["| Figure | Median (n) | Measured |", "|---|---|---|"]
    for benchmark, name, label in HEADLINES:
        record = records.get(benchmark)
        if record is None:
            continue
        found = [f for f in record.get("figures", [])
                 if (f["figure"].startswith(name[:-1]) if name.endswith("*") else f["figure"] == name)]
        stale = "" if changed_since(record) is None else ", older than its code"
        fresh = f"<!-- freshness -->{stale}<!-- /freshness -->"
        for f in found:
            rows.append(f"| {label or f['figure']} | {number(f['median'], f['unit'])}{_unit(f['unit'])} "
                        f"(n = {f['n']}) | `benchmarks/{benchmark}.py`, {record.get('date', '')[:10]}{fresh} |")
    if len(rows) == 2:
        return "No headline figure has a record yet."
    return "\n".join(rows + ["", "Every figure, with its spread and machine: [Benchmarks](docs/benchmarks.md)."])


def with_headlines(readme: str, block: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise SystemExit(f"README.md lacks the {BEGIN} / {END} lines the headline figures go between")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{block}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only check that both are what the records say")
    parser.add_argument("--records", default=str(RECORDS), help="the records' folder")
    opts = parser.parse_args(argv)
    records = load(opts.records)
    want = {PAGE: page(records), README: with_headlines(README.read_text(), headlines(records))}
    if opts.check:
        stale = [str(path.relative_to(REPO)) for path, text in want.items()
                 if not path.exists() or FRESHNESS.sub("", path.read_text()) != FRESHNESS.sub("", text)]
        if stale:
            print(f"{', '.join(stale)}: not what the benchmark records say; run python benchmarks/figures.py")
            return 1
        return 0
    for path, text in want.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
