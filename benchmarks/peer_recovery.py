"""Heal from peers vs restart from the store: kill-node drills on make run's model and mesh (dp2 x pp2 x
tp2 on the embedded 5-node cluster with a spare), side by side in one run.

Each round runs the same spec twice, in an order that alternates from round to round: with peer
snapshots every step (`checkpoint.peer_every_steps: 1`) and without (`0`: today's path, the latest
durable checkpoint). The durable checkpoint is every 5 steps in both; the drill kills the node of the
last ranks at step 8. Every drill's report must name the cause (node_lost) and the decision (replace);
one that does not is counted and left out. Prints per configuration the median, min and max of:
- failure -> first step (SIGKILL of the raylet -> the first step finished on the new attempt's ranks;
  its report may reach the controller later: "report held"), in phases: "first step" runs from the
  controller hearing of the restore to the step's end, "its span" is the step's own time on its rank;
- steps redone (the step the failure was detected at - the step the new attempt started from);
- bytes the object store sent during the recovery;
- step time (the mean over steps that are neither an attempt's first nor a checkpoint's: a snapshot
  every n steps is paid once per n);
and for the peer runs the host memory the snapshots hold per rank / the rank's state (the largest).
Goals (issue 21): failure -> first step <= 2 s, steps redone <= 1, step time ratio <= 1.02, store bytes
in a peer recovery 0, host memory per state <= 2.1.

    python benchmarks/peer_recovery.py [--rounds 5] [--peer-every 2 3]

Its record: benchmarks/records/peer_recovery.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import records  # noqa: E402
from controller.ray.cluster import LocalRayCluster  # noqa: E402
from controller.ray.runner import drive  # noqa: E402
from controller.spec import LocalClusterSpec, parse_spec  # noqa: E402

CONFIGS = {"peers": 1, "store": 0}
"""name -> checkpoint.peer_every_steps (--peer-every adds intervals: "peers/2" ...)."""
EVERY = 5
CODE = ["trainer/peer.py", "trainer/peer_load.py", "checkpointing/peer.py", "trainer/restore.py",
        "controller/ray/worker_group.py", "controller/ray/pool.py", "controller/state.py"]
"""What a heal from peers measures: the snapshots, the agreed step, the load from buddies and the relaunch."""


def one_run(cluster: LocalRayCluster, name: str, index: int, root: str, configs: dict[str, int]) -> dict:
    spec = parse_spec({
        "name": f"heal-{name.replace('/', '-')}-{index}",
        "model": {"n_layers": 4, "d_model": 128, "n_heads": 4, "vocab_size": 256, "seq_len": 128},
        "data": {"kind": "synthetic", "seed": 0},
        "train": {"steps": 16, "global_batch": 16, "micro_batch": 2, "lr": 3e-3, "seed": 0},
        "parallelism": {"dp": 2, "tp": 2, "pp": 2},
        "cluster": {"local": {"nodes": 5, "gpus_per_node": 2, "racks": 2, "spares": 1}},
        "checkpoint": {"uri": f"file://{root}", "every_steps": EVERY, "keep": 2,
                       "peer_every_steps": configs[name]},
        "health": {"collective_timeout_s": 20, "hang_floor_s": 30},
        "drills": [{"kind": "kill-node", "at_step": 8}],
    })
    with contextlib.redirect_stdout(sys.stderr):
        controller = drive(spec, cluster)
    run = controller.to_dict(0)
    cluster.add_node(3)  # the drill killed node-3 (the last ranks' node); bring it back
    if not run["drills"]:
        return {"outcome": f"no drill report: run {run['state']} at step {run['step']}: {run['error']}"}
    (report,) = run["drills"]
    events = run["events"]
    restored = [e["detail"] for e in events if e["kind"] == "restored" and e["attempt"] == 1]
    started = next(e["time"] for e in events if e["kind"] == "attempt_started" and e["attempt"] == 1)
    heard = next((e["time"] for e in events if e["kind"] == "restored" and e["attempt"] == 1), float("nan"))
    phases = {"detect": report["detected_at"] - report["injected_at"], "decide+launch": started - report["detected_at"],
              "start+load": heard - started, "load": restored[0].get("seconds", float("nan")) if restored else float("nan"),
              "first step": report["recovered_at"] - heard,
              "its span": next((h["end"] - h["start"] for h in run["history"] if h["attempt"] == 1 and h.get("end")),
                               float("nan")),
              "report held": report["recovery_heard_at"] - report["recovered_at"],
              "in place": sum(bool(d.get("in_place")) for d in restored)}
    memory = [e["detail"] for e in events if e["kind"] == "peer_snapshots"]
    firsts = {min(h["step"] for h in run["history"] if h["attempt"] == a) for a in {h["attempt"] for h in run["history"]}}
    steady = [h["end"] - h["start"] for h in run["history"]
              if h["step"] not in firsts and h["step"] % EVERY != 0 and h.get("start") and h.get("end")]
    return {**report, "state": run["state"],
            "store_bytes": restored[0].get("bytes_read", 0) if restored else None,
            "source": restored[0].get("source") if restored else None,
            "step_s": statistics.fmean(steady) if steady else float("nan"),  # a mean: snapshots every n steps amortized
            "host_per_state": max((m["max_host_per_state"] for m in memory), default=None), "phases": phases}


def summary(values: list[float], unit: str = "s") -> str:
    return (f"median {statistics.median(values):.3f} {unit} (min {min(values):.3f}, max {max(values):.3f}, "
            f"n={len(values)})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--peer-every", type=int, nargs="*", default=[],
                        help="more snapshot intervals to measure beside every step (e.g. 2 3)")
    opts = parser.parse_args()
    configs = {**CONFIGS, **{f"peers/{n}": n for n in opts.peer_every if n > 1}}
    results: dict[str, list[dict]] = {name: [] for name in configs}
    wrong: list[str] = []
    cluster = LocalRayCluster(LocalClusterSpec(nodes=5, gpus_per_node=2, racks=2, spares=1))
    with contextlib.redirect_stdout(sys.stderr):
        cluster.start()
    try:
        with tempfile.TemporaryDirectory() as root:
            for i in range(opts.rounds):
                order = list(configs) if i % 2 == 0 else list(reversed(configs))
                for name in order:
                    r = one_run(cluster, name, i, root, configs)
                    ok = (r.get("cause") == "node_lost" and r.get("decision") == "replace"
                          and r.get("outcome") == "recovered" and r.get("state") == "succeeded")
                    print(f"  round {i + 1} {name}: failure -> first step {r.get('recovery_s', float('nan')):.2f} s, "
                          f"steps redone {r.get('steps_lost')}, from {r.get('source')}, store bytes "
                          f"{r.get('store_bytes')}, step {r.get('step_s', float('nan')):.3f} s, "
                          f"host/state {r.get('host_per_state')}, {r.get('outcome')}", flush=True)
                    if "phases" in r:
                        print("    " + ", ".join(f"{k} {v:.2f} s" if k != "in place" else f"ranks kept in place {v}"
                                                for k, v in r["phases"].items()), flush=True)
                    (results[name] if ok else wrong).append(r if ok else f"round {i + 1} {name}: {r}")  # type: ignore[arg-type]
    finally:
        with contextlib.redirect_stdout(sys.stderr):
            cluster.shutdown()
    figures: list[dict[str, Any]] = []
    for name, runs in results.items():
        if not runs:
            continue
        peers = bool(configs[name])  # (the goals are the peer path's)
        recovery, redone = [r["recovery_s"] for r in runs], [float(r["steps_lost"]) for r in runs]
        store_bytes, step = [float(r["store_bytes"] or 0) for r in runs], [r["step_s"] for r in runs]
        print(name)
        print("  failure -> first step: " + summary(recovery))
        print("  steps redone:          " + summary(redone, "steps"))
        print("  store bytes read:      " + summary(store_bytes, "B"))
        print("  step time:             " + summary(step))
        figures += [records.figure(f"{name}: failure -> first step", recovery, "s", goal="<= 2" if peers else None),
                    records.figure(f"{name}: steps redone", redone, "steps", goal="<= 1" if peers else None),
                    records.figure(f"{name}: store bytes read", store_bytes, "bytes", goal="0" if peers else None),
                    records.figure(f"{name}: step time", step, "s")]
        for phase in runs[0]["phases"]:
            values = [r["phases"][phase] for r in runs]
            print(f"    {phase:<14} " + summary(values, "ranks" if phase == "in place" else "s"))
            figures.append(records.figure(f"{name}: phase {phase}", values, "count" if phase == "in place" else "s"))
        if peers:
            host = [r["host_per_state"] for r in runs]
            print("  host memory / state:   " + summary(host, "x"))
            print(f"  recovered from: {sorted({r['source'] for r in runs})}")
            figures.append(records.figure(f"{name}: host memory / state", host, "ratio", goal="<= 2.1"))
    med = {n: {k: statistics.median([r[k] for r in runs]) for k in ("recovery_s", "step_s")}
           for n, runs in results.items() if runs}
    for name in [n for n in med if configs[n] and "store" in med]:
        print(f"ratio {name}/store: failure -> first step {med[name]['recovery_s'] / med['store']['recovery_s']:.3f}, "
              f"step time {med[name]['step_s'] / med['store']['step_s']:.3f}")
        figures += [records.figure(f"{name} / store: failure -> first step (medians)",
                                   [med[name]["recovery_s"] / med["store"]["recovery_s"]], "ratio"),
                    records.figure(f"{name} / store: step time (medians)",
                                   [med[name]["step_s"] / med["store"]["step_s"]], "ratio", goal="<= 1.02")]
    print(f"drills with the wrong cause, decision or outcome: {len(wrong)} of {opts.rounds * len(configs)}")
    for line in wrong:
        print(f"  {line}")
    print("goals: failure -> first step <= 2 s, steps redone <= 1, step time ratio <= 1.02, store bytes 0 "
          "(peers), host memory / state <= 2.1")
    if figures:
        records.write("peer_recovery", figures, code=CODE, extra={"not_counted": wrong})


if __name__ == "__main__":
    main()
