"""The service's account of its cluster's nodes: which are quarantined (out of use for every run until
an operator releases them), which the cluster lost (listed until they come back), and the role the
service gives each usable node. Roles follow labels except where the pool has moved on: a spare a run
trains on is promoted (the pool shrinks until a repair), a node back from repair or released refills
the pool while it is short. The caller (the service) holds its lock around every call."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from controller.errors import ServiceError
from controller.service.registry import Registry
from controller.topology import NodeState, Topology


class NodeBook:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        rows = registry.node_rows()
        self.out_of_use: dict[str, dict[str, Any]] = {r["name"]: r for r in rows if r["state"] == "quarantined"}
        self.lost: dict[str, dict[str, Any]] = {r["name"]: r for r in rows if r["state"] == "lost"}
        """Nodes the cluster stopped showing (a dead raylet or host), until it shows them again."""
        self.released: dict[str, float] = {r["name"]: r["time"] for r in rows if r["state"] == "released"}
        """node -> when an operator released it (a quarantine from before then does not count again)."""
        self._seen: set[str] = set()
        self._labelled_spares: set[str] = set()
        """Every node the cluster labels a spare: the pool's intended size."""
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
        if node in self.out_of_use or when <= self.released.get(node, float("-inf")):
            return False
        self.out_of_use[node] = {"name": node, "state": "quarantined", "reason": reason, "run_id": run_id,
                                 "time": when}
        self.registry.set_node(node, state="quarantined", reason=reason, run_id=run_id, time=when)
        return True

    def release(self, name: str, when: float, raw: Topology | None) -> tuple[dict[str, Any], str]:
        """An operator's release of a quarantined node at `when` (no earlier than every quarantine of it):
        (the quarantine it ends, the node's role now). `raw`: what the cluster shows (None: no answer,
        its label decides)."""
        row = self.out_of_use.pop(name, None)
        if row is None:
            raise ServiceError("node_not_quarantined", f"node {name!r} is not quarantined on this service; "
                                                       "`goodput nodes` lists the nodes and their states")
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
                         "reason": out["reason"] if out else None, "since": out["time"] if out else None})
        return rows

