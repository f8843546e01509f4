"""What observability costs the controller.

1. Scrape: a Service with 4 runs of 64 ranks each (dp8 x tp8 on 8-GPU nodes, fake worker groups that
   report every rank's step, straggler scoring on), each `--steps` steps into its run, plus a failure
   and checkpoint commits. Time of one `/metrics` exposition (the collector and prometheus-client's
   text format, as Prometheus would fetch it), the first (folds the whole history) and the following
   ones, each after the runs went on for a 15 s scrape interval (only what is new is folded, but the
   clock has moved: the accounting is recomputed); side by side, the same for an idle service with no
   run, and the old figure at a frozen clock (where the accounting's cache answers). Its share of a
   15 s scrape interval is what a scrape costs the service.
2. Controller CPU per 1,000 step reports: the same runs driven poll by poll (controller step plus the
   registry save a driver does; a step per 0.2 s poll), CPU seconds per 1,000 rank reports, without
   and with a scrape every 15 simulated seconds, measured in alternating blocks; their ratio is what
   being scraped adds.

    python benchmarks/metrics_scrape.py [--steps 200]

Its record: benchmarks/records/metrics_scrape.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from benchmarks import records  # noqa: E402
from controller.run_state import RunState  # noqa: E402
from controller.service.metrics import ServiceCollector  # noqa: E402
from controller.service.registry import Registry  # noqa: E402
from controller.service.service import Service  # noqa: E402
from controller.spec import parse_spec  # noqa: E402
from tests.unit.fakes import FakeCluster, FakeWorkerGroup, ManualClock  # noqa: E402
from trainer.report import StepReport  # noqa: E402

RANKS, RUNS, NODES_PER_RUN = 64, 4, 8
CODE = ["controller/service/metrics.py", "controller/accounting.py", "controller/service/service.py",
        "controller/state.py", "controller/service/registry.py"]
"""What a scrape's figures measure: the collector, the accounting it reads, and the controller it runs beside."""


class Clock(ManualClock):
    pass


class MeshGroup(FakeWorkerGroup):
    """Reports one step of every rank per poll (rank 63, a last-stage rank, carries the loss)."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.next_step = 1

    def start(self, attempt):  # type: ignore[no-untyped-def]
        super().start(attempt)
        self.next_step = attempt.start_step + 1

    def poll(self):  # type: ignore[no-untyped-def]
        result = super().poll()
        step = self.next_step
        for rank in range(RANKS):
            result.reports.append(StepReport(
                rank=rank, attempt=self.started[-1].attempt, step=step, cursor=step * 64,
                loss=5.0 / step if rank == RANKS - 1 else None, step_time_s=POLL_S, data_s=0.001,
                compute_s=0.15 + 0.001 * (rank % 7), wait_s=0.04, tokens_per_s=5e5, end_time=self.clock()))
        if step % 20 == 0:
            result.events.append((0, "checkpoint_staged", {"step": step, "blocked_s": 0.3}))
            result.events.append((0, "checkpoint_committed", {"step": step, "uri": "file:///x", "bytes": 10**9,
                                                             "seconds": 4.0, "removed": []}))
        self.next_step += 1
        return result


def make_service(runs: int) -> tuple[Service, Clock, dict[str, MeshGroup]]:
    clock = Clock(1000.0)
    groups: dict[str, MeshGroup] = {}
    spares = max(runs, 1)
    nodes = max(runs, 1) * NODES_PER_RUN + spares  # one spare each (an idle service: one run's worth)
    raw = {"name": "bench", "model": {"n_layers": 4, "d_model": 256, "n_heads": 8, "vocab_size": 1024, "seq_len": 128},
           "train": {"steps": 10**6, "global_batch": 64, "micro_batch": 8, "lr": 1e-3, "seed": 0},
           "parallelism": {"dp": 8, "tp": 8, "pp": 1},
           "cluster": {"local": {"nodes": nodes, "gpus_per_node": 8, "racks": 4, "spares": spares}},
           "checkpoint": {"uri": "file:///tmp/goodput-bench-unused", "every_steps": 20}}
    spec = parse_spec(raw)

    def group(spec_, run_id):  # type: ignore[no-untyped-def]
        groups[run_id] = MeshGroup(clock)
        return groups[run_id]

    service = Service(Registry("sqlite://"), FakeCluster(spec.topology()), group_factory=group, clock=clock,
                      threads=False, store_factory=lambda _: None)
    for i in range(runs):
        service.add(parse_spec({**raw, "name": f"run-{i}"}))
    service.schedule()
    return service, clock, groups


POLL_S = 0.2
"""The service's driver poll interval; the fake mesh finishes a step per poll."""


def drive(service: Service, clock: Clock, polls: int) -> None:
    for _ in range(polls):
        clock.t += POLL_S
        for run_id, controller, _ in service.live_controllers():
            while controller.state not in (RunState.RUNNING,) and not controller.state.terminal:
                service.advance(run_id, clock.t)
            service.advance(run_id, clock.t)


def scrape_s(registry: CollectorRegistry, repeat: int, between: Callable[[], None] = lambda: None
             ) -> tuple[float, list[float], int]:
    """(first, each of the rest) seconds, and the bytes of one exposition; `between` runs untimed
    before each repeat (what happens in the run between two scrapes)."""
    t = time.perf_counter()
    body = generate_latest(registry)
    first = time.perf_counter() - t
    times = []
    for _ in range(repeat):
        between()
        t = time.perf_counter()
        generate_latest(registry)
        times.append(time.perf_counter() - t)
    return first, times, len(body)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    opts = parser.parse_args()

    service, clock, groups = make_service(RUNS)
    drive(service, clock, opts.steps)
    groups["run-1"].lose_node(service.controller("run-1").placement.node_of_rank[5])  # type: ignore[union-attr]
    drive(service, clock, 20)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServiceCollector(service))
    # Between two scrapes the runs go on for a 15 s scrape interval (75 polls): the clock moves and
    # new steps arrive, so each scrape recomputes what changed (a frozen clock lets the accounting's
    # cache answer every repeat: the old figure, printed beside it).
    _, frozen_times, _ = scrape_s(registry, 30)
    first, steady_times, size = scrape_s(registry, 10, between=lambda: drive(service, clock, int(15 / POLL_S)))
    idle_service, *_ = make_service(0)
    idle = CollectorRegistry(auto_describe=False)
    idle.register(ServiceCollector(idle_service))
    _, idle_times, idle_size = scrape_s(idle, 30)
    frozen, steady, idle_s = (statistics.median(t) for t in (frozen_times, steady_times, idle_times))
    series = sum(1 for line in generate_latest(registry).decode().splitlines() if line and not line.startswith("#"))
    print(f"scrape, {RUNS} runs x {RANKS} ranks at ~step {opts.steps}: first {first * 1e3:.1f} ms, then "
          f"{steady * 1e3:.2f} ms median ({size / 1024:.0f} KiB, {series} samples); idle service "
          f"{idle_s * 1e3:.2f} ms ({idle_size / 1024:.1f} KiB)")
    print(f"  ratio to the idle service {steady / idle_s:.1f}x; share of a 15 s scrape interval "
          f"{steady / 15:.2e}; at a frozen clock (the accounting cached) {frozen * 1e3:.2f} ms, "
          f"ratio live/frozen {steady / frozen:.2f}")

    # Controller CPU per 1,000 rank reports, alternating blocks without and with scrapes (every 15 s).
    collector_registry = registry
    without: list[float] = []
    with_scrape: list[float] = []
    block = 150
    for i in range(8):
        scraping = i % 2 == 1
        cpu = time.process_time()
        for poll in range(block):
            drive(service, clock, 1)
            if scraping and poll % int(15 / POLL_S) == int(15 / POLL_S) - 1:
                generate_latest(collector_registry)
        spent = time.process_time() - cpu
        (with_scrape if scraping else without).append(spent / (block * RUNS * RANKS) * 1000)
    a, b = statistics.median(without), statistics.median(with_scrape)
    print(f"controller CPU per 1,000 step reports (controller step + registry save): {a * 1e3:.1f} ms; with a "
          f"scrape every 15 s: {b * 1e3:.1f} ms; ratio {b / a:.3f}")
    figures = [records.figure("scrape: first exposition (folds the whole history)", [first * 1e3], "ms"),
               records.figure("scrape: exposition, the runs going on 15 s between",
                              [t * 1e3 for t in steady_times], "ms"),
               records.figure("scrape: exposition, an idle service", [t * 1e3 for t in idle_times], "ms"),
               records.figure("scrape: exposition at a frozen clock (the accounting cached)",
                              [t * 1e3 for t in frozen_times], "ms"),
               records.figure("scrape: live / idle service (medians)", [steady / idle_s], "ratio"),
               records.figure("scrape: share of a 15 s scrape interval", [steady / 15], "ratio"),
               records.figure("scrape: live / frozen clock (medians)", [steady / frozen], "ratio"),
               records.figure("scrape: exposition size", [size], "bytes"),
               records.figure("scrape: exposition size, an idle service", [idle_size], "bytes"),
               records.figure("scrape: samples in an exposition", [series], "count"),
               records.figure("controller: CPU per 1,000 step reports", [x * 1e3 for x in without], "ms"),
               records.figure("controller: CPU per 1,000 step reports, scraped every 15 s",
                              [x * 1e3 for x in with_scrape], "ms"),
               records.figure("controller: CPU scraped / not (medians)", [b / a], "ratio")]
    records.write("metrics_scrape", figures, code=CODE, extra={"runs": RUNS, "ranks": RANKS, "steps": opts.steps})


if __name__ == "__main__":
    main()
