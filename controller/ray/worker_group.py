"""The Ray worker group: one actor per GPU slot, in a bundle of its node's placement group (bundle
label selectors pin it there; a launch's reservations are granted all together or released), and one
training process per rank for each attempt, forked for its actor from the node's warm image
(controller/ray/zygote.py). Ranks rendezvous through a TCPStore
hosted here in the controller (never in a rank that can die; a fresh key prefix per attempt).

Why a forked process per attempt (measured, see benchmarks/regroup_vs_restart.py and
benchmarks/recovery_drills.py): a fresh process spends seconds importing torch, while rebuilding the
process group inside a surviving process takes under a second. But a gloo rank blocked in a
collective cannot be freed from inside its process (`abort()` does not interrupt it in torch 2.13),
only by its peers' sockets closing or its timeout. So each node imports torch once (its zygote; an
embedded cluster's nodes share one import, controller/ray/host_image.py) and
forks the rank's training process from that warm image per attempt: ending an attempt is a SIGKILL of
the forked processes (instant, and it frees every peer), starting one is a fork (milliseconds). Spare
nodes get warm actors once the first attempt has stepped (and with every later launch), so a
replacement starts as fast as a survivor. And a training process that did leave its failed attempt (a
peer died: its collective raised) is not ended but parked, and trains its slot's next attempt in place
(benchmarks/survivors_in_place.py: failure -> first step 0.69x of a re-fork on this machine); only the
failed part is replaced.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from controller.attempt import AttemptSpec, GroupStatus, PollResult
from controller.events import EventKind
from controller.ray import detached
from controller.ray import replicas as ray_replicas
from controller.ray import run_store
from controller.ray.heartbeats import HeartbeatWatch, corroborate, isolation
from controller.ray.liveness import node_states
from controller.ray.run_store import NAMESPACE
from controller.ray.rank_actor import UNRESPONSIVE_S, RankActor, RankProcessDied
from health.heartbeat import SilenceVerdict
from trainer.worker import WorkerArgs


DRAIN_WAIT_S = 0.1
"""How long a poll waits for the ranks' drains. A drain to a dead node's actor is failed by Ray only
later (about a second): a poll that waited 0.5 s for it held up the next one, which reads the
survivors' first signals."""

RESERVATION_RETRY_S = 20.0
"""A launch whose reservation on a node Ray has not granted after this long asks for it again (`_ask_again`)."""
SETTLE_WAIT_S = 0.5
"""How long the poll that ends an attempt waits for the drains still out (its last steps' reports)."""


class LaunchAborted(Exception):
    """A start given up because the run was cancelled."""


class RayWorkerGroup:
    def __init__(self, *, store_host: str = "127.0.0.1", launch_timeout_s: float = 120.0,
                 collective_timeout_s: float = 120.0, warm: bool = True, name: str | None = None,
                 interface: str | None = None) -> None:
        self.name = name
        """With a name (the run id), actors are detached and named `{name}/{node}/{k}`: they outlive the
        controller's process, and a restarted controller finds them again (`attach`)."""
        self._made: dict[str, int] = {}
        self.store_host = store_host
        self.launch_timeout_s = launch_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.interface = interface
        """The spec's cluster.interface, for the ranks' collectives (where their node sets none)."""
        self.warm = warm
        """Keep actors (and their training processes' parked state) across attempts; False: fresh actors per attempt."""
        self._store: Any = None
        self._store_host = store_host
        """Where the ranks reach the run's store (controller/ray/run_store.py)."""
        self._pool: dict[str, list[Any]] = {}
        """node -> its warm actors, idle or assigned."""
        self._node_id: dict[str, str] = {}
        """node -> the Ray node id its pooled actors and reservations are on (where known)."""
        self.actors: list[Any] = []
        """This attempt's actor of each rank."""
        self._runs: list[Any] = []
        self._finished: set[int] = set()
        self._failed: set[int] = set()
        self._unanswered: set[int] = set()
        """Ranks whose actor's drain failed in this poll (its process gone, or its node)."""
        self._drains: dict[int, tuple[Any, float]] = {}
        self._nodes: set[str] = set()
        self._node_of_rank: tuple[str, ...] = ()
        self._abort = threading.Event()
        self._groups: dict[str, list[Any]] = {}
        """node -> the placement groups that reserve its GPU slots for this group's actors."""
        self._reservations = 0
        self._growth: list[tuple[str, Any]] = []
        """(node, actor) of the last growth of the pool (undone together when it does not start)."""
        self._growth_group_of: dict[str, Any] = {}
        """node -> the placement group the launch's growth reserved there."""
        self._growth_refs: dict[str, list[Any]] = {}
        """node -> the warm() refs of the actors the launch's growth started there."""
        self.reservations_asked_again = 0
        """How many times a launch asked Ray again for a node's reservation it had not granted."""
        self._warming: dict[str, list[Any]] = {}
        """node -> warm() refs of the actors `prewarm` started there, not yet waited for by a launch."""
        self._peer_key: str | None = None
        """The folder of the run's peer snapshots on the nodes (checkpointing.peer.run_key), once known."""
        self._attempt: AttemptSpec | None = None
        self._replicas: ray_replicas.ReplicaTracking | None = None
        """failure_domain replica: the attempt's membership and the replicas being formed again."""
        self._hearts: HeartbeatWatch | None = None
        """The attempt's heartbeats (controller/ray/heartbeats.py)."""
        self._gone: set[str] = set()
        """Nodes of this attempt declared lost: their actors are not waited for (a dark node answers nothing)."""
        self.isolated: str | None = None
        """Why this controller suspects itself (every node silent at once), while it does; else None."""

    def abort(self) -> None:
        """From any thread: a `start` waiting for its workers gives up within half a second, and so does
        every later one (a cancelled run's group is not used again)."""
        self._abort.set()

    def start(self, attempt: AttemptSpec) -> None:
        import ray
        import torch.distributed as dist

        self._end_attempt()  # (whether this one starts or not, the last one's membership is gone)
        placement = attempt.placement
        world = placement.mesh.world_size
        ranks_per_node = collections.Counter(placement.node_of_rank)  # one pass (not one per node)
        wanted = {node: ranks_per_node[node] for node in placement.nodes_used()}
        if self.warm and self._pool:  # a spare may replace any node: as many warm actors as the fullest one has
            # (a launch with no warm actors yet, a group's first, leaves its spares to `prewarm`, once the
            # attempt has stepped: their actors' start is off the run's startup, ~0.6 CPU-s each)
            wanted |= {spare: max(wanted.values()) for spare in placement.spares}
        self._forget_dead_nodes()
        new = self._grow_pool(wanted)
        # actors started ahead of this launch (`prewarm`) are waited for as its own new ones are
        new += [(node, ref) for node in wanted for ref in self._warming.pop(node, [])]
        if self._store is None:  # (while the new actors start)
            self._store, self._store_host = run_store.open_store(self.name, self.store_host)
        if new:
            refs = [warm for _, warm in new]  # each actor's warm() waits for its bundle, then imports torch
            deadline = time.monotonic() + self.launch_timeout_s
            ready: list[Any] = []
            gone: set[str] = set()
            asked = time.monotonic()
            while len(ready) < len(new) and not self._abort.is_set() and time.monotonic() < deadline and not gone:
                ready, _ = ray.wait(refs, num_returns=len(new), timeout=min(0.5, max(0.0, deadline - time.monotonic())))
                gone = {node for node, _ in new} - _alive_names()  # a node that died meanwhile never starts them
                if len(ready) < len(new) and time.monotonic() - asked > RESERVATION_RETRY_S:
                    asked = time.monotonic()
                    new = self._ask_again(new, ready)
                    refs = [warm for _, warm in new]
            if len(ready) < len(new):
                late = sorted({node for node, warm in new if warm not in ready})
                states = self._reservation_states(late)
                for node in late:  # actors that never started must not be handed out later
                    for actor in self._pool.pop(node, []):
                        ray.kill(actor, no_restart=True)
                for node, actor in self._growth:  # all or nothing: no half-held gang
                    if actor in self._pool.get(node, []):
                        self._pool[node].remove(actor)
                        ray.kill(actor, no_restart=True)
                for group in list(self._growth_group_of.values()):
                    self._drop_reservation(group)
                if self._abort.is_set():
                    raise LaunchAborted(f"the launch was cancelled while workers on {late} were starting")
                if gone:
                    raise RuntimeError(f"node(s) {sorted(gone)} died while their workers were starting")
                raise TimeoutError(f"workers on nodes {late} did not start in {self.launch_timeout_s:.0f} s: "
                                   f"those nodes lack free GPU slots or are gone (their reservations: {states}; "
                                   f"asked again {self.reservations_asked_again} time(s))")
            ray.get(ready)  # an actor that died while importing raises here
        self._peer_key = attempt.peer_key
        self._attempt = attempt
        self._replicas = None
        prefix = f"{attempt.run_id}/attempt-{attempt.attempt}/"
        if attempt.failure_domain == "replica" and placement.mesh.dp_replicas > 1:
            from trainer.protocol import Roster
            from trainer.replica import MembershipBoard

            # replicas whose nodes do not hold the peer snapshot loaded join at epoch 0: a loading one gives them its state
            receiving = tuple(k for k in range(placement.mesh.dp_replicas)
                              if attempt.peer_restore is not None and attempt.peer_replicas is not None
                              and k not in attempt.peer_replicas)
            roster, first = Roster.start(placement.mesh.dp_replicas, receiving)
            self._replicas = ray_replicas.ReplicaTracking(MembershipBoard(dist.PrefixStore(prefix, self._store)),
                                                          placement.mesh.dp_replicas, world, roster)
            self._replicas.board.publish(first)
        taken: dict[str, int] = {}
        self.actors = []
        for node in placement.node_of_rank:
            self.actors.append(self._pool[node][taken.get(node, 0)])
            taken[node] = taken.get(node, 0) + 1
        self._finished, self._failed = set(), set()
        self._drains = {}
        self._nodes = set(placement.node_of_rank)
        self._node_of_rank = tuple(placement.node_of_rank)
        self._runs = [actor.run.remote(self._worker_args(attempt, rank)) for rank, actor in enumerate(self.actors)]
        self.watch_heartbeats(prefix)

    def _worker_args(self, attempt: AttemptSpec, rank: int, incarnation: int = 0) -> WorkerArgs:
        return WorkerArgs(
            rank=rank, world_size=attempt.placement.mesh.world_size, store_host=self._store_host,
            store_port=self._store.port, store_prefix=f"{attempt.run_id}/attempt-{attempt.attempt}/",
            config=attempt.config, attempt=attempt.attempt, start_step=attempt.start_step, cursor=attempt.cursor,
            resume_step=attempt.resume_step if incarnation == 0 else None,
            collective_timeout_s=self.collective_timeout_s,
            run_id=attempt.run_id, checkpoint_uri=attempt.checkpoint_uri,
            checkpoint_every=attempt.checkpoint_every, checkpoint_auto=attempt.checkpoint_auto,
            checkpoint_keep=attempt.checkpoint_keep, mtbf_s=attempt.mtbf_s,
            store_retry_budget_s=attempt.store_retry_budget_s, peer_every=attempt.peer_every,
            peer_buddy=attempt.peer_buddy, peer_restore=ray_replicas.peer_restore(attempt, rank, incarnation),
            peer_key=attempt.peer_key, replica_domain=self._replicas is not None, incarnation=incarnation,
            batch_while_healing=attempt.batch_while_healing, interface=self.interface,
            stoppable=attempt.stoppable and self._replicas is None,
        )

    def request_stop(self, keep: str, reason: str) -> None:
        """The running attempt's ranks stop after their next step boundary with its state kept as asked
        (trainer/stop.py), through the run's store."""
        import torch.distributed as dist

        from trainer.stop import Keep, request_stop

        assert self._attempt is not None and self._store is not None
        prefix = f"{self._attempt.run_id}/attempt-{self._attempt.attempt}/"
        request_stop(dist.PrefixStore(prefix, self._store), Keep[keep.upper()], reason)

    # -- failure_domain replica ---------------------------------------------------------------------
    def contains_replicas(self) -> bool:
        """Whether this attempt runs each replica as its own world (launched so here: an attempt a
        restarted controller re-attached to has no membership to go on with)."""
        return self._replicas is not None

    def lose_replicas(self, replicas: list[int], nodes: tuple[str, ...], *, suspect: bool = False) -> float:
        return ray_replicas.lose_replicas(self, replicas, nodes, suspect=suspect)

    def form_replicas(self, replicas: list[int], placement: Any) -> None:
        ray_replicas.form_replicas(self, replicas, placement)

    def _grow_pool(self, wanted: dict[str, int]) -> list[tuple[str, Any]]:
        """Start actors until each node has `wanted` of them; (node, warm() ref) of the new ones. Their
        GPU slots are reserved first, one placement group per node whose bundles carry a label selector
        for it, all waited for together and released together if any is not granted in time (`start`):
        a launch holds all the slots it needs or none. Per node, not one group for all: Ray re-reserves
        a lost node's bundles when it returns, so a lost node's group is removed (`_forget_node`)
        without touching the warm actors elsewhere."""
        if self.name is not None and not self._made:  # names an earlier controller used stay taken
            for name, _ in self._named():
                node, k = name.split("/")[-2], int(name.rsplit("/", 1)[1])
                self._made[node] = max(self._made.get(node, 0), k + 1)
        self._growth, self._growth_group_of, self._growth_refs = [], {}, {}
        new = []
        for node, count in wanted.items():
            missing = count - len(self._pool.get(node, []))
            if missing > 0:
                new += self._reserve(node, missing)
        return new

    def _reserve(self, node: str, missing: int) -> list[tuple[str, Any]]:
        """Reserve `missing` GPU slots on `node` (one placement group) and start an actor in each;
        (node, warm() ref) of each. Part of the launch's growth (released with it if it fails)."""
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
            self._pool.setdefault(node, []).append(actor)
            new.append((node, actor.warm.remote()))
            self._growth.append((node, actor))
        self._growth_refs[node] = [warm for _, warm in new]
        return new

    def _ask_again(self, new: list[tuple[str, Any]], ready: list[Any]) -> list[tuple[str, Any]]:
        """A launch's reservations that Ray has not granted yet, asked for anew: each node's placement
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
                self._forget(actor)
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

    def _reservation_states(self, nodes: list[str]) -> dict[str, str]:
        """node -> Ray's state of this launch's reservation there (what a launch that timed out says)."""
        from ray.util import placement_group_table

        states = {}
        for node in nodes:
            group = self._growth_group_of.get(node)
            try:
                states[node] = placement_group_table(group).get("state", "?") if group is not None else "none"
            except Exception as e:  # noqa: BLE001 - the answer is the error
                states[node] = f"unknown ({type(e).__name__})"
        return states

    def prewarm(self, nodes: list[str]) -> None:
        """Warm actors on these nodes now, ahead of the recovery that may need them (spares the
        cluster gave this run after its launch: a node back from repair refills the pool cold, and
        a fresh actor importing torch costs a recovery ~5 s). Not waited for here: the launch that
        uses them waits for them as for its own new actors."""
        if not self.warm or self._attempt is None:
            return
        count = max(collections.Counter(self._attempt.placement.node_of_rank).values())
        alive = _alive_names()
        wanted = {n: count for n in nodes if n in alive and len(self._pool.get(n, [])) < count}
        if not wanted:
            return
        for node, ref in self._grow_pool(wanted):
            self._warming.setdefault(node, []).append(ref)
        # (held for the run, not part of any launch's gang)
        self._growth, self._growth_group_of, self._growth_refs = [], {}, {}

    def _forget_node(self, node: str) -> None:
        """A node that died: its actors went with it; its reservations go too (else Ray would hold its
        GPUs for them again when it returns)."""
        self._warming.pop(node, None)
        self._pool.pop(node, None)
        self._node_id.pop(node, None)
        for group in self._groups.pop(node, []):
            self._drop_reservation(group)

    def _forget_dead_nodes(self) -> None:
        """Before a launch: nodes the pool knows that Ray no longer shows alive, by name, or by Ray's
        node id where the pool knows it: a node lost and back under its name (a new raylet) before this
        launch has none of the actors or reservations its name still holds here."""
        alive = _alive_ids()
        for node in set(self._pool) | set(self._groups):
            known = self._node_id.get(node)
            if node not in alive or (known is not None and known not in alive[node]):
                self._forget_node(node)
        for node, ids in alive.items():  # where a node holding nothing here starts its actors next
            if not self._pool.get(node) and not self._groups.get(node):
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

    def poll(self) -> PollResult:
        import ray
        from ray.exceptions import ActorDiedError, RayActorError

        result = PollResult(GroupStatus.RUNNING)
        out = self._replicas.out if self._replicas is not None else set()
        ray_replicas.publish_joining(self)
        ready, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        ready_ids = {r.hex() for r in ready}
        for rank, ref in enumerate(self._runs):
            if rank in self._finished or rank in out or ref.hex() not in ready_ids:
                continue
            self._finished.add(rank)
            try:
                ray.get(ref)
            except RankProcessDied:
                result.dead_ranks.add(rank)  # the process is gone: a cause, not a symptom
                result.on_live_nodes.add(rank)  # and its actor, so its node, answered
            except (ActorDiedError, RayActorError):
                result.dead_ranks.add(rank)
                self._forget(self.actors[rank])
            except Exception as e:  # noqa: BLE001 - the rank's own error, reported as is
                result.errors[rank] = f"{type(e).__name__}: {e}"
        self._unanswered = set()
        self._collect(result)
        # The data plane speaks first: a rank whose collective failed (a peer's process gone), an actor
        # that no longer answers, a survivor's discarded cross-replica step. Then the raylets of every
        # node those collectives reach are probed (Ray's own health checks take seconds more), and a
        # node whose raylet refuses is lost with its ranks: the data plane and the probe agree.
        discarded = any(kind == EventKind.REPLICA_STEP_DISCARDED for _, kind, _ in result.events)
        signalled = self._failed | result.dead_ranks | set(result.errors) | self._unanswered
        silence = self._hearts.verdict(out | ray_replicas.forming_ranks(self)) if self._hearts is not None else None
        result.isolated = self.isolated = isolation(silence)
        if result.isolated is None:  # (cut off, this controller would wait on Ray's GCS: it asks nothing)
            result.dead_nodes, result.suspect_nodes = self._node_states(signalled, every=discarded)
            result.silent_nodes = self._silent(silence, result)
            result.dead_nodes |= set(result.silent_nodes)
        self._gone |= result.dead_nodes | result.suspect_nodes
        if result.isolated is None:
            self._resolve(result)
        for rank in [r for r in self._drains if self._node_of_rank[r] in self._gone]:
            del self._drains[rank]  # (a lost node's actors say nothing more: not waited for below)
        if result.suspect_nodes:
            result.dead_ranks |= {r for r, node in enumerate(self._node_of_rank)
                                  if node in result.suspect_nodes and r not in out}
            for node in result.suspect_nodes:  # (now: once it is back under its name, Ray shows it alive)
                self._forget_node(node)
        self._failed |= set(result.errors) | result.dead_ranks
        if self._failed or result.dead_nodes:  # failed stays failed: later polls must not read "finished"
            result.status = GroupStatus.FAILED
        elif self._finished >= ray_replicas.awaited_ranks(self):
            result.status = GroupStatus.FINISHED  # (a replica forming or joining when the holders are done has nothing to join)
        if result.status is not GroupStatus.RUNNING and self._drains:  # the attempt ends: what the ranks still had to say
            self._collect(result, wait_s=SETTLE_WAIT_S)
        return result

    def _resolve(self, result: PollResult) -> None:
        """The membership the ranks' words move (controller/ray/replicas.on_events): a rejoin, or a
        discarded step with nothing lost in this poll; an epoch published for the latter joins the timeline."""
        r = self._replicas
        if r is None:
            return
        lost = bool(result.dead_nodes or result.suspect_nodes or result.dead_ranks or result.errors or self._failed)
        ray_replicas.on_events(self, result.events, lost=lost)
        result.events.extend((-1, EventKind.REPLICA_RESYNC, detail) for detail in r.resolved)
        r.resolved.clear()

    def _collect(self, result: PollResult, wait_s: float = DRAIN_WAIT_S) -> None:
        """Drain every live rank's reports, waiting `wait_s` at most for the answers (a drain not
        answered by then is read at a later poll: a dead node's actors may take Ray a while to fail,
        and the next poll must not wait on them). A rank is unresponsive when its drain is unanswered
        after UNRESPONSIVE_S (a stopped actor) or its training process has been quiet that long (a
        stopped process). One drain in flight per rank."""
        import ray

        now = time.monotonic()
        out = self._replicas.out if self._replicas is not None else set()
        for rank, actor in enumerate(self.actors):
            if rank not in self._drains and rank not in result.dead_ranks and rank not in out:
                self._drains[rank] = (actor.drain.remote(), now)
        refs = [ref for ref, _ in self._drains.values()]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        done_ids = {r.hex() for r in done}
        for rank, (ref, issued) in list(self._drains.items()):
            if ref.hex() not in done_ids:
                if now - issued > UNRESPONSIVE_S:
                    result.unresponsive.add(rank)
                continue
            del self._drains[rank]
            try:
                reports, events, quiet_s = ray.get(ref)
            except Exception:  # noqa: BLE001 - a dead actor has nothing left to say
                self._unanswered.add(rank)  # (its node's raylet is probed in this poll)
                continue
            if quiet_s is not None and quiet_s > UNRESPONSIVE_S and rank not in self._finished:
                result.unresponsive.add(rank)
            result.reports.extend(reports)
            result.events.extend((rank, kind, detail) for kind, detail in events)
        result.reports.sort(key=lambda r: (r.step, r.rank))

    def watch_heartbeats(self, prefix: str) -> None:
        """Watch the heartbeats of the attempt whose store keys start with `prefix` (from now on)."""
        self._gone = set()
        if self._hearts is not None:
            self._hearts.close()
        self._hearts = HeartbeatWatch(self._store_host, self._store.port, prefix, self._node_of_rank)

    def _silent(self, verdict: SilenceVerdict | None, result: PollResult) -> dict[str, str]:
        """The attempt's nodes whose heartbeat stopped and whose loss other evidence confirms (node ->
        what was seen)."""
        if verdict is None:
            return {}
        unresponsive = {self._node_of_rank[r] for r in result.unresponsive}
        silent = corroborate(verdict, unresponsive_nodes=unresponsive)
        for node in silent:
            self._forget_node(node)
        return silent

    def _node_states(self, signalled: set[int], every: bool = False) -> tuple[set[str], set[str]]:
        """(dead, suspect) among this attempt's nodes (controller/ray/liveness.node_states): the nodes
        asked are those the signalled ranks' collectives reach (the whole world; their replica's nodes
        under failure_domain replica), or every node with `every`. A dead node is forgotten at once."""
        asked = None if every else {self._node_of_rank[r] for r in ray_replicas.collective_reach(self, signalled)}
        dead, suspect = node_states(self._nodes, asked)
        for node in dead:
            self._forget_node(node)  # its actors died with it
        return dead, suspect

    def rank_actor(self, rank: int) -> Any:
        """This attempt's actor of `rank` (drills act on it: controller/ray/drills.py)."""
        return self.actors[rank]

    def ranks_on(self, node: str) -> list[int]:
        """This attempt's ranks on `node`."""
        return [rank for rank, on in enumerate(self._node_of_rank) if on == node]

    def slot_actors(self) -> list[Any]:
        """Every warm actor of the pool, idle or assigned: one per GPU slot this group holds."""
        return [actor for pool in self._pool.values() for actor in pool]

    def where(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([a.where.remote() for a in self.actors if a is not None], timeout=60)

    def shutdown(self) -> None:
        """End the attempt: every rank's training process is gone when this returns, but those that left
        it already, parked for their slot's next attempt (controller/ray/rank_actor.py). Warm actors
        stay for the next attempt (all of them go with `close`, or here when not `warm`)."""
        import ray

        self._end_attempt()
        if not self.warm:
            self.close(keep_snapshots=True)
            return
        gone = self.on_gone_nodes(range(len(self.actors)))  # (a dark node answers nothing: not waited for)
        live = [(actor, run) for rank, (actor, run) in enumerate(zip(self.actors, self._runs))
                if rank not in gone and actor is not None]
        stops = [actor.stop.remote(keep_parked=True) for actor, _ in live]
        done, _ = ray.wait(stops, num_returns=len(stops), timeout=15)
        for (actor, _), ref in zip(live, stops):
            if ref not in done:  # an actor that cannot stop its process goes with it
                ray.kill(actor, no_restart=True)
                self._forget(actor)
        runs = [run for _, run in live]
        ended, _ = ray.wait(runs, num_returns=len(runs), timeout=5)
        for ref in ended:  # the killed processes' errors are expected: read them so Ray does not log them
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001
                pass
        self.actors, self._runs, self._drains = [], [], {}

    def on_gone_nodes(self, ranks: Any) -> set[int]:
        """Of `ranks`, those on nodes of this attempt declared lost; their actors are killed without
        waiting for an answer (on a node that is dark, or cut off, nothing answers; Ray ends them
        when it reaches the node again, and the node's raylet ends them if Ray declared it dead)."""
        import ray

        gone = {rank for rank in ranks if rank < len(self._node_of_rank) and self._node_of_rank[rank] in self._gone}
        for rank in gone:
            if rank < len(self.actors) and self.actors[rank] is not None:
                try:
                    ray.kill(self.actors[rank], no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
        return gone

    def _end_attempt(self) -> None:
        """No attempt runs now: none has replicas to contain (`contains_replicas` is False), so a
        failure of the next launch cannot be mistaken for a replica of the last one failing."""
        self._replicas = None
        if self._hearts is not None:
            self._hearts.close()
        self._hearts = None

    def _forget(self, actor: Any) -> None:
        for pool in self._pool.values():
            if actor in pool:
                pool.remove(actor)

    def peer_copies(self, peer_key: str, nodes: set[str]) -> dict[str, list[Any]]:
        """What each of `nodes` holds of the run's peer snapshots (`checkpointing.peer.Held` records),
        asked of one warm actor per node (a node with none, or one that does not answer within 10 s,
        holds nothing usable)."""
        import ray

        self._peer_key = peer_key
        self._forget_dead_nodes()
        asked = {node: self._pool[node][0].peer_copies.remote(peer_key) for node in nodes if self._pool.get(node)}
        if not asked:
            return {}
        ready, _ = ray.wait(list(asked.values()), num_returns=len(asked), timeout=10)
        held: dict[str, list[Any]] = {}
        for node, ref in asked.items():
            if ref in ready:
                try:
                    held[node] = ray.get(ref)
                except Exception:  # noqa: BLE001 - an actor that died since: its node holds nothing usable
                    continue
        return held

    def close(self, *, keep_snapshots: bool = False) -> None:
        """Release everything: every actor, and with it every training process (named ones of this
        run that an earlier controller left, too), and the run's peer snapshots in the nodes' memory
        (unless `keep_snapshots`: the next attempt may load them)."""
        import ray

        actors = [actor for pool in self._pool.values() for actor in pool]
        actors += [handle for _, handle in self._named()]
        if not keep_snapshots and self._peer_key is not None:
            drops = [pool[0].drop_peer_copies.remote(self._peer_key) for pool in self._pool.values() if pool]
            if drops:
                ray.wait(drops, num_returns=len(drops), timeout=10)
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for group in [g for groups in self._groups.values() for g in groups] + self._named_reservations():
            self._drop_reservation(group)
        self._groups = {}
        self._pool = {}
        self.actors, self._runs, self._drains = [], [], {}
        if self.name is not None:  # (the run is over: nothing reads its store again)
            run_store.end_store(self.name)
            self._store = None

    def _named_reservations(self) -> list[Any]:
        return detached.named_reservations(self.name)

    def _named(self) -> list[tuple[str, Any]]:
        return detached.named_actors(self.name)

    def attach(self, attempt: AttemptSpec, out: frozenset[int] = frozenset(),
               rejoined: frozenset[int] = frozenset()) -> bool:
        """Take over the live workers of `attempt` that an earlier controller started (controller/ray/
        detached.py): True when every rank's training process is still running (then `poll` goes on
        as if nothing happened), but those of the replicas `out` (lost, not rejoined: formed anew);
        `rejoined`: replicas the timeline saw rejoin (they hold the state, whatever the newest epoch says)."""
        return detached.attach(self, attempt, out, rejoined)


def _alive_names() -> set[str]:
    """The `node` labels of the cluster's alive Ray nodes."""
    return set(_alive_ids())


def _alive_ids() -> dict[str, set[str]]:
    """The cluster's alive Ray nodes: `node` label -> their Ray node ids (two while Ray still lists a
    node's old raylet alive after it came back)."""
    import ray

    alive: dict[str, set[str]] = {}
    for info in ray.nodes():
        if info.get("Alive") and (name := (info.get("Labels") or {}).get("node")):
            alive.setdefault(name, set()).add(info["NodeID"])
    return alive
