"""A service's runs outlive it: their actors and GPU reservations are detached and named after the run
(`{run}/{node}/{k}`, `{run}/reservation-{node}-...`), their store too (controller/ray/run_store.py).
Here they are found again by name, and a restarted controller takes over a live attempt (`attach`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from controller.ray import replicas as ray_replicas
from controller.ray import run_store
from controller.ray.run_store import NAMESPACE

if TYPE_CHECKING:
    from controller.attempt import AttemptSpec
    from controller.ray.worker_group import RayWorkerGroup


def _nothing() -> Any:
    """A finished ref in the place of a rank that has no process (its replica is out)."""
    import ray

    return ray.put(None)


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


def attach(group: "RayWorkerGroup", attempt: "AttemptSpec", out: frozenset[int] = frozenset(),
           rejoined: frozenset[int] = frozenset()) -> bool:
    """Take over the live workers of `attempt` that an earlier controller started: True when every
    rank's training process is still running (then `poll` goes on as if nothing happened), but
    those of the replicas `out` (failure_domain replica: lost and not rejoined when the earlier
    controller ended; whatever it had started to form them again is stopped: they are formed anew)."""
    import ray

    run = group.name
    named = named_actors(run)
    if not named or run is None:
        return False
    group._peer_key = attempt.peer_key
    prefix = f"{run}/reservation-"
    for reservation in named_reservations(run):  # the earlier controller's, by node (to forget a lost one's)
        node = reservation_node(reservation, prefix)
        if node is not None:
            group._groups.setdefault(node, []).append(reservation)
    try:
        identities = ray.get([h.identity.remote() for _, h in named], timeout=15)
    except Exception:  # noqa: BLE001 - a dead or stuck actor: not attachable
        return False
    world = attempt.placement.mesh.world_size
    per = world // max(attempt.placement.mesh.dp_replicas, 1)
    out_ranks = {rank for k in out for rank in range(k * per, (k + 1) * per)}
    by_rank: dict[int, Any] = {}
    by_node: dict[int, str] = {}
    incarnation: dict[int, int] = {}
    forming: list[Any] = []
    for (name, handle), ident in zip(named, identities):
        node = name.split("/")[-2]
        group._pool.setdefault(node, []).append(handle)
        group._made[node] = max(group._made.get(node, 0), int(name.rsplit("/", 1)[1]) + 1)
        if ident.get("attempt") == attempt.attempt and ident.get("alive") and not ident.get("done"):
            rank = int(ident["rank"])
            incarnation[rank] = max(incarnation.get(rank, 0), int(ident.get("incarnation") or 0))
            if rank in out_ranks:
                forming.append(handle)  # (an earlier controller's forming of a replica out: formed anew)
                continue
            by_rank[rank] = handle
            by_node[rank] = node
    if sorted(by_rank) != sorted(set(range(world)) - out_ranks) or any(
            node != attempt.placement.node_of_rank[rank] for rank, node in by_node.items()):
        return False  # (a rank gone, or a replica formed again elsewhere since the placement recorded)
    found = run_store.find_store(run)  # the membership and the groups' rendezvous go on there
    if found is None and attempt.failure_domain == "replica":
        return False
    if found is not None:
        group._store, group._store_host = found
    group._attempt = attempt
    if not ray_replicas.reattach(group, attempt, incarnation, out, rejoined):
        return False
    if forming:
        ray.wait([handle.stop.remote() for handle in forming], num_returns=len(forming), timeout=15)
    group.actors = [by_rank.get(r) for r in range(world)]  # (a replica out has none until it forms again)
    group._runs = [actor.wait_done.remote() if actor is not None else _nothing() for actor in group.actors]
    group._finished, group._failed, group._drains = set(), set(), {}
    group._nodes = {node for rank, node in enumerate(attempt.placement.node_of_rank) if rank not in out_ranks}
    group._node_of_rank = tuple(attempt.placement.node_of_rank)
    group.watch_heartbeats(f"{attempt.run_id}/attempt-{attempt.attempt}/")
    return True


def reservation_node(reservation: Any, prefix: str) -> str | None:
    """The node a named reservation `{run}/reservation-{node}-{k}-{ns}` is for."""
    from ray.util import placement_group_table

    name = (placement_group_table(reservation) or {}).get("name") or ""
    if not name.startswith(prefix):
        return None
    return name[len(prefix):].rsplit("-", 2)[0]  # node names may hold dashes: the last two parts are k, ns
