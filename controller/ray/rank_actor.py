"""The rank actor: one per GPU slot. It has its node's warm image (controller/ray/zygote.py) fork the
rank's training process, relays its reports, has the zygote send its heartbeats, and holds the slot's
drill switches (trainer/switches.py) in memory every training process of the slot shares. It never
imports torch: starting one costs Ray's worker and this package's torch-free modules only.

A training process whose attempt failed under it (a peer gone: its collective raised) tears its
process group down and parks, waiting for its slot's next attempt, which it then trains in place:
no fork, and its warm caches kept where they still hold (trainer/parallel.py); benchmarks/
survivors_in_place.py measures it against a re-fork. One that does not leave its collective (a gloo
rank blocked on a live peer: a parked rank's sockets stay open, so one waiting on it waits on; a
stopped process) is SIGKILLed when the attempt ends and the next attempt forks a fresh one. Why
forked processes at all, see controller/ray/worker_group.py."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from checkpointing.peer import Held, forget_run, held_copies, holdings, peer_base
from controller.ray.zygote import SlotMemory, ZygoteClient

from trainer.args import WorkerArgs, WorkerSummary
from trainer.report import StepReport


UNRESPONSIVE_S = 3.0
"""A rank whose process or actor has shown no sign of life for this long counts as unresponsive."""

TEARDOWN_GRACE_S = 2.0
"""How long the end of an attempt waits for a training process that is tearing its process group
down to park (it is then kept for the next attempt) before it is SIGKILLed."""


class RankProcessDied(RuntimeError):
    """The rank's training process ended by a signal or without a word: a cause, not a symptom."""


class RankActor:
    """Holds one GPU slot on one node. `warm` finds (or starts) the node's zygote and waits until it has
    imported torch; `run` has it fork this attempt's training process (or hands the attempt to the
    slot's parked one) and relays its reports; `stop` SIGKILLs it (a parked one stays, if asked). Concurrent calls (max_concurrency=5): `run` waits on
    the process while `drain` hands reports to the controller, `wait_done` (a re-attached controller)
    waits for its outcome and `stop` ends it."""

    def __init__(self) -> None:
        from trainer.switches import DrillSwitches

        self._lock = threading.Lock()
        # Shared with every training process of this slot: drills set on this GPU slot stay with it.
        self._memory = SlotMemory()
        self._switches = DrillSwitches(self._memory.switches)
        self._zygote: ZygoteClient | None = None
        self._lifeline: int | None = None
        """The write end of the training process's lifeline (closed: the process exits)."""
        self._reports: list[StepReport] = []
        self._events: list[tuple[str, dict]] = []
        self._process: Any = None
        self._beat: Any = None
        self._receive: Any = None
        """The training process's reports (its pipe's reading end)."""
        self._commands: Any = None
        """The parked training process's next attempt (the writing end of its command pipe)."""
        self._leaving = threading.Event()
        """The training process's attempt failed: it is tearing its process group down."""
        self._parked = threading.Event()
        """The training process has torn its process group down and waits for the next attempt."""
        self._identity: dict[str, Any] = {}
        self._done = threading.Event()
        self._outcome: tuple[str, Any] | None = None
        self._heart = NodeHeart()

    def warm(self) -> dict[str, Any]:
        """Wait for this node's warm image: on an embedded cluster's node, a fork of the host's
        (controller/ray/host_image.py); elsewhere the node's zygote (started here by the node's first
        rank actor)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from controller.ray.host_image import node_image
        from controller.ray.run_store import NAMESPACE
        from controller.ray.zygote import ZYGOTE_PREFIX, NodeZygote

        if self._zygote is None:
            node = ray.get_runtime_context().get_node_id()
            path = node_image(node)
            if path is None:
                zygote: Any = ray.remote(NodeZygote).options(
                    name=ZYGOTE_PREFIX + node, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                    num_cpus=0, max_concurrency=4,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                path = ray.get(zygote.warm.remote())
            self._zygote = ZygoteClient(path)
            self._heart.zygote = self._zygote
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
        if self._zygote is None:
            self.warm()
        if args.peer_every or args.peer_restore is not None:  # the snapshots live in this node's host memory
            args = dataclasses.replace(args, peer_dir=str(self._peer_folder()))
        with self._lock:
            self._identity = {"run_id": args.run_id, "attempt": args.attempt, "rank": args.rank,
                              "incarnation": args.incarnation}
            self._done, self._outcome = done, None
        self._heart.beat_for(args.store_host, args.store_port, heartbeat_key(args.store_prefix, args.rank))
        try:
            summary = self._run(args)
            self._outcome = ("ok", summary)
            return summary
        except BaseException as e:
            self._outcome = ("error", e)
            raise
        finally:
            done.set()

    def _peer_folder(self) -> Path:
        """This node's snapshot folder: one per Ray node (a node that comes back is a new node, with
        empty memory)."""
        import ray

        return peer_base() / ray.get_runtime_context().get_node_id()

    def peer_copies(self, peer_key: str) -> list[Held]:
        """What this node holds of the run's peer snapshots (in its folder `peer_key`,
        checkpointing.peer.run_key): its complete copies, a record per step."""
        return holdings(held_copies(self._peer_folder() / peer_key))

    def drop_peer_copies(self, peer_key: str) -> None:
        """The run has ended, or this node's replica was lost: the run's snapshots leave this node's memory."""
        forget_run(self._peer_folder() / peer_key)

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
        self._start(args)
        process, receive = self._process, self._receive
        summary: WorkerSummary | None = None
        while True:
            try:
                kind, payload = receive.recv()
            except (EOFError, OSError):
                break
            if kind == "report":
                self.report(payload)
            elif kind == "event":
                self.event(*payload)
            elif kind == "leaving":
                self._leaving.set()
            elif kind == "done":
                summary = payload
            elif kind == "error":
                message, parked = payload
                if parked:  # torn down and waiting: it may train the slot's next attempt
                    self._parked.set()
                raise RuntimeError(message)
        process.join()
        receive.close()
        if process.exitcode is not None and process.exitcode < 0:
            name = signal.Signals(-process.exitcode).name
            raise RankProcessDied(f"rank {args.rank}'s training process (pid {process.pid}) was killed by {name}")
        if summary is None:
            raise RankProcessDied(f"rank {args.rank}'s training process exited with code {process.exitcode} "
                                  "without a result")
        return summary

    def _start(self, args: WorkerArgs) -> None:
        """Hand the attempt to the parked training process, or have the zygote fork one."""
        import multiprocessing

        if self._zygote is None:
            self.warm()
        assert self._zygote is not None
        with self._lock:
            parked = self._parked.is_set() and self._process is not None and self._process.is_alive()
            self._parked.clear()
            self._leaving.clear()
            if parked:
                try:
                    self._commands.send(dataclasses.replace(args, in_place=True))
                    return
                except (BrokenPipeError, OSError):  # it died parked: a fresh one
                    pass
            self._end_process()
            receive, send = multiprocessing.Pipe(duplex=False)
            commands_in, commands = multiprocessing.Pipe(duplex=False)
            lifeline_in, lifeline = os.pipe()
            self._memory.value = time.time()
            try:
                process = self._zygote.fork(args, report=send.fileno(), commands=commands_in.fileno(),
                                            lifeline=lifeline_in, memory=self._memory)
            except BaseException:
                receive.close()
                commands.close()
                os.close(lifeline)
                raise
            finally:
                send.close()
                commands_in.close()
                os.close(lifeline_in)
            self._beat = self._memory
            self._process, self._receive, self._commands, self._lifeline = process, receive, commands, lifeline

    def _end_process(self) -> None:
        """SIGKILL the training process (even a stopped one) and wait for it; under the lock."""
        process = self._process
        if process is None or process.pid is None:
            return
        for sig in (signal.SIGKILL, signal.SIGCONT):
            try:
                os.kill(process.pid, sig)
            except ProcessLookupError:
                break
        process.join(timeout=10)
        if self._commands is not None:
            self._commands.close()
            self._commands = None
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        self._parked.clear()

    def stop(self, keep_parked: bool = False) -> None:
        """End this attempt's training process, even a stopped one; returns once it is gone. With
        `keep_parked`, a process that left its failed attempt (or does so within TEARDOWN_GRACE_S of
        starting to) stays, parked, for the slot's next attempt."""
        if keep_parked and self._leaving.is_set():
            self._parked.wait(TEARDOWN_GRACE_S)
        with self._lock:
            process = self._process
            if keep_parked and self._parked.is_set() and process is not None and process.is_alive():
                return
            self._end_process()

    def slow(self, factor: float) -> None:
        """The slow-rank drill: this GPU slot computes `factor` times slower from now on."""
        self._switches.slow(factor)

    def bitflip(self) -> None:
        """The bitflip drill: the training process flips a bit of its parameters before its next step."""
        self._switches.request_bitflip()

    def collective_fault(self, point: str, delay_s: float | None, from_step: int | None = None) -> None:
        """The collective-fault drill: this slot's rank fails (or, with a delay, holds back) the named
        point of the replica protocol the next time it gets there (trainer/protocol.ProtocolFault), at
        step `from_step` or later."""
        from trainer.protocol import PROTOCOL_POINTS

        self._switches.request_collective_fault(PROTOCOL_POINTS.index(point), delay_s, from_step)

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


def heartbeat_key(store_prefix: str, rank: int) -> str:
    """The counter of the run's store that the actor holding `rank` of an attempt adds to."""
    return f"{store_prefix}heartbeat/{rank}"


class NodeHeart:
    """The node's heartbeat for this rank actor (health/heartbeat.py): the node's zygote adds one to a
    counter of the run's store every HEARTBEAT_PERIOD_S, whatever the training process does (a slow
    step, a checkpoint, a stopped rank), so only a node that is gone, cut off or frozen goes silent
    (and a rank actor that died: the beat's lifeline closes with it). The counter is the rank's of the
    newest attempt this actor trains; a store that does not answer (a partition) is tried again at the
    next beat."""

    def __init__(self) -> None:
        self.zygote: ZygoteClient | None = None
        self._target: tuple[str, int, str] | None = None
        self._lifeline: int | None = None
        self._lock = threading.Lock()

    def beat_for(self, host: str, port: int, key: str) -> None:
        with self._lock:
            if self._target == (host, port, key) or self.zygote is None:
                return
            ending, beat = self._lifeline, os.pipe()
            try:
                self.zygote.beat(host, port, key, beat[0])
            except BaseException:
                os.close(beat[1])
                raise
            finally:
                os.close(beat[0])
            self._target, self._lifeline = (host, port, key), beat[1]
            if ending is not None:
                os.close(ending)  # the last attempt's key goes quiet
