"""A Ray cluster as an operator starts it: `ray start` for a head and labelled worker raylets, on this
machine, in their own temp dir; stopped by PID (never `ray stop`, which ends every Ray process here).

Two shapes: all on 127.0.0.1 (Ray's CLI needs tests/support/ray_worker_node.py for a second raylet
there), or each node on its own loopback address (127.0.0.2, .3, ...), where the stock `ray start`
runs unchanged, as on separate hosts."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil

from checkpointing.peer import ROOT_ENV, peer_base
from controller.ray.cluster import FAST_HEALTH_CHECK, QUIET_RAY_ENV

RAY = str(Path(sys.executable).parent / "ray")
ROOT = Path(__file__).resolve().parents[2]
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""Ray resolves 127.0.0.1 to the machine's address unless told it is a single-machine cluster."""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def children(p: psutil.Process) -> list[psutil.Process]:
    """`p`'s descendants now; none when it is gone (it may end, and its PID be reused by another
    process, between the moment it was listed and this call: psutil then raises NoSuchProcess)."""
    try:
        return p.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def naming(text: str) -> list[psutil.Process]:
    """Every process whose command line holds `text` (a cluster's temp dir), and their children."""
    ours = []
    for p in psutil.process_iter(["cmdline"]):
        if text in " ".join(p.info["cmdline"] or []):
            ours.append(p)
            ours.extend(children(p))
    return ours


def kill(procs: list[psutil.Process]) -> None:
    """SIGKILL these (those still there) and wait for them."""
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def own_folders(tmp: Path) -> tuple[Path, dict[str, str]]:
    """Where a test cluster's nodes keep what they leave on this machine, and the environment that says
    so: their workers' temp files (a node's zygote socket) in the test's `tmp`, and their peer
    snapshots (host memory) in a folder of the cluster's own under /dev/shm/goodput-peer, as the
    embedded cluster keeps them (controller/ray/cluster.py). Its nodes are processes of this machine,
    and one killed with them would leave them in /tmp and /dev/shm. (The peer folder, which the
    cluster's stop removes; the variables.)"""
    peer_base().mkdir(parents=True, exist_ok=True)
    peer_dir = Path(tempfile.mkdtemp(prefix="goodput-test-", dir=peer_base()))
    return peer_dir, {"RAY_TMPDIR": str(tmp), ROOT_ENV: str(peer_dir)}


class RayStartCluster:
    def __init__(self, tmp: Path, *, head_ip: str = "127.0.0.1", worker_ips: list[str] | None = None,
                 default_health_checks: bool = False) -> None:
        self.tmp = tmp
        self.default_health_checks = default_health_checks
        """Ray's own health checks (a dead node declared after ~30 s), as a stock cluster has them;
        else goodput's fast ones (controller.ray.cluster.FAST_HEALTH_CHECK)."""
        self.head_ip = head_ip
        self.worker_ips = worker_ips
        """One address per worker (None: every raylet on the head's 127.0.0.1)."""
        self.one_address = head_ip == "127.0.0.1"
        # (Ray's monitoring and idle workers off, as in the embedded cluster: QUIET_RAY_ENV)
        # (and no token auth unless asked: a token a user's own `ray.init()` left in ~/.ray would turn it on)
        # (and what its nodes leave on this machine in folders of its own: own_folders)
        self.peer_dir, folders = own_folders(tmp)
        self.env = {"RAY_AUTH_MODE": "disabled", **os.environ, **QUIET_RAY_ENV,
                    **(LOOPBACK_ENV if self.one_address else {}), **folders}
        self.address = ""

    def ray_start(self, *args: str, head: bool = False, ip: str = "127.0.0.1") -> None:
        if self.one_address:
            # `ray start` itself for the head; for worker raylets the same command with Ray's rewriting
            # of 127.0.0.1 to the machine's outward address turned off (tests/support/ray_worker_node.py).
            command = [RAY, "start", "--node-ip-address", "127.0.0.1"] if head else [
                sys.executable, str(ROOT / "tests" / "support" / "ray_worker_node.py")]
        else:
            command = [RAY, "start", "--node-ip-address", ip]
        proc = subprocess.run([*command, "--temp-dir", str(self.tmp), "--disable-usage-stats", *args],
                              capture_output=True, text=True, env=self.env, timeout=120)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    def start(self, nodes: int, spares: int, *, client_port: int | None = None) -> "RayStartCluster":
        """A head (with Ray Client's server on `client_port`, if given) and `nodes` labelled workers."""
        port = "0" if self.one_address else str(free_port(self.head_ip))
        client = ["--ray-client-server-port", str(client_port)] if client_port else []
        self.ray_start("--head", "--port", port, "--num-cpus", "1", "--num-gpus", "0", "--include-dashboard", "false",
                       *([] if self.default_health_checks else ["--system-config", json.dumps(dict(FAST_HEALTH_CHECK))]),
                       *client, head=True, ip=self.head_ip)
        self.address = (self.tmp / "ray_current_cluster").read_text().strip()
        assert self.address.startswith(f"{self.head_ip}:"), self.address
        for i in range(nodes):
            labels = f"node=ext-{i},rack=rack-0" + (",spare=true" if i >= nodes - spares else "")
            ip = self.worker_ips[i] if self.worker_ips else "127.0.0.1"
            self.ray_start("--address", self.address, "--num-cpus", "2", "--num-gpus", "2", "--labels", labels, ip=ip)
        return self

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster (their command lines name its temp dir) and their children."""
        return naming(str(self.tmp))

    def raylet_ips(self) -> set[str]:
        """The --node_ip_address of every raylet of this cluster alive now."""
        ips = set()
        for p in self.processes():
            try:
                for arg in p.cmdline():
                    if p.name() == "raylet" and arg.startswith("--node_ip_address="):
                        ips.add(arg.split("=", 1)[1])
            except psutil.NoSuchProcess:
                continue
        return ips

    def node_labels(self) -> dict[str, tuple[dict[str, str], psutil.Process]]:
        """Every labelled raylet of this cluster alive now: its `node` label -> (its labels, its process)."""
        out = {}
        for p in self.processes():
            try:
                if p.name() != "raylet":
                    continue
                for arg in p.cmdline():
                    if arg.startswith("--labels=") and len(arg) > len("--labels="):
                        labels = json.loads(arg.split("=", 1)[1])
                        if labels.get("node"):
                            out[labels["node"]] = (labels, p)
            except (psutil.NoSuchProcess, ValueError):
                continue
        return out

    def kill_node(self, node: str) -> None:
        """A node lost: its raylet and every process under it (its workers, its agents), by PID."""
        _, raylet = self.node_labels()[node]
        kill([*children(raylet), raylet])

    def stop(self) -> None:
        """By PID: `ray stop` would end every Ray process on the machine, not just ours."""
        kill(self.processes())
        shutil.rmtree(self.peer_dir, ignore_errors=True)
