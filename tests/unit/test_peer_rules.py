"""The peer snapshot rules (checkpointing/peer.py): buddies on other nodes and racks, and the step a
recovery may load only when every rank's copy survives somewhere it can be read."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from checkpointing.peer import (
    Copy, Held, PeerPoint, buddies, drop_marker, forget_attempts_before, held_copies, holdings, peer_point,
    replica_buddies, replica_peer_point, run_key, sender_of, words_checksum, write_marker,
)
from controller.placement import place
from controller.topology import Topology
from trainer.config import MeshShape


def _copy(rank: int, *, step: int = 7, attempt: int = 0, world: int = 4, role: str = "own") -> Copy:
    return Copy(attempt=attempt, rank=rank, world_size=world, step=step, cursor=step * 16,
                mesh={"dp": 2, "pp": 2, "tp": 1}, identity="id", role=role, nbytes=10)


def _reported(copies: dict[str, list[Copy]]) -> dict:
    """What each node tells the controller of its copies."""
    return {node: holdings(held) for node, held in copies.items()}


def test_buddies_of_make_runs_placement_are_the_same_stage_of_the_other_replica_in_the_other_rack() -> None:
    topology = Topology.from_local(nodes=5, gpus_per_node=2, racks=2, spares=1)
    p = place(MeshShape(dp=2, pp=2, tp=2), topology)
    buddy = buddies(p.node_of_rank, p.rack_of_node)
    assert buddy is not None and sorted(buddy) == list(range(8))
    for rank, keeper in enumerate(buddy):
        assert p.node_of_rank[keeper] != p.node_of_rank[rank]
        assert p.rack_of_node[p.node_of_rank[keeper]] != p.rack_of_node[p.node_of_rank[rank]]
        assert MeshShape(dp=2, pp=2, tp=2).rank_coords(keeper) | {"dp": 0} == \
            MeshShape(dp=2, pp=2, tp=2).rank_coords(rank) | {"dp": 0}
    assert [buddy[s] for s in sender_of(buddy)] == list(range(8))


def test_buddies_need_two_nodes_and_prefer_another_rack() -> None:
    assert buddies(["a", "a", "a"], {"a": "r0"}) is None
    nodes = ["a", "a", "b", "b", "c", "c"]
    racks = {"a": "r0", "b": "r0", "c": "r1"}
    buddy = buddies(nodes, racks)
    assert buddy is not None
    assert all(nodes[buddy[r]] != nodes[r] for r in range(6))
    # Four of six ranks sit in r0: at least two pairs must stay in it, and no more than that do.
    assert sum(racks[nodes[buddy[r]]] == racks[nodes[r]] for r in range(6)) == 2


def test_replica_buddies_stay_inside_their_replica_on_another_node() -> None:
    """failure_domain replica: a replica's snapshots travel on its own world, so its ranks keep each
    other's copies: local ranks, a permutation per replica, never on the rank's own node."""
    topology = Topology.from_local(nodes=5, gpus_per_node=2, racks=2, spares=1)
    mesh = MeshShape(dp=2, pp=2, tp=2, dp_replicas=2)
    p = place(mesh, topology)
    buddy = replica_buddies(p.node_of_rank, p.rack_of_node, 2)
    assert buddy is not None and len(buddy) == 8
    for k in range(2):
        local = buddy[4 * k:4 * k + 4]
        assert sorted(local) == [0, 1, 2, 3]
        for r, keeper in enumerate(local):
            assert p.node_of_rank[4 * k + keeper] != p.node_of_rank[4 * k + r]
            assert {p.node_of_rank[4 * k + keeper]} <= set(p.node_of_rank[4 * k:4 * k + 4])
    # a replica on one node has no copy that could outlive it
    assert replica_buddies(["a", "a", "b", "b"], {"a": "r0", "b": "r0"}, 2) is None


def test_a_replica_loads_the_peer_step_only_from_its_own_nodes_and_the_others_receive_it() -> None:
    """Copies named by local rank, world 2 per replica. Replica 0 runs on n0+n1 (both alive, step 7
    whole there); replica 1 on n2+n4: n2 holds its copies of step 7 whole (its own and n3's, lost),
    n4 (the spare) nothing. A third replica on fresh nodes loads nothing: it receives the state."""
    def copies(rank: int, keeper_of: int, step: int = 7) -> list[Copy]:
        return [_copy(rank, world=2, step=step), _copy(keeper_of, world=2, step=step, role="buddy")]

    held = _reported({"n0": copies(0, 1), "n1": copies(1, 0), "n2": copies(0, 1), "n3": copies(1, 0),
                      "n6": [_copy(0, world=2, step=9)]})
    point, loaders, why = replica_peer_point(held, identity="id", replica_nodes=[{"n0", "n1"}, {"n2", "n4"}, {"n5", "n7"}])
    assert point is not None and (point.step, point.world_size) == (7, 2) and loaders == (0, 1), why
    # only what a replica's own nodes hold counts: n6's step 9 lacks local rank 1 (its copies were lost)
    point, loaders, _ = replica_peer_point(held, identity="id", replica_nodes=[{"n6", "n5"}, {"n2"}])
    assert point is not None and point.step == 7 and loaders == (1,)
    point, loaders, why = replica_peer_point(held, identity="id", replica_nodes=[{"n6"}, {"n5"}])
    assert point is None and loaders == () and "rank(s) [1]" in why
    # a newer step whole on one replica's nodes wins; the replicas holding only older ones receive it
    held["n5"] = holdings(copies(0, 1, step=9) + copies(1, 0, step=9))
    point, loaders, _ = replica_peer_point(held, identity="id", replica_nodes=[{"n0", "n1"}, {"n5"}])
    assert point is not None and point.step == 9 and loaders == (1,)
    # an SDC rollback's exclusion holds per replica as it does for the world
    point, loaders, _ = replica_peer_point(held, identity="id", replica_nodes=[{"n0", "n1"}, {"n5"}], excluded=[(0, 7)])
    assert point is not None and point.step == 7 and loaders == (0,)


def test_the_agreed_step_needs_every_ranks_copy_on_a_node_of_the_new_attempt() -> None:
    held = {
        "n0": [_copy(0), _copy(1), _copy(2, role="buddy"), _copy(3, role="buddy")],
        "n1": [_copy(2), _copy(3), _copy(0, role="buddy"), _copy(1, role="buddy")],
    }
    point, _ = peer_point(_reported(held), identity="id", nodes={"n0", "n2"})
    assert point is not None and (point.step, point.cursor, point.world_size) == (7, 112, 4)
    # A node and its buddies' node lost together: rank 2 and 3's copies are gone.
    point, why = peer_point(_reported({"n0": held["n0"][:2]}), identity="id", nodes={"n0"})
    assert point is None and "rank(s) [2, 3]" in why
    # A node off the new attempt's nodes cannot send what it holds.
    assert peer_point(_reported(held), identity="id", nodes={"n1"})[0] is not None
    assert peer_point(_reported({"n9": held["n0"]}), identity="id", nodes={"n0"})[0] is None
    # Another model's snapshots are never loaded.
    assert peer_point(_reported(held), identity="other", nodes={"n0", "n1"})[0] is None


def test_the_newest_complete_step_wins_and_an_sdc_rollback_excludes_later_snapshots() -> None:
    old = [_copy(r, step=5) for r in range(4)]
    newer = [_copy(r, step=6) for r in range(3)]  # rank 3's copy of step 6 is still being written
    point, _ = peer_point(_reported({"n0": old + newer}), identity="id", nodes={"n0"})
    assert point is not None and point.step == 5
    newest = [_copy(r, step=9, attempt=1) for r in range(4)]
    point, _ = peer_point(_reported({"n0": old + newest}), identity="id", nodes={"n0"})
    assert point is not None and (point.attempt, point.step) == (1, 9)
    point, _ = peer_point(_reported({"n0": old + newest}), identity="id", nodes={"n0"}, excluded=[(1, 8)])
    assert point is not None and (point.attempt, point.step) == (0, 5)


def test_a_node_reports_one_record_per_snapshot_step_naming_each_rank_once() -> None:
    copies = [_copy(1), _copy(0, role="buddy"), _copy(1, role="buddy"), _copy(3, step=8), _copy(2)]
    mesh = {"dp": 2, "pp": 2, "tp": 1}
    assert holdings(copies) == [Held(attempt=0, step=7, cursor=112, world_size=4, mesh=mesh, identity="id",
                                     ranks=(0, 1, 2)),
                                Held(attempt=0, step=8, cursor=128, world_size=4, mesh=mesh, identity="id",
                                     ranks=(3,))]
    assert holdings([]) == []


def _report(step: int, rank: int = 3) -> dict:
    return {"rank": rank, "attempt": 0, "step": step, "cursor": step * 16, "loss": 5.0 - step / 10,
            "step_time_s": 0.1, "data_s": 0.0, "compute_s": 0.1, "wait_s": 0.0, "tokens_per_s": 1.0}


def test_the_reports_a_step_s_markers_carry_reach_the_point_from_any_node_that_holds_it() -> None:
    """Rank 3 knows the loss; its own copy (on n1, lost) and the copy n0 keeps for it carry its reports
    of steps 6 and 7 (a snapshot every 2 steps). The point from n0 alone carries them once, by step."""
    with_reports = dict(reports=[_report(7), _report(6)])
    n0 = [_copy(0), _copy(1), Copy(**{**_copy(3, role="buddy").__dict__, **with_reports}),
          _copy(2, role="buddy")]
    n1 = [Copy(**{**_copy(3).__dict__, **with_reports}), _copy(2)]
    (held,) = holdings(n0)
    assert [r["step"] for r in held.reports] == [6, 7]
    point, why = peer_point(_reported({"n0": n0, "n1": n1}), identity="id", nodes={"n0", "n2"})
    assert point is not None, why
    assert [(r["step"], r["loss"]) for r in point.reports] == [(6, 4.4), (7, 4.3)]
    point, _ = peer_point(_reported({"n0": n0 + [_copy(r, step=9) for r in range(4)]}), identity="id", nodes={"n0"})
    assert point is not None and point.step == 9 and point.reports == (), "another step's reports are not its"


def reference_peer_point(held: dict[str, list[Copy]], *, identity: str, nodes: set[str],
                         excluded: list[tuple[int, int]]) -> PeerPoint | None:
    """The rule over every copy, as it read before nodes reported `Held` records."""
    sets: dict[tuple[int, int], dict[int, Copy]] = {}
    for node in sorted(held):
        if node not in nodes:
            continue
        for copy in held[node]:
            if copy.identity != identity or any(copy.attempt == a and copy.step > after for a, after in excluded):
                continue
            sets.setdefault((copy.attempt, copy.step), {}).setdefault(copy.rank, copy)
    for (attempt, step), ranks in sorted(sets.items(), key=lambda kv: (kv[0][1], kv[0][0]), reverse=True):
        any_copy = next(iter(ranks.values()))
        if set(ranks) == set(range(any_copy.world_size)):
            return PeerPoint(attempt=attempt, step=step, cursor=any_copy.cursor, world_size=any_copy.world_size,
                             mesh=dict(any_copy.mesh))
    return None


@pytest.mark.parametrize("seed", range(40))
def test_the_step_agreed_on_reported_records_is_the_one_every_copy_gives(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.choice([2, 4, 6, 8])
    names = [f"n{i}" for i in range(rng.randint(2, 5))]
    held: dict[str, list[Copy]] = {n: [] for n in names}
    for attempt in range(rng.randint(1, 2)):
        for step in rng.sample(range(1, 12), rng.randint(1, 3)):
            for rank in range(world):
                for role in ("own", "buddy"):
                    if rng.random() < 0.8:  # the rest lost with a node, or torn
                        held[rng.choice(names)].append(
                            _copy(rank, step=step, attempt=attempt, world=world, role=role))
    for copies in held.values():
        rng.shuffle(copies)
    nodes = set(rng.sample(names, rng.randint(1, len(names))))
    excluded = [(0, rng.randint(0, 12))] if rng.random() < 0.3 else []
    point, why = peer_point(_reported(held), identity="id", nodes=nodes, excluded=excluded)
    assert point == reference_peer_point(held, identity="id", nodes=nodes, excluded=excluded)
    assert (point is None) == bool(why)


def test_markers_say_what_is_complete(tmp_path: Path) -> None:
    copy = _copy(1)
    (tmp_path / copy.stem).write_bytes(b"x" * 10)
    (tmp_path / f"{copy.stem}.meta").write_bytes(b"m")
    assert held_copies(tmp_path) == []  # no marker: not a copy
    write_marker(tmp_path, copy)
    assert held_copies(tmp_path) == [copy]
    (tmp_path / copy.stem).write_bytes(b"x" * 9)
    assert held_copies(tmp_path) == [], "a file shorter than its marker says is no copy"
    (tmp_path / copy.stem).write_bytes(b"x" * 10)
    drop_marker(tmp_path, copy.stem)
    assert held_copies(tmp_path) == []
    write_marker(tmp_path, copy)
    later = _copy(0, attempt=2)
    for name in (later.stem, f"{later.stem}.meta"):
        (tmp_path / name).write_bytes(b"x" * 10)
    write_marker(tmp_path, later)
    forget_attempts_before(tmp_path, 2)
    assert held_copies(tmp_path) == [later]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([later.stem, f"{later.stem}.meta", f"{later.stem}.json"])


def reference_buddies(node_of_rank: list[str] | tuple[str, ...], rack_of_node: dict[str, str], *,
            tries: int = 64) -> list[int] | None:
    """The buddy rule written plainly, rank by rank (what `buddies` computes on columns)."""
    world = len(node_of_rank)
    if len(set(node_of_rank)) < 2:
        return None
    order = sorted(range(world), key=lambda r: (rack_of_node.get(node_of_rank[r], ""), node_of_rank[r], r))
    half = world // 2
    shifts = sorted(range(1, world), key=lambda s: (abs(s - half), s))[:tries]
    rack = [rack_of_node.get(node_of_rank[r]) for r in range(world)]
    best: tuple[int, int, list[int]] | None = None
    for shift in shifts:
        buddy = [0] * world
        for i, rank in enumerate(order):
            buddy[rank] = order[(i + shift) % world]
        if any(node_of_rank[r] == node_of_rank[buddy[r]] for r in range(world)):
            continue
        same_rack = sum(rack[r] == rack[buddy[r]] for r in range(world))
        score = (same_rack, abs(shift - half))
        if best is None or score < best[:2]:
            best = (*score, buddy)
        if same_rack == 0:
            break
    return best[2] if best is not None else None


@pytest.mark.parametrize("seed", range(30))
def test_buddies_match_the_plain_rule_on_random_placements(seed: int) -> None:
    """Random node names and racks (some nodes without one), ranks dealt unevenly: the same buddies
    as the rank-by-rank reference, including None."""
    rng = random.Random(seed)
    nodes = [f"n{rng.randrange(1000)}" for _ in range(rng.randrange(1, 12))]
    racks = {n: f"r{rng.randrange(3)}" for n in nodes if rng.random() < 0.8}
    node_of_rank = [rng.choice(nodes) for _ in range(rng.randrange(1, 60))]
    tries = rng.choice([1, 4, 64])
    assert buddies(node_of_rank, racks, tries=tries) == reference_buddies(node_of_rank, racks, tries=tries)


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 4096 + 5])
def test_the_checksum_is_the_sum_of_the_words_and_catches_any_flipped_bit(size: int) -> None:
    rng = random.Random(size)
    data = bytearray(rng.getrandbits(8) for _ in range(size))
    padded = bytes(data[:size - size % 8])
    reference = sum(int.from_bytes(padded[i:i + 8], "little", signed=True) for i in range(0, len(padded), 8))
    reference += sum(data[len(padded):])
    assert words_checksum(data) % 2**64 == reference % 2**64 and -2**63 <= words_checksum(data) < 2**63
    for _ in range(min(size * 8, 40)):
        flipped = bytearray(data)
        bit = rng.randrange(size * 8)
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert words_checksum(flipped) != words_checksum(data), f"bit {bit} flipped unseen"


def test_a_run_key_tells_runs_of_the_same_name_apart() -> None:
    assert run_key("tiny-gpt", 1.5) == run_key("tiny-gpt", 1.5)
    assert run_key("tiny-gpt", 1.5) != run_key("tiny-gpt", 1.5000001)
    assert run_key("tiny-gpt", 1.5).startswith("tiny-gpt-") and run_key("a", 1.5) != run_key("b", 1.5)


def test_a_new_attempt_keeps_only_the_step_it_loaded_of_older_attempts(tmp_path: Path) -> None:
    loaded, other, older = _copy(0, step=6), _copy(1, step=5), _copy(0, step=5, attempt=1)
    loaded = Copy(**{**loaded.__dict__, "slot": 1})
    for copy in (loaded, other, older):
        for name in (copy.stem, f"{copy.stem}.meta"):
            (tmp_path / name).write_bytes(b"x" * 10)
        write_marker(tmp_path, copy)
    forget_attempts_before(tmp_path, 2, keep=(0, 6))
    assert held_copies(tmp_path) == [loaded]
    forget_attempts_before(tmp_path, 2)
    assert list(tmp_path.iterdir()) == []
