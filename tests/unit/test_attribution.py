"""Failures are attributed to their cause, not to the survivors that noticed."""

from __future__ import annotations

from controller.attribution import attribute
from controller.failure_policy import FailureCause

NODES = ("n0", "n0", "n1", "n1")
GLOO = "RayTaskError: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"


def run(**kw):  # type: ignore[no-untyped-def]
    base = dict(errors={}, dead_nodes=set(), dead_ranks=set(), unresponsive=set(), node_of_rank=NODES,
                signal_age_s=5.0)
    return attribute(1.0, **{**base, **kw})


def test_dead_node_wins_at_once() -> None:
    f = run(errors={0: GLOO}, dead_ranks={2, 3}, dead_nodes={"n1"}, signal_age_s=0.0)
    assert f is not None and f.cause is FailureCause.NODE_LOST and f.nodes == ("n1",) and f.ranks == (2, 3)


def test_dead_rank_waits_for_grace_then_names_the_rank() -> None:
    assert run(errors={1: GLOO}, dead_ranks={2}, signal_age_s=1.0) is None
    f = run(errors={1: GLOO, 3: GLOO}, dead_ranks={2})
    assert f is not None and f.cause is FailureCause.RANK_DIED and f.ranks == (2,) and f.nodes == ()


def test_process_death_under_a_live_actor_needs_no_grace() -> None:
    f = run(errors={1: GLOO}, dead_ranks={2}, on_live_nodes={2}, signal_age_s=0.0)
    assert f is not None and f.cause is FailureCause.RANK_DIED and f.ranks == (2,)
    assert run(dead_ranks={2, 3}, on_live_nodes={2}, signal_age_s=0.0) is None, "rank 3's node may be dying"


def test_hung_rank_is_the_one_that_stopped_answering() -> None:
    f = run(errors={0: "DistBackendError: Timed out", 1: GLOO, 3: GLOO}, unresponsive={2})
    assert f is not None and f.cause is FailureCause.HANG and f.ranks == (2,)


def test_own_exception_beats_collective_symptoms() -> None:
    f = run(errors={0: GLOO, 1: "Traceback\nValueError: boom"})
    assert f is not None and f.cause is FailureCause.WORKER_ERROR and f.ranks == (1,)


def test_only_symptoms() -> None:
    f = run(errors={0: GLOO, 1: GLOO})
    assert f is not None and f.cause is FailureCause.COLLECTIVE_ERROR


def test_nothing_failed() -> None:
    assert run() is None


def test_all_ranks_of_a_node_dead_waits_for_the_node_verdict() -> None:
    assert run(errors={0: GLOO}, dead_ranks={2, 3}, signal_age_s=10.0) is None, "Ray may not know yet"
    f = run(errors={0: GLOO}, dead_ranks={2, 3}, signal_age_s=25.0)
    assert f is not None and f.cause is FailureCause.RANK_DIED and f.ranks == (2, 3)


def test_a_second_node_whose_ranks_all_died_is_waited_for() -> None:
    """Two nodes lost at once are declared dead by Ray a moment apart: one failure names both."""
    nodes = ("n0", "n0", "n1", "n1", "n2", "n2")
    assert run(dead_ranks={2, 3, 4, 5}, dead_nodes={"n1"}, node_of_rank=nodes, signal_age_s=1.0) is None
    f = run(dead_ranks={2, 3, 4, 5}, dead_nodes={"n1", "n2"}, node_of_rank=nodes, signal_age_s=1.5)
    assert f is not None and f.nodes == ("n1", "n2") and f.ranks == (2, 3, 4, 5)
    late = run(dead_ranks={2, 3, 4, 5}, dead_nodes={"n1"}, node_of_rank=nodes, signal_age_s=25.0)
    assert late is not None and late.nodes == ("n1",), "not forever: the dead node is replaced"
    f = run(dead_ranks={2, 3, 4}, dead_nodes={"n1"}, node_of_rank=nodes, signal_age_s=0.0)
    assert f is not None and f.nodes == ("n1",), "rank 5 lives: n2 is not dying"


def test_a_second_node_whose_daemon_is_gone_is_waited_for() -> None:
    """Its ranks may not be known dead yet (Ray reports an actor's death a moment after its worker's),
    but its raylet refuses connections: wait for Ray to declare it, and decide for both."""
    nodes = ("n0", "n0", "n1", "n1", "n2", "n2")
    assert run(errors={0: GLOO}, dead_ranks={2, 3}, dead_nodes={"n1"}, suspect_nodes={"n2"}, node_of_rank=nodes,
               signal_age_s=1.0) is None
    f = run(errors={0: GLOO}, dead_ranks={2, 3}, dead_nodes={"n1", "n2"}, node_of_rank=nodes, signal_age_s=1.5)
    assert f is not None and f.nodes == ("n1", "n2") and f.ranks == (2, 3, 4, 5)
    late = run(errors={0: GLOO}, dead_nodes={"n1"}, suspect_nodes={"n2"}, node_of_rank=nodes, signal_age_s=25.0)
    assert late is not None and late.nodes == ("n1",), "not forever"
    f = run(errors={0: GLOO}, dead_nodes={"n1"}, suspect_nodes={"n1"}, node_of_rank=nodes, signal_age_s=0.0)
    assert f is not None and f.nodes == ("n1",), "a suspect already declared dead is no reason to wait"


def test_a_node_whose_ranks_all_died_and_whose_daemon_is_gone_is_lost_at_once() -> None:
    """Ray's default health checks declare a dead node only after ~30 s. When every rank of a node
    died and the probe finds its raylet refusing connections, the node is lost now; a node whose
    ranks died but whose raylet answers (or is not known to refuse) is waited for, as before."""
    nodes = ("n0", "n0", "n1", "n1")
    f = run(errors={0: GLOO}, dead_ranks={2, 3}, suspect_nodes={"n1"}, node_of_rank=nodes, signal_age_s=0.3)
    assert f is not None and f.cause.value == "node_lost" and f.nodes == ("n1",) and f.ranks == (2, 3)
    assert run(errors={0: GLOO}, dead_ranks={2, 3}, node_of_rank=nodes, signal_age_s=5.0) is None
    assert run(errors={0: GLOO}, dead_ranks={2}, suspect_nodes={"n1"}, node_of_rank=nodes, signal_age_s=0.3) is None, \
        "one rank of it lives: the node is not lost (yet)"


def test_a_meshs_stages_are_computed_as_the_dict_would_hold_them() -> None:
    from controller.attribution import MeshStages
    from trainer.config import MeshShape

    mesh = MeshShape(dp=2, pp=3, tp=2)
    stages = MeshStages(mesh)
    assert dict(stages) == {r: mesh.stage_of(r) for r in range(12)} and len(stages) == 12
    assert 11 in stages and 12 not in stages and -1 not in stages
    # all at once, as the straggler tracker takes them, against the coordinates' own divmod
    assert stages.ranks() == range(12) and stages.stages().tolist() == [mesh.rank_coords(r)["pp"] for r in range(12)]
