"""A run's warm actors: one per GPU slot it holds, by node, and the reservations that hold those slots.

A slot is reserved before its actor starts: one placement group per node and growth, its bundles
pinned to the node by a label selector. Per node, not one group for all: Ray re-reserves a lost
node's bundles when it returns, so a lost node's groups are removed (`forget_node`) without touching
the warm actors elsewhere. A launch's growth is a gang (all its reservations are granted, or all are
released: `undo_growth`); actors started ahead of a recovery (`prewarm`) and those a replica forms on
(`warm_for`) are held for the run, part of no launch's gang (`keep_growth`).

With a name (the run id) the actors and reservations are detached and named (`{run}/{node}/{k}`,
`{run}/reservation-{node}-{n}-{ns}`): they outlive the controller, and a restarted one adopts them
(`adopt`, `adopt_reservation`: controller/ray/detached.py finds them).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from controller.ray.liveness import NODE_TABLE_WAIT_S, node_table
from controller.ray.rank_actor import RankActor
from controller.ray.run_store import NAMESPACE

RESERVATION_RETRY_S = 20.0
"""A launch whose reservation on a node Ray has not granted after this long asks for it again (`ask_again`)."""


class LaunchAborted(Exception):
    """A start given up because the run was cancelled."""


class WarmPool:
    def __init__(self, name: str | None) -> None:
        self.name = name
        self._actors: dict[str, list[Any]] = {}
        """node -> its warm actors, idle or assigned."""
        self._node_id: dict[str, str] = {}
        """node -> the Ray node id its actors and reservations are on (where known)."""
        self._groups: dict[str, list[Any]] = {}
        """node -> the placement groups that reserve its GPU slots for this pool's actors."""
        self._made: dict[str, int] = {}
        """node -> the next actor number there (names an earlier controller used stay taken)."""
        self._reservations = 0
        self._growth: list[tuple[str, Any]] = []
        """(node, actor) of the last growth (undone together when it does not start)."""
        self._growth_group_of: dict[str, Any] = {}
        """node -> the placement group the last growth reserved there."""
        self._growth_refs: dict[str, list[Any]] = {}
        """node -> the warm() refs of the actors the last growth started there."""
        self._warming: dict[str, list[Any]] = {}
        """node -> warm() refs of the actors `prewarm` started there, not yet waited for."""
        self.reservations_asked_again = 0
        """How many times a launch asked Ray again for a node's reservation it had not granted."""

    def __bool__(self) -> bool:
        """Whether a node has held warm actors here (since it was last forgotten)."""
        return bool(self._actors)

    def actors(self) -> list[Any]:
        """Every warm actor, idle or assigned: one per GPU slot this pool holds."""
        return [actor for actors in self._actors.values() for actor in actors]

    def on(self, node: str) -> list[Any]:
        """`node`'s warm actors, in the order they were started (a launch takes the first ones)."""
        return list(self._actors.get(node, []))

    def any_on(self, node: str) -> Any | None:
        """One warm actor of `node` (to ask what the node holds), or None."""
        actors = self._actors.get(node)
        return actors[0] if actors else None

    def idle_on(self, node: str, busy: set[int]) -> Any | None:
        """A warm actor of `node` whose id() is not in `busy`, or None."""
        return next((a for a in self._actors.get(node, []) if id(a) not in busy), None)

    def grow(self, wanted: dict[str, int]) -> list[tuple[str, Any]]:
        """Start actors until each node has `wanted` of them; (node, warm() ref) of the new ones. The
        growth before is no longer undoable: this is the growth `undo_growth` undoes."""
        if self.name is not None and not self._made:  # names an earlier controller used stay taken
            for name, _ in named_actors(self.name):
                node, k = name.split("/")[-2], int(name.rsplit("/", 1)[1])
                self._made[node] = max(self._made.get(node, 0), k + 1)
        self.keep_growth()
        new = []
        for node, count in wanted.items():
            missing = count - len(self._actors.get(node, []))
            if missing > 0:
                new += self._reserve(node, missing)
        return new

    def keep_growth(self) -> None:
        """The last growth is held for the run: part of no launch's gang, never undone."""
        self._growth, self._growth_group_of, self._growth_refs = [], {}, {}

    def take_warming(self, nodes: Any) -> list[tuple[str, Any]]:
        """(node, warm() ref) of the actors `prewarm` started on `nodes`: the caller waits for them now."""
        return [(node, ref) for node in nodes for ref in self._warming.pop(node, [])]

    def _reserve(self, node: str, missing: int) -> list[tuple[str, Any]]:
        """Reserve `missing` GPU slots on `node` (one placement group) and start an actor in each;
        (node, warm() ref) of each. Part of the growth (released with it if it fails)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_cls = ray.remote(RankActor)
        new = []
        self._reservations += 1
        group = placement_group(
            [{"GPU": 1.0} for _ in range(missing)], strategy="PACK",
            bundle_label_selector=[{"node": node} for _ in range(missing)],
            **({"name": f"{self.name}/reservation-{node}-{self._reservations}-{time.time_ns()}",
                "lifetime": "detached"} if self.name is not None else {}))
        self._groups.setdefault(node, []).append(group)
        self._growth_group_of[node] = group
        for index in range(missing):
            options: dict[str, Any] = {}
            if self.name is not None:
                k = self._made.get(node, 0)
                self._made[node] = k + 1
                options = {"name": f"{self.name}/{node}/{k}", "namespace": NAMESPACE, "lifetime": "detached"}
            actor: Any = actor_cls.options(
                num_cpus=0, num_gpus=1, max_concurrency=5,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
                **options).remote()
            self._actors.setdefault(node, []).append(actor)
            new.append((node, actor.warm.remote()))
            self._growth.append((node, actor))
        self._growth_refs[node] = [warm for _, warm in new]
        return new

    def wait_started(self, new: list[tuple[str, Any]], timeout_s: float, abort: threading.Event) -> None:
        """Wait for the growth's new actors (`new`: (node, warm() ref)) to start: each warm() waits for
        its bundle, then imports torch. All or nothing: when they have not all started in `timeout_s`,
        when `abort` is set (LaunchAborted, within half a second), or when one of their nodes dies
        meanwhile (it never starts them), the growth is undone and the error says why."""
        import ray

        if not new:
            return
        refs = [warm for _, warm in new]
        deadline = time.monotonic() + timeout_s
        ready: list[Any] = []
        gone: set[str] = set()
        asked = time.monotonic()
        while len(ready) < len(new) and not abort.is_set() and time.monotonic() < deadline and not gone:
            ready, _ = ray.wait(refs, num_returns=len(new), timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            gone = {node for node, _ in new} - alive_nodes()
            if len(ready) < len(new) and time.monotonic() - asked > RESERVATION_RETRY_S:
                asked = time.monotonic()
                new = self.ask_again(new, ready)
                refs = [warm for _, warm in new]
        if len(ready) < len(new):
            late = sorted({node for node, warm in new if warm not in ready})
            states = self.growth_states(late)
            self.undo_growth(late)
            if abort.is_set():
                raise LaunchAborted(f"the launch was cancelled while workers on {late} were starting")
            if gone:
                raise RuntimeError(f"node(s) {sorted(gone)} died while their workers were starting")
            raise TimeoutError(f"workers on nodes {late} did not start in {timeout_s:.0f} s: "
                               f"those nodes lack free GPU slots or are gone (their reservations: {states}; "
                               f"asked again {self.reservations_asked_again} time(s))")
        ray.get(ready)  # an actor that died while importing raises here

    def ask_again(self, new: list[tuple[str, Any]], ready: list[Any]) -> list[tuple[str, Any]]:
        """The growth's reservations that Ray has not granted yet, asked for anew: each node's placement
        group still pending is removed with its actors and reserved again (a pending group can be left
        unscheduled until some node joins: ray#62483, and the launch before waited for it to time
        out). `new` with the new actors' warm() refs in place of the dropped ones."""
        import ray
        from ray.util import placement_group_table

        waiting = {node for node, warm in new if warm not in ready and node in self._growth_group_of}
        for node in sorted(waiting):
            group = self._growth_group_of[node]
            try:
                if placement_group_table(group).get("state") == "CREATED":
                    continue  # granted: its actors are starting (importing torch may take a while)
            except Exception:  # noqa: BLE001 - not known to Ray any more: ask again
                pass
            ours = [actor for n, actor in self._growth if n == node]
            dropped = {id(actor) for actor in ours}
            for actor in ours:
                self.forget(actor)
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - never started
                    pass
            self._growth = [(n, a) for n, a in self._growth if id(a) not in dropped]
            del self._growth_group_of[node]
            self._drop_reservation(group)
            theirs = {warm.hex() for warm in self._growth_refs.pop(node, [])}  # (not a prewarmed actor's)
            new = [(n, warm) for n, warm in new if warm.hex() not in theirs] + self._reserve(node, len(ours))
            self.reservations_asked_again += 1
        return new

    def growth_states(self, nodes: list[str]) -> dict[str, str]:
        """node -> Ray's state of the growth's reservation there (what a launch that timed out says)."""
        from ray.util import placement_group_table

        states = {}
        for node in nodes:
            group = self._growth_group_of.get(node)
            try:
                states[node] = placement_group_table(group).get("state", "?") if group is not None else "none"
            except Exception as e:  # noqa: BLE001 - the answer is the error
                states[node] = f"unknown ({type(e).__name__})"
        return states

    def undo_growth(self, late: list[str]) -> None:
        """A launch that did not start: the actors of the `late` nodes (never started: they must not be
        handed out later) and every actor and reservation of the growth go (no half-held gang)."""
        import ray

        for node in late:
            for actor in self._actors.pop(node, []):
                ray.kill(actor, no_restart=True)
        for node, actor in self._growth:
            if actor in self._actors.get(node, []):
                self._actors[node].remove(actor)
                ray.kill(actor, no_restart=True)
        for group in list(self._growth_group_of.values()):
            self._drop_reservation(group)

    def prewarm(self, nodes: list[str], count: int) -> None:
        """Start actors now on those of `nodes` alive with fewer than `count`, not waited for here:
        whoever uses them takes them with `take_warming` (and waits for them). Asked while a run trains:
        ClusterSilent when Ray's GCS does not list its nodes within liveness.NODE_TABLE_WAIT_S."""
        alive = alive_nodes(NODE_TABLE_WAIT_S)
        wanted = {n: count for n in nodes if n in alive and len(self._actors.get(n, [])) < count}
        if not wanted:
            return
        for node, ref in self.grow(wanted):
            self._warming.setdefault(node, []).append(ref)
        self.keep_growth()

    def warm_for(self, nodes: list[str], busy: set[int], timeout_s: float) -> None:
        """Idle warm actors on `nodes` (one per entry: a node listed twice needs two), beside those
        whose id() is in `busy`; started now where there are too few (a node back from repair under its
        name, a spare the prewarm has not reached yet) and waited for. RuntimeError when they do not
        start in `timeout_s`."""
        import ray

        need = collections.Counter(nodes)
        idle = {node: sum(id(a) not in busy for a in self._actors.get(node, [])) for node in need}
        short = {node: len(self._actors.get(node, [])) + n - idle[node] for node, n in need.items() if idle[node] < n}
        warming = [ref for _, ref in self.take_warming(need)]
        new = self.grow(short) if short else []
        self.keep_growth()
        refs = warming + [ref for _, ref in new]
        if refs:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
            if len(ready) < len(refs):
                raise RuntimeError(f"warm workers on {sorted(short)} did not start in {timeout_s:.0f} s")
            ray.get(ready)

    def adopt(self, name: str, handle: Any) -> str:
        """A named actor an earlier controller started (`{run}/{node}/{k}`) joins the pool; its node."""
        node, k = name.split("/")[-2], int(name.rsplit("/", 1)[1])
        self._actors.setdefault(node, []).append(handle)
        self._made[node] = max(self._made.get(node, 0), k + 1)
        return node

    def adopt_reservation(self, node: str, group: Any) -> None:
        """A named reservation an earlier controller made on `node` (dropped with the node, or at `close`)."""
        self._groups.setdefault(node, []).append(group)

    def forget(self, actor: Any) -> None:
        """An actor that died (or was killed): not handed out again."""
        for actors in self._actors.values():
            if actor in actors:
                actors.remove(actor)

    def forget_node(self, node: str) -> None:
        """A node that died: its actors went with it; its reservations go too (else Ray would hold its
        GPUs for them again when it returns)."""
        self._warming.pop(node, None)
        self._actors.pop(node, None)
        self._node_id.pop(node, None)
        for group in self._groups.pop(node, []):
            self._drop_reservation(group)

    def forget_dead_nodes(self) -> None:
        """Before a launch: nodes the pool knows that Ray no longer shows alive, by name, or by Ray's
        node id where the pool knows it: a node lost and back under its name (a new raylet) before this
        launch has none of the actors or reservations its name still holds here."""
        alive = alive_ids()
        for node in set(self._actors) | set(self._groups):
            known = self._node_id.get(node)
            if node not in alive or (known is not None and known not in alive[node]):
                self.forget_node(node)
        for node, ids in alive.items():  # where a node holding nothing here starts its actors next
            if not self._actors.get(node) and not self._groups.get(node):
                if len(ids) == 1:
                    self._node_id[node] = next(iter(ids))
                else:  # (Ray still lists its old raylet too: which one is not known)
                    self._node_id.pop(node, None)

    def _drop_reservation(self, group: Any) -> None:
        from ray.util import remove_placement_group

        try:
            remove_placement_group(group)
        except Exception:  # noqa: BLE001 - already gone
            pass
        for groups in self._groups.values():
            if group in groups:
                groups.remove(group)

    def close(self, peer_key: str | None) -> None:
        """Release everything: every actor (named ones of this run that an earlier controller left,
        too), the run's peer snapshots in the nodes' memory (unless `peer_key` is None), and every
        reservation."""
        import ray

        actors = self.actors() + [handle for _, handle in named_actors(self.name)]
        if peer_key is not None:
            drops = [held[0].drop_peer_copies.remote(peer_key) for held in self._actors.values() if held]
            if drops:
                ray.wait(drops, num_returns=len(drops), timeout=10)
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for group in [g for groups in self._groups.values() for g in groups] + named_reservations(self.name):
            self._drop_reservation(group)
        self._groups = {}
        self._actors = {}


def named_reservations(run: str | None) -> list[Any]:
    """This run's placement groups that an earlier controller left (they are detached). Found by
    name in the cluster's table and taken by id: a lookup by name only sees the placement groups
    of this driver's own namespace, and the earlier controller's was another."""
    import ray
    from ray._raylet import PlacementGroupID  # type: ignore[attr-defined]
    from ray.util.placement_group import PlacementGroup

    if run is None:
        return []
    found = []
    for entry in ray.util.placement_group_table().values():
        name = entry.get("name") or ""
        if name.startswith(f"{run}/reservation-") and entry.get("state") != "REMOVED":
            found.append(PlacementGroup(PlacementGroupID.from_hex(entry["placement_group_id"])))
    return found


def named_actors(run: str | None) -> list[tuple[str, Any]]:
    """(name, handle) of this run's named actors alive in the cluster."""
    import ray

    if run is None:
        return []
    found = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry.get("namespace") == NAMESPACE and entry.get("name", "").startswith(f"{run}/"):
            try:
                found.append((entry["name"], ray.get_actor(entry["name"], namespace=NAMESPACE)))
            except ValueError:
                continue
    return found


def alive_nodes(wait_s: float | None = None) -> set[str]:
    """The `node` labels of the cluster's alive Ray nodes (liveness.node_table: `wait_s`, ClusterSilent)."""
    return set(alive_ids(wait_s))


def alive_ids(wait_s: float | None = None) -> dict[str, set[str]]:
    """The cluster's alive Ray nodes: `node` label -> their Ray node ids (two while Ray still lists a
    node's old raylet alive after it came back); liveness.node_table says what `wait_s` does."""
    alive: dict[str, set[str]] = {}
    for info in node_table(wait_s):
        if info.get("Alive") and (name := (info.get("Labels") or {}).get("node")):
            alive.setdefault(name, set()).add(info["NodeID"])
    return alive
