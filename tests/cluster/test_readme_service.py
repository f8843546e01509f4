"""The README's "The service" walkthrough, command by command and in its order, as a newcomer runs it
right after `make run`: `goodput serve` with its defaults (only the port and the state dir come from
the environment, as the README says they may), then submit, drill, nodes, cancel, resume --watch,
list. Each step checks what the README promises for it; the issue that found it broken (issue 18)
says what each did before."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
import yaml

from checkpointing.manifest import Manifest, commit, committed_steps
from checkpointing.store import LocalStore
from controller.spec import parse_spec
from tests.support.serve import Serve
from trainer.config import state_fingerprint, state_identity

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def walkthrough() -> list[list[str]]:
    """The goodput commands of the README's service walkthrough, in order."""
    block = README.split("## The service", 1)[1].split("```", 2)[1]
    return [line.split("#", 1)[0].split() for line in block.strip().splitlines() if line.startswith("goodput")]


def make_runs_leftovers(cwd: Path) -> list[str]:
    """What `make run` leaves in the directory a newcomer works in: goodput-runs/tiny-gpt with the
    example's own model committed at step 60 (the example's relative checkpoint URI)."""
    spec = parse_spec(yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text()))
    store = LocalStore(cwd / "goodput-runs")
    model = spec.to_model_config()
    commit(store, Manifest(run_id="tiny-gpt", step=60, attempt=1, mesh={"dp": 1, "pp": 2, "tp": 2}, world_size=4,
                           cursor=960, seeds={"data": 0, "init": 0}, identity=state_fingerprint(model),
                           identity_detail=state_identity(model)))
    return sorted(o.key for o in store.list("tiny-gpt/"))


def test_the_readme_service_walkthrough_works_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands = walkthrough()
    assert [c[:2] for c in commands] == [["goodput", "serve"], ["goodput", "submit"], ["goodput", "drill"],
                                         ["goodput", "nodes"], ["goodput", "cancel"], ["goodput", "resume"],
                                         ["goodput", "list"]], commands
    cwd = tmp_path / "work"
    (cwd / "examples").mkdir(parents=True)
    shutil.copy(ROOT / "examples" / "tiny-gpt.yaml", cwd / "examples")
    leftovers = make_runs_leftovers(cwd)
    monkeypatch.chdir(cwd)
    state = tmp_path / "state"
    serve_args = commands[0][2:]
    assert serve_args == ["&"] or serve_args == [], serve_args
    serve = Serve(state, tmp_path / "serve.log").start()  # `goodput serve`: every cluster setting its default
    try:
        assert "comes back after 5 s" in serve.text()

        # goodput submit examples/tiny-gpt.yaml: a new run; before, 422 (8 GPUs, the service offered 6),
        # and once that fitted, 'succeeded' at once on make run's step 60.
        submitted = serve.cli(*commands[1][1:])
        assert re.match(r"tiny-gpt: (pending|planning|launching|running); checkpoints in "
                        rf"file://{re.escape(str(state.resolve()))}/goodput-runs/tiny-gpt$", submitted.stdout.strip()), \
            submitted.stdout

        # goodput drill tiny-gpt kill-node: the report once recovered, onto the spare.
        drill = serve.cli(*commands[2][1:], timeout=600)
        killed = re.search(r"kill-node (node-\d+) at step \d+ -> recovered", drill.stdout)
        assert killed and re.search(r"decision\s+replace", drill.stdout), drill.stdout
        node = killed.group(1)

        # goodput nodes: the killed node is listed (lost), then back as the new spare; the spare that
        # took its place is a training node now.
        seen, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:
            listed = serve.cli(*commands[3][1:]).stdout
            row = re.search(rf"^{node}\s+(\w+)", listed, re.M)
            assert row, f"{node} is not listed at all:\n{listed}"
            seen.append(row.group(1))
            if row.group(1) == "spare":
                break
            assert row.group(1) == "lost", listed
            time.sleep(1.0)
        assert seen[-1] == "spare", (seen, listed)
        rows = {m.group(1): m.group(2) for m in re.finditer(r"^(node-\d+)\s+(\w+)", listed, re.M)}
        assert list(rows.values()).count("spare") == 1 and len(rows) == 5, listed

        # goodput cancel tiny-gpt; goodput resume tiny-gpt --watch: from its latest checkpoint to the end.
        cancelled = serve.cli(*commands[4][1:]).stdout
        assert re.match(r"tiny-gpt: cancelled at step \d+; goodput resume tiny-gpt", cancelled), cancelled
        resumed = serve.cli(*commands[5][1:], timeout=1200)
        assert "tiny-gpt: succeeded" in resumed.stdout, resumed.stdout + resumed.stderr
        assert "{" not in resumed.stderr, "the live view speaks in sentences"

        # goodput list
        listing = serve.cli(*commands[6][1:]).stdout
        assert re.search(r"^tiny-gpt\s+succeeded\s+60/60", listing, re.M), listing
        status = serve.json("status", "tiny-gpt")
        assert isinstance(status, dict) and status["step"] == 60
        events = serve.json("events", "tiny-gpt")
        assert isinstance(events, list)
        # Every drill recovered, but one the cancel cut short (the spec's bitflip, when the cancel came
        # between its injection at step 45 and the first step after it): that one says so.
        assert {d["kind"] for d in status["drills"]} == {"kill-node", "bitflip"}, status["drills"]
        kinds = [e["kind"] for e in events]
        cancel = kinds.index("cancelled")
        for d in status["drills"]:
            injected = next(i for i, e in enumerate(events) if e["kind"] == "drill_injected" and e["detail"]["id"] == d["id"])
            cut_short = injected < cancel and "first_step_after_recovery" not in kinds[injected:cancel]
            assert d["outcome"] == ("cancelled" if cut_short else "recovered"), (d, kinds)
        attempts = [e for e in events if e["kind"] == "attempt_started"]
        assert attempts[0]["detail"]["resume_step"] is None, "it started from scratch, not from make run's step 60"
        assert any(e["kind"] == "resume_requested" for e in events)
        store = LocalStore(state / "goodput-runs")
        assert committed_steps(store, "tiny-gpt")[-1] == 60
        assert sorted(o.key for o in LocalStore(cwd / "goodput-runs").list("tiny-gpt/")) == leftovers, \
            "make run's checkpoints are untouched"
    finally:
        serve.stop()
