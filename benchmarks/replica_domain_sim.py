"""Stop-the-world recovery vs one data-parallel replica as the failure domain, simulated side by side on
the same incidents (same seed): 54 days of the Llama 3 preset's model (examples/llama3-405b-restart.yaml:
405B, pp16 x tp8 pipelines, 16 samples per pipeline) at 1,024, 16,384 and 131,072 GPUs, restart from
the store (`world`) vs `elastic.failure_domain: replica` with dp_replicas = dp / 8 (dp_shard 8: what
the model's memory needs, so 1,024 GPUs hold a single replica and the replica path has nothing to
contain there; the batch shrinks while replicas are out, since the preset's global batch cannot be
split over every live count of 16 or 128 replicas, which keeping it needs), and at 131,072 GPUs Meta's FT-HSDP stall (~3 minutes per failure at ~100K GPUs,
arXiv 2602.00277) as a pessimistic preset for the survivors' stall.

Per row: ETTR, the mean recovery of every failure (world: failure detected -> the new attempt's
first step), the survivors' mean recovery over the failures a replica contained (-> their next step),
interruptions, world restarts (failures no replica can contain: SDC rollbacks), the degraded hours
in their two parts (a mesh smaller than planned; training without the replicas that were out), and
the simulation's wall time.

    python benchmarks/replica_domain_sim.py [--days 54] [--seed 0] [--scales 8,128,1024]

Its record: benchmarks/records/replica_domain_sim.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import yaml  # noqa: E402

from benchmarks import records  # noqa: E402
from benchmarks.simulate_scale import PRESET, at_scale, variant  # noqa: E402
from controller.sim.run import simulate  # noqa: E402
from controller.spec import parse_spec  # noqa: E402

DP_SHARD = 8
CODE = ["controller/sim/run.py", "controller/sim/replicas.py", "controller/sim/group.py", "controller/sim/model.py",
        "controller/replicas.py", "controller/failure_policy.py"]
"""What the simulated paths measure: the controller's replica domain and failure policy, on the simulator's model."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--days", type=float, default=54.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scales", default="8,128,1024", help="pipelines (dp) of 128 GPUs each")
    opts = parser.parse_args()
    raw = yaml.safe_load(PRESET.read_text())
    print(f"{'GPUs':>8} {'path':<22}{'D':>5}{'ETTR':>8}{'MTTR s':>9}{'survivors s (median)':>22}{'interruptions':>15}{'world restarts':>16}"
          f"{'degraded h (mesh + out)':>24}{'wall s':>8}")
    figures: list[dict[str, Any]] = []
    for dp in [int(x) for x in opts.scales.split(",")]:
        base = at_scale(raw, dp)
        replicas = dp // DP_SHARD
        rows = [("world (restart)", base, 1)]
        if replicas >= 2:
            contained = variant(base, parallelism__dp_replicas=replicas, elastic__failure_domain="replica",
                                elastic__batch_while_healing="shrink")
            rows.append(("replica", contained, replicas))
            if dp == 1024:
                rows.append(("replica, FT-HSDP stall", variant(contained, cost__replica_stall_s=180.0), replicas))
        for name, spec, d in rows:
            t = time.perf_counter()
            r = simulate(parse_spec(spec), days=opts.days, seed=opts.seed)
            wall = time.perf_counter() - t
            g = r["goodput"]
            recoveries = [f["recovery_seconds"] for f in g["failures"] if f["recovery_seconds"] is not None]
            survivors = [f["recovery_seconds"] for f in g["failures"] if f.get("contained") and f["recovery_seconds"] is not None]
            restarts = sum(v for k, v in r["decisions"].items() if k != "heal_replica")
            mttr = statistics.fmean(recoveries) if recoveries else 0
            interruptions = sum(r["failures_by_cause"].values())
            mesh_h, out_h = (g["degraded_seconds"][part] / 3600 for part in ("smaller_mesh", "replicas_out"))
            print(f"{r['gpus']:>8} {name:<22}{d:>5}{r['ettr']:>8.4f}{mttr:>9.1f}"
                  + (f"{statistics.fmean(survivors):>13.1f} ({statistics.median(survivors):5.2f})" if survivors
                     else f"{'-':>22}")
                  + f"{interruptions:>15}{restarts:>16}{mesh_h:>14.1f} + {out_h:>7.1f}{wall:>8.1f}", flush=True)
            row = f"{r['gpus']:,} GPUs, {name}"  # (one simulation: each figure one value)
            figures += [records.figure(f"{row}: ETTR", [r["ettr"]], "ratio"),
                        records.figure(f"{row}: MTTR (mean recovery)", [mttr], "s"),
                        records.figure(f"{row}: interruptions", [interruptions], "count"),
                        records.figure(f"{row}: world restarts", [restarts], "count"),
                        records.figure(f"{row}: degraded, a smaller mesh", [mesh_h], "h"),
                        records.figure(f"{row}: degraded, replicas out", [out_h], "h"),
                        records.figure(f"{row}: simulation wall", [wall], "s")]
            if survivors:
                figures += [records.figure(f"{row}: survivors' mean recovery", [statistics.fmean(survivors)], "s"),
                            records.figure(f"{row}: survivors' median recovery", [statistics.median(survivors)], "s")]
            del r
    records.write("replica_domain_sim", figures, code=CODE, extra={"days": opts.days, "seed": opts.seed})


if __name__ == "__main__":
    main()
