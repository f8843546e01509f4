"""Both recovery paths of `goodput simulate` at 131,072 GPUs, for the days issue 44 asked about: the
Llama-3-405B-like spec of tests/unit/test_sim_scale_replica.py (126 layers, d_model 16,384, pp16 x
tp8, dp 1,024; 128 replicas on the replica path, 32 spares), with GQA and peer snapshots every step,
and with multi-head attention restoring from the store only, seed 3. Each row is one simulation, run
one after the other in this process: its wall time against the goal of 60 s, and what it simulated
(steps, attempts, ETTR), so a faster run that simulated less shows as such.

    python benchmarks/sim_paths_131k.py [--days 54] [--seed 3] [--only world/gqa-peers,...]

Its record: benchmarks/records/sim_paths_131k.json.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import records  # noqa: E402
from controller.events import EventKind  # noqa: E402
from controller.sim.run import simulate  # noqa: E402
from controller.spec import parse_spec  # noqa: E402

GOAL_S = 60.0
CODE = ["controller/sim/run.py", "controller/sim/group.py", "controller/sim/replicas.py", "controller/sim/cluster.py",
        "controller/sim/model.py", "controller/state.py"]
"""What a simulation's wall time measures: the simulator, and the controller it drives."""
BASE: dict[str, Any] = {
    "name": "scale",
    "model": {"n_layers": 126, "d_model": 16384, "n_heads": 128, "n_kv_heads": 8, "vocab_size": 65536,
              "seq_len": 8192, "ffn_hidden": 53248},
    "train": {"steps": 400000, "global_batch": 16384, "micro_batch": 1},
    "parallelism": {"dp": 1024, "tp": 8, "pp": 16},
    "cluster": {"simulated": {"nodes": 16416, "gpus_per_node": 8, "racks": 513, "spares": 32}},
    "checkpoint": {"uri": "sim://", "every_steps": "auto", "keep": 2, "peer_every_steps": 1},
    "health": {"collective_timeout_s": 300, "hang_floor_s": 360},
    "elastic": {"min_dp": 512, "max_failures": 100000, "wait_for_capacity_s": 86400},
    "failures": {},
}
MODELS: dict[str, dict[str, dict[str, Any]]] = {
    "gqa-peers": {},
    "mha-store": {"model": {"n_kv_heads": 0}, "checkpoint": {"peer_every_steps": 0}},
}
PATHS: dict[str, dict[str, dict[str, Any]]] = {
    "world": {"elastic": {"failure_domain": "world"}},
    "replica": {"parallelism": {"dp_replicas": 128},
                "elastic": {"failure_domain": "replica", "batch_while_healing": "shrink"}},
}


def raw_spec(path: str, model: str) -> dict[str, Any]:
    raw = copy.deepcopy(BASE)
    for changes in (MODELS[model], PATHS[path]):
        for section, values in changes.items():
            raw[section] = {**raw[section], **values}
    return raw


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--days", type=float, default=54.0)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated path/model pairs, e.g. world/gqa-peers")
    opts = parser.parse_args()
    rows = [(p, m) for p in PATHS for m in MODELS]
    if opts.only:
        rows = [tuple(x.split("/")) for x in opts.only.split(",")]  # type: ignore[misc]
    print(f"{'path':<9}{'model':<11}{'wall s':>8}{'/ goal':>8}{'steps':>9}{'attempts':>10}{'ETTR':>8}  state")
    figures: list[dict[str, Any]] = []
    states: dict[str, str] = {}
    for path, model in rows:
        t = time.perf_counter()
        r = simulate(parse_spec(raw_spec(path, model)), days=opts.days, seed=opts.seed)
        wall = time.perf_counter() - t
        attempts = sum(1 for e in r["_controller"].events if e.kind == EventKind.ATTEMPT_STARTED)
        print(f"{path:<9}{model:<11}{wall:>8.1f}{wall / GOAL_S:>8.2f}{r['steps']:>9}{attempts:>10}{r['ettr']:>8.3f}  "
              f"{r['state']}", flush=True)
        row = f"{path}/{model}"  # (one simulation: each figure one value)
        figures += [records.figure(f"{row}: simulation wall", [wall], "s", goal=f"<= {GOAL_S:g}"),
                    records.figure(f"{row}: wall / goal", [wall / GOAL_S], "ratio", goal="<= 1"),
                    records.figure(f"{row}: steps simulated", [r["steps"]], "steps"),
                    records.figure(f"{row}: attempts", [attempts], "count"),
                    records.figure(f"{row}: ETTR", [r["ettr"]], "ratio")]
        states[row] = r["state"]
        del r
        gc.collect()  # (the simulation runs without the cyclic collector: what it left goes before the next)
    records.write("sim_paths_131k", figures, code=CODE, extra={"days": opts.days, "seed": opts.seed, "states": states})


if __name__ == "__main__":
    main()
