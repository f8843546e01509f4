"""A chaos soak against a real `goodput serve` on its embedded cluster: random failures of every kind
that fails something (kill-rank, kill-node, hang-rank, storage-outage) at random steps of random live
runs, and SIGKILLs of the service itself, until --failures drills were injected. Two runs are kept
live (a run that ends is followed by a new one). A poller asks the API what a user and Prometheus ask
all along. At the end every run is driven to its end and every committed checkpoint of every run is
verified byte for byte.

Prints: failures injected and survived (drill outcome `recovered`), service restarts, checkpoints
lost (committed, not retired by retention, and missing or failing verification: must be 0), runs
failed (must be 0), each run's ETTR, and the slowest API answer.

    python benchmarks/chaos_soak.py [--failures 30] [--seed 0] [--restart-every 8]

Its record: benchmarks/records/chaos_soak.json.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import yaml  # noqa: E402

from benchmarks import records  # noqa: E402
from tests.support.serve import Poller, Serve, write_spec  # noqa: E402

KINDS = ("kill-rank", "kill-node", "hang-rank", "storage-outage")
NODES, SPARES = 6, 2
CODE = ["controller/state.py", "controller/failure_policy.py", "controller/service/service.py",
        "controller/service/restore.py", "controller/ray/worker_group.py", "controller/ray/pool.py",
        "trainer/checkpoint.py",
        "checkpointing/manifest.py"]
"""What a soak's figures measure: recovery from every kind of failure, a service restarted under its runs, and
the checkpoints kept through both."""


def spec_file(root: Path, name: str) -> Path:
    path = root / f"{name}.yaml"
    write_spec(path, name, steps=150, dp=2, every_steps=5)
    raw = yaml.safe_load(path.read_text())
    raw["health"] = {"collective_timeout_s": 6, "hang_floor_s": 10}
    raw["checkpoint"]["retry_budget_s"] = 1
    raw["elastic"] = {"min_dp": 1, "max_failures": 1000}
    path.write_text(yaml.safe_dump(raw))
    return path


def status(serve: Serve, run: str) -> dict:
    out = serve.json("status", run)
    assert isinstance(out, dict)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--failures", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--restart-every", type=int, default=8,
                        help="SIGKILL and restart the service after about this many failures")
    opts = parser.parse_args()
    rng = random.Random(opts.seed)
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        serve = Serve(root / "state", root / "serve.log", "--local-nodes", str(NODES), "--gpus-per-node", "1",
                      "--racks", "1", "--spares", str(SPARES)).start()
        runs: list[str] = []
        live: list[str] = []
        injected, outcomes, restarts = 0, [], 0
        poller = Poller(serve, []).start()
        try:
            while injected < opts.failures:
                for run in list(live):
                    s = status(serve, run)
                    if s["state"] in ("succeeded", "failed", "cancelled"):
                        live.remove(run)
                while len(live) < 2:
                    name = f"soak-{len(runs)}"
                    serve.cli("submit", str(spec_file(root, name)))
                    runs.append(name)
                    live.append(name)
                    poller.runs = list(runs)
                if injected and injected % opts.restart_every == 0 and restarts < injected // opts.restart_every:
                    assert serve.proc is not None
                    serve.proc.send_signal(signal.SIGKILL)
                    serve.proc.wait()
                    serve.start()
                    restarts += 1
                    print(f"[{time.time() - started:6.0f} s] service SIGKILLed and started again ({restarts})",
                          flush=True)
                    continue
                run = rng.choice(live)
                s = status(serve, run)
                if s["state"] != "running" or s["step"] >= 140:
                    time.sleep(1)
                    continue
                kind = rng.choice(KINDS)  # a killed node is repaired after serve's default 5 s: the pool refills
                # a few steps ahead: the CLI takes about a second to start, the run does ~2 steps/s
                args = ["drill", run, kind, "--at-step", str(s["step"] + rng.randint(4, 12)), "--timeout", "300"]
                if kind == "storage-outage":
                    args += ["--seconds", "8"]  # longer than 5 steps: a save falls inside it
                proc = serve.cli(*args, "--json", ok=False, timeout=400)
                if "drill_rejected" in proc.stderr and "has passed" in proc.stderr:
                    continue  # the run got there first: nothing was injected; draw again
                injected += 1
                try:
                    import json

                    report = json.loads(proc.stdout)
                except ValueError:
                    report = {"outcome": f"no report: {proc.stderr.strip()[-300:]}"}
                outcomes.append(report.get("outcome"))
                print(f"[{time.time() - started:6.0f} s] {injected:3d} {kind:15s} on {run}: cause {report.get('cause')}, "
                      f"decision {report.get('decision')}, {report.get('outcome')}", flush=True)
            for run in live:  # every run to its end
                deadline = time.monotonic() + 900
                while status(serve, run)["state"] not in ("succeeded", "failed", "cancelled"):
                    assert time.monotonic() < deadline, f"{run} did not end"
                    time.sleep(2)
            finals = {run: status(serve, run) for run in runs}
            lost = 0
            for run in runs:
                in_store = serve.json("checkpoints", run, "--uri", f"file://{root}/ckpt")
                indexed = serve.json("checkpoints", run)
                assert isinstance(in_store, list) and isinstance(indexed, list)
                verified = {r["step"] for r in in_store if r["verification"] == "verified"}
                lost += sum(1 for r in in_store if r["verification"] != "verified")
                lost += sum(1 for r in indexed if r.get("state", "committed") == "committed"
                            and r["step"] not in verified)
        finally:
            poller.stop()
            serve.stop()
    failed = [r for r, f in finals.items() if f["state"] != "succeeded"]
    ettrs = [f["goodput"]["ettr"] for f in finals.values()]
    survived = sum(1 for o in outcomes if o == "recovered")
    print(f"failures injected {injected}, survived {survived} ({outcomes.count('not_detected')} not detected, "
          f"{sum(1 for o in outcomes if o not in ('recovered', 'not_detected'))} other); service restarts {restarts}")
    print(f"runs {len(runs)}, failed {len(failed)} {failed or ''}; checkpoints lost {lost}")
    print(f"ETTR per run: median {statistics.median(ettrs):.3f} (min {min(ettrs):.3f}, max {max(ettrs):.3f})")
    slowest = max(poller.slowest.items(), key=lambda kv: kv[1], default=("-", 0.0))
    print(f"slowest API answer {slowest[1] * 1e3:.0f} ms ({slowest[0]}), of {poller.answered} answered; "
          f"wall {time.time() - started:.0f} s, seed {opts.seed}")
    figures = [records.figure("chaos: failures injected", [injected], "count"),
               records.figure("chaos: failures survived (drill outcome recovered)", [survived], "count"),
               records.figure("chaos: service restarts", [restarts], "count"),
               records.figure("chaos: runs failed", [len(failed)], "count", goal="0"),
               records.figure("chaos: checkpoints lost", [lost], "count", goal="0"),
               records.figure("chaos: ETTR per run", ettrs, "ratio"),
               records.figure("chaos: slowest API answer", [slowest[1] * 1e3], "ms")]
    records.write("chaos_soak", figures, code=CODE, extra={
        "seed": opts.seed, "outcomes": outcomes, "failed_runs": failed, "slowest_path": slowest[0],
        "answered": poller.answered, "wall_s": time.time() - started})


if __name__ == "__main__":
    main()
