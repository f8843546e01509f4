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
    from controller.placement import place, swap_nodes
    from controller.topology import Topology
    from trainer.config import MeshShape

    topology = Topology.from_local(nodes=8, gpus_per_node=2, racks=2, spares=0)
    placement = place(MeshShape(dp=3, pp=1, tp=2), topology)
    placement.node_codes  # (computed: a swap carries them over)
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
