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
import dataclasses
import threading
import time
from typing import Any

from controller.attempt import AttemptSpec, GroupStatus, PollResult
from controller.errors import ClusterSilent
from controller.events import EventKind
from controller.ray import detached, run_store
from controller.ray.heartbeats import HeartbeatWatch, corroborate, isolation
from controller.ray.liveness import node_states
from controller.ray.pool import WarmPool
from controller.ray.rank_actor import UNRESPONSIVE_S, RankProcessDied
from controller.ray.replicas import ReplicaTracking, peer_restore
from health.heartbeat import SilenceVerdict
from trainer.worker import WorkerArgs


DRAIN_WAIT_S = 0.1
"""How long a poll waits for the ranks' drains. A drain to a dead node's actor is failed by Ray only
later (about a second): a poll that waited 0.5 s for it held up the next one, which reads the
survivors' first signals."""

SETTLE_WAIT_S = 0.5
"""How long the poll that ends an attempt waits for the drains still out (its last steps' reports)."""


class RayWorkerGroup:
    def __init__(self, *, store_host: str = "127.0.0.1", launch_timeout_s: float = 120.0,
                 collective_timeout_s: float = 120.0, warm: bool = True, name: str | None = None,
                 interface: str | None = None) -> None:
        self.name = name
        """With a name (the run id), actors are detached and named `{name}/{node}/{k}`: they outlive the
        controller's process, and a restarted controller finds them again (`attach`)."""
        self.pool = WarmPool(name)
        """The run's warm actors, one per GPU slot, and their reservations (controller/ray/pool.py)."""
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
        self._peer_key: str | None = None
        """The folder of the run's peer snapshots on the nodes (checkpointing.peer.run_key), once known."""
        self._attempt: AttemptSpec | None = None
        self._replicas: ReplicaTracking | None = None
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
        import torch.distributed as dist

        self._end_attempt()  # (whether this one starts or not, the last one's membership is gone)
        placement = attempt.placement
        ranks_per_node = collections.Counter(placement.node_of_rank)  # one pass (not one per node)
        wanted = {node: ranks_per_node[node] for node in placement.nodes_used()}
        if self.warm and self.pool:  # a spare may replace any node: as many warm actors as the fullest one has
            # (a launch with no warm actors yet, a group's first, leaves its spares to `prewarm`, once the
            # attempt has stepped: their actors' start is off the run's startup, ~0.6 CPU-s each)
            wanted |= {spare: max(wanted.values()) for spare in placement.spares}
        self.pool.forget_dead_nodes()
        new = self.pool.grow(wanted)
        new += self.pool.take_warming(wanted)  # (started ahead of this launch: waited for as its own new ones are)
        if self._store is None:  # (while the new actors start)
            self._store, self._store_host = run_store.open_store(self.name, self.store_host)
        self.pool.wait_started(new, self.launch_timeout_s, self._abort)
        self._peer_key = attempt.peer_key
        self._attempt = attempt
        prefix = f"{attempt.run_id}/attempt-{attempt.attempt}/"
        self._replicas = ReplicaTracking.start(dist.PrefixStore(prefix, self._store), attempt)
        taken: dict[str, int] = {}
        self.actors = []
        for node in placement.node_of_rank:
            self.actors.append(self.pool.on(node)[taken.get(node, 0)])
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
            peer_buddy=attempt.peer_buddy, peer_restore=peer_restore(attempt, rank, incarnation),
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
        """The controller's word: these replicas are out. Their training processes on live nodes end
        (a node loss ended the others), and the next membership epoch, without them, lets the survivors
        go on (when they were told, Unix seconds, is returned). `suspect` (a contained SDC): their peer
        snapshots on their nodes go too, since they may hold the corruption; a lost replica's snapshots
        are otherwise the state every replica held at their step, kept for the world path's fallback."""
        import ray

        r = self._replicas
        assert r is not None and self._attempt is not None
        ranks = r.running(replicas)
        self._gone |= set(nodes) & set(self._node_of_rank) if not suspect else set()
        gone = self.on_gone_nodes(ranks)  # (not waited for: a dark node answers nothing)
        stops = [self.actors[rank].stop.remote() for rank in ranks if self.actors[rank] is not None and rank not in gone]
        membership = r.lose(replicas)  # (NotContainable: no replica holding the state is left; nothing changed)
        self._failed -= set(ranks)
        self._nodes = self._live_nodes()
        for rank in ranks:
            self._drains.pop(rank, None)
        # The survivors first: the lost replica's ranks are not members of the new epoch (nothing of
        # theirs reaches its groups, and a rank that finds its epoch superseded ends), so its stops are
        # waited for after the survivors are told, before any of its actors is used again.
        told = r.publish(membership)
        ray.wait(stops, num_returns=len(stops), timeout=15)
        if suspect and self._attempt.peer_every and self._peer_key is not None:  # (an SDC's nodes are alive)
            held_by = {self._node_of_rank[rank] for rank in ranks}
            drops = [actor.drop_peer_copies.remote(self._peer_key) for node in held_by
                     if (actor := self.pool.any_on(node)) is not None]
            ray.wait(drops, num_returns=len(drops), timeout=15)
        return told

    def form_replicas(self, replicas: list[int], placement: Any) -> None:
        """Form `replicas` again where `placement` puts them: a training process per rank, forked from
        a warm actor of its (new) node (RuntimeError when there is none and none starts: the world path
        takes over); once every one has built its replica's world, the next epoch lists them as joining
        and a live replica gives them its state (`poll` publishes it)."""
        r = self._replicas
        assert r is not None and self._attempt is not None
        self._attempt = dataclasses.replace(self._attempt, placement=placement)
        self._node_of_rank = tuple(placement.node_of_rank)
        if self._hearts is not None:
            self._hearts.moved(self._node_of_rank)
        busy = {id(a) for rank, a in enumerate(self.actors) if rank not in r.out and a is not None}
        self.pool.warm_for([placement.node_of_rank[rank] for k in replicas for rank in r.ranks(k)], busy,
                           self.launch_timeout_s)
        for replica in replicas:
            incarnation = r.form(replica)
            for rank in r.ranks(replica):
                node = placement.node_of_rank[rank]
                actor = self.pool.idle_on(node, busy)
                if actor is None:
                    raise RuntimeError(f"no idle warm actor on {node} for rank {rank} of replica {replica}")
                busy.add(id(actor))
                self.actors[rank] = actor
                self._runs[rank] = actor.run.remote(self._worker_args(self._attempt, rank, incarnation))
                self._finished.discard(rank)
        self._nodes = self._live_nodes()

    def _live_nodes(self) -> set[str]:
        """The nodes the attempt runs on now. A replica out keeps naming its lost nodes, which are not
        asked about again (a dead one would be found dead at every poll: the attempt would never end)."""
        out = self._replicas.out if self._replicas is not None else set()
        return {node for rank, node in enumerate(self._node_of_rank) if rank not in out}

    def prewarm(self, nodes: list[str]) -> None:
        """Warm actors on these nodes now, ahead of the recovery that may need them (spares the
        cluster gave this run after its launch: a node back from repair refills the pool cold, and
        a fresh actor importing torch costs a recovery ~5 s). Not waited for here: the launch that
        uses them waits for them as for its own new actors."""
        if not self.warm or self._attempt is None:
            return
        self.pool.prewarm(nodes, max(collections.Counter(self._attempt.placement.node_of_rank).values()))

    def poll(self) -> PollResult:
        import ray
        from ray.exceptions import ActorDiedError, RayActorError

        result = PollResult(GroupStatus.RUNNING)
        out = self._replicas.out if self._replicas is not None else set()
        if self._replicas is not None:
            self._replicas.publish_joining()
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
                self.pool.forget(self.actors[rank])
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
        forming = self._replicas.forming_ranks() if self._replicas is not None else set()
        silence = self._hearts.verdict(out | forming) if self._hearts is not None else None
        result.isolated = self.isolated = isolation(silence)
        if result.isolated is None:  # (cut off, this controller would wait on Ray's GCS: it asks nothing)
            try:
                result.dead_nodes, result.suspect_nodes = self._node_states(signalled, every=discarded)
                result.silent_nodes = self._silent(silence, result)
            except ClusterSilent:  # a cut only begun: the heartbeats cannot say so yet, and the GCS does
                pass  # not answer within the poll's wait either; nothing is judged (the next polls say which)
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
                self.pool.forget_node(node)
        self._failed |= set(result.errors) | result.dead_ranks
        if self._failed or result.dead_nodes:  # failed stays failed: later polls must not read "finished"
            result.status = GroupStatus.FAILED
        elif self._finished >= self._awaited():
            result.status = GroupStatus.FINISHED  # (a replica forming or joining when the holders are done has nothing to join)
        if result.status is not GroupStatus.RUNNING and self._drains:  # the attempt ends: what the ranks still had to say
            self._collect(result, wait_s=SETTLE_WAIT_S)
        return result

    def _awaited(self) -> set[int]:
        """The ranks whose end the attempt's end waits for (all of them over a world)."""
        every = set(range(len(self._runs)))
        return self._replicas.awaited(every, self._finished) if self._replicas is not None else every

    def _collective_reach(self, ranks: set[int]) -> set[int]:
        """The ranks whose processes `ranks`' collectives reach: every rank of the attempt over a world
        (a failed collective names no peer), their replicas' ranks under failure_domain replica."""
        if not ranks:
            return set()
        if self._replicas is None:
            return set(range(len(self._node_of_rank)))
        return self._replicas.collective_reach(ranks)

    def _resolve(self, result: PollResult) -> None:
        """The membership the ranks' words move (ReplicaTracking.on_events): a rejoin, or a
        discarded step with nothing lost in this poll; an epoch published for the latter joins the timeline."""
        r = self._replicas
        if r is None:
            return
        lost = bool(result.dead_nodes or result.suspect_nodes or result.dead_ranks or result.errors or self._failed)
        r.on_events(result.events, lost=lost)
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
            self.pool.forget_node(node)
        return silent

    def _node_states(self, signalled: set[int], every: bool = False) -> tuple[set[str], set[str]]:
        """(dead, suspect) among this attempt's nodes (controller/ray/liveness.node_states): the nodes
        asked are those the signalled ranks' collectives reach (the whole world; their replica's nodes
        under failure_domain replica), or every node with `every`. A dead node is forgotten at once."""
        asked = None if every else {self._node_of_rank[r] for r in self._collective_reach(signalled)}
        dead, suspect = node_states(self._nodes, asked)
        for node in dead:
            self.pool.forget_node(node)  # its actors died with it
        return dead, suspect

    def rank_actor(self, rank: int) -> Any:
        """This attempt's actor of `rank` (drills act on it: controller/ray/drills.py)."""
        return self.actors[rank]

    def ranks_on(self, node: str) -> list[int]:
        """This attempt's ranks on `node`."""
        return [rank for rank, on in enumerate(self._node_of_rank) if on == node]

    def slot_actors(self) -> list[Any]:
        """Every warm actor of the pool, idle or assigned: one per GPU slot this group holds."""
        return self.pool.actors()

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
                self.pool.forget(actor)
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

    def peer_copies(self, peer_key: str, nodes: set[str]) -> dict[str, list[Any]]:
        """What each of `nodes` holds of the run's peer snapshots (`checkpointing.peer.Held` records),
        asked of one warm actor per node (a node with none, or one that does not answer within 10 s,
        holds nothing usable)."""
        import ray

        self._peer_key = peer_key
        self.pool.forget_dead_nodes()
        asked = {node: actor.peer_copies.remote(peer_key) for node in nodes if (actor := self.pool.any_on(node)) is not None}
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
        self.pool.close(None if keep_snapshots else self._peer_key)
        self.actors, self._runs, self._drains = [], [], {}
        if self.name is not None:  # (the run is over: nothing reads its store again)
            run_store.end_store(self.name)
            self._store = None

    def attach(self, attempt: AttemptSpec, out: frozenset[int] = frozenset(),
               rejoined: frozenset[int] = frozenset()) -> bool:
        """Take over the live workers of `attempt` that an earlier controller started (found by name:
        controller/ray/detached.py): True when every rank's training process is still running (then
        `poll` goes on as if nothing happened), but those of the replicas `out` (lost, not rejoined:
        whatever the earlier controller had started to form them again is stopped; they are formed
        anew); `rejoined`: replicas the timeline saw rejoin (they hold the state, whatever the newest
        epoch says)."""
        import ray
        import torch.distributed as dist

        self._peer_key = attempt.peer_key
        live = detached.find_live(self.pool, attempt, out)
        if live is None or self.name is None:
            return False
        found = run_store.find_store(self.name)  # the membership and the groups' rendezvous go on there
        if found is None and attempt.failure_domain == "replica":
            return False
        if found is not None:
            self._store, self._store_host = found
        self._attempt = attempt
        self._replicas = None
        prefix = f"{attempt.run_id}/attempt-{attempt.attempt}/"
        if attempt.failure_domain == "replica" and attempt.placement.mesh.dp_replicas > 1:
            self._replicas = ReplicaTracking.resume(dist.PrefixStore(prefix, self._store), attempt,
                                                    live.incarnation, out, rejoined)
            if self._replicas is None:
                return False
        elif out:
            return False
        if live.forming:
            ray.wait([handle.stop.remote() for handle in live.forming], num_returns=len(live.forming), timeout=15)
        self.actors = live.actors  # (a replica out has none until it forms again)
        self._runs = [actor.wait_done.remote() if actor is not None else _nothing() for actor in self.actors]
        self._finished, self._failed, self._drains = set(), set(), {}
        self._node_of_rank = tuple(attempt.placement.node_of_rank)
        self._nodes = self._live_nodes()
        self.watch_heartbeats(prefix)
        return True


def _nothing() -> Any:
    """A finished ref in the place of a rank that has no process (its replica is out)."""
    import ray

    return ray.put(None)
