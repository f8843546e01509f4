"""Commands that talk to a service over its REST API (GOODPUT_URL): submit, status, watch, list, events,
cancel, resume, drill, report, nodes and the service's checkpoint index."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from controller.cli.render import QUIET_KINDS, CliError, clock, describe, emit_json, table, when
from controller.drills import PARAMS
from controller.spec import load_spec


@contextlib.contextmanager
def api() -> Iterator[Any]:
    """A client of the run's API (GOODPUT_URL); its failures become one-line CLI errors."""
    from controller.cli.client import ApiClientError, Client

    client = Client()
    try:
        yield client
    except ApiClientError as e:
        raise CliError(str(e)) from None
    finally:
        client.close()


def poll_until(fetch: Callable[[], dict], first: dict, done: Callable[[dict], bool], *, timeout_s: float,
               every_s: float, stuck: Callable[[dict], str]) -> dict:
    """Fetch again every `every_s` until `done` (starting from `first`); CliError(stuck(last)) after `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    last = first
    while not done(last):
        if time.monotonic() > deadline:
            raise CliError(stuck(last))
        time.sleep(every_s)
        last = fetch()
    return last


def paged(client: Any, path: str, *, key: str, page_size: int) -> list[dict]:
    """Every row of a paged listing (`after` the last row's `key`, pages of `page_size`)."""
    rows: list[dict] = []
    while True:
        page = client.call("GET", path, params={"after": rows[-1][key] if rows else -1})
        rows.extend(page)
        if len(page) < page_size:
            return rows


def checkpoints_from_service(opts: argparse.Namespace) -> int:
    with api() as client:
        rows = client.call("GET", f"/v1/runs/{opts.run}/checkpoints")
    if opts.json:
        emit_json(rows)
        return 0
    if not rows:
        print(f"no committed checkpoints for run {opts.run!r}")
    table(["step", "attempt", "MiB", "save s", "committed", "uri"],
           [[r["step"], r["attempt"], f"{(r.get('bytes') or 0) / 2**20:.1f}", f"{r.get('seconds') or 0:.2f}",
             when(r["committed_at"]), r.get("uri") or ""] for r in rows])
    return 0


def cmd_drill(opts: argparse.Namespace) -> int:
    """Inject a drill into a running run through its API; wait for the report unless --no-wait."""
    with api() as client:
        body = {"kind": opts.kind, "target": opts.target, "at_step": opts.at_step}
        body |= {k: v for k in PARAMS if (v := getattr(opts, k)) is not None}
        drill = client.call("POST", f"/v1/runs/{opts.run}/drills", body)
        if not opts.no_wait:
            drill = poll_until(lambda: client.call("GET", f"/v1/drills/{drill['id']}"), drill,
                               lambda d: d["outcome"] not in ("scheduled", "pending"), timeout_s=opts.timeout,
                               every_s=0.5, stuck=lambda d: f"drill {d['id']} is still {d['outcome']} after "
                                                            f"{opts.timeout:.0f} s; see `goodput status {opts.run}`")
    if opts.json:
        emit_json(drill)
    elif drill["outcome"] == "scheduled":
        when = f"after step {drill['at_step']}" if drill.get("at_step") is not None else "now"
        print(f"{drill['id']}: {drill['kind']} on run {opts.run} scheduled {when}")
    else:
        print(f"{drill['id']}: {drill['kind']} {drill.get('target')} at step {drill.get('at_step')} -> "
              f"{drill['outcome']}")
        for key in ("cause", "attributed_to", "decision", "detection_s", "recovery_s", "steps_lost", "error"):
            if drill.get(key) is not None:
                value = drill[key]
                print(f"  {key:<14} {value:.2f} s" if key.endswith("_s") else f"  {key:<14} {value}")
    if drill["outcome"] not in ("recovered", "scheduled", "detected"):
        raise CliError(f"drill {drill['id']} ended {drill['outcome']}; see `goodput status {opts.run}`")
    return 0


def cmd_status(opts: argparse.Namespace) -> int:
    with api() as client:
        run = client.call("GET", f"/v1/runs/{opts.run}")
        if opts.watch:
            run = watch(client, run)
    if opts.json:
        emit_json(run)
        return 0
    mesh = run["mesh"] or {}
    print(f"{run['id']}: {run['state']}, step {run['step']}, loss {run['loss']}, attempt {run['attempt']}, "
          f"mesh dp{mesh.get('dp')} pp{mesh.get('pp')} tp{mesh.get('tp')}, ETTR {run['goodput']['ettr']:.2f}")
    if run.get("waiting_for"):
        print(f"  pending: {run['waiting_for']}")
    goodput = run["goodput"]
    lost = sorted(((k, v) for k, v in goodput["badput_seconds"].items() if v >= 0.05), key=lambda kv: -kv[1])
    print(f"  goodput: {goodput['productive_seconds']:.1f} s productive of {goodput['wall_seconds']:.1f} s; badput: "
          + (", ".join(f"{k} {v:.1f} s" for k, v in lost) or "none"))
    if run.get("budgets"):
        b = run["budgets"]
        print(f"  failures: {b['infrastructure']['used']} of elastic.max_failures {b['infrastructure']['max']}"
              f"{'; a worker error retried once on other nodes' if b['user_error']['retried'] else ''}; "
              f"not charged: {b['preemptions']} preemption(s), {b['drains']} drain(s)")
    for d in run.get("drills", []):
        print(f"  {d['id']}: {d['kind']} {d['target']} at step {d['at_step']} -> {d['outcome']}")
    if run.get("error"):
        print(f"  error: {run['error']['message']}")
        if run["error"].get("traceback"):  # a user error: what the code raised
            print("  " + run["error"]["traceback"].rstrip().replace("\n", "\n  "))
    return 0


def watch(client: Any, run: dict) -> dict:
    """Follow a run live (the progress bar of `goodput run`, events as they come) until it ends; the
    final Run object."""
    import time

    from controller.cli.ui import ProgressView

    after = -1
    with ProgressView(run["id"], run.get("total_steps") or 1, quiet=False) as view:
        while True:
            for event in client.call("GET", f"/v1/runs/{run['id']}/events", params={"after": after}):
                after = event["seq"]
                if event["kind"] not in QUIET_KINDS:
                    view.note(describe(event))
            if run["step"]:
                view.show(run["step"], run.get("total_steps") or run["step"], run["loss"], run["attempt"])
            if run["state"] in ("succeeded", "failed", "cancelled"):
                return run
            time.sleep(0.5)
            run = client.call("GET", f"/v1/runs/{run['id']}")


def cmd_submit(opts: argparse.Namespace) -> int:
    spec = load_spec(opts.spec)
    with api() as client:
        run = client.call("POST", "/v1/runs", spec.model_dump(mode="json", exclude_unset=True))
        if opts.watch:
            run = watch(client, run)
    if opts.json:
        emit_json(run)
    else:
        print(f"{run['id']}: {run['state']}" + (f" ({run['waiting_for']})" if run.get("waiting_for") else "")
              + (f"; checkpoints in {run['checkpoint_uri']}/{run['id']}" if run.get("checkpoint_uri") else ""))
    if opts.watch and run["state"] != "succeeded":
        raise CliError(f"run {run['id']} {run['state']}: {(run.get('error') or {}).get('message', 'see events')}")
    return 0


def cmd_list(opts: argparse.Namespace) -> int:
    with api() as client:
        runs = client.call("GET", "/v1/runs")
    if opts.json:
        emit_json(runs)
        return 0
    if not runs:
        print("no runs")
        return 0
    table(["run", "state", "step", "loss", "attempt", "mesh", "created", "team", "priority", "note"],
           [[r["id"], r["state"], f"{r['step']}/{r.get('total_steps', '?')}",
             "" if r["loss"] is None else f"{r['loss']:.4f}", r["attempt"],
             "" if not r["mesh"] else f"dp{r['mesh']['dp']} pp{r['mesh']['pp']} tp{r['mesh']['tp']}",
             when(r["created_at"]), r.get("team", "-"), r.get("priority", "-"),
             r.get("waiting_for") or (r.get("error") or {}).get("message", "")]
            for r in runs])
    return 0


def all_events(client: Any, run: str) -> list[dict]:
    return paged(client, f"/v1/runs/{run}/events", key="seq", page_size=1000)


def cmd_events(opts: argparse.Namespace) -> int:
    with api() as client:
        events = all_events(client, opts.run)
    if opts.json:
        emit_json(events)
        return 0
    for e in events:
        print(f"{when(e['time'])}  attempt {e['attempt']}  {describe(e)}")
    return 0


ENDED = ("succeeded", "failed", "cancelled")


def cmd_cancel(opts: argparse.Namespace) -> int:
    """Cancel, then wait until the run has stopped (its GPUs free, resumable) unless --no-wait."""
    with api() as client:
        run = client.call("POST", f"/v1/runs/{opts.run}/cancel")  # on an ended run: changes nothing
        already = run["state"] in ENDED
        if not already and not opts.no_wait:
            run = poll_until(lambda: client.call("GET", f"/v1/runs/{opts.run}"), run, lambda r: r["state"] in ENDED,
                             timeout_s=opts.timeout, every_s=0.3,
                             stuck=lambda r: f"{r['id']} is still {r['state']} {opts.timeout:.0f} s after the cancel; "
                                             f"see `goodput status {r['id']}`")
    if opts.json:
        emit_json(run)
    elif already:
        raise CliError(f"{run['id']} had already ended ({run['state']}); nothing was cancelled "
                       f"(goodput resume {run['id']} starts it again)")
    elif run["state"] in ENDED:
        print(f"{run['id']}: {run['state']} at step {run['step']}; goodput resume {run['id']} goes on from its "
              "latest checkpoint")
    else:
        print(f"{run['id']}: cancel requested ({run['state']})")
    return 0


def cmd_resume(opts: argparse.Namespace) -> int:
    body = {k: v for k, v in (("step", opts.step), ("steps", opts.steps)) if v is not None}
    with api() as client:
        run = client.call("POST", f"/v1/runs/{opts.run}/resume", body)
        if opts.watch:
            run = watch(client, run)
    if opts.json:
        emit_json(run)
    elif opts.watch:
        print(f"{run['id']}: {run['state']}, step {run['step']}/{run.get('total_steps')}")
    else:
        src = f"step {opts.step}" if opts.step is not None else "its latest checkpoint"
        print(f"{run['id']}: resumes from {src} ({run['state']})")
    if opts.watch and run["state"] != "succeeded":
        raise CliError(f"run {run['id']} {run['state']}: {(run.get('error') or {}).get('message', 'see events')}")
    return 0


def cmd_report(opts: argparse.Namespace) -> int:
    from controller.cli import report

    with api() as client:
        run = client.call("GET", f"/v1/runs/{opts.run}")
        events = all_events(client, opts.run)
        history = paged(client, f"/v1/runs/{opts.run}/history", key="step", page_size=10000)
    data = report.build(run, events, history)
    path = report.plot(data, Path(opts.out or f"{opts.run}-timeline.png"))
    if opts.json:
        emit_json({**{k: v for k, v in data.items() if k not in ("events", "history")}, "png": str(path)})
    else:
        print(report.table(data))
        print(f"\ntimeline: {path}")
    return 0


def deadline(text: str, now: float) -> float:
    """`--by`: a duration from now (90s, 30m, 2h) or a time (ISO 8601; UTC unless it says) -> Unix seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    if text[-1:] in units and text[:-1].replace(".", "", 1).isdigit():
        return now + float(text[:-1]) * units[text[-1]]
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise CliError(f"--by {text!r}: give a duration (90s, 30m, 2h) or a time (2026-11-28T18:00:00Z)") from None
    return (when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)).timestamp()


def cmd_nodes(opts: argparse.Namespace) -> int:
    if opts.action in ("release", "drain") and not opts.node:
        raise CliError(f"give the node: goodput nodes {opts.action} NODE")
    if opts.by is not None and opts.action != "drain":
        raise CliError("--by goes with drain: goodput nodes drain NODE --by 30m")
    with api() as client:
        if opts.action == "drain":
            body = {"by": deadline(opts.by, time.time())} if opts.by else None
            row = client.call("POST", f"/v1/nodes/{opts.node}/drain", body)
            if opts.json:
                emit_json(row)
            else:
                runs = row.get("runs") or []
                print(f"{row['name']}: {row['state']} ({row['reason']}); "
                      + (f"moving {', '.join(runs)} off it at their next step boundary" if runs
                         else "no run on it") + "; `goodput nodes` shows when it is drained")
            return 0
        if opts.action == "release":
            released = client.call("POST", f"/v1/nodes/{opts.node}/release")
            if opts.json:
                emit_json(released)
            else:
                print(f"{released['name']}: released as a {'spare' if released['state'] == 'spare' else 'training node'} "
                      f"(was {released['was']['state']}: {released['was']['reason']})")
                if released.get("kubernetes"):
                    print(f"  kubernetes: {released['kubernetes']}")
            return 0
        view = client.call("GET", "/v1/nodes")
    if opts.json:
        emit_json(view)
        return 0
    table(["node", "state", "rack", "gpus", "run", "since", "reason"],
           [[n["name"], n["state"], n["rack"] or "-", n["gpus"], n["run"] or "-", clock(n.get("since"))
             if n.get("since") else "-", n["reason"] or ""] for n in view["nodes"]])
    print(f"{view['free_gpus']} of {view['gpus']} GPU(s) free")
    return 0
