"""Preemption -> the high-priority run's first step (issue 45), on a real `goodput serve` (127.0.0.1, its
embedded Ray cluster of 2 nodes x 2 GPU slots, no spare: 4 training GPUs) driven through its REST API.

Each round, in the same service and cluster:

- preemption path: a low-priority run (dp2 x tp2: every training GPU) trains; once it has done a few
  steps a high-priority run of the same mesh (3 steps) is submitted. The low run is asked to stop at
  its next step boundary (`stop_requested`), commits that step and goes back to the queue
  (`preempted`); the high run is admitted, launched and does its first step. Figure: the high run's
  submission (the client's clock just before its POST) -> the END of its first step (its history's
  first step `end`); and, separately, the low run's `stop_requested` -> that same end. Also the low
  run's steps redone: the last step its preempted attempt trained minus the step its next attempt
  resumes from (`attempt_started` resume_step; goal 0, at most 1). The low run is cancelled once it
  has trained a step again, so every round starts from an idle cluster.
- idle path (the reference, measured in the same process): the same high-priority run submitted onto
  the idle cluster: submission -> the end of its first step.

The two alternate (the order flips each round); one idle run before round 1 warms the cluster up and
is not counted. The issue sets no absolute goal: the ratio printed is preemption path / idle path, and
the difference is what preemption adds (the stop at a step boundary + the commit + the admission; the
launch and the first step are in both paths).

    python benchmarks/preemption.py [--rounds 5]     (its record: benchmarks/records/preemption.json)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import httpx  # noqa: E402
import psutil  # noqa: E402
import yaml  # noqa: E402

from benchmarks import records  # noqa: E402
from tests.support.serve import Serve, _running, write_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NODES, GPUS_PER_NODE = 2, 2
DP, TP = 2, 2  # every training GPU of the cluster
LOW_STEPS, HIGH_STEPS = 100_000, 3
LOW_TRAINED = 3
"""Steps the low run has done before the high run is submitted."""
TIMEOUT_S = 600.0
SETTLE_S = 2.0
"""After the last run's GPUs are free, before the next submission: its ranks' teardown off the CPUs."""
ENDED = ("succeeded", "failed", "cancelled")
CODE = ["controller/service/scheduler.py", "controller/service/service.py", "controller/state.py",
        "controller/ray/worker_group.py", "controller/ray/pool.py", "trainer/stop.py"]
"""What a preemption's figures measure."""


class Api:
    """The service's REST API with the admin token (the default team)."""

    def __init__(self, serve: Serve) -> None:
        token = (serve.state / "api-token").read_text().strip()
        self.http = httpx.Client(base_url=serve.url, headers={"Authorization": f"Bearer {token}"}, timeout=60,
                                 trust_env=False)

    def get(self, path: str, **params: Any) -> Any:
        response = self.http.get(path, params=params)
        response.raise_for_status()
        return response.json()

    def post(self, path: str, body: Any = None) -> Any:
        response = self.http.post(path, json=body)
        assert response.status_code in (200, 201, 202), f"POST {path}: {response.status_code} {response.text}"
        return response.json()

    def status(self, run: str) -> dict:
        return self.get(f"/v1/runs/{run}")

    def events(self, run: str) -> list[dict]:
        rows: list[dict] = []
        while True:
            page = self.get(f"/v1/runs/{run}/events", after=rows[-1]["seq"] if rows else -1)
            rows.extend(page)
            if len(page) < 1000:  # (a page: MAX_EVENTS_PAGE)
                return rows

    def history(self, run: str) -> list[dict]:
        rows: list[dict] = []
        while True:
            page = self.get(f"/v1/runs/{run}/history", after=rows[-1]["step"] if rows else -1)
            rows.extend(page)
            if len(page) < 10000:  # (a page: MAX_HISTORY_PAGE)
                return rows

    def submit(self, spec: dict) -> float:
        """POST the spec; the client's clock just before (Unix seconds, as the history's step times)."""
        t0 = time.time()
        self.post("/v1/runs", spec)
        return t0

    def wait(self, run: str, predicate: Callable[[dict], bool], what: str, timeout_s: float = TIMEOUT_S,
             poll_s: float = 0.5) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status(run)
            if predicate(status):
                return status
            if status["state"] in ENDED:
                raise RuntimeError(f"{run} is {status['state']} while waiting for {what}: {status.get('error')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{run}: no {what} in {timeout_s:.0f} s (state {status['state']}, step "
                                   f"{status['step']})")
            time.sleep(poll_s)

    def wait_idle(self, timeout_s: float = 120) -> None:
        """Every GPU of the cluster free again (the last run's placement released)."""
        deadline = time.monotonic() + timeout_s
        while (view := self.get("/v1/cluster"))["free_gpus"] < view["gpus"] or view["gpus"] < NODES * GPUS_PER_NODE:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster is not idle after {timeout_s:.0f} s: {view}")
            time.sleep(0.5)
        time.sleep(SETTLE_S)


def spec(root: Path, name: str, steps: int, priority: str) -> dict:
    """write_spec's tiny model (the cluster tests' runs), dp2 x tp2, its own checkpoint folder."""
    path = write_spec(root / f"{name}.yaml", name, steps=steps, dp=DP, tp=TP, every_steps=10)
    raw = yaml.safe_load(path.read_text())
    raw["priority"] = priority
    raw["checkpoint"]["uri"] = f"file://{root}/ckpt/{name}"
    return raw


def first_step_end(api: Api, run: str) -> float:
    history = api.history(run)
    first = min((h for h in history if h.get("end") is not None), key=lambda h: h["step"])
    return float(first["end"])


def first_event(events: list[dict], kind: str, attempt: int | None = None) -> dict:
    return next(e for e in events if e["kind"] == kind and (attempt is None or e["attempt"] == attempt))


def idle(api: Api, root: Path, name: str) -> dict[str, float]:
    """The high-priority run alone on the idle cluster: submission -> its first step's end."""
    api.wait_idle()
    t0 = api.submit(spec(root, name, HIGH_STEPS, "high"))
    api.wait(name, lambda s: s["state"] == "succeeded", "the end")
    end = first_step_end(api, name)
    started = first_event(api.events(name), "attempt_started", 0)["time"]
    return {"figure": end - t0, "admitted": started - t0, "launch_first_step": end - started}


def preempt(api: Api, root: Path, low: str, high: str) -> dict[str, float]:
    """A low-priority run on every training GPU, preempted by a high-priority run of the same mesh."""
    api.wait_idle()
    api.submit(spec(root, low, LOW_STEPS, "low"))
    api.wait(low, lambda s: s["state"] == "running" and s["step"] >= LOW_TRAINED, f"step {LOW_TRAINED}")
    t0 = api.submit(spec(root, high, HIGH_STEPS, "high"))
    api.wait(high, lambda s: s["step"] >= 1, "a first step")
    # What the preempted attempt trained, read before its next attempt can redo (and replace) any of it.
    trained = max(h["step"] for h in api.history(low) if h["attempt"] == 0)
    api.wait(high, lambda s: s["state"] == "succeeded", "the end")
    end = first_step_end(api, high)
    high_started = first_event(api.events(high), "attempt_started", 0)["time"]
    # The low run back from the queue: its next attempt has done a step; then it is cancelled.
    api.wait(low, lambda s: s["attempt"] >= 1 and s["state"] == "running"
             and any(e["kind"] == "first_step_after_recovery" for e in api.events(low)), "a step after resuming")
    events = api.events(low)
    api.post(f"/v1/runs/{low}/cancel")
    api.wait(low, lambda s: s["state"] == "cancelled", "the cancel", timeout_s=180)
    stop = first_event(events, "stop_requested", 0)
    preempted = first_event(events, "preempted", 0)
    resumed = first_event(events, "attempt_started", 1)["detail"]
    resume_step = resumed.get("resume_step")
    resume_step = resumed["start_step"] if resume_step is None else resume_step
    assert len([e for e in events if e["kind"] == "preempted"]) == 1, "one preemption per round"
    assert not [e for e in events if e["kind"] == "failure_detected"], "a preemption is not a failure"
    return {"figure": end - t0, "from_stop": end - stop["time"], "asked": stop["time"] - t0,
            "stop_commit": preempted["time"] - stop["time"], "admitted": high_started - preempted["time"],
            "launch_first_step": end - high_started, "preempted_step": float(preempted["detail"]["step"]),
            "trained": float(trained), "resume_step": float(resume_step),
            "redone": float(max(trained, preempted["detail"]["step"]) - resume_step)}


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):6.2f} (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


def stop_service(serve: Serve, started: list[psutil.Process]) -> None:
    """SIGTERM the service (it shuts its embedded cluster down), then end by PID whatever it started
    and left running."""
    from controller.service.main import reap_leftovers

    started += [p for p in serve.descendants() if p.pid not in {q.pid for q in started}]
    serve.stop()
    _, alive = psutil.wait_procs(started, timeout=30)
    left = [p for p in alive if _running(p)]
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=10)
    reap_leftovers(serve.state)  # the recorded cluster processes (pid + start time) and folders
    if left:
        print(f"ended {len(left)} process(es) the service left running: {[p.pid for p in left]}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args()
    # The ranks import this checkout's trainer (the cluster tests' PYTHONPATH).
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    os.environ.pop("GOODPUT_TOKEN", None)
    os.environ.pop("GOODPUT_URL", None)
    wall = time.monotonic()
    load = os.getloadavg()
    ref: list[dict[str, float]] = []
    pre: list[dict[str, float]] = []
    wrong: list[str] = []
    with tempfile.TemporaryDirectory(prefix="goodput-preemption-") as tmp:
        root = Path(tmp)
        os.environ["GOODPUT_STATE_DIR"] = str(root / "state")
        serve = Serve(root / "state", root / "serve.log", "--local-nodes", str(NODES), "--gpus-per-node",
                      str(GPUS_PER_NODE), "--racks", "1", "--spares", "0")
        started: list[psutil.Process] = []
        try:
            serve.start()
            started = serve.descendants()
            api = Api(serve)
            w = idle(api, root, "warmup")
            print(f"  warm-up (idle path, not counted): submission -> first step end {w['figure']:.2f} s", flush=True)
            for i in range(opts.rounds):
                for kind in ("idle", "preempt") if i % 2 == 0 else ("preempt", "idle"):
                    try:
                        if kind == "idle":
                            r = idle(api, root, f"ref-{i}")
                            ref.append(r)
                            print(f"  round {i + 1} idle path:       submission -> first step end {r['figure']:6.2f} s "
                                  f"(admitted {r['admitted']:.2f} s, launch + first step {r['launch_first_step']:.2f} s)",
                                  flush=True)
                        else:
                            r = preempt(api, root, f"low-{i}", f"high-{i}")
                            pre.append(r)
                            print(f"  round {i + 1} preemption path: submission -> first step end {r['figure']:6.2f} s; "
                                  f"stop_requested -> it {r['from_stop']:.2f} s (asked {r['asked']:.2f} s, stop + commit "
                                  f"{r['stop_commit']:.2f} s, admitted {r['admitted']:.2f} s, launch + first step "
                                  f"{r['launch_first_step']:.2f} s); low run: trained to step {r['trained']:.0f}, "
                                  f"preempted at {r['preempted_step']:.0f}, resumed from {r['resume_step']:.0f}: "
                                  f"{r['redone']:.0f} redone", flush=True)
                    except (RuntimeError, AssertionError, StopIteration, httpx.HTTPError) as e:
                        wrong.append(f"round {i + 1} {kind}: {type(e).__name__}: {e}")
                        print(f"  round {i + 1} {kind}: NOT COUNTED ({type(e).__name__}: {e})", flush=True)
                        for run in api.get("/v1/runs"):  # back to an idle cluster for the next one
                            if run["state"] not in ENDED:
                                api.post(f"/v1/runs/{run['id']}/cancel")
        finally:
            stop_service(serve, started)
    print(f"preemption -> the high-priority run's first step; {NODES} nodes x {GPUS_PER_NODE} GPU slots, runs dp{DP} x "
          f"tp{TP} (write_spec's tiny model), {os.cpu_count()} CPU cores; wall {time.monotonic() - wall:.0f} s")
    figures: list[dict[str, Any]] = []
    if pre:
        print("preemption path")
        for key, label in [("figure", "submission -> first step end s"), ("from_stop", "stop_requested -> it s"),
                           ("asked", "  submission -> stop_requested s"), ("stop_commit", "  stop + commit s"),
                           ("admitted", "  preempted -> launch s"), ("launch_first_step", "  launch + first step s")]:
            print(f"  {label:<34}{summary([r[key] for r in pre])}")
        redone = [r["redone"] for r in pre]
        print(f"  {'low run steps redone':<34}{summary(redone)}; goal 0, at most 1: "
              f"{sum(x == 0 for x in redone)} of {len(redone)} at 0, {sum(x <= 1 for x in redone)} at most 1")
        figures += [records.figure("preemption: high run submission -> its first step end", [r["figure"] for r in pre], "s"),
                    records.figure("preemption: low run stop_requested -> high run first step end",
                           [r["from_stop"] for r in pre], "s"),
                    records.figure("preemption: stop_requested -> preempted (stop at a step boundary + commit)",
                           [r["stop_commit"] for r in pre], "s"),
                    records.figure("preemption: low run steps redone", redone, "steps", goal="<= 1")]
    if ref:
        print("idle path (the reference)")
        for key, label in [("figure", "submission -> first step end s"), ("admitted", "  submission -> launch s"),
                           ("launch_first_step", "  launch + first step s")]:
            print(f"  {label:<34}{summary([r[key] for r in ref])}")
        figures.append(records.figure("idle: high run submission -> its first step end", [r["figure"] for r in ref], "s"))
    if pre and ref:
        p, q = statistics.median(r["figure"] for r in pre), statistics.median(r["figure"] for r in ref)
        stop = statistics.median(r["stop_commit"] for r in pre)
        # Submission -> the high run's launch: the part preemption changes (the launch and the first step
        # after it are the same work in both paths, and on a shared machine the noisiest part).
        own_p = statistics.median(r["asked"] + r["stop_commit"] + r["admitted"] for r in pre)
        own_q = statistics.median(r["admitted"] for r in ref)
        print(f"preemption path / idle path (medians): {p / q:.2f}x; the difference {p - q:+.2f} s")
        print(f"  preemption adds {own_p - own_q:.2f} s before the launch (submission -> launch: median {own_p:.2f} s "
              f"against {own_q:.2f} s idle) = the stop at a step boundary + the commit (median {stop:.2f} s) + the "
              f"scheduler noticing and admitting; launch + first step: median "
              f"{statistics.median(r['launch_first_step'] for r in pre):.2f} s against "
              f"{statistics.median(r['launch_first_step'] for r in ref):.2f} s idle (no absolute goal in issue 45)")
        figures.append(records.figure("preemption: high run submission -> its launch (stop + commit + admission)",
                              [r["asked"] + r["stop_commit"] + r["admitted"] for r in pre], "s"))
        figures.append(records.figure("idle: high run submission -> its launch", [r["admitted"] for r in ref], "s"))
    print(f"not counted: {len(wrong)} of {2 * opts.rounds}; load average (1 min) {load[0]:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end (other work on the machine shows in the launch times)")
    for line in wrong:
        print("  " + line)
    if figures:
        records.write("preemption", figures, code=CODE, extra={
            "not_counted": wrong, "per_round": {"preemption": pre, "idle": ref},
            "load_average_1m": {"start": load[0], "end": os.getloadavg()[0]}})


if __name__ == "__main__":
    main()
