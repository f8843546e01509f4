"""The silent-fault drills, done on the node itself (DrillKind.silent): power-off, partition, slow-link,
lossy-link, freeze-node.

A task placed on the target node (`inject`) finds the node's own link (the interface that holds the
address Ray knows the node by) and starts a helper process there, detached from Ray (`python -m
controller.ray.netfaults ...`): the task returns first, with what will be hit, and the helper acts a
moment later (a cut link would keep the task's answer from ever leaving the node). What the helper does:

    power-off    ip link set LINK down; SIGKILL every process on the node. Nothing it sent after the
                 cut arrives, and nothing closes: its peers see silence, as when a host loses power.
    partition    ip link set LINK down; with `seconds`, up again after them (a flap). Its processes
                 live on and come back to a run that has gone on without them (fencing).
    slow-link    tc netem: `delay_ms` added to everything the node sends, for the rest of its life
                 (refused, saying so, on a kernel without netem: nothing else delays a link).
    lossy-link   tc netem: `loss` percent of what the node sends dropped (nftables where the kernel
                 has no netem).
    freeze-node  SIGSTOP every process on the node; with `seconds`, SIGCONT after them (a hung host).

"Every process on the node" is every process in the node's network namespace where the node has one
of its own (a lab node: not PID 1's namespace); where it shares PID 1's (a pod, whose PID 1 is its own
init, or a bare machine, whose PID 1 is the machine's), only the node's raylet and every process under
it, so that a drill never ends a machine's own daemons. A node on a loopback address shares its
network with every other node of an embedded cluster: these drills refuse it, say why, and touch nothing. They need CAP_NET_ADMIN on the node
(root in the lab; a privileged pod on Kubernetes) and iproute2.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

ACT_AFTER_S = 0.1
"""How long after the task's answer the helper acts (the answer must leave the node first)."""


def own_link(address: str) -> str:
    """The interface holding `address` on this host; ValueError saying why a silent fault cannot be
    made here when there is none of its own."""
    if ipaddress.ip_address(address).is_loopback:
        raise ValueError(f"the node is at {address}, a loopback address: it shares its network with the "
                         "other nodes of this machine, so cutting it would cut them all. Silent-fault drills "
                         "need nodes that are hosts of their own (machines, pods, the test lab's namespaces)")
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            return name
    raise ValueError(f"no interface of this node holds its address {address}")


def has_netem() -> bool:
    """Whether this kernel has tc's netem qdisc: `tc qdisc add dev lo root netem` says "qdisc kind is
    unknown" without it, and is undone at once with it."""
    added = subprocess.run(["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms"], capture_output=True,
                           timeout=10)
    if added.returncode != 0:
        return b"unknown" not in added.stderr  # (refused for another reason, e.g. a qdisc already there: it has one)
    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True, timeout=10)
    return True


def can_make(kind: str) -> str | None:
    """Why this node cannot take `kind` (a kernel without netem cannot delay a link), or None."""
    if kind == "slow-link" and not has_netem():
        return ("this node's kernel has no netem qdisc (sch_netem), which a slow-link needs to delay what the "
                "node sends; a lossy-link works without it (nftables)")
    if kind == "lossy-link" and not has_netem() and shutil.which("nft") is None:
        return "this node has neither tc's netem qdisc nor nftables (`nft`) to drop its packets with"
    return None


def _net_ns() -> int:
    return os.stat("/proc/self/ns/net").st_ino


def node_processes(spare: set[int], raylet: int | None = None) -> list[int]:
    """The node's processes but `spare`: every process in this network namespace if it is not PID 1's,
    else `raylet` and every process under it."""
    mine = _net_ns()
    try:
        shared = os.stat("/proc/1/ns/net").st_ino == mine
    except OSError:
        shared = True
    if shared:
        import psutil

        if raylet is None:
            return []
        try:
            tree = [raylet] + [p.pid for p in psutil.Process(raylet).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        return [pid for pid in tree if pid not in spare]
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in spare:
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino == mine:
                pids.append(int(entry))
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], check=True, capture_output=True, timeout=10)


def _signal_all(sig: int, spare: set[int], raylet: int | None, rounds: int = 1) -> None:
    for _ in range(rounds):
        pids = node_processes(spare, raylet)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def act(kind: str, link: str, *, seconds: float | None, delay_ms: float | None, loss: float | None,
        raylet: int | None = None) -> None:
    """What the helper does on the node (see the module docstring)."""
    me = {os.getpid()}
    if kind == "power-off":
        _ip("link", "set", "dev", link, "down")
        _signal_all(signal.SIGKILL, me, raylet, rounds=20)  # (a process may fork while the others end)
        return
    if kind == "partition":
        _ip("link", "set", "dev", link, "down")
        if seconds is not None:
            time.sleep(seconds)
            _ip("link", "set", "dev", link, "up")
        return
    if kind in ("slow-link", "lossy-link"):
        netem = ["delay", f"{delay_ms}ms"] if kind == "slow-link" else ["loss", f"{loss}%"]
        if has_netem():
            _tc("qdisc", "replace", "dev", link, "root", "netem", *netem)
        else:  # lossy-link only (can_make says so): nftables drops a random share of what leaves the link
            table = ["inet", "goodput_drill"]
            subprocess.run(["nft", "add", "table", *table], check=True, capture_output=True, timeout=10)
            subprocess.run(["nft", "add", "chain", *table, "out", "{ type filter hook output priority 0 ; }"],
                           check=True, capture_output=True, timeout=10)
            subprocess.run(["nft", "add", "rule", *table, "out", "oifname", link, "numgen", "random", "mod", "100",
                            "<", str(max(1, round(loss or 0))), "drop"], check=True, capture_output=True, timeout=10)
        return
    if kind == "freeze-node":
        _signal_all(signal.SIGSTOP, me, raylet, rounds=3)
        if seconds is not None:
            time.sleep(seconds)
            _signal_all(signal.SIGCONT, me, raylet)
        return
    raise ValueError(f"{kind} is not a silent fault")


def start_helper(kind: str, address: str, *, seconds: float | None = None, delay_ms: float | None = None,
                 loss: float | None = None) -> dict[str, Any]:
    """On the node (a Ray task's body): check the node can take the fault, start the detached helper
    that makes it ACT_AFTER_S from now, and say what it will hit. A refusal comes back as a string."""
    try:
        link = own_link(address)
    except ValueError as e:
        return {"refused": str(e)}
    if (why := can_make(kind)) is not None:
        return {"refused": why}
    raylet = _raylet()
    argv = [sys.executable, "-m", "controller.ray.netfaults", kind, "--link", link, "--after", str(ACT_AFTER_S)]
    if raylet is not None:
        argv += ["--raylet", str(raylet)]
    for name, value in (("--seconds", seconds), ("--delay-ms", delay_ms), ("--loss", loss)):
        if value is not None:
            argv += [name, str(value)]
    helper = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                                  os.path.abspath(__file__)))))
    return {"link": link, "address": address, "helper_pid": helper.pid, "acts_at": time.time() + ACT_AFTER_S,
            "processes": len(node_processes({helper.pid}, raylet))}


def _raylet() -> int | None:
    """The pid of this node's raylet: the nearest ancestor of this task's process named so."""
    import psutil

    try:
        for parent in psutil.Process().parents():
            if parent.name() == "raylet":
                return parent.pid
    except psutil.Error:
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controller.ray.netfaults", description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=["power-off", "partition", "slow-link", "lossy-link", "freeze-node"])
    parser.add_argument("--link", required=True)
    parser.add_argument("--after", type=float, default=ACT_AFTER_S)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--delay-ms", type=float)
    parser.add_argument("--loss", type=float)
    parser.add_argument("--raylet", type=int)
    opts = parser.parse_args(argv)
    time.sleep(opts.after)
    act(opts.kind, opts.link, seconds=opts.seconds, delay_ms=opts.delay_ms, loss=opts.loss, raylet=opts.raylet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
