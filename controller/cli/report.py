"""`goodput report RUN`: where a run's wall time went, as a table (or JSON) and a picture read at a
glance — loss over wall time with failures, detections, recoveries, drills and checkpoints marked,
and the goodput/badput bar by category below. matplotlib (Agg: no screen needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from controller.events import EventKind
from controller.accounting import CATEGORIES

COLORS = {"productive": "#2e7d32", "queueing": "#90a4ae", "startup": "#607d8b", "checkpoint_stall": "#8d6e63",
          "failure_detection": "#d32f2f", "restart_restore": "#f9a825", "recomputation": "#ef6c00",
          "straggler_slowdown": "#7b1fa2", "degraded_capacity": "#5d4037", "waiting_for_capacity": "#1565c0", "other": "#bdbdbd"}


MAX_DETAILED = 8
"""Above this many attempts (or failures) the plot stops labelling each one."""


def build(run: dict[str, Any], events: list[dict[str, Any]], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The report's data: the accounting of the Run object, plus the timeline a plot needs."""
    goodput = run["goodput"]
    wall = goodput["wall_seconds"]
    rows = [{"category": "productive", "seconds": goodput["productive_seconds"],
             "share": goodput["productive_seconds"] / wall if wall else 0.0}]
    rows += [{"category": c, "seconds": goodput["badput_seconds"].get(c, 0.0),
              "share": goodput["badput_seconds"].get(c, 0.0) / wall if wall else 0.0} for c in CATEGORIES]
    return {
        "run": run["id"], "state": run["state"], "step": run["step"], "total_steps": run.get("total_steps"),
        "attempts": run["attempt"] + 1, "ettr": goodput["ettr"], "wall_seconds": wall, "breakdown": rows,
        "per_attempt": goodput.get("attempts", []), "failures": goodput.get("failures", []),
        "submitted_at": next((e["time"] for e in events if e["kind"] == EventKind.SUBMITTED), run.get("created_at")),
        "events": [e for e in events if e["kind"] in (EventKind.DRILL_INJECTED, EventKind.FAILURE_DETECTED, EventKind.FIRST_STEP_AFTER_RECOVERY,
                                                       EventKind.ATTEMPT_STARTED, EventKind.CHECKPOINT_COMMITTED, EventKind.QUARANTINED)],
        "history": history,
    }


def table(report: dict[str, Any]) -> str:
    lines = [f"run {report['run']}: {report['state']}, step {report['step']}/{report['total_steps']}, "
             f"{report['attempts']} attempt(s), ETTR {report['ettr']:.3f} of {report['wall_seconds']:.1f} s",
             "", f"{'category':<22}{'seconds':>10}{'share':>9}"]
    for row in report["breakdown"]:
        lines.append(f"{row['category']:<22}{row['seconds']:>10.2f}{row['share']:>8.1%}")
    if len(report["per_attempt"]) > 1:
        lines += ["", f"{'attempt':<9}{'wall s':>9}{'ETTR':>7}  largest badput"]
        for a in report["per_attempt"]:
            worst = max(a["badput_seconds"].items(), key=lambda kv: kv[1])
            lines.append(f"{a['attempt']:<9}{a['wall_seconds']:>9.1f}{a['ettr']:>7.2f}  {worst[0]} {worst[1]:.1f} s")
    if report["failures"]:
        lines += ["", f"{'failure':<18}{'attempt':>8}{'detection s':>13}{'recovery s':>12}"]
        for f in report["failures"]:
            recovery = "-" if f["recovery_seconds"] is None else f"{f['recovery_seconds']:.2f}"
            lines.append(f"{f['cause']:<18}{f['attempt']:>8}{f['detection_seconds']:>13.2f}{recovery:>12}")
    return "\n".join(lines)


def plot(report: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = report["submitted_at"]
    fig, (top, bar) = plt.subplots(2, 1, figsize=(12, 7), gridspec_kw={"height_ratios": [4, 1]})
    fig.suptitle(f"{report['run']}: {report['state']}, step {report['step']}/{report['total_steps']}, "
                 f"{report['attempts']} attempt(s), ETTR {report['ettr']:.2f}", fontsize=13)

    steps = [h for h in report["history"] if h.get("end") is not None and h.get("loss") is not None]
    attempts = sorted({h["attempt"] for h in steps})
    if len(attempts) <= MAX_DETAILED:
        for attempt in attempts:
            own = [h for h in steps if h["attempt"] == attempt]
            top.plot([h["end"] - t0 for h in own], [h["loss"] for h in own], marker=".", markersize=3,
                     linewidth=1.2, label=f"loss (kept steps), attempt {attempt}")
    else:  # a long run: one line, thinned to what the figure can show
        stride = max(1, len(steps) // 4000)
        top.plot([h["end"] - t0 for h in steps[::stride]], [h["loss"] for h in steps[::stride]], linewidth=1.0,
                 label=f"loss (kept steps), {len(attempts)} attempts")
    labelled_span = False
    for f in report["failures"]:
        top.axvspan(f["onset"] - t0, f["detected_at"] - t0, color=COLORS["failure_detection"], alpha=0.25, lw=0)
        if f["recovered_at"] is not None:
            top.axvspan(f["detected_at"] - t0, f["recovered_at"] - t0, color=COLORS["restart_restore"], alpha=0.25,
                        lw=0)
        if f.get("contained"):  # only some replicas stopped: the others trained on with less throughput
            end = f.get("rejoined_at") or (report["events"][-1]["time"] if report["events"] else f["detected_at"])
            top.axvspan(f["detected_at"] - t0, end - t0, color=COLORS["degraded_capacity"], alpha=0.12, lw=0,
                        label=None if labelled_span else "replicas out (degraded capacity)")
            labelled_span = True
    marks = {EventKind.DRILL_INJECTED: ("#ef6c00", "--", "drill injected"), EventKind.FAILURE_DETECTED: ("#d32f2f", "-", "failure detected"),
             EventKind.FIRST_STEP_AFTER_RECOVERY: ("#2e7d32", "-", "recovered (first step)"),
             EventKind.REPLICA_REJOINED: ("#00838f", "-.", "replica rejoined"),
             EventKind.QUARANTINED: ("#7b1fa2", ":", "node quarantined")}
    labelled: set[str] = set()
    detailed = len(report["failures"]) <= MAX_DETAILED
    for e in report["events"]:
        if e["kind"] in marks:
            color, style, label = marks[e["kind"]]
            top.axvline(e["time"] - t0, color=color, linestyle=style, linewidth=1.4,
                        label=None if label in labelled else label)
            labelled.add(label)
            if e["kind"] == EventKind.DRILL_INJECTED and detailed:
                top.annotate(e["detail"].get("drill", "drill"), (e["time"] - t0, 1.0), xycoords=("data", "axes fraction"),
                             xytext=(3, -12), textcoords="offset points", fontsize=8, color=color)
            if e["kind"] == EventKind.FAILURE_DETECTED and detailed:
                top.annotate(e["detail"].get("cause", ""), (e["time"] - t0, 1.0), xycoords=("data", "axes fraction"),
                             xytext=(3, -24), textcoords="offset points", fontsize=8, color=color)
    commits = [e["time"] - t0 for e in report["events"] if e["kind"] == EventKind.CHECKPOINT_COMMITTED]
    if commits and len(commits) <= 200:
        top.plot(commits, [0.0] * len(commits), linestyle="none", marker="^", color="#455a64", markersize=7,
                 transform=top.get_xaxis_transform(), clip_on=False, label="checkpoint committed")
    top.set_xlim(0, max(report["wall_seconds"], 1e-3))
    top.set_xlabel("seconds since submission")
    top.set_ylabel("training loss")
    top.grid(alpha=0.3)
    top.legend(loc="lower left", fontsize=8, ncol=2, framealpha=0.9)

    left = 0.0
    for row in report["breakdown"]:
        if row["seconds"] <= 0:
            continue
        bar.barh(0, row["seconds"], left=left, color=COLORS[row["category"]], edgecolor="white",
                 label=f"{row['category']} {row['seconds']:.1f} s ({row['share']:.0%})")
        if row["share"] >= 0.06:
            bar.text(left + row["seconds"] / 2, 0, f"{row['share']:.0%}", ha="center", va="center", fontsize=9,
                     color="white")
        left += row["seconds"]
    bar.set_xlim(0, max(report["wall_seconds"], 1e-3))
    bar.set_yticks([])
    bar.set_xlabel("wall time, by where it went (productive = goodput; the rest badput)")
    bar.legend(loc="upper center", bbox_to_anchor=(0.5, -0.55), ncol=4, fontsize=8, frameon=False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def curve_axis(rows: list[dict[str, Any]]) -> str | None:
    """The sweep's first axis that is a number taking three values or more (a world size, an
    interval): drawn as a curve along it, one line per setting of the other axes."""
    for key in rows[0]["setting"] if rows else ():
        values = [r["setting"][key] for r in rows]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) and len(set(values)) >= 3:
            return key
    return None


def plot_sweep(rows: list[dict[str, Any]], out: Path) -> Path:
    """`goodput simulate --sweep ... --out`: along a numeric axis (`curve_axis`), ETTR and MTTR as
    curves, one per setting of the other axes; otherwise ETTR and steps done per setting, side by side
    (an infeasible setting is drawn as such, with no bar)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    along = curve_axis(rows)
    if along is not None:
        return _plot_curves(plt, rows, along, out)
    labels = [", ".join(f"{k}={v}" for k, v in r["setting"].items()) for r in rows]
    feasible = [r["state"] != "infeasible" for r in rows]
    x = list(range(len(rows)))
    fig, (ettr, steps) = plt.subplots(2, 1, figsize=(max(6.0, 1.4 * len(rows) + 2), 7), sharex=True)
    fig.suptitle(f"goodput simulate: {len(rows)} setting(s)", fontsize=13)
    ettr.bar(x, [r["ettr"] if ok else 0.0 for r, ok in zip(rows, feasible)], color=COLORS["productive"])
    ettr.set_ylabel("ETTR")
    ettr.set_ylim(0, 1.05)
    steps.bar(x, [r["steps"] if ok else 0 for r, ok in zip(rows, feasible)], color=COLORS["startup"])
    steps.set_ylabel("steps done")
    for i, (r, ok) in enumerate(zip(rows, feasible)):
        if ok:
            ettr.annotate(f"{r['ettr']:.4f}", (i, r["ettr"]), ha="center", va="bottom", fontsize=9)
            steps.annotate(f"{r['steps']}/{r['total_steps']}", (i, r["steps"]), ha="center", va="bottom", fontsize=9)
        else:
            ettr.annotate("infeasible", (i, 0.02), ha="center", va="bottom", fontsize=9, color=COLORS["failure_detection"])
    steps.set_xticks(x)
    steps.set_xticklabels(labels, rotation=20, ha="right", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _plot_curves(plt: Any, rows: list[dict[str, Any]], along: str, out: Path) -> Path:
    """ETTR and MTTR against `along`, a line per setting of the other axes; a point the cluster cannot
    hold is left out of its line and named under the chart."""
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        label = ", ".join(f"{k}={v}" for k, v in r["setting"].items() if k != along) or "all"
        series.setdefault(label, []).append(r)
    fig, (ettr, mttr) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    fig.suptitle(f"goodput simulate: ETTR and MTTR as {along} grows", fontsize=13)
    infeasible = []
    for label, points in series.items():
        done = sorted((r for r in points if r["state"] != "infeasible"), key=lambda r: r["setting"][along])
        infeasible += [f"{label} at {r['setting'][along]}" for r in points if r["state"] == "infeasible"]
        ettr.plot([r["setting"][along] for r in done], [r["ettr"] for r in done], marker="o", label=label)
        timed = [r for r in done if r["mttr_s"] is not None]
        mttr.plot([r["setting"][along] for r in timed], [r["mttr_s"] for r in timed], marker="o", label=label)
        for r in done:
            ettr.annotate(f"{r['ettr']:.3f}", (r["setting"][along], r["ettr"]), textcoords="offset points",
                          xytext=(0, 5), ha="center", fontsize=8)
    values = sorted({r["setting"][along] for r in rows})
    if min(values) > 0 and max(values) >= 10 * min(values):
        mttr.set_xscale("log")
    gpus = {v: {r.get("gpus") for r in rows if r["setting"][along] == v and r["state"] != "infeasible"} for v in values}
    mttr.set_xticks(values, labels=[f"{v:,}" + (f"\n{next(iter(g)):,} GPUs" if len(g) == 1 else "")
                                    for v, g in gpus.items()])
    mttr.minorticks_off()
    feasible = [r["ettr"] for r in rows if r["state"] != "infeasible"]
    ettr.set_ylim(min([0.8, *feasible]) - 0.02, 1.0)
    ettr.set_ylabel("ETTR")
    mttr.set_ylabel("MTTR (s)")
    mttr.set_xlabel(along)
    for ax in (ettr, mttr):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if infeasible:
        mttr.annotate("infeasible: " + "; ".join(infeasible), (0.0, -0.3), xycoords="axes fraction", fontsize=8,
                      color=COLORS["failure_detection"])
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out
