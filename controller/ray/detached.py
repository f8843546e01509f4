"""A service's runs outlive it: their actors and GPU reservations are detached and named after the run
(`{run}/{node}/{k}`, `{run}/reservation-{node}-...`: controller/ray/pool.py), their store too
(controller/ray/run_store.py). Here they are found again by name (`find_live`), for a restarted
controller to take over a live attempt (RayWorkerGroup.attach)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from controller.ray.pool import WarmPool, named_actors, named_reservations

if TYPE_CHECKING:
    from controller.attempt import AttemptSpec


@dataclass
class Live:
    """What an earlier controller left running of an attempt."""

    actors: list[Any]
    """The actor of each rank (None for a rank of a replica out)."""
    incarnation: dict[int, int]
    """rank -> the incarnation its process runs (the highest seen)."""
    forming: list[Any] = field(default_factory=list)
    """Actors that were forming a replica out again (they are stopped: it is formed anew)."""


def find_live(pool: WarmPool, attempt: "AttemptSpec", out: frozenset[int] = frozenset()) -> Live | None:
    """Every named actor and reservation of the run joins `pool` (the earlier controller's slots stay
    held); the live training processes of `attempt` are returned, when every rank has one on the node
    the attempt's placement gives it, but those of the replicas `out` (failure_domain replica: lost
    and not rejoined when the earlier controller ended). None when a rank is gone, or a replica
    was formed again elsewhere since the placement recorded."""
    import ray

    run = pool.name
    named = named_actors(run)
    if not named or run is None:
        return None
    prefix = f"{run}/reservation-"
    for reservation in named_reservations(run):  # the earlier controller's, by node (to forget a lost one's)
        node = reservation_node(reservation, prefix)
        if node is not None:
            pool.adopt_reservation(node, reservation)
    try:
        identities = ray.get([h.identity.remote() for _, h in named], timeout=15)
    except Exception:  # noqa: BLE001 - a dead or stuck actor: not attachable
        return None
    world = attempt.placement.mesh.world_size
    per = world // max(attempt.placement.mesh.dp_replicas, 1)
    out_ranks = {rank for k in out for rank in range(k * per, (k + 1) * per)}
    by_rank: dict[int, Any] = {}
    by_node: dict[int, str] = {}
    live = Live(actors=[], incarnation={})
    for (name, handle), ident in zip(named, identities):
        node = pool.adopt(name, handle)
        if ident.get("attempt") == attempt.attempt and ident.get("alive") and not ident.get("done"):
            rank = int(ident["rank"])
            live.incarnation[rank] = max(live.incarnation.get(rank, 0), int(ident.get("incarnation") or 0))
            if rank in out_ranks:
                live.forming.append(handle)
                continue
            by_rank[rank] = handle
            by_node[rank] = node
    if sorted(by_rank) != sorted(set(range(world)) - out_ranks) or any(
            node != attempt.placement.node_of_rank[rank] for rank, node in by_node.items()):
        return None
    live.actors = [by_rank.get(rank) for rank in range(world)]
    return live


def reservation_node(reservation: Any, prefix: str) -> str | None:
    """The node a named reservation `{run}/reservation-{node}-{k}-{ns}` is for."""
    from ray.util import placement_group_table

    name = (placement_group_table(reservation) or {}).get("name") or ""
    if not name.startswith(prefix):
        return None
    return name[len(prefix):].rsplit("-", 2)[0]  # node names may hold dashes: the last two parts are k, ns
