"""Ray at the edge: start the embedded local cluster, or join an existing one, and read its topology.

The embedded cluster is several raylets on this machine (Ray's own multi-node test facility), one per
node of `cluster.local`, each declaring its GPU slots and the labels `node` and `rack`; spare nodes
carry `spare=true`. Everything binds to 127.0.0.1, lives under its own RAY_TMPDIR, and detects a dead
raylet in ~1.5 s instead of Ray's default ~13 s (measured facts in DESIGN.md). Killing a node is
SIGKILL of its raylet, the same thing a real node loss does. Its nodes share one import of torch and
the trainer (controller/ray/host_image.py, started with the cluster and ended by its PID).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import socket
import subprocess
import tempfile
import threading
import time
from types import MappingProxyType
from typing import Any, Iterator, Mapping

from checkpointing.peer import ROOT_ENV, peer_base
from controller.errors import ClusterError
from controller.ray import host_image
from controller.ray.host_image import HOST_IMAGE_ENV
from controller.ray.registration import prompt_registration
from controller.spec import LocalClusterSpec
from controller.topology import Node, NodeState, Topology, local_roles

FAST_HEALTH_CHECK: Mapping[str, int] = MappingProxyType({
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
    "health_check_initial_delay_ms": 0,
})
"""Period x threshold + timeout ~ 2 s from a raylet's death to Ray marking the node dead. Read-only: Ray
adds the session's object-spilling folder to the `_system_config` it is given, and when that was this
constant, every later cluster of the process (and every `ray start --system-config` made from it)
spilled into the first cluster's session folder, removed with it and made again, never to be removed."""
DEPLOYED_HEALTH_CHECK = {
    "health_check_period_ms": 2000,
    "health_check_timeout_ms": 2000,
    "health_check_failure_threshold": 5,
}
"""The Ray cluster deploy/ renders (its head's RAY_* environment): a node is dead to Ray ~10-12 s
after its raylet stops answering (Ray's default: ~30 s). goodput does not wait for it (its own
heartbeats declare a dark node lost in ~1.4 s); Ray's verdict frees the dead node's actors and
resources, and lets a repaired host rejoin. The cost: the GCS sends one health RPC per node every
2 s (1,024/s at 2,048 nodes, 1.5 times Ray's default rate), and a raylet that stalls for 10 s (a
host swapping, a GCS overloaded) is declared dead for good: its actors end, and it must rejoin."""
DEFAULT_GPU_MEMORY_GB = 80.0

QUIET_RAY_ENV = {"RAY_enable_metrics_collection": "0", "REPORTER_UPDATE_INTERVAL_MS": "60000",
                 "RAY_prestart_worker_first_driver": "0"}
"""What the embedded cluster turns off of Ray: on a machine that runs every node, it is CPU the ranks
do not get, and goodput uses none of it.
- Every Ray process records and exports its metrics (`enable_metrics_collection`): goodput's metrics
  are its own exporter's.
- Every node's dashboard agent reads every worker's psutil figures every 5 s (60 s here).
- Every raylet starts a Python worker per CPU when the first driver connects
  (`prestart_worker_first_driver`): rank actors start their own, and those of the head and the spares
  sat idle for the cluster's life (each ~1.7 CPU-s to start, then ~0.5 % of a core).
Measured with all nodes on 2 cores: an idle 5-node cluster's agents went from 7.8 % to 1.6 % of a
core and its idle workers from 1.5 % to none; a training step of make run's mesh spent 3.4 % of its
CPU in the agents before, 1.1 % after; a first run on a fresh cluster ended 42.4 s after it was
asked for (47.5 s before), a warm one in 19.8-25.0 s (25.5-25.7 s).
A deployed cluster (deploy/) keeps Ray's defaults: its operators may read Ray's dashboard."""

PROMPT_RAY_ENV = {"RAY_raylet_client_connect_timeout_milliseconds": "100",
                  "RAY_raylet_client_num_connect_attempts": "100"}
"""A Ray process that connects to a local socket not there yet tries again after 1 s, 10 times (Ray's
default): a raylet connecting to its own object store at start often misses once (the store's thread
is not up on a loaded 2-core machine), and its node then started in ~1.9 s, not ~0.85 s. Here it tries
every 0.1 s, 100 times: the same 10 s before it gives up. Measured: 5-node starts of 6.7-7.9 s (4 runs)
against 7.0-12.4 s (4 runs, alternating), no node over 1.1 s against 13 of 20 at 1.9-2.0 s."""

QUIET_HEAD: Mapping[str, bool] = MappingProxyType({"include_log_monitor": False, "no_monitor": True})
"""What the embedded cluster's head starts without, each a Python process importing Ray (~0.33 CPU-s
each of the cluster's start on 2 cores, measured): the log monitor (it sends the workers' output to
drivers, and goodput's driver connects with log_to_driver=False; the files stay) and the autoscaler's
monitor (the embedded cluster's nodes are fixed). A deployed cluster (deploy/) keeps both."""


def _ray():  # type: ignore[no-untyped-def]
    import ray

    return ray


class _RayClusterBase:
    """What both kinds of cluster share: the topology read from Ray, and leaving Ray."""

    def topology(self, within_s: float | None = None) -> Topology:
        """What Ray shows (ClusterSilent when its GCS does not say within `within_s`: liveness.node_table)."""
        return topology_from_ray(within_s)

    def connected(self) -> bool:
        """Whether this process still reaches the cluster (one round trip to Ray's GCS). A Ray Client
        whose connection was lost for longer than its reconnect grace (30 s) is not, for good."""
        ray = _ray()
        try:
            return bool(ray.is_initialized()) and ray.nodes() is not None
        except Exception:  # noqa: BLE001 - any failure to ask is an answer: no
            return False

    def _disconnect(self) -> None:
        ray = _ray()
        if ray.is_initialized():
            ray.shutdown()


FOLDER_PREFIX = "goodput-ray-"
"""The embedded cluster's session folder's name (its peer snapshots' folder takes the same name)."""


class LocalRayCluster(_RayClusterBase):
    """An embedded multi-raylet Ray cluster shaped like `cluster.local`."""

    def __init__(self, local: LocalClusterSpec, *, fast_failure_detection: bool = True,
                 log_dir: str | None = None, repair_after_s: float | None = None) -> None:
        self.local = local
        self.fast_failure_detection = fast_failure_detection
        self.log_dir = log_dir
        """Where the raylets' and GCS's own output goes (ray-processes.log); default: the cluster's temp dir."""
        self.repair_after_s = repair_after_s
        """A killed node's raylet starts again this long after (as a real node comes back from repair);
        None: it stays dead (goodput run: the drill's story is the spare, then the shrink). The owner
        calls `repair_due` from its main thread (Ray's node start installs signal handlers)."""
        self._repairs: dict[str, float] = {}
        """node -> when it is repaired (time.monotonic())."""
        self._lock = threading.Lock()
        """kill_node comes from drill threads, repair_due from the main thread."""
        self._cluster: Any = None
        self._nodes: dict[str, Any] = {}
        self._tmp: str | None = None
        self._peer_dir: str | None = None
        self._saved_env: dict[str, str | None] = {}
        self._host_image: subprocess.Popen[bytes] | None = None
        """The nodes' shared warm image (controller/ray/host_image.py)."""

    def folders(self) -> list[str]:
        """What the running cluster keeps on this host outside the state dir: Ray's session folder and the
        nodes' peer snapshots (a service killed before its shutdown leaves them to the next one)."""
        return [f for f in (self._tmp, self._peer_dir) if f is not None]

    def start(self) -> None:
        self._tmp = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
        # Ray reads these when it is imported and passes them to every process it starts: set them
        # first so no socket binds anything but 127.0.0.1.
        # The nodes' peer snapshots (host memory) go with the cluster: a folder of its own, removed at shutdown.
        self._peer_dir = str(peer_base() / os.path.basename(self._tmp))
        os.makedirs(self._peer_dir, exist_ok=True)
        for key, value in {"RAY_TMPDIR": self._tmp, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                           ROOT_ENV: self._peer_dir, **QUIET_RAY_ENV, **PROMPT_RAY_ENV}.items():
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value
        image = os.path.join(self._tmp, "host-image.sock")
        with open(self.processes_log, "ab") as log:  # (it imports torch while the raylets start)
            try:
                self._host_image = host_image.start(image, log)
                self._saved_env[HOST_IMAGE_ENV] = os.environ.get(HOST_IMAGE_ENV)
                os.environ[HOST_IMAGE_ENV] = image
            except (OSError, RuntimeError) as e:  # the nodes import in zygotes of their own, as other nodes do
                log.write(f"goodput: no host image ({e}); each node imports torch in a zygote of its own\n".encode())
        from ray.cluster_utils import Cluster

        system_config = dict(FAST_HEALTH_CHECK) if self.fast_failure_detection else {}  # (Ray adds to it)
        try:
            with self._children_log(), prompt_registration():
                self._cluster = Cluster(initialize_head=True, head_node_args={
                    "num_cpus": 1, "num_gpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False,
                    **QUIET_HEAD, "_system_config": system_config,
                })
            for i in range(self.local.nodes):
                self.add_node(i)
            _ray().init(address=self._cluster.address, log_to_driver=False, logging_level="WARNING",
                        _node_ip_address="127.0.0.1")
        except Exception:
            self.shutdown()
            raise

    def add_node(self, index: int) -> str:
        """Start the raylet of node-{index} (also how a replaced node comes back)."""
        name = f"node-{index}"
        spare = local_roles(self.local.nodes, self.local.spares).get(name) is NodeState.SPARE
        labels = {"node": name, "rack": f"rack-{index % self.local.racks}",
                  "gpu_memory_gb": str(self.local.gpu_memory_gb)}
        if spare:
            labels["spare"] = "true"
        with self._children_log(), prompt_registration():
            self._nodes[name] = self._cluster.add_node(
                num_cpus=self.local.gpus_per_node, num_gpus=self.local.gpus_per_node,
                node_ip_address="127.0.0.1", labels=labels,
            )
        return name

    @contextlib.contextmanager
    def _children_log(self) -> Iterator[None]:
        """Processes started in here (raylets, GCS) inherit a log file as stdout/stderr instead of
        ours: a dying raylet dumps its state there, not into `goodput run --json`."""
        assert self._tmp is not None
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        with open(self.processes_log, "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])

    @property
    def processes_log(self) -> str:
        assert self._tmp is not None or self.log_dir is not None
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
            return os.path.join(self.log_dir, "ray-processes.log")
        return os.path.join(self._tmp or "", "raylets.log")

    def kill_node(self, name: str) -> None:
        """The node dies: its raylet and every process under it (its workers and the training
        processes they forked) SIGKILLed together, as a machine that goes down ends them all at once
        (left to notice their raylet's death, workers trained on for up to a step); with
        `repair_after_s`, `repair_due` starts it again that long after, with the same name, labels
        and slots (a new Ray node id)."""
        with self._lock:
            node = self._nodes.pop(name)
            raylets = node.all_processes.get("raylet") or []
            if raylets:
                _kill_tree(raylets[0].process.pid)
            self._cluster.remove_node(node, allow_graceful=False)  # (its other processes, and Ray's books)
            if self.repair_after_s is not None:
                self._repairs[name] = time.monotonic() + self.repair_after_s

    def repair_due(self) -> list[str]:
        """Start the raylets of killed nodes whose repair time has come (main thread only); their names.
        A repair that fails is logged and tried again at the next call."""
        with self._lock:
            due = [n for n, at in self._repairs.items() if at <= time.monotonic()]
        repaired: list[str] = []
        for name in due:
            try:
                with self._lock:
                    if self._cluster is None:
                        return repaired
                    self.add_node(int(name.removeprefix("node-")))
                    del self._repairs[name]
                repaired.append(name)
            except Exception as e:  # noqa: BLE001 - the node stays lost; say why
                print(f"goodput: the repair of {name} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return repaired

    def pending_repairs(self) -> list[str]:
        return sorted(self._repairs)

    def shutdown(self) -> None:
        with self._lock:
            self._repairs.clear()
        self._disconnect()
        if self._cluster is not None:
            self._cluster.shutdown()
            self._cluster = None
        if self._host_image is not None:  # (the nodes' own images ended with their raylets)
            self._host_image.terminate()
            try:
                self._host_image.wait(10)
            except subprocess.TimeoutExpired:
                self._host_image.kill()
                self._host_image.wait()
            self._host_image = None
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
        if self._peer_dir is not None:
            shutil.rmtree(self._peer_dir, ignore_errors=True)
            self._peer_dir = None


class RemoteRayCluster(_RayClusterBase):
    """An existing Ray cluster at `cluster.address`:
    - HOST:PORT (the head's GCS): this process drives it as a Ray driver on its own node. If this
      host (`node_ip`) is not a node of the cluster yet, it joins as one with no CPUs and no GPUs
      (`ray start --address HOST:PORT --num-cpus 0 --num-gpus 0`), so nothing is ever scheduled on it.
      This is how the service runs in production (deploy/): a driver keeps no session that a dropped
      connection ends, and if its node is lost, the process ends with it and a restarted one
      re-attaches to its runs' detached actors.
    - ray://HOST:PORT: Ray Client. Fine for a short foreground run; not for the service: a connection
      lost for longer than Ray Client's 30 s reconnect grace ends the session for good (measured:
      the README's "On Kubernetes").
    - auto: the cluster of the raylet already on this host."""

    def __init__(self, address: str, *, node_ip: str | None = None, connect_timeout_s: float = 5.0,
                 join_timeout_s: float = 120.0) -> None:
        self.address = address
        self.node_ip = node_ip
        """This host's address as the cluster reaches it (the service's --advertise-host)."""
        self.connect_timeout_s = connect_timeout_s
        self.join_timeout_s = join_timeout_s
        self.joined = False
        """Whether this process started this host's raylet (it stays: a restarted service reuses it)."""

    def start(self) -> None:
        if not self.gcs_answers(self.connect_timeout_s):
            raise ClusterError(f"Ray address {self.address} does not answer within "
                               f"{self.connect_timeout_s:.0f} s; check cluster.address")
        extra: dict[str, Any] = {}
        if self._as_node():
            self.prepare()
            extra["_node_ip_address"] = self.node_ip
        try:
            _ray().init(address=self.address, log_to_driver=False, logging_level="WARNING", **extra)
        except Exception as e:  # noqa: BLE001 - Ray raises several kinds here; one line says which
            raise ClusterError(f"cannot join the Ray cluster at {self.address}: {e}") from None

    def gcs_answers(self, timeout_s: float = 1.0) -> bool:
        """Whether the head's GCS accepts a connection from this host within `timeout_s` (asked
        before this process is a driver: a standby's view of the cluster)."""
        if self.address == "auto":
            return True
        host, _, port = self.address.removeprefix("ray://").rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout_s):
                return True
        except (OSError, ValueError):
            return False

    def _as_node(self) -> bool:
        return self.node_ip is not None and self.address != "auto" and not self.address.startswith("ray://")

    def prepare(self) -> None:
        """Join as a node now, before driving anything (a standby does it while it waits, so that
        taking over does not wait for a raylet to start): a raylet with no resources on this host,
        unless a raylet of the cluster answers at `node_ip` (a head or worker here, or the raylet an
        earlier service started). A node the cluster still lists as alive whose raylet does not
        answer is the one a restarted container left behind (every process of it ended; Ray's
        default health checks take ~30 s to notice): a new raylet joins beside it, and the driver
        connects to the new one (Ray connects a driver only to a raylet running on its host)."""
        if not self._as_node() or _raylet_answers(self.address, str(self.node_ip)):
            return
        import subprocess

        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        command = [ray_cli if os.path.exists(ray_cli) else "ray", "start", "--address", self.address,
                   "--node-ip-address", str(self.node_ip), "--num-cpus", "0", "--num-gpus", "0",
                   "--object-store-memory", str(100 * 2**20), "--labels", "goodput-role=controller",
                   "--disable-usage-stats"]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=self.join_timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ClusterError(f"joining the Ray cluster at {self.address} as a node ({' '.join(command)}) "
                               f"failed: {e}") from None
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise ClusterError(f"joining the Ray cluster at {self.address} as a node ({' '.join(command)}) "
                               f"failed: {' / '.join(tail)}")
        self.joined = True

    def kill_node(self, name: str) -> None:
        """SIGKILL the raylet of the node labelled `name`, from a task placed on that node (a worker's
        parent is its node's raylet): the node is lost as if it had died."""
        ray = _ray()
        task = ray.remote(num_cpus=0, max_retries=0)(_kill_own_raylet).options(label_selector={"node": name})
        try:
            refused = ray.get(task.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - the expected end: the task died with the raylet it killed
            return
        if isinstance(refused, str):
            raise ClusterError(refused)

    def shutdown(self) -> None:
        self._disconnect()


def _raylet_answers(address: str, ip: str) -> bool:
    """Whether a node the cluster lists as alive at `ip` has a raylet that accepts connections (its
    node manager port), from the cluster's GCS (before this process is a driver)."""
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # what `ray start` itself uses
    from ray.core.generated import gcs_pb2

    try:
        nodes = GcsClient(address=address).get_all_node_info(timeout=10)
    except Exception as e:  # noqa: BLE001 - one line says why
        raise ClusterError(f"cannot read the nodes of the Ray cluster at {address}: {e}") from None
    for info in nodes.values():
        if info.state != gcs_pb2.GcsNodeInfo.ALIVE or info.node_manager_address != ip:  # type: ignore[attr-defined]
            continue
        try:
            with socket.create_connection((ip, int(info.node_manager_port)), timeout=2):
                return True
        except OSError:
            continue  # listed, but its raylet is gone
    return False


def topology_from_ray(within_s: float | None = None) -> Topology:
    """Alive Ray nodes with GPUs, named by their `node` label (else their id), racked by `rack`;
    liveness.node_table says what `within_s` does."""
    from controller.ray.liveness import node_table

    infos = [info for info in node_table(within_s)
             if info.get("Alive") and int(info.get("Resources", {}).get("GPU", 0)) > 0]
    nodes = []
    for info in _one_per_name(infos):
        gpus = int(info.get("Resources", {}).get("GPU", 0))
        labels = info.get("Labels") or {}
        nodes.append(Node(
            name=labels.get("node", info["NodeID"][:12]),
            rack=labels.get("rack", "rack-0"),
            num_gpus=gpus,
            gpu_memory_bytes=int(float(labels.get("gpu_memory_gb", DEFAULT_GPU_MEMORY_GB)) * 2**30),
            state=NodeState.SPARE if labels.get("spare") == "true" else NodeState.HEALTHY,
            ray_node_id=info["NodeID"],
        ))
    if not nodes:
        raise ClusterError("the Ray cluster has no alive node with GPU slots")
    return Topology(tuple(sorted(nodes, key=lambda n: n.name)))


def _one_per_name(infos: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One alive Ray node per `node` label. A node started again under its name while Ray still lists
    its old raylet alive (a host that went dark is declared dead only after Ray's health checks, ~30 s
    by default) is listed twice: the one whose raylet accepts a connection is the node (the last
    listed if that does not decide)."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for info in infos:
        by_name.setdefault((info.get("Labels") or {}).get("node", info["NodeID"][:12]), []).append(info)
    out = []
    for name, listed in by_name.items():
        if len(listed) > 1:
            from controller.ray.liveness import probe

            said = probe({i["NodeID"]: [(i["NodeManagerAddress"], int(i["NodeManagerPort"]))] for i in listed})
            listed = [i for i in listed if "accepted" in said[i["NodeID"]]] or listed
        out.append(listed[-1])
    return out


def _kill_own_raylet() -> int | str:
    """A node's death, from a task on it: every process under its raylet (its workers, and the
    training processes they forked, which would otherwise train on until Ray's health checks declare
    the node dead) and the raylet itself, SIGKILLed together; this task's process last."""
    import os
    import signal

    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/comm") as f:
            name = f.read().strip()
    except OSError:
        name = "?"
    if name != "raylet":
        return f"kill-node: the worker's parent is {name!r} (pid {parent}), not a raylet; not killed"
    _kill_tree(parent, spare=os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)
    return parent


def _kill_tree(raylet_pid: int, spare: int | None = None) -> None:
    """SIGKILL a raylet and every process under it (but `spare`, the caller's own), all stopped first:
    none can fork or restart another while the rest go."""
    import signal

    import psutil

    try:
        raylet = psutil.Process(raylet_pid)
        tree = [p for p in raylet.children(recursive=True) if p.pid != spare]
    except psutil.Error:
        return  # already gone
    for process in tree:
        try:
            process.send_signal(signal.SIGSTOP)
        except psutil.Error:
            pass
    try:
        raylet.send_signal(signal.SIGKILL)
    except psutil.Error:
        pass
    for process in tree:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass


def make_cluster(address: str | None, local: LocalClusterSpec | None, *, log_dir: str | None = None,
                 repair_after_s: float | None = None, node_ip: str | None = None) -> LocalRayCluster | RemoteRayCluster:
    """A Ray cluster to join at `address` (from this host, `node_ip`), else an embedded one of `local`
    (default: LocalClusterSpec())."""
    if address:
        return RemoteRayCluster(address, node_ip=node_ip)
    return LocalRayCluster(local or LocalClusterSpec(), log_dir=log_dir, repair_after_s=repair_after_s)
