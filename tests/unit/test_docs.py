"""The documentation site: it builds in strict mode (a broken link, a missing page or a page left out
of the nav fails), its generated reference names everything the code has (checked against the code
itself, not against the generator), and the README stays a front page."""

from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
GEN = runpy.run_path(str(ROOT / "docs" / "gen_reference.py"), run_name="gen_reference")


def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DISABLE_MKDOCS_2_WARNING": "true"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    for page in ("index.html", "reference/cli/index.html", "reference/rest/index.html", "reference/spec/index.html",
                 "reference/metrics/index.html", "benchmarks/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                out.append(path + (name,))
                out.extend(_commands(sub, path + (name,)))
    return out


def test_the_cli_reference_has_every_command_and_option() -> None:
    from controller.cli.main import build_parser

    page = GEN["cli_page"]()
    commands = _commands(build_parser())
    assert len(commands) > 20
    for command in commands:
        assert f"goodput {' '.join(command)}\n" in page, command
    assert "`--gpu-quota GPU_QUOTA`" in page or "`--gpu-quota N`" in page


def test_the_rest_reference_has_every_route_with_its_role() -> None:
    from fastapi.routing import APIRoute

    from controller.service.app import create_app

    from controller.service.registry import Registry
    from controller.service.service import Service

    page = GEN["rest_page"]()
    service = Service(Registry("sqlite://"), GEN["_NoCluster"](), group_factory=lambda *_: None, threads=False)
    routes = create_app(service, token="t").routes
    api = [(m, r.path) for r in routes if isinstance(r, APIRoute) and r.include_in_schema for m in r.methods]
    assert len(api) > 20
    for method, path in api:
        assert f"## {method} {path}\n" in page, (method, path)
    assert "| POST | `/v1/teams/{name}/quota` | admin |" in page
    assert "| GET | `/v1/audit` | operator |" in page


def _fields(model: Any, seen: set[Any]) -> list[tuple[str, str]]:
    from pydantic import BaseModel

    if model in seen:
        return []
    seen.add(model)
    out = []
    for name, info in model.model_fields.items():
        out.append((model.__name__, name))
        for arg in _types(info.annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                out.extend(_fields(arg, seen))
    return out


def _types(annotation: Any) -> list[Any]:
    args = getattr(annotation, "__args__", None)
    if not args:
        return [annotation]
    return [t for a in args for t in _types(a)]


def test_the_spec_reference_has_every_field_of_every_section() -> None:
    from controller.spec import RunSpec

    page = GEN["spec_page"]()
    fields = _fields(RunSpec, set())
    assert len(fields) > 80
    sections = page.split("\n## ")
    by_section = {s.split("\n", 1)[0]: s for s in sections[1:]}
    for model, field in fields:
        assert model in by_section, model
        assert f"| `{field}` |" in by_section[model], (model, field)
    peer = next(line for line in by_section["CheckpointSpec"].splitlines() if line.startswith("| `peer_every_steps`"))
    assert "host memory" in peer and "`1`" in peer, peer  # (its docstring and its default)


def test_the_metrics_reference_has_every_exported_series() -> None:
    from controller.service.metrics import exported_series

    page = GEN["metrics_page"]()
    names = {s.removesuffix("_created").removesuffix("_bucket").removesuffix("_count").removesuffix("_sum")
             for s in exported_series() if not s.endswith("_created")}
    assert names
    for name in names:
        assert f"`{name}`" in page or f"`{name.removesuffix('_total')}`" in page, name


def test_the_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move detail into docs/"
    text = "\n".join(lines)
    for command in ("make run", "make test", "make docs"):
        assert command in text, command


@pytest.mark.parametrize("page", sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")))
def test_every_hand_written_page_is_in_the_nav(page: str) -> None:
    assert page in (ROOT / "mkdocs.yml").read_text(), f"docs/{page} is not in mkdocs.yml's nav"


FIGURES = runpy.run_path(str(ROOT / "benchmarks" / "figures.py"), run_name="figures")


def test_the_benchmarks_page_and_the_readme_figures_are_what_the_records_say() -> None:
    assert FIGURES["main"](["--check"]) == 0, "run python benchmarks/figures.py"


def test_a_figure_is_written_from_its_record_and_marked_when_its_code_changed_after_it(tmp_path: Path) -> None:
    import json

    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    first = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], cwd=ROOT, capture_output=True,
                           text=True).stdout.split()[0]
    base = {"command": "x.py --rounds 3", "machine": {"cpu_count": 2, "processor": "x86_64"}, "torch": "2.13.0",
            "ray": "2.60.0", "date": "2026-11-28T00:00:00+00:00", "git_dirty": False}
    fig = {"figure": "x: steps redone", "unit": "steps", "n": 3, "median": 0.0, "min": 0.0, "max": 1.0,
           "values": [0.0, 0.0, 1.0], "goal": "0"}
    records = {"fresh": {**base, "benchmark": "fresh", "git_commit": head, "code": ["README.md"], "figures": [fig]},
               "old": {**base, "benchmark": "old", "git_commit": first, "code": ["controller/state.py"],
                       "figures": [{**fig, "figure": "y: ratio", "unit": "ratio", "median": 1.0123, "min": 0.9,
                                    "max": 1.2}]},
               "lost": {**base, "benchmark": "lost", "git_commit": "0" * 40, "code": ["README.md"], "figures": [fig]}}
    for name, record in records.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(record))
    text = FIGURES["page"](FIGURES["load"](tmp_path))
    fresh, old, lost = (text.split(f"## {n}\n")[1].split("\n## ")[0] for n in ("fresh", "old", "lost"))
    assert "| x: steps redone | 0 steps | 0 – 1 steps | 3 | 0 |" in fresh and "Older than its code" not in fresh
    assert "| y: ratio | 1.01 | 0.9 – 1.20 | 3 |" in old and "**Older than its code** (changed at `" in old
    assert "**Older than its code** (changed at `unknown`)" in lost
    assert "`python benchmarks/x.py --rounds 3`" in fresh


def _documented_commands() -> list[tuple[str, str]]:
    """(page, command line) of every `goodput ...` line in a code block of the README and the pages
    (continuation lines joined; synopsis lines, with their [optional] parts, left out)."""
    import re

    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in re.findall(r"```[a-z]*\n(.*?)```", path.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.split(r"\s#\s|\s{2,}#", line)[0].strip().removesuffix("&").strip()
                if line.startswith("goodput ") and "[" not in line:
                    out.append((path.relative_to(ROOT).as_posix(), line))
    return out


def test_every_goodput_command_the_docs_show_parses() -> None:
    """A newcomer copies these: each must be a command the CLI takes, with arguments it knows."""
    import contextlib
    import io
    import shlex

    from controller.cli.main import build_parser

    parser = build_parser()
    commands = _documented_commands()
    assert len(commands) > 30
    wrong = []
    for page, line in commands:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                parser.parse_args(shlex.split(line)[1:])
        except SystemExit:
            wrong.append(f"{page}: {line}: {err.getvalue().strip().splitlines()[-1]}")
    assert not wrong, "\n".join(wrong)
