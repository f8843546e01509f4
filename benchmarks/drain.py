"""A drain (issue 45): `goodput nodes drain NODE` on a node of a running run, on a real `goodput serve`
(127.0.0.1, its embedded Ray cluster of 3 nodes x 2 GPU slots, one a spare) driven through its REST API.

Each round: a run (dp2 x tp2 on two nodes, a peer snapshot every step, a durable checkpoint every 25)
trains; after a few steps one of its nodes is drained. Figures, per round:

- drain finished: the drain request (the client's clock just before its POST) -> the run's `drained`
  event (every rank stopped after the same step with it kept by its peers: the run is off the node).
  Goal: within 2 steps + the snapshot time, i.e. against 2 x the run's median step time before the
  drain (the history's step end - start) + what its step cadence (end to end) has beyond a step (the
  peer snapshot and the step boundary's other work);
- the reseat: `drained` -> the end of the next attempt's first step (the node's ranks on the spare,
  loaded from their buddies' memory);
- steps redone (goal 0): the step the run stopped at minus the step its next attempt starts from;
- bytes read from the store (goal 0): the next attempt's `restored` events' bytes_read.

Then the node is released (it refills the spare pool) and the run cancelled, so every round starts
from the same cluster.

    python benchmarks/drain.py [--rounds 5]     (its record: benchmarks/records/drain.json)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import psutil  # noqa: E402
import yaml  # noqa: E402

from benchmarks import records  # noqa: E402
from benchmarks.preemption import ENDED, REPO, Api, stop_service, summary  # noqa: E402
from tests.support.serve import Serve, write_spec  # noqa: E402

NODES, GPUS_PER_NODE, SPARES = 3, 2, 1
TRAINED = 4
"""Steps the run has done before the drain."""


def spec(root: Path, name: str) -> dict:
    path = write_spec(root / f"{name}.yaml", name, steps=100_000, dp=2, tp=2, every_steps=25)
    raw = yaml.safe_load(path.read_text())
    raw["checkpoint"] = {**raw["checkpoint"], "uri": f"file://{root}/ckpt/{name}", "peer_every_steps": 1}
    return raw


def one(api: Api, root: Path, name: str) -> dict[str, float]:
    api.submit(spec(root, name))
    status = api.wait(name, lambda s: s["state"] == "running" and s["step"] >= TRAINED, f"step {TRAINED}")
    node = sorted({row["node"] for row in status["placement"]})[-1]
    before = [h for h in api.history(name) if h.get("end") is not None and h.get("start") is not None]
    step_s = statistics.median(h["end"] - h["start"] for h in before)
    t0 = time.time()
    api.post(f"/v1/nodes/{node}/drain")
    api.wait(name, lambda s: any(e["kind"] == "first_step_after_recovery" for e in api.events(name)),
             "a step after the drain")
    events = api.events(name)
    api.post(f"/v1/runs/{name}/cancel")
    api.wait(name, lambda s: s["state"] in ENDED, "the cancel", timeout_s=180)
    nodes = {n["name"]: n for n in api.get("/v1/nodes")["nodes"]}
    assert nodes[node]["state"] == "drained", nodes[node]
    api.post(f"/v1/nodes/{node}/release")
    drained = next(e for e in events if e["kind"] == "drained")
    started = next(e for e in events if e["kind"] == "attempt_started" and e["attempt"] == 1)["detail"]
    first = next(e for e in events if e["kind"] == "first_step_after_recovery")
    restored = [e["detail"] for e in events if e["kind"] == "restored" and e["attempt"] == 1]
    assert not [e for e in events if e["kind"] == "failure_detected"], "a drain is not a failure"
    # The snapshot (and the step boundary's other work) is what the cadence has beyond the step itself.
    cadence = statistics.median(b["end"] - a["end"] for a, b in zip(before, before[1:]))
    snapshot_s = max(0.0, cadence - step_s)
    return {"drain_s": drained["time"] - t0, "goal_s": 2 * step_s + snapshot_s, "step_s": step_s,
            "snapshot_s": snapshot_s, "reseat_s": float(first["detail"].get("ended_at", first["time"])) - drained["time"],
            "redone": float(drained["detail"]["step"] - started["start_step"]),
            "bytes_read": float(sum(int(r.get("bytes_read") or 0) for r in restored)),
            "from_peers": float(all(r.get("source") == "peer" for r in restored) and bool(restored))}


CODE = ["controller/state.py", "controller/service/service.py", "controller/ray/worker_group.py", "controller/ray/pool.py",
        "trainer/stop.py", "trainer/peer.py", "trainer/peer_load.py"]
"""What a drain's figures measure."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    opts = parser.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    os.environ.pop("GOODPUT_TOKEN", None)
    os.environ.pop("GOODPUT_URL", None)
    wall = time.monotonic()
    rounds: list[dict[str, float]] = []
    wrong: list[str] = []
    with tempfile.TemporaryDirectory(prefix="goodput-drain-") as tmp:
        root = Path(tmp)
        os.environ["GOODPUT_STATE_DIR"] = str(root / "state")
        serve = Serve(root / "state", root / "serve.log", "--local-nodes", str(NODES), "--gpus-per-node",
                      str(GPUS_PER_NODE), "--racks", "1", "--spares", str(SPARES))
        started: list[psutil.Process] = []
        try:
            serve.start()
            started = serve.descendants()
            api = Api(serve)
            for i in range(opts.rounds):
                try:
                    r = one(api, root, f"drained-{i}")
                except (RuntimeError, AssertionError, StopIteration) as e:
                    wrong.append(f"round {i + 1}: {type(e).__name__}: {e}")
                    print(f"  round {i + 1}: NOT COUNTED ({type(e).__name__}: {e})", flush=True)
                    continue
                rounds.append(r)
                print(f"  round {i + 1}: drain -> off the node {r['drain_s']:.2f} s (goal {r['goal_s']:.2f} s = 2 x "
                      f"{r['step_s']:.2f} s step + {r['snapshot_s']:.2f} s snapshot), reseat -> first step "
                      f"{r['reseat_s']:.2f} s, {r['redone']:.0f} steps redone, {r['bytes_read']:.0f} bytes from the store"
                      f"{', from peers' if r['from_peers'] else ''}", flush=True)
        finally:
            stop_service(serve, started)
    print(f"drain of a node of a running run; {NODES} nodes x {GPUS_PER_NODE} GPU slots ({SPARES} spare), run dp2 x "
          f"tp2 (write_spec's tiny model), {os.cpu_count()} CPU cores; wall {time.monotonic() - wall:.0f} s")
    figures: list[dict[str, Any]] = []
    if rounds:
        ratio = [r["drain_s"] / r["goal_s"] for r in rounds]
        print(f"  drain -> off the node s            {summary([r['drain_s'] for r in rounds])}")
        print(f"  / (2 steps + snapshot)              {summary(ratio)}; met {sum(x <= 1 for x in ratio)} of {len(ratio)}")
        print(f"  reseat -> first step s             {summary([r['reseat_s'] for r in rounds])}")
        print(f"  steps redone                       {summary([r['redone'] for r in rounds])} (goal 0)")
        print(f"  bytes read from the store          {summary([r['bytes_read'] for r in rounds])} (goal 0)")
        figures = [records.figure("drain: request -> the run off the node", [r["drain_s"] for r in rounds], "s"),
                   records.figure("drain: (request -> off the node) / (2 steps + snapshot)", ratio, "ratio",
                                  goal="<= 1"),
                   records.figure("drain: reseat -> first step end", [r["reseat_s"] for r in rounds], "s"),
                   records.figure("drain: steps redone", [r["redone"] for r in rounds], "steps", goal="0"),
                   records.figure("drain: bytes read from the store", [r["bytes_read"] for r in rounds], "bytes",
                                  goal="0")]
    print(f"not counted: {len(wrong)} of {opts.rounds}")
    for line in wrong:
        print("  " + line)
    if figures:
        records.write("drain", figures, code=CODE, extra={"not_counted": wrong, "per_round": rounds})


if __name__ == "__main__":
    main()
