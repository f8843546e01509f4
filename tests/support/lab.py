"""The lab: test nodes that are hosts of their own, so that a fault can be silent.

On one kernel a SIGKILL closes every socket of the dead process at once: its peers' collectives fail
in milliseconds and its raylet's port refuses. A host that loses power, or a partition, closes
nothing. Here each node is a pod-like host on this machine:
- a network namespace with a veth to one bridge, an address in 198.18.0.0/15 (the range reserved for
  network tests), no default route (nothing can leave the lab but to the bridge);
- its own hostname (a UTS namespace) and its own hosts file (`ip netns exec` mounts
  /etc/netns/NAME/hosts over /etc/hosts): a rank's gloo resolves its hostname to its own address;
- processes started in it with `Lab.run` (`ray start` above all), which end when the node does.
The bridge holds the controller's address (`Lab.gateway`, in this machine's own namespace: the
controller runs outside the nodes, as it does on a real cluster). Cutting a node's link (`cut`), or
delaying it with tc netem, is what the drills do from inside the node (controller/ray/netfaults.py);
the lab can do it from outside as well.

The lab creates all of it and removes all of it (`close`): every process in its namespaces (all
started by it), the namespaces, the veths, the bridge and the hosts files. Needs root (CI runs as
root) and iproute2; `available()` says why not otherwise.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

NETNS_ETC = Path("/etc/netns")
PREFIX = "gpl"
"""Every name the lab makes starts so (bridge gplN-br, namespaces gplN-hostname, veths gplN-vK)."""


def available() -> str | None:
    """None when the lab can be built here, else why not."""
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, veths, a bridge)"
    for tool in ("ip", "tc", "nft", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"the lab needs `{tool}` (Debian's iproute2 / nftables / util-linux / hostname)"
    return None


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _netns_inode(name: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except FileNotFoundError:
        return None


def processes_in(netns_inode: int) -> list[psutil.Process]:
    """Every process whose network namespace is this one (a listed process may end meanwhile)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.stat(f"/proc/{p.pid}/ns/net").st_ino == netns_inode:
                found.append(p)
        except (FileNotFoundError, ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            continue
    return found


@dataclass(frozen=True)
class LabNode:
    hostname: str
    """The node's own hostname (its UTS namespace), the name Ray and gloo see."""
    netns: str
    """Its network namespace (`ip netns exec NETNS ...`)."""
    address: str
    """Its address on the bridge."""
    veth: str
    """The bridge's end of its link (the node's end is `eth0` inside the namespace)."""


class Lab:
    """`nodes` hosts (named `hostnames`) on one bridge, 198.18.`subnet`.0/24."""

    def __init__(self, hostnames: list[str], *, subnet: int | None = None) -> None:
        why = available()
        if why is not None:
            raise RuntimeError(why)
        self.index = subnet if subnet is not None else os.getpid() % 200 + 1
        self.name = f"{PREFIX}{self.index}"
        self.bridge = f"{self.name}-br"
        self.gateway = f"198.18.{self.index}.1"
        """The controller's address on the bridge (this machine's own namespace)."""
        self.nodes = {h: LabNode(hostname=h, netns=f"{self.name}-{h}", address=f"198.18.{self.index}.{10 + i}",
                                 veth=f"{self.name}-v{i}")
                      for i, h in enumerate(hostnames)}
        self._made: list[str] = []

    # -- build and tear down ---------------------------------------------------------------------------
    def open(self) -> "Lab":
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def _open(self) -> None:
        _sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(self.bridge)
        _sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + f"{self.gateway} controller\n" + "".join(
            f"{n.address} {n.hostname}\n" for n in self.nodes.values())
        for n in self.nodes.values():
            _sh("ip", "netns", "add", n.netns)
            self._made.append(n.netns)
            (NETNS_ETC / n.netns).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / n.netns / "hosts").write_text(hosts)
            _sh("ip", "link", "add", n.veth, "type", "veth", "peer", "name", "eth0", "netns", n.netns)
            _sh("ip", "link", "set", n.veth, "master", self.bridge)
            _sh("ip", "link", "set", n.veth, "up")
            _sh("ip", "-n", n.netns, "addr", "add", f"{n.address}/24", "dev", "eth0")
            _sh("ip", "-n", n.netns, "link", "set", "eth0", "up")
            _sh("ip", "-n", n.netns, "link", "set", "lo", "up")

    def close(self) -> None:
        """Every process in the lab's namespaces (all started by the lab) killed, then every namespace,
        veth, bridge and hosts file it made removed. Safe to call twice, and after a partial open."""
        for n in self.nodes.values():
            self.kill_all(n.hostname)
        for n in self.nodes.values():
            if _netns_inode(n.netns) is not None:
                _sh("ip", "netns", "del", n.netns, check=False)  # (its eth0 goes with it, and so the veth)
            _sh("ip", "link", "del", n.veth, check=False)
            shutil.rmtree(NETNS_ETC / n.netns, ignore_errors=True)
        _sh("ip", "link", "del", self.bridge, check=False)
        self.mend_controller()
        self._made.clear()

    def leftovers(self) -> list[str]:
        """Whatever of this lab still exists (a test asserts none after `close`)."""
        links = _sh("ip", "-o", "link", "show").stdout
        netns = _sh("ip", "netns", "list").stdout
        left = [name for name in [self.bridge, *(n.veth for n in self.nodes.values())] if f" {name}:" in links
                or f" {name}@" in links]
        left += [n.netns for n in self.nodes.values() if n.netns in netns.split()]
        left += [str(NETNS_ETC / n.netns) for n in self.nodes.values() if (NETNS_ETC / n.netns).exists()]
        if _sh("nft", "list", "table", "inet", self.name, check=False).returncode == 0:
            left.append(f"nftables table inet {self.name}")
        return left

    def __enter__(self) -> "Lab":
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- inside a node ---------------------------------------------------------------------------------
    def command(self, hostname: str, argv: list[str]) -> list[str]:
        """`argv` as run inside the node: its network namespace and hosts file, its own hostname."""
        n = self.nodes[hostname]
        return ["ip", "netns", "exec", n.netns, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', n.hostname, *argv]

    def run(self, hostname: str, argv: list[str], *, env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
        """Run to completion inside the node (`ray start ...` returns once its daemons run there)."""
        return subprocess.run(self.command(hostname, argv), capture_output=True, text=True, env=env, timeout=timeout)

    def popen(self, hostname: str, argv: list[str], *, env: dict[str, str] | None = None,
              **kwargs: object) -> subprocess.Popen:
        return subprocess.Popen(self.command(hostname, argv), env=env, **kwargs)  # type: ignore[call-overload]

    def processes(self, hostname: str) -> list[psutil.Process]:
        inode = _netns_inode(self.nodes[hostname].netns)
        return [] if inode is None else processes_in(inode)

    def kill_all(self, hostname: str) -> None:
        """SIGKILL every process of the node (all started by this lab), until none is left."""
        for _ in range(20):
            procs = self.processes(hostname)
            if not procs:
                return
            for p in procs:
                try:
                    p.send_signal(signal.SIGKILL)
                except psutil.NoSuchProcess:
                    pass
            psutil.wait_procs(procs, timeout=5)
        raise RuntimeError(f"processes of lab node {hostname} outlive SIGKILL: {self.processes(hostname)}")

    # -- faults from outside (the drills make them from inside the node) ---------------------------------
    def cut(self, hostname: str) -> None:
        """The node's link goes dark: nothing it sends arrives, nothing sent to it arrives, nothing closes."""
        _sh("ip", "link", "set", self.nodes[hostname].veth, "down")

    def cut_controller(self) -> None:
        """This machine's own namespace (the controller's) is cut off from every node: everything it
        sends onto the bridge is dropped (an nftables rule on its output); the nodes still reach one
        another (bridged traffic does not pass this machine's output hook)."""
        _sh("nft", "add", "table", "inet", self.name)
        _sh("nft", "add", "chain", "inet", self.name, "out", "{ type filter hook output priority 0 ; }")
        _sh("nft", "add", "rule", "inet", self.name, "out", "oifname", self.bridge, "drop")

    def mend_controller(self) -> None:
        _sh("nft", "delete", "table", "inet", self.name, check=False)

    def block(self, hostname: str, addresses: list[str]) -> None:
        """A partial partition: nothing passes between the node and these addresses, in either
        direction, and nothing closes (nftables in the node's own namespace; `unblock` ends it)."""
        netns, table = self.nodes[hostname].netns, f"{self.name}_block"
        peers = "{ " + ", ".join(addresses) + " }"
        for command in (f"add table inet {table}",
                        f"add chain inet {table} out {{ type filter hook output priority 0 ; }}",
                        f"add chain inet {table} in {{ type filter hook input priority 0 ; }}",
                        f"add rule inet {table} out ip daddr {peers} drop",
                        f"add rule inet {table} in ip saddr {peers} drop"):
            _sh("ip", "netns", "exec", netns, "nft", *command.split())

    def unblock(self, hostname: str) -> None:
        _sh("ip", "netns", "exec", self.nodes[hostname].netns, "nft", "delete", "table", "inet",
            f"{self.name}_block", check=False)

    def mend(self, hostname: str) -> None:
        _sh("ip", "link", "set", self.nodes[hostname].veth, "up")

    def reachable(self, hostname: str, port: int, timeout_s: float = 1.0) -> bool:
        """Whether a TCP connection to the node's `port` is accepted from the controller's side."""
        import socket

        try:
            socket.create_connection((self.nodes[hostname].address, port), timeout=timeout_s).close()
            return True
        except OSError:
            return False


def wait_until(predicate: "object", timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        time.sleep(0.1)


class LabRayCluster:
    """A stock Ray cluster in the lab, as an operator starts one: `ray start --head` on the host
    `head`, `ray start --address` on each worker host (labelled `node`, `rack` and `spare`), Ray's
    own default health checks (a dead node declared after ~30 s: what goodput must not wait for).
    A service joins it from outside the lab's hosts (`goodput serve --address HEAD:6379
    --advertise-host GATEWAY`, a raylet with no resources on the gateway)."""

    PORT = 6379

    def __init__(self, lab: Lab, tmp: Path, *, workers: list[str], spares: int = 0, gpus_per_node: int = 2,
                 racks: dict[str, str] | None = None) -> None:
        self.lab, self.tmp = lab, tmp
        self.workers, self.spares, self.gpus_per_node = workers, spares, gpus_per_node
        self.racks = racks or {}
        self.head = lab.nodes["head"]
        self.address = f"{self.head.address}:{self.PORT}"
        import sys

        self.ray = str(Path(sys.executable).parent / "ray")
        from controller.ray.cluster import QUIET_RAY_ENV
        from tests.support.ray_start import own_folders

        self.peer_dir, folders = own_folders(tmp)
        self.env = {**{k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"},
                    **QUIET_RAY_ENV, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex(), **folders}
        """Every process of the cluster, and the service that joins it, holds the cluster's token (and Ray's
        monitoring and idle workers are off, as in the embedded cluster: QUIET_RAY_ENV; what its nodes
        leave on this machine goes in folders of its own: ray_start.own_folders)."""

    def start(self) -> "LabRayCluster":
        self._ray_start("head", "--head", "--port", str(self.PORT), "--num-cpus", "1", "--num-gpus", "0",
                        "--include-dashboard", "false")
        for host in self.workers:
            self._join(host)
        return self

    def _join(self, host: str) -> None:
        spare = self.workers.index(host) >= len(self.workers) - self.spares
        labels = f"node={host},rack={self.racks.get(host, 'rack-0')}" + (",spare=true" if spare else "")
        self._ray_start(host, "--address", self.address, "--num-cpus", "2", "--num-gpus", str(self.gpus_per_node),
                        "--labels", labels)

    def _ray_start(self, host: str, *args: str) -> None:
        n = self.lab.nodes[host]
        proc = self.lab.run(host, [self.ray, "start", "--node-ip-address", n.address, "--temp-dir", str(self.tmp),
                                   "--disable-usage-stats", *args], env=self.env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]

    def outside(self) -> list[psutil.Process]:
        """The cluster's processes outside the lab's hosts (a service's raylet on the gateway), by the
        temp dir their command lines name."""
        from tests.support.ray_start import naming

        return naming(str(self.tmp))

    def stop(self) -> None:
        """By PID: every process on the lab's hosts, and the cluster's outside them."""
        from tests.support.ray_start import kill

        for host in self.lab.nodes:
            self.lab.kill_all(host)
        kill(self.outside())
        shutil.rmtree(self.peer_dir, ignore_errors=True)

    def repair(self, host: str) -> None:
        """The node back from repair: whatever is left of it killed, its link up and clean, and a
        raylet started again (a new Ray node, with the same labels)."""
        self.lab.kill_all(host)
        self.lab.mend(host)
        self.mend_link(host)
        self._join(host)

    def mend_link(self, host: str) -> None:
        """The node's link up and clean again (what a partition, slow-link or lossy-link drill left)."""
        netns = self.lab.nodes[host].netns
        _sh("ip", "-n", netns, "link", "set", "eth0", "up")
        _sh("tc", "-n", netns, "qdisc", "del", "dev", "eth0", "root", check=False)
        _sh("ip", "netns", "exec", netns, "nft", "delete", "table", "inet", "goodput_drill", check=False)
