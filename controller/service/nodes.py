"""The service's account of its cluster's nodes: which are quarantined (out of use for every run until
an operator releases them), which the cluster lost (listed until they come back), and the role the
service gives each usable node. Roles follow labels except where the pool has moved on: a spare a run
trains on is promoted (the pool shrinks until a repair), a node back from repair or released refills
the pool while it is short. The caller (the service) holds its lock around every call."""

from __future__ import annotations

import datetime
import sys
import threading
from dataclasses import replace
from typing import Any, Callable, Iterable, Protocol

from controller.errors import ServiceError
from controller.events import EventKind
from controller.service.registry import Registry
from controller.topology import NodeState, Topology


class NodeBook:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        rows = registry.node_rows()
        self.out_of_use: dict[str, dict[str, Any]] = {r["name"]: r for r in rows if r["state"] in OUT_OF_USE}
        """Quarantined nodes, and drained ones (and draining: no new rank; the runs on them leave at a step
        boundary), until an operator releases them."""
        self.lost: dict[str, dict[str, Any]] = {r["name"]: r for r in rows if r["state"] == "lost"}
        """Nodes the cluster stopped showing (a dead raylet or host), until it shows them again."""
        self.released: dict[str, float] = {r["name"]: r["time"] for r in rows if r["state"] == "released"}
        """node -> when an operator released it (a quarantine from before then does not count again)."""
        self._seen: set[str] = set()
        self._labelled_spares: set[str] = set()
        """Every node the cluster labels a spare: the pool's intended size."""
        self._ids: dict[str, str] = {}
        """node -> the Ray node id the cluster showed it under last."""
        self._roles: dict[str, NodeState] = {}
        """Where the service's role for a node differs from its label. Kept in memory: a restarted
        service goes by labels."""

    def in_roles(self, live: Topology) -> Topology:
        """The cluster's nodes, each in the service's role for it."""
        roles = self._roles
        return Topology(tuple(replace(n, state=roles[n.name])
                              if n.name in roles and n.state in (NodeState.HEALTHY, NodeState.SPARE) else n
                              for n in live.nodes))

    def track(self, raw: Topology, now: float, holders: dict[str, str], placed: set[str]) -> None:
        """Notice nodes the cluster lost (`raw` no longer shows them) and got back; promote the spares
        that a run's placement uses (`placed`)."""
        self._labelled_spares |= raw.names_in(NodeState.SPARE)
        ids = {n.name: n.ray_node_id for n in raw.nodes if n.ray_node_id is not None}
        for name in sorted(set(ids) & set(self._ids) - set(self.lost)):
            if ids[name] != self._ids[name]:  # started again under its name before Ray declared the old one
                self.lost[name] = {"name": name, "time": now}  # dead (a host that went dark): lost, and back
        self._ids = ids
        self._promote(raw, placed)  # first: a spare a run now trains on is out of the pool a returned node refills
        for name in raw.names & set(self.lost):
            row = self.lost.pop(name)
            role = self.refill(name, raw)
            reason = (f"back after {now - row['time']:.0f} s; "
                      + ("refills the spare pool" if role is NodeState.SPARE else "a training node again"))
            self.registry.set_node(name, state="returned", reason=reason, run_id=None, time=now)
            print(f"goodput serve: node {name} is {reason}", file=sys.stderr, flush=True)
        for name in self._seen - raw.names - set(self.lost) - set(self.out_of_use):
            holder = holders.get(name)
            row = {"name": name, "state": "lost", "reason": "the cluster no longer shows it (its raylet or host "
                   "died); listed until it comes back", "run_id": holder, "time": now}
            self.lost[name] = row
            self.registry.set_node(name, state="lost", reason=row["reason"], run_id=holder, time=now)
        self._seen = set(raw.names)
        self._promote(raw, placed)  # (and a returned spare that a run still places)

    def _promote(self, raw: Topology, placed: set[str]) -> None:
        for name in self.in_roles(raw).names_in(NodeState.SPARE) & placed:
            self._set_role(name, NodeState.HEALTHY)  # it took a lost or quarantined node's place

    def refill(self, name: str, raw: Topology) -> NodeState:
        """The role of a node that is usable again: a spare while the pool is short of its labelled size."""
        spares = self.in_roles(raw).names_in(NodeState.SPARE) - {name}
        role = NodeState.SPARE if len(spares) < len(self._labelled_spares) else NodeState.HEALTHY
        self._set_role(name, role)
        return role

    def _set_role(self, name: str, role: NodeState) -> None:
        labelled = NodeState.SPARE if name in self._labelled_spares else NodeState.HEALTHY
        if role is labelled:
            self._roles.pop(name, None)
        else:
            self._roles[name] = role

    def quarantine(self, node: str, reason: str, run_id: str, when: float) -> bool:
        """A run quarantined `node` at `when`: out of use for every run (False: already, or that
        quarantine was answered by a later release)."""
        held = self.out_of_use.get(node)  # (a quarantine outranks a drain: a release must not trust it again)
        if (held is not None and held["state"] == "quarantined") or when <= self.released.get(node, float("-inf")):
            return False
        self.out_of_use[node] = {"name": node, "state": "quarantined", "reason": reason, "run_id": run_id,
                                 "time": when}
        self.registry.set_node(node, state="quarantined", reason=reason, run_id=run_id, time=when)
        return True

    def drain(self, name: str, when: float, *, deadline: float | None, by: str) -> dict[str, Any]:
        """`name` must go (by `deadline`, Unix seconds, if given): no new rank on it; the runs on it leave
        at a step boundary (Service), then it is `drained` until released. Asked again: as it is."""
        row = self.out_of_use.get(name)
        if row is not None and row["state"] == "quarantined":
            raise ServiceError("node_out_of_use", f"node {name!r} is quarantined ({row['reason']}): it holds no "
                                                  "rank already; `goodput nodes release` it first to drain it")
        if row is not None:
            return row
        reason = f"drain asked by {by}" + (f", to be gone by {_utc(deadline)}" if deadline is not None else "")
        row = {"name": name, "state": "draining", "reason": reason, "run_id": None, "time": when,
               "deadline": deadline}
        self.out_of_use[name] = row
        self.registry.set_node(name, state="draining", reason=reason, run_id=None, time=when)
        return row

    def draining(self) -> dict[str, dict[str, Any]]:
        """The nodes being drained (read from any thread: a copy of the book taken at once)."""
        return {n: r for n, r in list(self.out_of_use.items()) if r["state"] == "draining"}

    def drained(self, name: str, when: float) -> None:
        """No run holds a rank on the draining `name` any more."""
        row = self.out_of_use[name]
        late = row.get("deadline") is not None and when > row["deadline"]
        row.update(state="drained", reason=f"{row['reason']}; drained{' after its deadline' if late else ''}",
                   time=when)
        self.registry.set_node(name, state="drained", reason=row["reason"], run_id=None, time=when)

    def release(self, name: str, when: float, raw: Topology | None) -> tuple[dict[str, Any], str]:
        """An operator's release of a quarantined or drained node at `when` (no earlier than every
        quarantine of it): (the row it ends, the node's role now). `raw`: what the cluster shows (None:
        no answer, its label decides)."""
        row = self.out_of_use.pop(name, None)
        if row is None:
            raise ServiceError("node_not_quarantined", f"node {name!r} is neither quarantined nor drained on this "
                                                       "service; `goodput nodes` lists the nodes and their states")
        self.released[name] = when
        self.registry.set_node(name, state="released", reason=f"released by an operator (was: {row['reason']})",
                               run_id=row.get("run_id"), time=when)
        if raw is None:
            return row, "spare" if name in self._labelled_spares else "healthy"
        return row, self.refill(name, raw).value

    def rows(self, live_nodes: dict[str, Any], holders: dict[str, str]) -> list[dict[str, Any]]:
        """Every node with its state for the service (healthy, spare, quarantined, lost) and the run on it."""
        rows = []
        for name in sorted(set(live_nodes) | set(self.out_of_use) | set(self.lost)):
            node = live_nodes.get(name)
            out = self.out_of_use.get(name) or (self.lost.get(name) if node is None else None)
            state = out["state"] if out else (node.state.value if node else NodeState.LOST.value)
            rows.append({"name": name, "state": state, "rack": node.rack if node else None,
                         "gpus": node.num_gpus if node else 0, "run": holders.get(name),
                         "reason": out["reason"] if out else None, "since": out["time"] if out else None,
                         "deadline": out.get("deadline") if out else None})
        return rows



OUT_OF_USE = ("quarantined", "draining", "drained")


def _utc(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Cluster(Protocol):
    def topology(self, within_s: float | None = None) -> Topology:
        """The nodes it shows; ClusterSilent when it does not answer within `within_s` (None: its own wait)."""


class NodeActions(Protocol):
    """What quarantine and release do outside goodput (Kubernetes: cordon and taint)."""

    def quarantine(self, node: str, reason: str) -> Any: ...

    def release(self, node: str) -> Any: ...


Holders = Callable[[], dict[str, str]]
"""node -> the live run that holds it (the service's runs decide)."""


class ServiceNodes:
    """The nodes as the service sees them: what its cluster shows (only the nodes `view` keeps, each in
    the service's role for it), its NodeBook, and Kubernetes' side of quarantine and release. `lock` is
    the service's: admission and node ownership change under it."""

    def __init__(self, registry: Registry, cluster: Cluster, *, lock: threading.RLock, holders: Holders,
                 view: Callable[[Topology], Topology] | None = None, node_actions: NodeActions | None = None,
                 clock: Callable[[], float]) -> None:
        self.book = NodeBook(registry)
        self.cluster = cluster
        self.lock = lock
        self.holders = holders
        self.view = view or (lambda t: t)
        """Which of the cluster's nodes this service may use (all of them, unless told)."""
        self.node_actions = node_actions
        """Kubernetes' side of quarantine and release (controller.k8s.nodes), None outside a cluster."""
        self.clock = clock

    def shown(self, within_s: float | None = None) -> Topology:
        """The nodes the cluster shows this service, each in the service's role for it (`within_s`:
        Cluster.topology)."""
        return self.book.in_roles(self.view(self.cluster.topology(within_s)))

    def usable(self, within_s: float | None = None) -> Topology:
        """Every node the service may use, held or not (what a run could ever get)."""
        return Topology(tuple(n for n in self.shown(within_s).nodes if n.name not in self.book.out_of_use))

    def free(self, usable: Topology | None = None) -> Topology:
        """The usable nodes no run holds (`usable`: as just read, to read the cluster once)."""
        held = self.holders()
        nodes = (self.usable() if usable is None else usable).nodes
        return Topology(tuple(n for n in nodes if n.name not in held))

    def of(self, names: set[str], within_s: float | None = None) -> Topology:
        """What the cluster shows of these nodes that are in use (a run's own: it merges back the nodes it
        lost, never one quarantined or drained); `within_s`: Cluster.topology."""
        return Topology(tuple(n for n in self.usable(within_s).nodes if n.name in names))

    def track(self, placed: Callable[[], set[str]]) -> None:
        """Notice nodes the cluster lost and got back, and keep the spare pool honest (NodeBook.track);
        `placed`: the nodes the live runs' placements use."""
        try:
            raw = self.view(self.cluster.topology())
        except Exception:  # noqa: BLE001 - a cluster that does not answer changes nothing here
            return
        with self.lock:
            self.book.track(raw, self.clock(), self.holders(), placed())
        departing = getattr(self.cluster, "departing", None)  # (Kubernetes: cordoned, or tainted to go)
        for name, why in (departing() if departing is not None else {}).items():
            with self.lock:
                if name in raw.names and name not in self.book.out_of_use:
                    self.book.drain(name, self.clock(), deadline=None, by=f"Kubernetes ({why})")
                    print(f"goodput serve: node {name}: draining ({why})", file=sys.stderr, flush=True)

    def drain(self, name: str, *, deadline: float | None, by: str) -> dict[str, Any]:
        """An operator's drain of a node the cluster shows (NodeBook.drain)."""
        with self.lock:
            if name not in self.shown().names and name not in self.book.out_of_use:
                raise ServiceError("node_not_found", f"no node {name!r} in this service's cluster; `goodput nodes` "
                                                     "lists them")
            return self.book.drain(name, self.clock(), deadline=deadline, by=by)

    def settle_drains(self, in_use: set[str]) -> None:
        """Draining nodes no run's ranks are on (`in_use`: the nodes the live runs' placements use now)
        are drained."""
        with self.lock:
            for name in sorted(set(self.book.draining()) - in_use):
                self.book.drained(name, self.clock())

    def quarantine(self, quarantines: Iterable[dict[str, Any]], run_id: str,
                   record: Callable[[EventKind, dict[str, Any]], None]) -> None:
        """A node a run quarantined is out of use for every run until an operator releases it; on
        Kubernetes it is also cordoned and tainted (not a lost node: its pod died, not the node), in the
        background, and `record` gets the outcome for the run's timeline."""
        for q in quarantines:
            with self.lock:  # checked and set in one go: a release in between must not be undone
                if not self.book.quarantine(q["node"], q["reason"], run_id, q["time"]):
                    continue
            if self.node_actions is not None and q["reason"] != "lost":
                threading.Thread(target=self._cordon, args=(q["node"], str(q["reason"]), record),
                                 name=f"goodput-cordon-{q['node']}", daemon=True).start()

    def _cordon(self, node: str, reason: str, record: Callable[[EventKind, dict[str, Any]], None]) -> None:
        assert self.node_actions is not None
        try:
            outcome = self.node_actions.quarantine(node, reason)
            kind, detail = EventKind.NODE_CORDONED, {"node": node, "action": outcome.action, "detail": outcome.detail}
        except Exception as e:  # noqa: BLE001 - the quarantine stands in goodput; say why Kubernetes did not follow
            kind, detail = EventKind.NODE_CORDON_FAILED, {"node": node, "error": f"{type(e).__name__}: {e}"}
            print(f"goodput serve: could not cordon {node}: {e}", file=sys.stderr, flush=True)
        record(kind, detail)

    def release(self, name: str, quarantined_at: list[float]) -> dict[str, Any]:
        """An operator's explicit release of a quarantined node (`quarantined_at`: when runs quarantined
        it): usable by new runs again; on Kubernetes its taint goes (and the cordon, if goodput made it)."""
        try:
            raw: Topology | None = self.view(self.cluster.topology())
        except Exception:  # noqa: BLE001 - no answer from the cluster: its label decides the role
            raw = None
        with self.lock:  # every quarantine of it so far is answered by this release
            row, role = self.book.release(name, max([self.clock()] + quarantined_at), raw)
        kubernetes = None
        if self.node_actions is not None:
            try:
                kubernetes = self.node_actions.release(name).detail
            except Exception as e:  # noqa: BLE001 - released in goodput; the operator must finish in Kubernetes
                kubernetes = (f"not released in Kubernetes ({type(e).__name__}: {e}); remove the taint {name} "
                              "goodput.dev/quarantined and uncordon it by hand")
        return {"name": name, "state": role, "was": row, "kubernetes": kubernetes}

    def table(self) -> dict[str, Any]:
        """Every node with its state for the service (healthy, spare, quarantined, lost) and the run on it.
        The cluster is asked outside the service's lock (a GET must not wait on Ray behind the scheduler,
        nor hold it up: test_chaos once saw /v1/cluster take 2.9 s)."""
        try:
            raw: Topology | None = self.view(self.cluster.topology())
        except Exception:  # noqa: BLE001 - a cluster that does not answer shows no live node
            raw = None
        with self.lock:
            live_nodes = {n.name: n for n in self.book.in_roles(raw).nodes} if raw is not None else {}
            rows = self.book.rows(live_nodes, self.holders())
        return {"nodes": rows, "gpus": sum(r["gpus"] for r in rows),
                "free_gpus": sum(r["gpus"] for r in rows if r["run"] is None and r["state"] == "healthy")}
