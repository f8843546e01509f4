"""Planner and placer, table-driven: TP groups never span nodes, PP neighbours share a rack when the
racks allow, spares and excluded nodes stay unused, infeasible requests say what is short."""

from __future__ import annotations

import json
import random

import pytest

from controller.placement import Placement, PlacementError, place, ranks_on, recorded_nodes, swap_nodes
from controller.planner import PlanError, plan_mesh, static_state_bytes
from controller.topology import Node, NodeState, Topology
from trainer.config import MeshShape, ModelConfig, TrainConfig

TINY = ModelConfig(n_layers=4, d_model=128, n_heads=4, vocab_size=256, seq_len=128)
TRAIN = TrainConfig(steps=10, global_batch=16, micro_batch=2)
LLAMA_7B = ModelConfig(n_layers=32, d_model=4096, n_heads=32, vocab_size=32000, seq_len=4096, ffn_hidden=11008)
LLAMA_70B = ModelConfig(n_layers=80, d_model=8192, n_heads=64, vocab_size=32000, seq_len=4096, ffn_hidden=24576)
BIG_TRAIN = TrainConfig(steps=10, global_batch=1024, micro_batch=1)


def topo(nodes: int, gpus: int, racks: int, spares: int = 0, gb: float = 80.0) -> Topology:
    return Topology.from_local(nodes=nodes, gpus_per_node=gpus, racks=racks, spares=spares, gpu_memory_gb=gb)


def check_rules(p, topology: Topology, excluded: frozenset[str] = frozenset()) -> None:
    mesh = p.mesh
    assert len(p.node_of_rank) == mesh.world_size
    pairs = list(zip(p.node_of_rank, p.gpu_of_rank))
    assert len(set(pairs)) == len(pairs), "two ranks on one GPU"
    for rank in range(0, mesh.world_size, mesh.tp):
        assert len(set(p.node_of_rank[rank:rank + mesh.tp])) == 1, f"TP group at rank {rank} spans nodes"
    forbidden = {n.name for n in topology.nodes if n.state is not NodeState.HEALTHY} | excluded
    assert not forbidden & set(p.node_of_rank)
    assert p.nodes_used() == sorted(set(p.node_of_rank)), "rack_of_node holds exactly the nodes used"
    for node, gpu in pairs:
        assert 0 <= gpu < topology.node(node).num_gpus


@pytest.mark.parametrize(
    "mesh, nodes, gpus, racks, spares, excluded",
    [
        ((2, 2, 2), 4, 2, 2, 0, ()),
        ((2, 2, 2), 5, 2, 2, 1, ()),
        ((2, 2, 2), 5, 2, 2, 0, ("node-1",)),
        ((1, 4, 2), 4, 2, 2, 0, ()),
        ((4, 2, 4), 8, 8, 4, 0, ()),
        ((3, 1, 8), 4, 8, 2, 1, ()),
        ((2, 3, 1), 3, 2, 3, 0, ()),
    ],
)
def test_place_follows_rules(mesh, nodes, gpus, racks, spares, excluded) -> None:
    t = topo(nodes, gpus, racks, spares)
    dp, pp, tp = mesh
    p = place(MeshShape(dp=dp, pp=pp, tp=tp), t, frozenset(excluded))
    check_rules(p, t, frozenset(excluded))
    again = place(MeshShape(dp=dp, pp=pp, tp=tp), Topology(t.nodes), frozenset(excluded))
    assert p == again and p is not again, "not deterministic (a fresh topology places it anew)"
    assert place(MeshShape(dp=dp, pp=pp, tp=tp), t, frozenset(excluded)) is p, "the same topology remembers it"


@pytest.mark.parametrize("racks, expect_same_rack", [(2, True), (1, True)])
def test_pipeline_neighbours_share_a_rack_when_racks_allow(racks: int, expect_same_rack: bool) -> None:
    t = topo(8, 2, racks)
    p = place(MeshShape(dp=2, pp=4, tp=2), t)
    for rank in range(p.mesh.world_size):
        c = p.mesh.rank_coords(rank)
        if c["pp"] + 1 < p.mesh.pp:
            nxt = rank + p.mesh.tp
            same = p.rack_of_node[p.node_of_rank[rank]] == p.rack_of_node[p.node_of_rank[nxt]]
            assert same == expect_same_rack


def test_pipeline_spills_across_racks_only_when_it_must() -> None:
    """3 racks of 1 node x 2 GPUs, pp3 tp2: one pipeline must cross racks; it still gets placed."""
    t = topo(3, 2, 3)
    p = place(MeshShape(dp=1, pp=3, tp=2), t)
    check_rules(p, t)
    assert len(set(p.node_of_rank)) == 3


@pytest.mark.parametrize(
    "mesh, nodes, gpus, spares, excluded, message",
    [
        ((2, 2, 2), 4, 2, 1, (), "needs 8 GPUs .* the 3 usable nodes \\(6 GPUs\\) hold 1 such pipelines"),
        ((2, 2, 2), 4, 2, 0, ("node-0", "node-3"), "the 2 usable nodes \\(4 GPUs\\)"),
        ((1, 1, 4), 4, 2, 0, (), "tp = 4 does not fit"),
    ],
)
def test_place_infeasible(mesh, nodes, gpus, spares, excluded, message) -> None:
    dp, pp, tp = mesh
    with pytest.raises(PlacementError, match=message):
        place(MeshShape(dp=dp, pp=pp, tp=tp), topo(nodes, gpus, 2, spares), frozenset(excluded))


def test_memory_model_matches_the_playbook() -> None:
    assert static_state_bytes(7_000_000_000) == 112_000_000_000
    assert static_state_bytes(70_000_000_000) == 1_120_000_000_000
    assert 6.5e9 < LLAMA_7B.num_params() < 7.0e9
    assert 68e9 < LLAMA_70B.num_params() < 71e9


def test_70b_does_not_fit_one_node_of_h100s() -> None:
    with pytest.raises(PlanError, match=r"needs 1,1\d\d\.\d GB of static training state \(>= 1[45] GPUs"):
        plan_mesh(LLAMA_70B, BIG_TRAIN, topo(1, 8, 1, gb=80 * 1e9 / 2**30))


def test_70b_fits_four_nodes_with_model_parallelism() -> None:
    plan = plan_mesh(LLAMA_70B, BIG_TRAIN, topo(4, 8, 2, gb=80 * 1e9 / 2**30))
    assert plan.memory_per_gpu_bytes <= 80e9
    assert plan.mesh.world_size <= 32 and plan.mesh.tp <= 8
    assert plan.mesh.tp * plan.mesh.pp > 1, "1.1 TB over 32 GPUs with activations needs model parallelism"


@pytest.mark.parametrize(
    "model, train, nodes, gpus, expected",
    [
        (TINY, TRAIN, 4, 2, MeshShape(dp=8, pp=1, tp=1)),   # tiny: pure dp
        (TINY, TrainConfig(steps=1, global_batch=4, micro_batch=2), 4, 2, MeshShape(dp=2, pp=1, tp=1)),
        (LLAMA_7B, BIG_TRAIN, 2, 8, MeshShape(dp=16, pp=1, tp=1)),
    ],
)
def test_auto_plan(model, train, nodes, gpus, expected) -> None:
    plan = plan_mesh(model, train, topo(nodes, gpus, 1, gb=80 * 1e9 / 2**30))
    assert plan.mesh == expected
    assert plan.explanation


def test_auto_plan_prefers_tp_before_pp() -> None:
    # Static state alone fits with FSDP over 16 GPUs, activations of seq 4096 x micro 8 do not: tp first.
    train = TrainConfig(steps=1, global_batch=128, micro_batch=8)
    plan = plan_mesh(LLAMA_7B, train, topo(2, 8, 1, gb=80 * 1e9 / 2**30))
    assert plan.mesh.tp > 1 and plan.mesh.pp == 1


def test_fixed_mesh_bigger_than_cluster() -> None:
    with pytest.raises(PlanError, match=r"dp\*pp\*tp = 4\*2\*2 = 16 GPUs but the healthy nodes offer 8"):
        plan_mesh(TINY, TrainConfig(steps=1, global_batch=16, micro_batch=1), topo(4, 2, 2),
                  fixed=MeshShape(dp=4, pp=2, tp=2))


def test_heterogeneous_nodes_are_not_mixed_into_tp_groups() -> None:
    t = Topology((Node(name="a", rack="r", num_gpus=4, gpu_memory_bytes=1),
                  Node(name="b", rack="r", num_gpus=2, gpu_memory_bytes=1)))
    p = place(MeshShape(dp=3, pp=1, tp=2), t)
    check_rules(p, t)


def test_rows_match_the_coordinates_and_the_event_columns_give_the_placement_back() -> None:
    """Rows (the REST form) say what rank_coords says; an attempt_started event's columns, and the rows
    older events recorded, give the same Placement back (through JSON, as the registry keeps them)."""
    mesh = MeshShape(dp=2, pp=2, tp=2)
    racks = {f"n{i}": f"r{i % 2}" for i in range(4)}  # the nodes used (n4 is a spare)
    p = Placement(mesh=mesh, node_of_rank=tuple(f"n{r // 2}" for r in range(8)),
                  gpu_of_rank=tuple(r % 2 for r in range(8)), rack_of_node=racks, spares=("n4",))
    rows = list(p.rows())
    assert rows == [{"rank": r, **mesh.rank_coords(r), "node": p.node_of_rank[r], "rack": racks[p.node_of_rank[r]],
                     "gpu": p.gpu_of_rank[r]} for r in range(8)]
    for recorded in (p.columns(), rows[::-1]):
        back = json.loads(json.dumps(recorded))
        assert Placement.recorded(back, mesh, ["n4"]) == p
        assert recorded_nodes(back) == {"n0", "n1", "n2", "n3"} == set(p.nodes_used())


def reference_place(mesh: MeshShape, topology: Topology, excluded: frozenset[str] = frozenset()) -> Placement:
    """The placement rules written plainly, slot by slot (what `place` computes in columns)."""
    nodes = topology.usable(excluded)
    racks: dict[str, list[Node]] = {}
    for n in nodes:
        racks.setdefault(n.rack, []).append(n)
    pipelines: list[list[tuple[str, int]]] = []
    leftovers: list[tuple[str, int]] = []
    for rack in sorted(racks):
        slots = [(n.name, g) for n in racks[rack] for g in range(0, n.num_gpus - mesh.tp + 1, mesh.tp)]
        whole = len(slots) // mesh.pp * mesh.pp
        pipelines.extend(slots[i:i + mesh.pp] for i in range(0, whole, mesh.pp))
        leftovers.extend(slots[whole:])
    pipelines.extend(leftovers[i:i + mesh.pp] for i in range(0, len(leftovers) - mesh.pp + 1, mesh.pp))
    if len(pipelines) < mesh.dp:
        raise PlacementError("too small")
    node_of_rank = [node for pipeline in pipelines[:mesh.dp] for node, _ in pipeline for _ in range(mesh.tp)]
    gpu_of_rank = [g + t for pipeline in pipelines[:mesh.dp] for _, g in pipeline for t in range(mesh.tp)]
    return Placement(mesh=mesh, node_of_rank=tuple(node_of_rank), gpu_of_rank=tuple(gpu_of_rank),
                     rack_of_node={n.name: n.rack for n in nodes if n.name in set(node_of_rank)},
                     spares=tuple(n.name for n in topology.spares() if n.name not in excluded))


@pytest.mark.parametrize("seed", range(40))
def test_place_matches_the_plain_rules_on_random_clusters(seed: int) -> None:
    """Mixed GPU counts, uneven racks, lost, quarantined, spare and excluded nodes: the same placement
    as the plain reference, or the same refusal."""
    rng = random.Random(seed)
    states = [NodeState.HEALTHY] * 6 + [NodeState.SPARE, NodeState.LOST, NodeState.QUARANTINED]
    nodes = tuple(Node(name=f"node-{i}", rack=f"rack-{rng.randrange(4)}", num_gpus=rng.choice([2, 4, 8, 8]),
                       gpu_memory_bytes=1, state=rng.choice(states)) for i in range(rng.randrange(1, 40)))
    t = Topology(nodes)
    excluded = frozenset(n.name for n in nodes if rng.random() < 0.1)
    mesh = MeshShape(dp=rng.randrange(1, 9), pp=rng.choice([1, 2, 3, 4]), tp=rng.choice([1, 2]))
    try:
        expected = reference_place(mesh, t, excluded)
    except PlacementError:
        with pytest.raises(PlacementError):
            place(mesh, t, excluded)
        return
    got = place(mesh, t, excluded)
    assert got == expected
    check_rules(got, t, excluded)


@pytest.mark.parametrize("seed", range(20))
def test_a_derived_topology_answers_as_a_fresh_one(seed: int) -> None:
    """with_states carries what a topology computed once (order, index, columns, nodes by state) over
    to the topology it derives: what it answers equals what the same nodes answer from scratch."""
    rng = random.Random(seed)
    states = list(NodeState)
    t = Topology(tuple(Node(name=f"node-{i}", rack=f"rack-{rng.randrange(3)}", num_gpus=rng.choice([4, 8]),
                            gpu_memory_bytes=1, state=rng.choice(states)) for i in range(rng.randrange(2, 30))))
    mesh = MeshShape(dp=1, pp=rng.choice([1, 2]), tp=rng.choice([1, 2, 4]))
    for _ in range(4):
        try:
            place(mesh, t)  # computes the caches that carry over
        except PlacementError:
            pass
        t.spares(), t.names_in(NodeState.LOST)
        t = t.with_states({n.name: rng.choice(states) for n in rng.sample(t.nodes, rng.randrange(1, 4))})
        fresh = Topology(t.nodes)
        assert t.with_state("not-a-node", NodeState.LOST) == t, "an unknown name changes nothing"
        excluded = frozenset(n.name for n in t.nodes if rng.random() < 0.2)
        assert t.usable(excluded) == fresh.usable(excluded) and t.spares() == fresh.spares()
        assert all(t.names_in(s) == fresh.names_in(s) for s in states)
        for name in ("name", "rack", "rack_id", "num_gpus"):
            ours, theirs = getattr(t.usable_columns(excluded), name), getattr(fresh.usable_columns(excluded), name)
            assert ours.tolist() == theirs.tolist()
        gone = frozenset(n.name for n in t.nodes if rng.random() < 0.3)
        assert t.without(gone) == Topology(tuple(n for n in t.nodes if n.name not in gone))
        assert t.without(gone).names == fresh.names - gone


@pytest.mark.parametrize("seed", range(4))
def test_ranks_on_and_swap_nodes_match_a_pass_over_the_ranks(seed: int) -> None:
    """`ranks_on` answers from an index kept per placement, and `swap_nodes` derives the moved placement's
    index from the old one: both checked against a plain pass over node_of_rank, with swaps that move a
    node to a spare, exchange two used nodes, and chain one after the other."""
    rng = random.Random(seed)
    t = topo(12, 4, 3, spares=2)
    p = place(MeshShape(dp=4, pp=2, tp=2), t)
    for _ in range(3):
        used, spare = p.nodes_used(), list(p.spares)
        a, b = rng.sample(used, 2)
        swaps = {a: b, b: a} if not spare or rng.random() < 0.5 else {a: spare[0]}
        moved = swap_nodes(p, swaps, t)
        for node in set(moved.node_of_rank) | set(p.node_of_rank) | set(swaps.values()):
            assert ranks_on(moved.node_of_rank, (node,)) == [r for r, n in enumerate(moved.node_of_rank) if n == node]
        for rank, node in enumerate(p.node_of_rank):
            assert moved.node_of_rank[rank] == swaps.get(node, node)
        assert ranks_on(p.node_of_rank, used[:2]) == [r for r, n in enumerate(p.node_of_rank) if n in used[:2]]
        p = moved
