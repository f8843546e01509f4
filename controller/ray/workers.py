"""The Ray worker group: one actor per GPU slot, in a bundle of its node's placement group (bundle
label selectors pin it there; a launch's reservations are granted all together or released), and one
training process per rank forked from its actor for each attempt. Ranks rendezvous through a TCPStore
hosted here in the controller (never in a rank that can die; a fresh key prefix per attempt).

Why a forked process per attempt (measured, see benchmarks/regroup_vs_restart.py and
benchmarks/recovery_drills.py): a fresh process spends seconds importing torch, while rebuilding the
process group inside a surviving process takes under a second. But a gloo rank blocked in a
collective cannot be freed from inside its process (`abort()` does not interrupt it in torch 2.13),
only by its peers' sockets closing or its timeout. So each actor imports torch once ("warm") and
forks the rank's training process from that warm image per attempt: ending an attempt is a SIGKILL of
the forked processes (instant, and it frees every peer), starting one is a fork (milliseconds). Spare
nodes get warm actors up front, so a replacement starts as fast as a survivor.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from controller.attempt import AttemptSpec, GroupStatus, PollResult
from trainer.report import StepReport
from trainer.worker import WorkerArgs, WorkerSummary


UNRESPONSIVE_S = 3.0
"""A rank whose process or actor has shown no sign of life for this long counts as unresponsive."""

HEARTBEAT_S = 0.25
"""How often a training process says it is alive (a thread of its own: a stopped process goes quiet,
one blocked in a collective does not)."""


class RankProcessDied(RuntimeError):
    """The rank's training process ended by a signal or without a word: a cause, not a symptom."""


class RankActor:
    """Holds one GPU slot on one node. `warm` imports torch; `run` forks this attempt's training process
    and relays its reports; `stop` SIGKILLs it. Concurrent calls (max_concurrency=5): `run` waits on
    the process while `drain` hands reports to the controller, `wait_done` (a re-attached controller)
    waits for its outcome and `stop` ends it."""

    def __init__(self) -> None:
        import multiprocessing

        from trainer.switches import SIZE, DrillSwitches

        self._lock = threading.Lock()
        # Shared with every training process forked from here: drills set on this GPU slot stay with it.
        self._switches = DrillSwitches(multiprocessing.get_context("fork").Array("d", SIZE, lock=False))
        self._reports: list[StepReport] = []
        self._events: list[tuple[str, dict]] = []
        self._process: Any = None
        self._beat: Any = None
        self._identity: dict[str, Any] = {}
        self._done = threading.Event()
        self._outcome: tuple[str, Any] | None = None

    def warm(self) -> dict[str, Any]:
        import torch  # noqa: F401 - the point: pay the import once, before any attempt

        import trainer.checkpoint  # noqa: F401
        import trainer.train  # noqa: F401

        return self.where()

    def where(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        process = self._process
        return {"node_id": ctx.get_node_id(), "actor_pid": os.getpid(), "gpu_ids": ray.get_gpu_ids(),
                "pid": process.pid if process is not None and process.is_alive() else None}

    def run(self, args: WorkerArgs) -> WorkerSummary:
        """This attempt's training process, start to end; its outcome is kept for `wait_done` (a
        controller that re-attaches after its predecessor died has no handle on this call)."""
        done = threading.Event()
        with self._lock:
            self._identity = {"run_id": args.run_id, "attempt": args.attempt, "rank": args.rank}
            self._done, self._outcome = done, None
        try:
            summary = self._run(args)
            self._outcome = ("ok", summary)
            return summary
        except BaseException as e:
            self._outcome = ("error", e)
            raise
        finally:
            done.set()

    def wait_done(self) -> WorkerSummary:
        """Block until the current attempt's training process ends; its summary, or its error raised."""
        self._done.wait()
        assert self._outcome is not None
        kind, value = self._outcome
        if kind == "error":
            raise value
        return value

    def identity(self) -> dict[str, Any]:
        """Which run, attempt and rank this slot trains, and whether its training process is alive."""
        with self._lock:
            process = self._process
            return {**self._identity, "alive": process is not None and process.is_alive(),
                    "done": self._done.is_set()}

    def _run(self, args: WorkerArgs) -> WorkerSummary:
        import multiprocessing

        ctx = multiprocessing.get_context("fork")
        receive, send = ctx.Pipe(duplex=False)
        beat = ctx.Value("d", time.time(), lock=False)
        process = ctx.Process(target=_train_in_child, args=(args, send, beat, os.getpid(), self._switches),
                              name=f"goodput-rank-{args.rank}", daemon=True)
        with self._lock:
            self._beat = beat
            process.start()
            self._process = process
        send.close()
        summary: WorkerSummary | None = None
        error: str | None = None
        while True:
            try:
                kind, payload = receive.recv()
            except (EOFError, OSError):
                break
            if kind == "report":
                self.report(payload)
            elif kind == "event":
                self.event(*payload)
            elif kind == "done":
                summary = payload
            elif kind == "error":
                error = payload
        process.join()
        receive.close()
        if process.exitcode is not None and process.exitcode < 0:
            name = signal.Signals(-process.exitcode).name
            raise RankProcessDied(f"rank {args.rank}'s training process (pid {process.pid}) was killed by {name}")
        if error is not None:
            raise RuntimeError(error)
        if summary is None:
            raise RankProcessDied(f"rank {args.rank}'s training process exited with code {process.exitcode} "
                                  "without a result")
        return summary

    def stop(self) -> None:
        """End this attempt's training process, even a stopped one; returns once it is gone."""
        with self._lock:
            process = self._process
        if process is None or process.pid is None:
            return
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(process.pid, sig)
            except ProcessLookupError:
                break
        process.join(timeout=10)

    def slow(self, factor: float) -> None:
        """The slow-rank drill: this GPU slot computes `factor` times slower from now on."""
        self._switches.slow(factor)

    def bitflip(self) -> None:
        """The bitflip drill: the training process flips a bit of its parameters before its next step."""
        self._switches.request_bitflip()

    def outage(self, until: float) -> None:
        """The storage-outage drill: checkpoint writes from this slot are refused until `until`."""
        self._switches.outage(until)

    def signal_rank(self, sig: int) -> int:
        """Send a signal to the training process (the kill-rank and hang-rank drills); its pid."""
        with self._lock:
            process = self._process
        if process is None or not process.is_alive():
            raise RuntimeError("this rank has no running training process")
        os.kill(process.pid, sig)
        return int(process.pid)

    # ReportSink, fed from the pipe
    def report(self, report: StepReport) -> None:
        with self._lock:
            self._reports.append(report)

    def event(self, kind: str, detail: dict) -> None:
        with self._lock:
            self._events.append((kind, detail))

    def drain(self) -> tuple[list[StepReport], list[tuple[str, dict]], float | None]:
        """Reports and events since the last drain, and how long the training process has been quiet
        (None when none runs)."""
        with self._lock:
            out = (self._reports, self._events)
            self._reports, self._events = [], []
            process, beat = self._process, self._beat
        quiet = time.time() - beat.value if process is not None and process.is_alive() and beat else None
        return out[0], out[1], quiet


class _PipeSink:
    """The training process's ReportSink: everything goes up the pipe to its actor."""

    def __init__(self, send: Any) -> None:
        self._send = send
        self._lock = threading.Lock()

    def put(self, kind: str, payload: Any) -> None:
        with self._lock:
            self._send.send((kind, payload))

    def report(self, report: StepReport) -> None:
        self.put("report", report)

    def event(self, kind: str, detail: dict) -> None:
        self.put("event", (kind, detail))


def _train_in_child(args: WorkerArgs, send: Any, beat: Any, actor_pid: int, switches: Any) -> None:
    """Body of the forked training process. It never touches Ray (the fork has none of Ray's threads)
    and ends with its actor: the heartbeat thread exits the process once the actor is gone."""
    import traceback

    import torch

    from trainer.worker import run_worker

    def heartbeat() -> None:
        while True:
            if os.getppid() != actor_pid:
                os._exit(1)
            beat.value = time.time()
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=heartbeat, daemon=True).start()
    torch.set_num_threads(1)
    sink = _PipeSink(send)
    try:
        sink.put("done", run_worker(args, sink, switches=switches))
    except BaseException as e:  # noqa: BLE001 - the error goes to the controller, whatever it is
        sink.put("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
    finally:
        send.close()


class LaunchAborted(Exception):
    """A start given up because the run was cancelled."""


NAMESPACE = "goodput"
"""Ray namespace of the named (detached) actors of a service's runs."""


class RayWorkerGroup:
    def __init__(self, *, store_host: str = "127.0.0.1", launch_timeout_s: float = 120.0,
                 collective_timeout_s: float = 120.0, warm: bool = True, name: str | None = None) -> None:
        self.name = name
        """With a name (the run id), actors are detached and named `{name}/{node}/{k}`: they outlive the
        controller's process, and a restarted controller finds them again (`attach`)."""
        self._made: dict[str, int] = {}
        self.store_host = store_host
        self.launch_timeout_s = launch_timeout_s
        self.collective_timeout_s = collective_timeout_s
        self.warm = warm
        """Keep actors (and their imported torch) across attempts; False: fresh actors per attempt."""
        self._store: Any = None
        self._pool: dict[str, list[Any]] = {}
        """node -> its warm actors, idle or assigned."""
        self.actors: list[Any] = []
        """This attempt's actor of each rank."""
        self._runs: list[Any] = []
        self._finished: set[int] = set()
        self._failed: set[int] = set()
        self._drains: dict[int, tuple[Any, float]] = {}
        self._nodes: set[str] = set()
        self._abort = threading.Event()
        self._groups: dict[str, list[Any]] = {}
        """node -> the placement groups that reserve its GPU slots for this group's actors."""
        self._growth_groups: list[Any] = []
        self._reservations = 0
        self._growth: list[tuple[str, Any]] = []
        """(node, actor) of the last growth of the pool (undone together when it does not start)."""

    def abort(self) -> None:
        """From any thread: a `start` waiting for its workers gives up within half a second, and so does
        every later one (a cancelled run's group is not used again)."""
        self._abort.set()

    def start(self, attempt: AttemptSpec) -> None:
        import ray
        import torch.distributed as dist

        if self._store is None:
            self._store = dist.TCPStore(self.store_host, 0, is_master=True, wait_for_workers=False)
        placement = attempt.placement
        world = placement.mesh.world_size
        wanted = {node: len(placement.ranks_on(node)) for node in placement.nodes_used()}
        if self.warm:  # a spare may replace any node: as many warm actors as the fullest one has
            wanted |= {spare: max(wanted.values()) for spare in placement.spares}
        self._forget_dead_nodes()
        new = self._grow_pool(wanted)
        if new:
            refs = [warm for _, warm in new]  # each actor's warm() waits for its bundle, then imports torch
            deadline = time.monotonic() + self.launch_timeout_s
            ready: list[Any] = []
            while len(ready) < len(new) and not self._abort.is_set() and time.monotonic() < deadline:
                ready, _ = ray.wait(refs, num_returns=len(new), timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            if len(ready) < len(new):
                late = sorted({node for node, warm in new if warm not in ready})
                for node in late:  # actors that never started must not be handed out later
                    for actor in self._pool.pop(node, []):
                        ray.kill(actor, no_restart=True)
                for node, actor in self._growth:  # all or nothing: no half-held gang
                    if actor in self._pool.get(node, []):
                        self._pool[node].remove(actor)
                        ray.kill(actor, no_restart=True)
                for group in self._growth_groups:
                    self._drop_reservation(group)
                if self._abort.is_set():
                    raise LaunchAborted(f"the launch was cancelled while workers on {late} were starting")
                raise TimeoutError(f"workers on nodes {late} did not start in {self.launch_timeout_s:.0f} s: "
                                   "those nodes lack free GPU slots or are gone")
            ray.get(ready)  # an actor that died while importing raises here
        taken: dict[str, int] = {}
        self.actors = []
        for node in placement.node_of_rank:
            self.actors.append(self._pool[node][taken.get(node, 0)])
            taken[node] = taken.get(node, 0) + 1
        self._finished, self._failed = set(), set()
        self._drains = {}
        self._nodes = set(placement.node_of_rank)
        self._runs = [
            actor.run.remote(WorkerArgs(
                rank=rank, world_size=world, store_host=self.store_host, store_port=self._store.port,
                store_prefix=f"{attempt.run_id}/attempt-{attempt.attempt}/", config=attempt.config,
                attempt=attempt.attempt, start_step=attempt.start_step, cursor=attempt.cursor,
                resume_step=attempt.resume_step, collective_timeout_s=self.collective_timeout_s,
                run_id=attempt.run_id, checkpoint_uri=attempt.checkpoint_uri,
                checkpoint_every=attempt.checkpoint_every, checkpoint_auto=attempt.checkpoint_auto,
                checkpoint_keep=attempt.checkpoint_keep, mtbf_s=attempt.mtbf_s,
                store_retry_budget_s=attempt.store_retry_budget_s,
            ))
            for rank, actor in enumerate(self.actors)
        ]

    def _grow_pool(self, wanted: dict[str, int]) -> list[tuple[str, Any]]:
        """Start actors until each node has `wanted` of them; (node, warm() ref) of the new ones. Their
        GPU slots are reserved first, one placement group per node whose bundles carry a label selector
        for it, all waited for together and released together if any is not granted in time (`start`):
        a launch holds all the slots it needs or none. Per node, not one group for all: Ray re-reserves
        a lost node's bundles when it returns, so a lost node's group is removed (`_forget_node`)
        without touching the warm actors elsewhere."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.name is not None and not self._made:  # names an earlier controller used stay taken
            for name, _ in self._named():
                node, k = name.split("/")[-2], int(name.rsplit("/", 1)[1])
                self._made[node] = max(self._made.get(node, 0), k + 1)
        self._growth = []
        self._growth_groups = []
        actor_cls = ray.remote(RankActor)
        new = []
        for node, count in wanted.items():
            missing = count - len(self._pool.get(node, []))
            if missing <= 0:
                continue
            self._reservations += 1
            group = placement_group(
                [{"GPU": 1.0} for _ in range(missing)], strategy="PACK",
                bundle_label_selector=[{"node": node} for _ in range(missing)],
                **({"name": f"{self.name}/reservation-{node}-{self._reservations}-{time.time_ns()}",
                    "lifetime": "detached"} if self.name is not None else {}))
            self._groups.setdefault(node, []).append(group)
            self._growth_groups.append(group)
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
        return new

    def _forget_node(self, node: str) -> None:
        """A node that died: its actors went with it; its reservations go too (else Ray would hold its
        GPUs for them again when it returns)."""
        self._pool.pop(node, None)
        for group in self._groups.pop(node, []):
            self._drop_reservation(group)

    def _forget_dead_nodes(self) -> None:
        """Before a launch: nodes the pool knows that Ray no longer shows alive."""
        import ray

        alive = {(info.get("Labels") or {}).get("node") for info in ray.nodes() if info.get("Alive")}
        for node in [n for n in set(self._pool) | set(self._groups) if n not in alive]:
            self._forget_node(node)

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
        ready, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        ready_ids = {r.hex() for r in ready}
        for rank, ref in enumerate(self._runs):
            if rank in self._finished or ref.hex() not in ready_ids:
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
        self._collect(result)
        result.dead_nodes = self._dead_nodes()
        self._failed |= set(result.errors) | result.dead_ranks
        if self._failed or result.dead_nodes:  # failed stays failed: later polls must not read "finished"
            result.status = GroupStatus.FAILED
        elif len(self._finished) == len(self._runs):
            result.status = GroupStatus.FINISHED
        return result

    def _collect(self, result: PollResult) -> None:
        """Drain every live rank's reports. A rank is unresponsive when its drain is unanswered after
        UNRESPONSIVE_S (a stopped actor) or its training process has been quiet that long (a stopped
        process). One drain in flight per rank."""
        import ray

        now = time.monotonic()
        for rank, actor in enumerate(self.actors):
            if rank not in self._drains and rank not in result.dead_ranks:
                self._drains[rank] = (actor.drain.remote(), now)
        refs = [ref for ref, _ in self._drains.values()]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=0.5)
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
                continue
            if quiet_s is not None and quiet_s > UNRESPONSIVE_S and rank not in self._finished:
                result.unresponsive.add(rank)
            result.reports.extend(reports)
            result.events.extend((rank, kind, detail) for kind, detail in events)
        result.reports.sort(key=lambda r: (r.step, r.rank))

    def _dead_nodes(self) -> set[str]:
        """Nodes of this attempt with no alive Ray node carrying their `node` label."""
        import ray

        alive, seen = set(), set()
        for info in ray.nodes():
            name = (info.get("Labels") or {}).get("node")
            if name in self._nodes:
                seen.add(name)
                if info.get("Alive"):
                    alive.add(name)
        dead = seen - alive
        for node in dead:
            self._forget_node(node)  # its actors died with it
        return dead

    def stop_rank(self, rank: int) -> int:
        """SIGSTOP one rank's training process (the hang-rank drill); the attempt's end kills it."""
        import ray

        return int(ray.get(self.actors[rank].signal_rank.remote(signal.SIGSTOP), timeout=30))

    def kill_rank(self, rank: int) -> int:
        """SIGKILL one rank's training process (the kill-rank drill)."""
        import ray

        return int(ray.get(self.actors[rank].signal_rank.remote(signal.SIGKILL), timeout=30))

    def slow_rank(self, rank: int, factor: float) -> None:
        """Make one rank's GPU slot compute `factor` times slower (the slow-rank drill)."""
        import ray

        ray.get(self.actors[rank].slow.remote(factor), timeout=30)

    def bitflip_rank(self, rank: int) -> None:
        """Flip a high exponent bit of one parameter element of one rank, in place (the bitflip drill)."""
        import ray

        ray.get(self.actors[rank].bitflip.remote(), timeout=30)

    def storage_outage(self, seconds: float) -> float:
        """Every slot's checkpoint writes are refused for `seconds` (the storage-outage drill); the end time."""
        import ray

        until = time.time() + seconds
        actors = [actor for pool in self._pool.values() for actor in pool]
        ray.get([actor.outage.remote(until) for actor in actors], timeout=30)
        return until

    def where(self) -> list[dict[str, Any]]:
        import ray

        return ray.get([a.where.remote() for a in self.actors], timeout=60)

    def shutdown(self) -> None:
        """End the attempt: every rank's training process is gone when this returns. Warm actors stay
        for the next attempt (all of them go with `close`, or here when not `warm`)."""
        import ray

        if not self.warm:
            self.close()
            return
        stops = [actor.stop.remote() for actor in self.actors]
        done, _ = ray.wait(stops, num_returns=len(stops), timeout=15)
        for actor, ref in zip(self.actors, stops):
            if ref not in done:  # an actor that cannot stop its process goes with it
                ray.kill(actor, no_restart=True)
                self._forget(actor)
        ended, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=5)
        for ref in ended:  # the killed processes' errors are expected: read them so Ray does not log them
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001
                pass
        self.actors, self._runs, self._drains = [], [], {}

    def _forget(self, actor: Any) -> None:
        for pool in self._pool.values():
            if actor in pool:
                pool.remove(actor)

    def close(self) -> None:
        """Release everything: every actor, and with it every training process (named ones of this
        run that an earlier controller left, too)."""
        import ray

        actors = [actor for pool in self._pool.values() for actor in pool]
        actors += [handle for _, handle in self._named()]
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

    def _named_reservations(self) -> list[Any]:
        """This run's placement groups that an earlier controller left (they are detached)."""
        import ray
        from ray.util.placement_group import get_placement_group

        if self.name is None:
            return []
        found = []
        for entry in ray.util.placement_group_table().values():
            name = entry.get("name") or ""
            if name.startswith(f"{self.name}/reservation-") and entry.get("state") != "REMOVED":
                try:
                    found.append(get_placement_group(name))
                except ValueError:
                    continue
        return found

    def _named(self) -> list[tuple[str, Any]]:
        """(name, handle) of this run's named actors alive in the cluster."""
        import ray

        if self.name is None:
            return []
        found = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry.get("namespace") == NAMESPACE and entry.get("name", "").startswith(f"{self.name}/"):
                try:
                    found.append((entry["name"], ray.get_actor(entry["name"], namespace=NAMESPACE)))
                except ValueError:
                    continue
        return found

    def attach(self, attempt: AttemptSpec) -> bool:
        """Take over the live workers of `attempt` that an earlier controller started: True when every
        rank's training process is still running (then `poll` goes on as if nothing happened)."""
        import ray

        named = self._named()
        if not named:
            return False
        prefix = f"{self.name}/reservation-"
        for group in self._named_reservations():  # the earlier controller's, by node (to forget a lost one's)
            node = _reservation_node(group, prefix)
            if node is not None:
                self._groups.setdefault(node, []).append(group)
        try:
            identities = ray.get([h.identity.remote() for _, h in named], timeout=15)
        except Exception:  # noqa: BLE001 - a dead or stuck actor: not attachable
            return False
        world = attempt.placement.mesh.world_size
        by_rank: dict[int, Any] = {}
        for (name, handle), ident in zip(named, identities):
            node = name.split("/")[-2]
            self._pool.setdefault(node, []).append(handle)
            self._made[node] = max(self._made.get(node, 0), int(name.rsplit("/", 1)[1]) + 1)
            if ident.get("attempt") == attempt.attempt and ident.get("alive") and not ident.get("done"):
                by_rank[int(ident["rank"])] = handle
        if sorted(by_rank) != list(range(world)):
            return False
        self.actors = [by_rank[r] for r in range(world)]
        self._runs = [actor.wait_done.remote() for actor in self.actors]
        self._finished, self._failed, self._drains = set(), set(), {}
        self._nodes = set(attempt.placement.node_of_rank)
        return True


def _reservation_node(group: Any, prefix: str) -> str | None:
    """The node a named reservation `{run}/reservation-{node}-{k}-{ns}` is for."""
    from ray.util import placement_group_table

    name = (placement_group_table(group) or {}).get("name") or ""
    if not name.startswith(prefix):
        return None
    return name[len(prefix):].rsplit("-", 2)[0]  # node names may hold dashes: the last two parts are k, ns
