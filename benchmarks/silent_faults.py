"""Loud and silent node losses side by side, in the lab (tests/support/lab.py; needs root, iproute2,
nftables): a stock `ray start` cluster in network namespaces with Ray's default health checks,
`goodput serve --address` outside them, one run per failure domain (world, replica), and in each run
`--rounds` pairs of drills, interleaved: kill-node (loud: the raylet SIGKILLed, sockets close) then
power-off (silent: the link cut, then every process killed), each on the node of the last rank, the
node repaired after each drill (a new raylet in its namespace). Prints each drill and, per kind and
path, the median and spread of: detection (fault -> node declared lost), the first step after it
(world: the new attempt's; replica: the survivors' next committed step), and steps lost.

    sudo python benchmarks/silent_faults.py --rounds 5

Its record: benchmarks/records/silent_faults.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import records  # noqa: E402
from tests.support.lab import Lab, LabRayCluster, available  # noqa: E402
from tests.support.serve import Serve, wait_for, write_spec  # noqa: E402

WORKERS = ["gpu-a", "gpu-b", "gpu-c", "gpu-d", "gpu-e"]
CODE = ["controller/ray/liveness.py", "controller/ray/heartbeats.py", "health/heartbeat.py",
        "controller/failure_policy.py", "controller/replicas.py", "controller/state.py"]
"""What a node loss's figures measure: how it is noticed, loud or silent, and the recovery each domain makes."""


def spec(tmp: Path, name: str, *, replicas: int, steps: int) -> Path:
    path = write_spec(tmp / f"{name}.yaml", name, steps=steps, dp=4, every_steps=10)
    raw = yaml.safe_load(path.read_text())
    raw["health"] = {"collective_timeout_s": 20, "hang_floor_s": 30}
    raw["checkpoint"]["peer_every_steps"] = 1
    raw["elastic"] = {"max_failures": 50, **({"failure_domain": "replica"} if replicas > 1 else {})}
    if replicas > 1:
        raw["parallelism"]["dp_replicas"] = replicas
    path.write_text(yaml.safe_dump(raw))
    return path


def one_run(serve: Serve, cluster: LabRayCluster, tmp: Path, name: str, replicas: int, rounds: int) -> list[dict]:
    serve.cli("submit", str(spec(tmp, name, replicas=replicas, steps=100000)))
    out = []
    for i in range(rounds):
        for kind in ("kill-node", "power-off"):
            status = wait_for(serve, name, lambda s: s["state"] == "running" and s["step"] >= 8, timeout_s=600)
            target = status["placement"][-1]["node"]
            at = status["step"]
            wait_for(serve, name, lambda s: s["step"] >= at + 5, timeout_s=600)  # (warm, peer snapshots on buddies)
            report = serve.json("drill", name, kind, "--target", target)
            assert isinstance(report, dict)
            row = {"path": "replica" if replicas > 1 else "world", "kind": kind, "round": i,
                   "decision": report.get("decision"), "outcome": report.get("outcome"),
                   "detection_s": report.get("detection_s"), "first_step_s": report.get("recovery_s"),
                   "steps_lost": report.get("steps_lost")}
            print(json.dumps(row), flush=True)
            out.append(row)
            cluster.repair(target)
    serve.cli("cancel", name)
    return out


def summary(rows: list[dict]) -> list[dict[str, Any]]:
    """Print the table per path and kind of the drills that recovered; its figures."""
    figures: list[dict[str, Any]] = []
    print("\n| path | fault | n | decisions | detection s, median (min-max) | first step after s, median (min-max) "
          "| steps lost |")
    print("|---|---|---|---|---|---|---|")
    for path in ("world", "replica"):
        for kind in ("kill-node", "power-off"):
            sel = [r for r in rows if r["path"] == path and r["kind"] == kind and r["outcome"] == "recovered"]
            if not sel:
                continue
            det = [r["detection_s"] for r in sel]
            first = [r["first_step_s"] for r in sel]
            lost = [r["steps_lost"] for r in sel]
            decisions = ", ".join(f"{d} {n}" for d, n in collections.Counter(r["decision"] for r in sel).items())
            print(f"| {path} | {kind} | {len(sel)} | {decisions} | {statistics.median(det):.2f} "
                  f"({min(det):.2f}-{max(det):.2f}) | "
                  f"{statistics.median(first):.2f} ({min(first):.2f}-{max(first):.2f}) | {max(lost)} at most |")
            figures += [records.figure(f"{path}, {kind}: detection", det, "s"),
                        records.figure(f"{path}, {kind}: first step after", first, "s"),
                        records.figure(f"{path}, {kind}: steps lost", lost, "steps")]
    failed = [r for r in rows if r["outcome"] != "recovered"]
    if failed:
        print(f"\nnot recovered: {failed}")
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args()
    if (why := available()) is not None:
        print(f"silent_faults: {why}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="silent-faults-"))
    lab = Lab(["head", *WORKERS]).open()
    cluster = serve = None
    rows: list[dict] = []
    try:
        cluster = LabRayCluster(lab, tmp / "ray", workers=WORKERS, spares=1).start()
        serve = Serve(tmp / "state", tmp / "serve.log", "--address", cluster.address, "--advertise-host", lab.gateway,
                      env={**cluster.env, "GOODPUT_STATE_DIR": str(tmp / "state")}).start()
        t0 = time.monotonic()
        for name, replicas in (("bench-world", 1), ("bench-replica", 2)):
            rows += one_run(serve, cluster, tmp, name, replicas, opts.rounds)
        print(f"\n{len(rows)} drills in {time.monotonic() - t0:.0f} s")
    finally:
        if serve is not None:
            serve.stop()
        if cluster is not None:
            cluster.stop()
        lab.close()
    figures = summary(rows)
    if figures:
        records.write("silent_faults", figures, code=CODE, extra={"drills": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
