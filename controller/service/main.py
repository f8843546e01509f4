"""Where Ray and the service meet: `goodput serve` (the long-lived service) and `goodput run` (one run
in the foreground, as the one run of a service that takes no submissions), each on an embedded or joined
Ray cluster.

`goodput serve`: the long-lived service. One Ray cluster (embedded, or joined with --address), the
registry under --state-dir (or --db), the REST API on --host:--port, until SIGTERM or Ctrl-C.

Stopping (or dying) leaves unfinished runs unfinished in the registry; the next `goodput serve` on the
same state dir carries them on. The token is never printed, only where it is kept.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from checkpointing.store import StoreError
from controller.planner import plan_local
from controller.spec import RunSpec, SpecError, checkpoint_store, probe_store
from controller.topology import Topology

if TYPE_CHECKING:
    from controller.ray.cluster import LocalRayCluster, RemoteRayCluster
    from controller.service.registry import Registry
    from controller.service.service import Service
    from controller.state import RunController


EMBEDDED_CLUSTER = {"nodes": 5, "gpus_per_node": 2, "racks": 2, "spares": 1}
"""`goodput serve`'s embedded cluster by default: the one `make run` trains on (examples/tiny-gpt.yaml's
cluster.local), so the README's example fits the README's service."""


@dataclass
class ServeOptions:
    host: str
    port: int
    state_dir: str
    db: str | None
    address: str | None
    local_nodes: int
    gpus_per_node: int
    racks: int
    spares: int
    gpu_memory_gb: float
    poll_s: float = 0.2
    kubernetes: str = "auto"
    standby: bool = False
    """Another service leads the registry: wait as its standby and take over when it is gone (else refuse)."""
    """auto: on when running in a pod with a service account; on; off."""
    rack_label: str = "topology.kubernetes.io/zone"
    domain_label: str = "nvidia.com/gpu.clique"
    advertise_host: str = "127.0.0.1"
    """This process's address as the ranks reach it (their rendezvous store)."""
    repair_after_s: float | None = 5.0
    """Embedded cluster: a killed node comes back this long after (None: never)."""
    oidc: dict[str, Any] | None = None
    """An identity provider whose JWTs are accepted beside goodput tokens: controller/service/oidc.py's
    OidcSettings (issuer, audience, jwks, team_claim, role_claim)."""


def log(message: str) -> None:
    print(f"goodput serve: {message}", file=sys.stderr, flush=True)


def serve_forever(opts: ServeOptions) -> int:
    from controller.service.auth import TOKEN_ENV
    from controller.ray.cluster import LocalRayCluster, RemoteRayCluster, make_cluster
    from controller.service.app import ApiServer, create_app
    from controller.service.oidc import OidcSettings, OidcVerifier
    from controller.service.auth import check_bind, ensure_token
    from controller.service.registry import Registry, safe_url, sqlite_url
    from controller.spec import LocalClusterSpec

    state = Path(opts.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    os.chmod(state, 0o700)
    explicit = os.environ.get(TOKEN_ENV) or None
    check_bind(opts.host, explicit)
    token, path, made = ensure_token(state, explicit)
    if path is not None:
        log(f"admin API token {'made and kept' if made else 'read from'} {path} (owner-only; send it as "
            "'Authorization: Bearer <token>', or set GOODPUT_TOKEN; `goodput tokens create` makes tokens for others)")
    else:
        log(f"admin API token from {TOKEN_ENV}")
    registry = Registry(opts.db or sqlite_url(opts.state_dir), migrate=False)  # migrated once this one leads
    log(f"registry {safe_url(registry.url)}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    cluster = make_cluster(opts.address, LocalClusterSpec(nodes=opts.local_nodes, gpus_per_node=opts.gpus_per_node,
                                                           racks=opts.racks, spares=opts.spares,
                                                           gpu_memory_gb=opts.gpu_memory_gb),
                           log_dir=os.path.join(state, "logs"), repair_after_s=opts.repair_after_s,
                           node_ip=opts.advertise_host)
    # Lead before anything of a service that may already run here is touched.
    if opts.standby and not registry.lead(wait_s=0):
        if isinstance(cluster, RemoteRayCluster):
            cluster.prepare()  # joins as a node now: taking over then waits for no raylet
        if not _stand_by(registry, cluster, opts, stop):
            registry.close()
            return 0 if stop.is_set() else 4  # told to stop, or the lock was lost again before it drove
    else:
        registry.lead()
    registry.migrate()
    if isinstance(cluster, LocalRayCluster):
        log(f"the embedded Ray cluster's own logs: {cluster.processes_log}; a killed node "
            + (f"comes back after {opts.repair_after_s:g} s" if opts.repair_after_s is not None else "stays lost"))
    if not opts.address:
        reap_leftovers(state)
    server = service = None
    try:
        cluster.start()
        if isinstance(cluster, LocalRayCluster):
            record_processes(state, cluster.folders())
        log(f"cluster {'at ' + opts.address if opts.address else 'embedded'}: "
            f"{sum(n.num_gpus for n in cluster.topology().nodes)} GPU slot(s)")
        node_actions = None
        if _kubernetes_enabled(opts.kubernetes):
            from controller.k8s.cluster import KubeTopologyCluster
            from controller.k8s.nodes import KubeNodes

            kube = KubeNodes.from_service_account()
            cluster = KubeTopologyCluster(cluster, kube, rack_label=opts.rack_label,  # type: ignore[assignment]
                                          domain_label=opts.domain_label or None)
            node_actions = kube
            log(f"Kubernetes: a quarantine cordons and taints the node (goodput nodes release NODE undoes it); "
                f"racks from node labels {opts.domain_label or '-'} / {opts.rack_label}")
        service = ray_service(registry, cluster, poll_s=opts.poll_s, node_actions=node_actions,
                              store_host=opts.advertise_host, relative_root=state).start()
        carried = [r["id"] for r in service.runs() if r["state"] not in ("succeeded", "failed", "cancelled")]
        if carried:
            log(f"carrying on {len(carried)} unfinished run(s): {', '.join(carried)}")
        oidc = OidcVerifier(OidcSettings(**opts.oidc)) if opts.oidc is not None else None
        if oidc is not None:
            s = oidc.settings
            log(f"identity provider {s.issuer} (audience {s.audience}): its tokens name a team ({s.team_claim}) "
                f"and a role ({s.role_claim})")
        server = ApiServer(create_app(service, token=token, oidc=oidc), opts.host, opts.port).start()
        log(f"API on {server.url} (GOODPUT_URL={server.url})")
        since: float | None = None  # when the cluster stopped answering, or every run's heartbeats
        asked = checked = 0.0
        reach = Asked(service.reaches_cluster)
        while not stop.wait(0.5):
            now = time.monotonic()
            if now - checked >= LEAD_CHECK_S:
                checked = now
                if not registry.still_leads():
                    service.lead_lost(registry.lost_lead or "lost")
                    log(f"lost the registry's lock ({registry.lost_lead}): another service may lead now; "
                        "stopping at once without touching the runs (the leader re-attaches to them)")
                    return 4
            if service.lost_cluster is None and now - asked >= CLUSTER_CHECK_S:
                asked = now
                cut = "its GCS does not answer" if not reach(timeout_s=1.0) else service.isolated()
                since = None if cut is None else (since or now)
                if since is not None and registry.standby_waiting and now - since >= YIELD_AFTER_S:
                    service.cluster_lost(f"cut off from the Ray cluster at {opts.address or 'embedded'} for "
                                         f"{now - since:.0f} s ({cut}) while a standby that reaches it waits: "
                                         "yielding the lock and the runs to it")
                elif since is not None and now - since >= LOST_AFTER_S:
                    service.cluster_lost(f"cut off from the Ray cluster at {opts.address or 'embedded'} for "
                                         f"{now - since:.0f} s ({cut})")
            if service.lost_cluster is not None:
                log(f"lost the Ray cluster ({service.lost_cluster}): stopping without touching the runs; "
                    "a service started again re-attaches to them")
                return 3
            if isinstance(cluster, LocalRayCluster):  # repairs start raylets: only this thread may
                repaired = cluster.repair_due()
                for name in repaired:
                    log(f"node {name} repaired (its raylet started again)")
                if repaired:  # its new processes too must be ended by a service started after a kill
                    record_processes(state, cluster.folders())
        log("stopping; unfinished runs go on when a service starts again on this state dir")
    finally:
        if server is not None:
            server.stop()
        if service is not None:
            service.stop()
        registry.close()
        if service is not None and service.lost_cluster is not None:
            _leave(cluster)
        else:
            cluster.shutdown()
        (state / PIDS_FILE).unlink(missing_ok=True)
    return 0


def _leave(cluster: "LocalRayCluster | RemoteRayCluster") -> None:
    """End this process without waiting on a cluster it cannot reach: a driver's goodbye to a GCS
    that does not answer waits for a minute (and Ray asks again at exit). The lock is released
    already; the runs are left as they are for the service that leads now."""
    done = threading.Thread(target=cluster.shutdown, daemon=True, name="goodput-leave")
    done.start()
    done.join(LEAVE_WAIT_S)
    if done.is_alive():
        log(f"the cluster did not answer this driver's goodbye within {LEAVE_WAIT_S:g} s: ending without it")
        sys.stderr.flush()
        os._exit(3)


def _stand_by(registry: "Registry", cluster: "LocalRayCluster | RemoteRayCluster", opts: ServeOptions,
              stop: threading.Event) -> bool:
    """Wait as the standby of the service that leads `registry`: /healthz answers (the process is
    alive), /readyz and everything else say 503 (a Kubernetes Service sends it nothing), until the
    leader is gone and this one leads (True; LEAD_FENCE_S after it took the lock), or until told to
    stop or the lock is lost again meanwhile (False). It offers itself (`Registry.offer_standby`), and
    takes the lock, only while it reaches the cluster: a leader cut off from the cluster yields to it."""
    from controller.ray.cluster import RemoteRayCluster
    from controller.service.app import ApiServer, standby_app
    from controller.service.registry import safe_url

    server = ApiServer(standby_app(), opts.host, opts.port).start()
    log(f"standby: another goodput serve leads {safe_url(registry.url)}; this one takes over when it is gone "
        f"(until then {server.url} answers /healthz only)")
    since = time.monotonic()
    reach = Asked(cluster.gcs_answers if isinstance(cluster, RemoteRayCluster) else lambda: True)
    ready, asked = False, 0.0
    try:
        while not stop.wait(0.2):
            if time.monotonic() - asked >= CLUSTER_CHECK_S:
                asked = time.monotonic()
                if ready != reach(timeout_s=1.0):
                    ready = not ready
                    log("standby: " + ("reaches the cluster: ready to take over" if ready else
                                       "does not reach the cluster: it takes over nothing until it does"))
                registry.offer_standby(ready)
            if ready and registry.lead(wait_s=0):
                registry.offer_standby(False)
                # A leader whose lock's session was ended (not its process) may drive for up to
                # LEAD_CHECK_S more before it notices: act only once it has surely stopped.
                if stop.wait(LEAD_FENCE_S):
                    return False
                if not registry.still_leads():
                    log(f"lost the registry's lock again before driving anything ({registry.lost_lead})")
                    return False
                log(f"leading now, after {time.monotonic() - since:.1f} s as standby: taking over its runs")
                return True
        return False
    finally:
        server.stop()


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
        return RayWorkerGroup(collective_timeout_s=spec.health.collective_timeout_s, interface=spec.cluster.interface,
                              name=run_id if accept_submissions else None, store_host=store_host)

    def injector(g: Any) -> RayDrillInjector:
        return RayDrillInjector(cluster, g)

    return Service(registry, cluster, group_factory=group, injector_factory=injector,
                   store_factory=lambda spec: checkpoint_store(spec, probe=False), store_probe=probe_store, view=view,
                   accept_submissions=accept_submissions, poll_s=poll_s,
                   node_actions=node_actions, relative_root=relative_root)


def preflight(spec: RunSpec) -> None:
    """Everything that can be checked without a cluster, so bad input starts nothing: the spec itself
    first (its own errors are the ones to fix), then that the checkpoints already under the run's name
    (which it resumes) are of its model."""
    from checkpointing.manifest import CheckpointError, IdentityMismatch, check_identity, committed_steps, read_manifest
    from trainer.config import state_fingerprint, state_identity

    if spec.cluster.address is None:
        plan_local(spec)
    elif (fixed := spec.fixed_mesh()) is not None:
        spec.trainer_config(fixed)
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


@contextlib.contextmanager
def _ctrl_c_between_polls() -> Iterator[threading.Event]:
    """Ctrl-C (SIGINT) noted in the event, not raised wherever the main thread happens to be: `goodput
    run` raises it at its next poll of the run, from inside the run's lock, which it then leaves as an
    exception leaves a `with` block. Raised where it lands, it could land inside RunLock.acquire after
    the lock was taken and before it was counted: the main thread then held the run's lock for good,
    the run's driver thread waited on it, and the run never ended (`goodput run` hung after Ctrl-C:
    tests/cluster/test_cancel.py saw it once). Outside the main thread, where no signal handler can
    be set, nothing changes."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def run_foreground(spec: RunSpec, *, on_tick: "Callable[[RunController], None] | None" = None, api: tuple[str, int] | None = None,
                   api_any_port: bool = False, on_api: Callable[[str], None] | None = None,
                   token: str | None = None, log_dir: str | None = None) -> dict[str, Any]:
    """Start the cluster, run, stop the cluster; the final Run object. The run is the one run of a
    service that takes no submissions; with `api` (host, port) its REST API serves the run while it
    lasts (its URL goes to `on_api`); `api_any_port`: if that port is taken, a free one; `log_dir`:
    where an embedded cluster's processes write their own output."""
    from controller.ray.cluster import make_cluster
    from controller.ray.runner import spec_view
    from controller.service.app import create_app, serve
    from controller.service.registry import Registry

    preflight(spec)
    cluster = make_cluster(spec.cluster.address, spec.cluster.local, log_dir=log_dir)
    cluster.start()
    server = None
    registry = Registry("sqlite://")
    service = ray_service(registry, cluster, view=lambda t: spec_view(t, spec), accept_submissions=False)
    try:
        with _ctrl_c_between_polls() as interrupted:
            def tick(controller: RunController) -> None:
                if interrupted.is_set():
                    raise KeyboardInterrupt
                if on_tick is not None:
                    on_tick(controller)

            service.start()
            run_id = service.add(spec)["id"]
            if api is not None:
                server = serve(create_app(service, token=token), *api, any_port=api_any_port)
                if on_api is not None:
                    on_api(server.url)
            try:
                service.wait(run_id, on_tick=tick)
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


def _kubernetes_enabled(mode: str) -> bool:
    from controller.k8s.nodes import in_cluster

    if mode == "on" and not in_cluster():
        raise SystemExit("goodput serve: --kubernetes on, but this is not a pod with a service account "
                         "(no KUBERNETES_SERVICE_HOST or token); use --kubernetes off or auto")
    return mode == "on" or (mode == "auto" and in_cluster())


class Asked:
    """A yes-or-no question asked on a thread of its own and waited for a while only: a process cut
    off from its cluster may wait a minute for Ray's answer, and the loop that must notice the cut
    cannot. A question still unanswered is not asked twice; its answer counts when it comes. The
    thread is a daemon: a question still hanging never holds the process's exit."""

    def __init__(self, question: Callable[[], bool]) -> None:
        self.question = question
        self._answered = threading.Event()
        self._answer = False
        self._asking: threading.Thread | None = None

    def _ask(self) -> None:
        try:
            self._answer = bool(self.question())
        except Exception:  # noqa: BLE001 - failing to ask is an answer: no
            self._answer = False
        self._answered.set()

    def __call__(self, *, timeout_s: float) -> bool:
        if self._asking is None:
            self._answered.clear()
            self._asking = threading.Thread(target=self._ask, daemon=True, name="goodput-ask")
            self._asking.start()
        if not self._answered.wait(timeout_s):
            return False
        self._asking = None
        return self._answer


LEAD_CHECK_S = 2.0
"""How often a leading service asks the registry whether its lock is still its own."""
LEAD_FENCE_S = 6.0
"""How long a standby that took the lock waits before it drives: longer than a leader that lost it
takes to notice (LEAD_CHECK_S, plus the check's own 3 s timeout) and stop."""
CLUSTER_CHECK_S = 1.0
"""How often the service asks whether it still reaches its Ray cluster."""
LOST_AFTER_S = 30.0
"""A cluster that has not answered for this long is lost: the process ends (exit 3) without touching
its runs, so a supervisor's restart re-attaches (a GCS restarting with fault tolerance is back sooner)."""
YIELD_AFTER_S = 5.0
"""How long a leader cut off from its cluster (its GCS unanswered, or no heartbeat from any run)
waits when a standby that reaches the cluster stands by: then it releases the lock and ends (exit 3),
and the standby takes over LEAD_FENCE_S after. A cut shorter than this (a blip) is ridden out."""

LEAVE_WAIT_S = 5.0
"""How long a service that lost its cluster waits for its driver's goodbye before it ends without it."""

PIDS_FILE = "embedded-cluster.pids"
"""The embedded cluster's processes (pid and start time), so that a service started after one that
was killed can end what the dead one left running: Ray's per-node agents outlive their raylets."""


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def record_processes(state: Path, folders: list[str]) -> None:
    """The embedded cluster's processes and its folders outside the state dir (Ray's session folder, the
    nodes' peer snapshots in host memory), for `reap_leftovers`."""
    rows = [f"dir {folder}" for folder in folders]
    if Path("/proc").is_dir():
        rows += [f"{pid} {start}" for pid in _descendants(os.getpid()) if (start := _start_time(pid)) is not None]
    (state / PIDS_FILE).write_text("\n".join(rows) + "\n")


def reap_leftovers(state: Path) -> None:
    """SIGKILL the processes a previous service on this state dir started and left running (the same
    pid with the same start time, so a reused pid is never hit), then remove its cluster's folders
    (Ray's session, the peer snapshots it held in host memory)."""
    path = state / PIDS_FILE
    if not path.exists():
        return
    ended = 0
    rows = path.read_text().splitlines()
    for row in rows:
        pid_text, _, start = row.partition(" ")
        if not pid_text.isdigit() or _start_time(int(pid_text)) != start:
            continue
        try:
            os.kill(int(pid_text), signal.SIGKILL)
            ended += 1
        except ProcessLookupError:
            pass
    if ended:
        log(f"ended {ended} process(es) of the embedded cluster a killed service left running")
    from controller.ray.cluster import FOLDER_PREFIX

    folders = [Path(row[4:]) for row in rows if row.startswith("dir ")]
    for folder in folders:  # only what an embedded cluster makes: a stray line names nothing else
        if folder.is_absolute() and folder.name.startswith(FOLDER_PREFIX):
            shutil.rmtree(folder, ignore_errors=True)
    path.unlink()


