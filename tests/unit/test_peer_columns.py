"""`Holdings` (what many nodes hold, as numpy columns: the simulator's answer at 131,072 ranks) and the
`peer_point` it feeds: the same decision and the same reason as the per-node `Held` records it stands
for, read node by node (the path a Ray cluster's answers take). Random snapshots, copies, asked nodes
and exclusions; the reference is the same Holdings turned into a plain dict of per-node records."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpointing.peer import HeldColumns, Holdings, node_codes, peer_point

NODES = [f"node-{i}" for i in range(6)]


@st.composite
def columns(draw: st.DrawFn) -> list[HeldColumns]:
    out = []
    keys = draw(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 5)), min_size=0, max_size=4, unique=True))
    world = draw(st.integers(1, 6))
    for attempt, step in keys:
        copies = draw(st.lists(st.tuples(st.integers(0, len(NODES) - 1), st.integers(0, world - 1)), max_size=14))
        identity = draw(st.sampled_from(["id", "id", "other"]))
        out.append(HeldColumns(attempt, step, step * 8, world, {"dp": world}, identity, NODES,
                               np.array([n for n, _ in copies], dtype=np.int64),
                               np.array([r for _, r in copies], dtype=np.int64),
                               ({"step": step, "loss": 1.0},)))
    return out


@settings(max_examples=400, deadline=None)
@given(columns(), st.sets(st.sampled_from(NODES + ["elsewhere"])),
       st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), max_size=2))
def test_the_columns_decide_as_the_records_they_stand_for(cols: list[HeldColumns], nodes: set[str],
                                                         excluded: list[tuple[int, int]]) -> None:
    held = Holdings(cols)
    per_node = {node: list(records) for node, records in held.items()}
    assert peer_point(held, identity="id", nodes=nodes, excluded=excluded) == \
        peer_point(per_node, identity="id", nodes=nodes, excluded=excluded)


def test_a_node_reads_the_ranks_it_keeps_once_each_column() -> None:
    column = HeldColumns(1, 3, 24, 4, {"dp": 4}, "id", NODES, np.array([0, 1, 0, 2, 1]), np.array([0, 1, 2, 3, 0]))
    held = Holdings([column])
    assert sorted(held) == ["node-0", "node-1", "node-2"]
    assert [r.ranks for r in held["node-0"]] == [(0, 2)] and [r.ranks for r in held["node-1"]] == [(1, 0)]
    point, why = peer_point(held, identity="id", nodes={"node-0", "node-1", "node-2"})
    assert point is not None and (point.attempt, point.step, point.cursor) == (1, 3, 24), why
    point, why = peer_point(held, identity="id", nodes={"node-0", "node-1"})
    assert point is None and "rank(s) [3]" in why


@given(st.lists(st.sampled_from(NODES), max_size=40))
def test_node_codes_name_each_ranks_node_in_order_of_first_appearance(node_of_rank: list[str]) -> None:
    used, codes = node_codes(node_of_rank)
    assert used == list(dict.fromkeys(node_of_rank))
    assert [used[c] for c in codes.tolist()] == node_of_rank


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_swapped_placement_carries_the_node_codes_it_would_compute(data: st.DataObject) -> None:
    from controller.placement import Placement, place, swap_nodes
    from controller.topology import Topology
    from trainer.config import MeshShape

    topology = Topology.from_local(nodes=8, gpus_per_node=2, racks=2, spares=0)
    placement = place(MeshShape(dp=3, pp=1, tp=2), topology)
    placement.node_codes  # (computed: a swap carries them over)
    placement.columns()  # (and these: the racks of the groups that did not move)
    names = sorted(topology.names)
    used = sorted(placement.nodes())
    olds = data.draw(st.lists(st.sampled_from(used), unique=True, min_size=1, max_size=2))
    news = data.draw(st.lists(st.sampled_from(names), unique=True, min_size=len(olds), max_size=len(olds)))
    swapped = swap_nodes(placement, dict(zip(olds, news)), topology)
    carried = swapped.__dict__.get("node_codes")
    fresh = node_codes(swapped.node_of_rank)
    if not set(news) & set(used):  # onto nodes the placement did not use: one to one, carried over
        assert carried is not None
    if carried is not None:
        assert carried[0] == fresh[0] and carried[1].tolist() == fresh[1].tolist()
        assert "_group_columns" in swapped.__dict__
    anew = Placement(**{f: getattr(swapped, f) for f in swapped.__dataclass_fields__})
    assert swapped.columns() == anew.columns()


def test_a_placement_travels_without_what_it_computed_once() -> None:
    import pickle

    from controller.placement import place
    from controller.topology import Topology
    from trainer.config import MeshShape

    placement = place(MeshShape(dp=4, pp=1, tp=2), Topology.from_local(nodes=4, gpus_per_node=2, racks=2, spares=0))
    buddy = placement.peer_buddies()
    assert buddy is not None and "node_codes" in placement.__dict__
    copy = pickle.loads(pickle.dumps(placement))
    assert copy == placement and "node_codes" not in copy.__dict__ and "_buddies" not in copy.__dict__
    assert copy.peer_buddies() == buddy


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_one_to_one_swap_keeps_the_buddies_while_they_stay_as_good(data: st.DataObject) -> None:
    """A spare taking a node's place keeps every survivor's partner (its copies stay where they are):
    the buddies carried over keep every pair on two nodes and put no more pairs in one rack than the
    placement they came from; where they would, they are computed afresh."""
    from controller.placement import place, swap_nodes
    from controller.topology import Topology
    from trainer.config import MeshShape

    nodes, racks = data.draw(st.sampled_from([(10, 3), (6, 2)]))  # (6, 2): some swaps would add same-rack pairs
    topology = Topology.from_local(nodes=nodes, gpus_per_node=2, racks=racks, spares=0)
    replicas = data.draw(st.booleans())
    placement = place(MeshShape(dp=4, pp=1, tp=2, dp_replicas=2 if replicas else 1), topology)
    before = placement.peer_buddies(replicas=replicas)
    assert before is not None
    used = sorted(placement.nodes())
    free = sorted(set(topology.names) - set(used))
    olds = data.draw(st.lists(st.sampled_from(used), unique=True, min_size=1, max_size=2))
    news = data.draw(st.lists(st.sampled_from(free), unique=True, min_size=len(olds), max_size=len(olds)))
    swapped = swap_nodes(placement, dict(zip(olds, news)), topology)
    after = swapped.peer_buddies(replicas=replicas)
    keepers, old_keepers = swapped.peer_keepers(replicas=replicas), placement.peer_keepers(replicas=replicas)
    assert after is not None and keepers is not None and old_keepers is not None
    node, rack = swapped.node_of_rank, swapped.rack_of_node
    assert all(node[r] != node[k] for r, k in enumerate(keepers.tolist())), "a pair on one node"

    def same_rack(p: "object", k: "np.ndarray") -> int:
        return sum(p.rack_of_node[p.node_of_rank[r]] == p.rack_of_node[p.node_of_rank[b]]  # type: ignore[attr-defined]
                   for r, b in enumerate(k.tolist()))

    if after is before:  # carried over
        assert same_rack(swapped, keepers) <= same_rack(placement, old_keepers)
    else:
        assert after == swapped.__class__(**{f: getattr(swapped, f) for f in swapped.__dataclass_fields__}
                                          ).peer_buddies(replicas=replicas), "computed afresh"
    if all(rack[new] == placement.rack_of_node[old] for old, new in zip(olds, news)):
        assert after is before, "a spare of the lost node's own rack takes its place and its partners"


def test_a_swap_that_would_put_partners_in_one_rack_computes_the_buddies_afresh() -> None:
    from controller.placement import Placement, place, swap_nodes
    from controller.topology import Topology
    from trainer.config import MeshShape

    topology = Topology.from_local(nodes=6, gpus_per_node=2, racks=2, spares=0)
    placement = place(MeshShape(dp=4, pp=1, tp=2), topology)
    before = placement.peer_buddies()
    assert topology.node("node-2").rack == "rack-0" and topology.node("node-3").rack == "rack-1"
    swapped = swap_nodes(placement, {"node-2": "node-3"}, topology)  # node-2's partner is on rack-1
    assert swapped.peer_buddies() is not before
    assert swapped.peer_buddies() == Placement(**{f: getattr(swapped, f) for f in swapped.__dataclass_fields__}).peer_buddies()
