"""`goodput report` over a real API on loopback: the table adds up to the wall time, the JSON carries
the run's own accounting, and the PNG is a real image of the size asked for (a person looked at one
from `make run`; this checks it is drawn from the run's data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.cli.main import main
from controller.cli.report import build, table
from controller.service.app import ApiServer, create_app
from tests.unit.test_api import live_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def finished_run_with_a_failure() -> tuple[object, object]:
    c, g, _, service, live = live_run()
    g.finish_steps(1, 6)
    live.step(110.0)
    g.lose_node(c.placement.node_of_rank[7])  # type: ignore[union-attr]
    t = 111.0
    while c.attempt == 0 or c.state.value != "running":
        live.step(t)
        t += 1
    g.finish_steps(1, 4)
    live.step(t + 3)
    g.complete()
    live.step(t + 4)
    assert c.state.value == "succeeded"
    return c, service


def test_report_table_json_and_png(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    c, service = finished_run_with_a_failure()
    server = ApiServer(create_app(service), "127.0.0.1", 0).start()  # type: ignore[arg-type]
    monkeypatch.setenv("GOODPUT_URL", server.url)
    try:
        out = tmp_path / "t.png"
        with pytest.raises(SystemExit) as done:
            main(["report", "tiny-gpt", "--out", str(out), "--json"])
        assert done.value.code == 0
        data = json.loads(capsys.readouterr().out)
        drawn: list = []
        from matplotlib.figure import Figure

        real_savefig = Figure.savefig

        def keep(fig: Figure, *args: object, **kwargs: object) -> None:
            drawn.append(fig)
            real_savefig(fig, *args, **kwargs)

        monkeypatch.setattr(Figure, "savefig", keep)
        with pytest.raises(SystemExit) as done:
            main(["report", "tiny-gpt", "--out", str(out)])
        assert done.value.code == 0
        text = capsys.readouterr().out
    finally:
        server.stop()
    run = service.run("tiny-gpt")  # type: ignore[attr-defined]
    assert data["ettr"] == pytest.approx(run["goodput"]["ettr"])
    assert sum(r["seconds"] for r in data["breakdown"]) == pytest.approx(data["wall_seconds"], abs=1e-3)
    assert [f["cause"] for f in data["failures"]] == ["node_lost"] and data["attempts"] == 2
    assert "recomputation" in text and "node_lost" in text and f"timeline: {out}" in text
    # What was drawn is the run's own data: the loss line is its kept steps (time since submission,
    # loss), and the bar's segments are the breakdown's seconds, in order.
    (fig,) = drawn
    top, bar = fig.axes[0], fig.axes[1]
    t0 = run["created_at"]
    kept = [v for h in service.history("tiny-gpt", after=-1, limit=1000)  # type: ignore[attr-defined]
            for v in (h["end"] - t0, h["loss"])]
    lines = [[float(v) for xy in zip(line.get_xdata(), line.get_ydata()) for v in xy] for line in top.get_lines()]
    assert any(points == pytest.approx(kept) for points in lines if len(points) == len(kept)), lines
    widths = [p.get_width() for p in bar.patches]
    assert widths == pytest.approx([r["seconds"] for r in data["breakdown"] if r["seconds"] > 0])
    png = out.read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 20_000
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 1000 and height > 600


def test_the_table_is_the_accounting() -> None:
    c, service = finished_run_with_a_failure()
    view = c.to_dict(c.finished_at or 0.0)  # type: ignore[attr-defined]
    report = build(view, view["events"], view["history"])
    lines = table(report).splitlines()
    productive = next(line for line in lines if line.startswith("productive"))
    assert f"{view['goodput']['productive_seconds']:.2f}" in productive
    # the rollback to step 0 dropped attempt 0's steps: only attempt 1's are kept progress
    assert [(h["step"], h["attempt"]) for h in report["history"]] == [(1, 1), (2, 1), (3, 1), (4, 1)]
    assert all(h["end"] is not None for h in report["history"]), "every kept step carries its time"
