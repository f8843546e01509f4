"""Health probes: their cost, how fast they catch a slow rank, and how often they cry wolf.

1. Overhead: two trainers on the same dp2 x pp2 x tp2 mesh in the same 8 processes, one with the
   probes at their default cadence (integrity checksums and the anomaly all-reduce every step, SDC
   self-test and replica fingerprints every 10 steps), one without; steps interleaved (on, off, on,
   ...) so machine noise hits both alike. Printed: step time with probes / without (mean, which
   includes the periodic checks, and median). Target <= 1.02.
2. False flags: every clean step's per-rank compute time from both trainers goes through the
   controller's own StragglerTracker (health/straggler.py); flags per 1,000 clean steps.
3. Detection: rank 6 made 1.2x, 1.5x, 2x slower (the slow-rank drill's switch) after a clean lead-in;
   steps from the slowdown to the verdict, at straggler_ratio 1.5 (the default), 1.3 and 1.1.

    python benchmarks/health_probes.py [--steps 300] [--lead-in 15] [--after 30]

Its record: benchmarks/records/health_probes.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import records  # noqa: E402
from health.straggler import StragglerConfig, StragglerTracker  # noqa: E402
from tests.dist.harness import run_ranks  # noqa: E402
from trainer.config import (  # noqa: E402
    DataConfig, MeshShape, ModelConfig, ProbeConfig, TrainConfig, TrainerConfig,
)

MESH = MeshShape(dp=2, pp=2, tp=2)
FACTORS = (1.2, 1.5, 2.0)
RATIOS = (1.5, 1.3, 1.1)
SLOW_RANK = 6
CODE = ["trainer/probes.py", "health/sdc.py", "trainer/train.py", "health/straggler.py"]
"""What the probes' figures measure: their cost in the step, and the controller's straggler verdicts."""


def config(probes: bool, mesh: MeshShape = MESH) -> TrainerConfig:
    return TrainerConfig(model=ModelConfig(n_layers=4, d_model=128, n_heads=4, vocab_size=256, seq_len=128),
                         data=DataConfig(seed=0),
                         train=TrainConfig(steps=10**6, global_batch=16, micro_batch=2, lr=3e-3, dtype="float32"),
                         mesh=mesh, probes=ProbeConfig(enabled=probes))


def bench_rank(*, rank: int, world_size: int, store_port: int, steps: int, lead_in: int, after: int,
               skip_detection: bool = False, mesh: tuple[int, int, int] = (2, 2, 2)) -> dict:
    import torch
    import torch.distributed as dist

    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.switches import DrillSwitches
    from trainer.train import Trainer

    torch.set_num_threads(1)
    store = dist.PrefixStore("bench", dist.TCPStore("127.0.0.1", store_port, is_master=False))
    init_process_group(rank=rank, world_size=world_size, store=store, backend="gloo", timeout_s=300)
    choice = choose_device("float32")
    shape = MeshShape(dp=mesh[0], pp=mesh[1], tp=mesh[2])
    switches = DrillSwitches()
    with_probes = Trainer(config(True, shape), build_mesh(shape, "cpu"), choice, switches=switches)
    without = Trainer(config(False, shape), build_mesh(shape, "cpu"), choice)
    on, off, clean_on, clean_off, probe = [], [], [], [], []
    for _ in range(2):  # warm-up
        with_probes.train_step()
        without.train_step()
    for _ in range(steps):
        a = with_probes.train_step()
        b = without.train_step()
        on.append(a.step_time_s)
        probe.append(a.probe_s)
        off.append(b.step_time_s)
        clean_on.append(a.compute_s)
        clean_off.append(b.compute_s)
    slowed: dict[str, list[float]] = {}
    for factor in FACTORS if not skip_detection else ():
        series = []
        for i in range(lead_in + after):
            if rank == SLOW_RANK:
                switches.slow(factor if i >= lead_in else 1.0)
            series.append(with_probes.train_step().compute_s)
        switches.slow(1.0)
        slowed[str(factor)] = series
    dist.destroy_process_group()
    return {"on": on, "off": off, "clean_on": clean_on, "clean_off": clean_off, "slowed": slowed, "probe": probe}


def verdict_steps(series: dict[int, list[float]], ratio: float, mesh: MeshShape = MESH) -> list[tuple[int, int]]:
    """(rank, step) of every verdict the controller's tracker reaches on these samples."""
    stage = {r: mesh.rank_coords(r)["pp"] for r in range(mesh.world_size)}
    tracker = StragglerTracker(stage, StragglerConfig(ratio=ratio))
    found: list[tuple[int, int]] = []
    for step in range(1, len(series[0]) + 1):
        for rank, values in series.items():
            tracker.add(rank, step, values[step - 1])
        found.extend((v.rank, v.step) for v in tracker.evaluate())
    return found


def detection(results: list[dict], lead_in: int, after: int) -> list[dict[str, Any]]:
    """Print the steps from each slowdown to its verdict; its figures: each verdict on the slowed rank, the
    slowdowns it missed, and the wrong ranks flagged per (slowdown, ratio)."""
    print(f"\nsteps from slowdown to verdict (rank {SLOW_RANK} slowed after {lead_in} clean steps; "
          f"'-' = not flagged in {after} steps; wrong ranks flagged in brackets)")
    print("factor  " + "  ".join(f"ratio {ratio:<4}" for ratio in RATIOS))
    figures: list[dict[str, Any]] = []
    wrong_ranks: list[int] = []
    missed = 0
    for factor in FACTORS:
        series = {rank: r["slowed"][str(factor)] for rank, r in enumerate(results)}
        cells = []
        for ratio in RATIOS:
            found = verdict_steps(series, ratio)
            right = [step - lead_in for rank, step in found if rank == SLOW_RANK]
            wrong = sorted({rank for rank, _ in found if rank != SLOW_RANK})
            cell = (str(right[0]) if right else "-") + (f" {wrong}" if wrong else "")
            cells.append(f"{cell:<10}")
            if right:
                figures.append(records.figure(f"probes: rank slowed {factor}x -> verdict at ratio {ratio}",
                                              [right[0]], "steps"))
            else:
                missed += 1
            wrong_ranks.append(len(wrong))
        print(f"{factor:<6}  " + "  ".join(cells))
    return figures + [records.figure(f"probes: slowdowns not flagged in {after} steps", [missed], "count"),
                      records.figure("probes: wrong ranks flagged, per slowdown and ratio", wrong_ranks, "count",
                                     goal="0")]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300, help="interleaved clean steps per trainer")
    parser.add_argument("--lead-in", type=int, default=15, help="clean steps before each slowdown")
    parser.add_argument("--after", type=int, default=30, help="slow steps after it")
    parser.add_argument("--no-detection", action="store_true", help="measure the overhead only")
    parser.add_argument("--mesh", default="2,2,2", help="dp,pp,tp (detection needs rank 6: 2,2,2)")
    opts = parser.parse_args()
    dp, pp, tp = (int(x) for x in opts.mesh.split(","))
    mesh = MeshShape(dp=dp, pp=pp, tp=tp)
    skip = opts.no_detection or mesh.world_size <= SLOW_RANK
    results = run_ranks(bench_rank, mesh.world_size, timeout_s=7200, steps=opts.steps, lead_in=opts.lead_in,
                        after=opts.after, skip_detection=skip, mesh=(dp, pp, tp))
    on = [max(r["on"][i] for r in results) for i in range(opts.steps)]
    off = [max(r["off"][i] for r in results) for i in range(opts.steps)]
    print(f"mesh dp{dp} x pp{pp} x tp{tp}, {mesh.world_size} gloo ranks on {os.cpu_count()} cores, "
          f"{opts.steps} steps each way, interleaved")
    print(f"step time with probes: mean {statistics.mean(on) * 1e3:.1f} ms, median {statistics.median(on) * 1e3:.1f} ms")
    print(f"step time without:     mean {statistics.mean(off) * 1e3:.1f} ms, median {statistics.median(off) * 1e3:.1f} ms")
    means, medians = statistics.mean(on) / statistics.mean(off), statistics.median(on) / statistics.median(off)
    print(f"overhead ratio (with / without): mean {means:.3f}, median {medians:.3f}   (target <= 1.02)")

    probe_ms = [statistics.mean(r["probe"]) * 1e3 for r in results]
    print(f"time inside the probes per step (mean over steps, per rank): "
          f"{', '.join(f'{p:.1f}' for p in probe_ms)} ms")

    clean_steps = 0
    flags = 0
    for key in ("clean_on", "clean_off"):
        series = {rank: r[key] for rank, r in enumerate(results)}
        flags += len(verdict_steps(series, 1.5, mesh))
        clean_steps += opts.steps
    print(f"false straggler flags at ratio 1.5: {flags} in {clean_steps} clean steps "
          f"= {1000 * flags / clean_steps:.2f} per 1,000 steps")
    tight = sum(len(verdict_steps({rank: r[k] for rank, r in enumerate(results)}, 1.1, mesh))
                for k in ("clean_on", "clean_off"))
    print(f"false straggler flags at ratio 1.1: {tight} in {clean_steps} clean steps "
          f"= {1000 * tight / clean_steps:.2f} per 1,000 steps")
    figures = [records.figure("probes: step time with probes", [t * 1e3 for t in on], "ms"),
               records.figure("probes: step time without", [t * 1e3 for t in off], "ms"),
               records.figure("probes: with / without (means)", [means], "ratio", goal="<= 1.02"),
               records.figure("probes: with / without (medians)", [medians], "ratio", goal="<= 1.02"),
               records.figure("probes: time inside the probes per step (mean, per rank)", probe_ms, "ms"),
               records.figure("probes: false straggler flags at ratio 1.5", [1000 * flags / clean_steps],
                              "per 1k steps"),
               records.figure("probes: false straggler flags at ratio 1.1", [1000 * tight / clean_steps],
                              "per 1k steps")]
    if not skip:
        figures += detection(results, opts.lead_in, opts.after)
    records.write("health_probes", figures, code=CODE, extra={"mesh": [dp, pp, tp], "steps": opts.steps})


if __name__ == "__main__":
    main()
