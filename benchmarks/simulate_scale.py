"""`goodput simulate` at the scale it is for: 54 days of a Llama-3-405B-like run on 16,384 GPUs
(examples/llama3-405b-sim.yaml) with the Llama 3 report's failure model.

Prints the wall time of the simulation, the ETTR with goodput's defaults, and what each lever is
worth, side by side on the same incidents (same seed): hot spares (0 vs the example's 8 vs 32),
detection latency (goodput's data plane and raylet probe, 1 s for a loud node loss, vs Ray's
default health checks, 50 s, for a run without them), the restart (the default's ~150 s of
communicator init at this scale vs 300 s), and the checkpoint interval (Young/Daly `auto` vs fixed 50 and 500 steps). Steps done are printed too:
ETTR counts time, and a mesh shrunk to half its data-parallel width (no spare left) trains at half
the speed while its time still counts as productive.

Then, on the Llama 3 preset (examples/llama3-405b-restart.yaml) with the default restart for each
world: ETTR and MTTR of restart-from-store and heal-from-peers (`checkpoint.peer_every_steps` 0 and 1)
at 1,024, 16,384 and 131,072 GPUs (the same model, dp scaled, 16 samples per replica; at 131,072 GPUs restart-from-store
is issue 22's goal of 54 days in under 60 s, and heal-from-peers takes ~7 min for the same days), the
preset's own ETTR beside the report's "higher than 90 %", and one simulated day at 131,072 GPUs with
and without stragglers judged.

    python benchmarks/simulate_scale.py [--days 54] [--seed 0] [--skip-levers] [--peers-131k-days D]

Its record: benchmarks/records/simulate_scale.json.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import yaml  # noqa: E402

from benchmarks import records  # noqa: E402
from controller.sim.model import RAY_HEALTH_CHECK_FAILURES, RAY_HEALTH_CHECK_TIMEOUT_S  # noqa: E402
from controller.sim.run import fill, simulate  # noqa: E402
from controller.spec import parse_spec  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "llama3-405b-sim.yaml"
PRESET = EXAMPLE.with_name("llama3-405b-restart.yaml")
RAY_DETECTION_S = RAY_HEALTH_CHECK_FAILURES * RAY_HEALTH_CHECK_TIMEOUT_S
CODE = ["controller/sim/run.py", "controller/sim/model.py", "controller/sim/group.py", "controller/sim/cluster.py",
        "controller/state.py", "controller/failure_policy.py", "checkpointing/schedule.py", "health/straggler.py"]
"""What the simulations measure: the simulator's model, and the controller's decisions it drives."""


def variant(raw: dict, **changes: object) -> dict:
    out = copy.deepcopy(raw)
    for dotted, value in changes.items():
        node = out
        parts = dotted.split("__")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--days", type=float, default=54.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-levers", action="store_true", help="only the preset, both paths and 131k")
    parser.add_argument("--peers-131k-days", type=float, default=None,
                        help="simulated days of 131,072 GPUs healing from peers (default: --days; ~7 min for 54)")
    opts = parser.parse_args()
    raw = yaml.safe_load(EXAMPLE.read_text())
    figures: list[dict[str, Any]] = [] if opts.skip_levers else levers(raw, opts)
    paths, cost_models = preset_and_paths(opts)
    records.write("simulate_scale", figures + paths, code=CODE,
                  extra={"days": opts.days, "seed": opts.seed, "cost_models": cost_models})


def levers(raw: dict, opts: argparse.Namespace) -> list[dict[str, Any]]:
    """Print what each lever is worth on the example; its figures (one simulation each: one value)."""
    t = time.perf_counter()
    base = simulate(parse_spec(raw), days=opts.days, seed=opts.seed)
    wall = time.perf_counter() - t
    g = base["goodput"]
    print(f"{opts.days:g} simulated days, {base['gpus']} GPUs, {base['incidents']} incidents "
          f"({sum(base['failures_by_cause'].values())} interruptions of the run): {wall:.1f} s wall")
    print(f"ETTR with goodput's defaults: {base['ettr']:.4f} (MTTR {base['mttr_s']:.1f} s; decisions "
          f"{base['decisions']})")
    print("  badput: " + ", ".join(f"{k} {v / g['wall_seconds']:.3%}" for k, v in g["badput_seconds"].items() if v))
    figures = [records.figure("defaults: simulation wall", [wall], "s"),
               records.figure("defaults: incidents", [base["incidents"]], "count"),
               records.figure("defaults: interruptions", [sum(base["failures_by_cause"].values())], "count"),
               records.figure("defaults: ETTR", [base["ettr"]], "ratio"),
               records.figure("defaults: MTTR", [base["mttr_s"]], "s"),
               records.figure("defaults: steps done", [base["steps"]], "steps")]
    figures += [records.figure(f"defaults: badput, {k}", [v / g["wall_seconds"]], "ratio")
                for k, v in g["badput_seconds"].items() if v]

    rows = [
        ("spares 0", variant(raw, cluster__simulated__spares=0, cluster__simulated__nodes=2048)),
        ("spares 32", variant(raw, cluster__simulated__spares=32, cluster__simulated__nodes=2080)),
        ("node-loss detection 50 s (Ray's checks)", variant(raw, cost__node_loss_detection_s=RAY_DETECTION_S)),
        ("checkpoint every 50 steps", variant(raw, checkpoint__every_steps=50)),
        ("checkpoint every 500 steps", variant(raw, checkpoint__every_steps=500)),
        ("restart 300 s (a slow launch at scale)", variant(raw, cost__restart_s=300.0)),
    ]
    print(f"\n{'variant':<44}{'ETTR':>8}{'vs defaults':>13}{'MTTR s':>9}{'steps done':>12}{'vs defaults':>13}")
    cost = base["cost_model"]
    label = (f"defaults ({base['spares']} spares, {cost['node_loss_detection_s']:g} s, auto, "
             f"{cost['restart_s']:.0f} s restart)")
    print(f"{label:<44}{base['ettr']:>8.4f}{'':>13}{base['mttr_s']:>9.1f}{base['steps']:>12}")
    for name, r in rows:
        result = simulate(parse_spec(r), days=opts.days, seed=opts.seed)
        print(f"{name:<44}{result['ettr']:>8.4f}{result['ettr'] - base['ettr']:>+13.4f}"
              f"{result['mttr_s'] or 0:>9.1f}{result['steps']:>12}{result['steps'] / base['steps'] - 1:>+13.2%}")
        figures += [records.figure(f"{name}: ETTR", [result["ettr"]], "ratio"),
                    records.figure(f"{name}: ETTR vs the defaults (difference)", [result["ettr"] - base["ettr"]],
                                   "ratio"),
                    records.figure(f"{name}: MTTR", [result["mttr_s"] or 0], "s"),
                    records.figure(f"{name}: steps done", [result["steps"]], "steps"),
                    records.figure(f"{name}: steps done vs the defaults (relative)",
                                   [result["steps"] / base["steps"] - 1], "ratio")]
    return figures


def at_scale(raw: dict, dp: int) -> dict:
    """The preset's model on dp replicas of pp16 x tp8 (16 nodes each), 1.5 % spare nodes, the default
    restart for that world (the preset's published one is for 16,384 GPUs); dp, the batch and min_dp
    follow the nodes as `goodput simulate --fill` makes them."""
    nodes = dp * 16
    spares = max(2, nodes // 64)
    out = variant(raw, cluster__simulated__nodes=nodes + spares, cluster__simulated__spares=spares,
                  cluster__simulated__racks=max(1, (nodes + spares) // 32))
    fill(out, raw)
    out["cost"] = {k: v for k, v in (out.get("cost") or {}).items() if k != "restart_s"}
    return out


def preset_and_paths(opts: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, dict[str, float]]]:
    """Print the preset's figures, both recovery paths at three scales and a day at 131,072 GPUs; its
    figures (one simulation each: one value), and each path's days, restart and detection."""
    raw = yaml.safe_load(PRESET.read_text())
    preset = simulate(parse_spec(raw), days=opts.days, seed=opts.seed)
    print(f"\nLlama 3 preset ({PRESET.name}, restart {preset['cost_model']['restart_s']:.0f} s): ETTR "
          f"{preset['ettr']:.4f}, MTTR {preset['mttr_s']:.1f} s, {sum(preset['failures_by_cause'].values())} "
          f"interruptions; the report: 419 unexpected interruptions, ETTR higher than 0.90")
    figures = [records.figure("Llama 3 preset: ETTR", [preset["ettr"]], "ratio", goal="> 0.90 (the report)"),
               records.figure("Llama 3 preset: MTTR", [preset["mttr_s"]], "s"),
               records.figure("Llama 3 preset: interruptions", [sum(preset["failures_by_cause"].values())], "count",
                              goal="419 (the report)")]
    cost_models: dict[str, dict[str, float]] = {}
    print(f"\n{'GPUs':>8}{'path':>7}{'days':>6}{'restart s':>11}{'detect s':>10}{'ETTR':>8}{'MTTR s':>9}"
          f"{'interruptions':>15}{'wall s':>8}")
    for dp in (8, 128, 1024):
        for peers in (0, 1):
            # 131,072 ranks healing from peers: every recovery places buddies over every rank and agrees
            # on a step over what 16,384 nodes report (~0.1 s each, as a real controller would spend)
            days = opts.peers_131k_days if dp == 1024 and peers and opts.peers_131k_days else opts.days
            t = time.perf_counter()
            r = simulate(parse_spec(variant(at_scale(raw, dp), checkpoint__peer_every_steps=peers)),
                         days=days, seed=opts.seed)
            wall = time.perf_counter() - t
            print(f"{r['gpus']:>8}{'peers' if peers else 'store':>7}{days:>6g}{r['cost_model']['restart_s']:>11.1f}"
                  f"{r['cost_model']['node_loss_detection_s']:>10.1f}{r['ettr']:>8.4f}{r['mttr_s'] or 0:>9.1f}"
                  f"{sum(r['failures_by_cause'].values()):>15}{wall:>8.1f}"
                  + ("   <- goal: 54 days at 131,072 GPUs in < 60 s" if dp == 1024 and not peers else ""))
            row = f"{r['gpus']:,} GPUs, {'peers' if peers else 'store'}"
            figures += [records.figure(f"{row}: ETTR", [r["ettr"]], "ratio"),
                        records.figure(f"{row}: MTTR", [r["mttr_s"] or 0], "s"),
                        records.figure(f"{row}: interruptions", [sum(r["failures_by_cause"].values())], "count"),
                        records.figure(f"{row}: simulation wall", [wall], "s",
                                       goal="< 60" if dp == 1024 and not peers else None)]
            cost_models[row] = {"days": days, "restart_s": r["cost_model"]["restart_s"],
                                "node_loss_detection_s": r["cost_model"]["node_loss_detection_s"]}
            del r
    t = time.perf_counter()
    big = simulate(parse_spec(at_scale(raw, 1024)), days=1, seed=opts.seed)
    day = time.perf_counter() - t
    print(f"\n{big['gpus']:,} GPUs: one simulated day in {day:.1f} s ({sum(big['failures_by_cause'].values())} "
          f"interruptions, ETTR {big['ettr']:.4f})")
    # The same day with a tenth of the GPU incidents 2x stragglers instead, each judged by the real
    # tracker over every rank's samples for the steps after it strikes (the incidents differ: fewer
    # lost nodes, more slow ones; the wall times say what judging 131k ranks adds, roughly)
    judged = at_scale(raw, 1024)
    judged["failures"] = {**(judged.get("failures") or {}), "straggler_share": 0.1, "straggler_factor": 2.0}
    t = time.perf_counter()
    slow = simulate(parse_spec(judged), days=1, seed=opts.seed)
    with_judging = time.perf_counter() - t
    events = slow["_controller"].events
    flagged = [e for e in events if e.kind == "straggler"]
    print(f"  with {slow['incidents_by_component'].get('straggler', 0)} straggler incidents judged over all "
          f"{slow['gpus']:,} ranks: {with_judging:.1f} s, {with_judging / day:.2f}x the day without; "
          f"{len(flagged)} verdicts on {len({e.detail['rank'] for e in flagged})} ranks of "
          f"{len({e.detail['node'] for e in flagged})} nodes in {len({e.attempt for e in flagged})} attempts "
          f"(under straggler_action: report a slow node stays, and each attempt flags it anew)")
    day_label = f"{big['gpus']:,} GPUs, one simulated day"
    judged_label = f"{slow['gpus']:,} GPUs, one simulated day, stragglers judged"
    figures += [records.figure(f"{day_label}: simulation wall", [day], "s"),
                records.figure(f"{day_label}: interruptions", [sum(big["failures_by_cause"].values())], "count"),
                records.figure(f"{day_label}: ETTR", [big["ettr"]], "ratio"),
                records.figure(f"{judged_label}: simulation wall", [with_judging], "s"),
                records.figure(f"{judged_label}: wall / the day without", [with_judging / day], "ratio"),
                records.figure(f"{judged_label}: straggler incidents",
                               [slow["incidents_by_component"].get("straggler", 0)], "count"),
                records.figure(f"{judged_label}: verdicts", [len(flagged)], "count"),
                records.figure(f"{judged_label}: ranks flagged", [len({e.detail["rank"] for e in flagged})], "count"),
                records.figure(f"{judged_label}: nodes flagged", [len({e.detail["node"] for e in flagged})], "count"),
                records.figure(f"{judged_label}: attempts flagging", [len({e.attempt for e in flagged})], "count")]
    return figures, cost_models


if __name__ == "__main__":
    main()
