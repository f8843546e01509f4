"""`goodput run`: one run in the foreground, on the embedded local cluster or a given Ray cluster.

Starts (or joins) the cluster, drives the run controller until it ends, and always cleans up:
actors, placement groups and the embedded cluster are gone when this returns or raises,
Ctrl-C included.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from checkpointing.store import ObjectStore, StoreError, open_store
from controller.placement import Placement
from controller.planner import MeshPlan
from controller.ray.cluster import LocalRayCluster, RemoteRayCluster
from controller.spec import LocalClusterSpec, RunSpec, SpecError
from controller.planner import plan_run
from controller.state import RunController, RunState
from controller.topology import Topology, local_roles

if TYPE_CHECKING:
    from controller.service.registry import Registry
    from controller.service.service import Service

Tick = Callable[[RunController], None]


def checkpoint_store(spec: RunSpec, *, probe: bool = True) -> ObjectStore:
    """The spec's checkpoint store (a local path made absolute: actors do not share our cwd), proven
    writable by a probe object unless told not to (the service probes on its own, with a deadline)."""
    uri = spec.checkpoint.uri
    try:
        store = open_store(uri)
    except StoreError as e:
        raise SpecError(f"checkpoint.uri {uri!r}: {e}") from None
    if probe:
        probe_store(store, uri)
    return store


def probe_store(store: ObjectStore, uri: str) -> None:
    """Write and delete a probe object; SpecError says why the store cannot be written."""
    try:
        key = f".goodput-write-test-{time.time_ns()}"
        store.put_bytes(key, b"ok")
        store.delete_prefix(key)
    except StoreError as e:
        raise SpecError(f"checkpoint.uri {uri!r} cannot be written: {e}") from None
    except OSError as e:
        raise SpecError(f"checkpoint.uri {uri!r} cannot be written: {e.strerror}") from None


def spec_view(topology: Topology, spec: RunSpec) -> Topology:
    """On an embedded cluster the spec says which nodes the run has (node-0..N-1) and which of them
    are spares (the last `spares`); raylets beyond them (a shared test cluster) are not the run's."""
    local = spec.cluster.local
    if spec.cluster.address or local is None:
        return topology
    ours = local_roles(local.nodes, local.spares)
    return Topology(tuple(replace(n, state=ours[n.name]) for n in topology.nodes if n.name in ours))


def make_cluster(spec: RunSpec, *, log_dir: str | None = None) -> LocalRayCluster | RemoteRayCluster:
    if spec.cluster.address:
        return RemoteRayCluster(spec.cluster.address)
    return LocalRayCluster(spec.cluster.local or LocalClusterSpec(), log_dir=log_dir)


def drive(spec: RunSpec, cluster: LocalRayCluster | RemoteRayCluster, *, on_tick: Tick | None = None,
          poll_s: float = 0.2, warm_workers: bool = True) -> RunController:
    """Run the spec on a started cluster until the run ends, in this thread (tests and benchmarks drive
    one run this way; `goodput run` and `goodput serve` go through a Service). Cancel on Ctrl-C (and
    re-raise). `warm_workers=False` starts fresh actors for every attempt (the slower mechanism, kept to be
    measured against: benchmarks/recovery_drills.py)."""
    from controller.ray.drills import RayDrillInjector
    from controller.ray.worker_group import RayWorkerGroup

    store = checkpoint_store(spec)
    group = RayWorkerGroup(collective_timeout_s=spec.health.collective_timeout_s, warm=warm_workers)

    def topology() -> Topology:
        return spec_view(cluster.topology(), spec)

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


def plan_local(spec: RunSpec) -> tuple[MeshPlan, Placement]:
    """Plan and place on the spec's `cluster.local`; SpecError says what does not fit."""
    return plan_run(spec, spec.topology())


def preflight(spec: RunSpec) -> None:
    """Everything that can be checked without a cluster, so bad input starts nothing: among it, that
    the checkpoints already under the run's name (which it resumes) are of its model."""
    from checkpointing.manifest import CheckpointError, IdentityMismatch, check_identity, committed_steps, read_manifest
    from trainer.config import state_fingerprint, state_identity

    store = checkpoint_store(spec)
    try:
        steps = committed_steps(store, spec.name)
        if steps:
            model = spec.to_model_config()
            check_identity(read_manifest(store, spec.name, steps[-1]), state_fingerprint(model),
                           state_identity(model), store.uri)
    except IdentityMismatch as e:
        raise SpecError(str(e)) from None
    except (CheckpointError, StoreError):
        pass  # unreadable or unreachable now: the run's own checkpoint search decides, with retries
    if spec.cluster.address is None:
        plan_local(spec)
    elif (fixed := spec.fixed_mesh()) is not None:
        spec.trainer_config(fixed)


def ray_service(registry: "Registry", cluster: LocalRayCluster | RemoteRayCluster, *,
                view: Callable[[Topology], Topology] | None = None, accept_submissions: bool = True,
                poll_s: float = 0.2, node_actions: Any = None, store_host: str = "127.0.0.1",
                relative_root: Path | None = None) -> "Service":
    """A service whose runs train on `cluster` with Ray worker groups (goodput serve, goodput run).
    `store_host`: the address of this process the ranks reach for their rendezvous store (on
    Kubernetes, the controller pod's IP). `relative_root`: where submitted relative checkpoint paths
    land (goodput serve: its state dir)."""
    from controller.ray.drills import RayDrillInjector
    from controller.ray.worker_group import RayWorkerGroup
    from controller.service.service import Service

    def group(spec: RunSpec, run_id: str) -> RayWorkerGroup:
        # A long-lived service names its runs' actors so that they outlive it and it can re-attach.
        return RayWorkerGroup(collective_timeout_s=spec.health.collective_timeout_s,
                              name=run_id if accept_submissions else None, store_host=store_host)

    def injector(g: Any) -> RayDrillInjector:
        return RayDrillInjector(cluster, g)

    return Service(registry, cluster, group_factory=group, injector_factory=injector,
                   store_factory=functools.partial(checkpoint_store, probe=False), store_probe=probe_store, view=view, accept_submissions=accept_submissions, poll_s=poll_s,
                   node_actions=node_actions, relative_root=relative_root)


def run_foreground(spec: RunSpec, *, on_tick: Tick | None = None, api: tuple[str, int] | None = None,
                   api_any_port: bool = False, on_api: Callable[[str], None] | None = None,
                   token: str | None = None, log_dir: str | None = None) -> dict[str, Any]:
    """Start the cluster, run, stop the cluster; the final Run object. The run is the one run of a
    service that takes no submissions; with `api` (host, port) its REST API serves the run while it
    lasts (its URL goes to `on_api`); `api_any_port`: if that port is taken, a free one; `log_dir`:
    where an embedded cluster's processes write their own output."""
    from controller.service.app import create_app, serve
    from controller.service.registry import Registry

    preflight(spec)
    cluster = make_cluster(spec, log_dir=log_dir)
    cluster.start()
    server = None
    registry = Registry("sqlite://")
    service = ray_service(registry, cluster, view=lambda t: spec_view(t, spec), accept_submissions=False)
    try:
        service.start()
        run_id = service.add(spec)["id"]
        if api is not None:
            server = serve(create_app(service, token=token), *api, any_port=api_any_port)
            if on_api is not None:
                on_api(server.url)
        try:
            service.wait(run_id, on_tick=on_tick)
        except BaseException:
            service.cancel(run_id)
            service.wait(run_id, timeout_s=60)
            raise
        return service.controller(run_id).to_dict(time.time())
    finally:
        if server is not None:
            server.stop()
        service.stop()
        registry.close()
        cluster.shutdown()
