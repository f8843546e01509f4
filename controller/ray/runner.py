"""Driving one run on a Ray cluster in this thread (tests and benchmarks; `goodput run` and `goodput
serve` go through a Service: controller/service/main.py), and the view of an embedded cluster a spec
gives its run."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from controller.ray.cluster import LocalRayCluster, RemoteRayCluster
from controller.run_state import RunState
from controller.spec import RunSpec, checkpoint_store
from controller.state import RunController
from controller.topology import Topology, local_roles


Tick = Callable[[RunController], None]


def spec_view(topology: Topology, spec: RunSpec) -> Topology:
    """On an embedded cluster the spec says which nodes the run has (node-0..N-1) and which of them
    are spares (the last `spares`); raylets beyond them (a shared test cluster) are not the run's."""
    local = spec.cluster.local
    if spec.cluster.address or local is None:
        return topology
    ours = local_roles(local.nodes, local.spares)
    return Topology(tuple(replace(n, state=ours[n.name]) for n in topology.nodes if n.name in ours))


def drive(spec: RunSpec, cluster: LocalRayCluster | RemoteRayCluster, *, on_tick: Tick | None = None,
          poll_s: float = 0.2, warm_workers: bool = True) -> RunController:
    """Run the spec on a started cluster until the run ends, in this thread (tests and benchmarks drive
    one run this way; `goodput run` and `goodput serve` go through a Service). Cancel on Ctrl-C (and
    re-raise). `warm_workers=False` starts fresh actors for every attempt (the slower mechanism, kept to be
    measured against: benchmarks/recovery_drills.py)."""
    from controller.ray.drills import RayDrillInjector
    from controller.ray.worker_group import RayWorkerGroup

    from controller.providers import with_model_numbers

    spec = with_model_numbers(spec)
    store = checkpoint_store(spec)
    group = RayWorkerGroup(collective_timeout_s=spec.health.collective_timeout_s, warm=warm_workers,
                           interface=spec.cluster.interface)

    def topology(within_s: float | None = None) -> Topology:
        return spec_view(cluster.topology(within_s), spec)

    controller = RunController(spec, topology(), group, now=time.time(), checkpoint_store=store,
                               injector=RayDrillInjector(cluster, group), topology_source=topology)

    def advance() -> RunState:
        return controller.step(time.time())

    try:
        while True:
            before = controller.state
            ended = advance().terminal
            if on_tick is not None:
                on_tick(controller)  # the last step's events too
            if ended:
                break
            if controller.state is RunState.RUNNING or controller.state is before:  # nothing spins
                time.sleep(poll_s)
    except BaseException:
        controller.cancel()
        advance()
        raise
    finally:
        group.close()
    return controller
