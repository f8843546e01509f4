"""The replica protocol's races, driven there on purpose (issue 44): rank processes that train as
replicas with faults injected at named protocol points (trainer/protocol.ProtocolFault), and a
controller for the test that decides as goodput's does: a `Roster` (trainer/protocol.py, the same
decisions controller/ray/replicas.py takes) fed by what the ranks say (their events, through the
store, as the worker group drains them) and by the test's kills. Nothing is published by hand."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from tests.dist.harness import Ranks
from tests.dist.parity import full
from trainer.config import TrainerConfig, config_from_dict, config_to_dict
from trainer.membership import MembershipBoard
from trainer.protocol import NotContainable, Roster
from trainer.report import ListSink


class StoreSink(ListSink):
    """A rank's sink that also says each event through the store (what the worker group would drain)."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        super().__init__()
        self.store, self.rank = store, rank

    def event(self, kind: str, detail: dict) -> None:
        super().event(kind, detail)
        n = self.store.add("events", 1)
        self.store.set(f"event/{n}", json.dumps({"rank": self.rank, "kind": kind, "detail": detail}))


def race_rank(*, rank: int, world_size: int, store_port: int, replica: int, incarnation: int, config: dict,
              replicas: int, faults: tuple[str, ...] = (), corrupt_at: int | None = None,
              timeout_s: float = 20.0) -> dict[str, Any]:
    """One rank of replica `replica` (its `incarnation`-th forming: 0 joins epoch 0, later ones wait
    for the epoch that lists them joining), with `faults` (`POINT@RANK:step=N`, RANK the run's) on
    this rank; `corrupt_at`: after that step, flip a mantissa bit of its AdamW state. What it ended
    with: its log, events, step, checksum, parameters, and the SilentDataCorruption or removal."""
    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.probes import SilentDataCorruption
    from trainer.tensors import local_tensor
    from trainer.protocol import ProtocolFault
    from trainer.replica import CrossReplica, ReplicaBroken, checksum, replica_step, state_tensors, switch_to
    from trainer.train import Trainer

    store = dist.TCPStore("127.0.0.1", store_port, is_master=False)
    init_process_group(rank=rank, world_size=world_size, store=dist.PrefixStore(f"replica{replica}/i{incarnation}", store),
                       backend="gloo", timeout_s=timeout_s)
    cfg = config_from_dict(config)
    run_rank = replica * world_size + rank
    mine = [f for f in (ProtocolFault.parse(t) for t in faults) if f.rank == run_rank]
    cross = CrossReplica(store, replica=replica, position=rank, device=torch.device("cpu"), timeout_s=timeout_s,
                         replicas=replicas, faults=mine)
    sink = StoreSink(store, run_rank)
    trainer = Trainer(cfg, build_mesh(cfg.mesh, "cpu"), choose_device(cfg.train.dtype), replicas=cross, sink=sink)
    trainer.rank = run_rank
    log: list[dict[str, Any]] = []

    def discarded(detail: dict[str, Any]) -> None:
        if rank == 0:
            sink.event("replica_step_discarded", {k: v for k, v in detail.items() if k != "kind"})

    removed, sdc = False, None
    try:
        if incarnation == 0:
            switch_to(trainer, cross.board.get(0), wait_s=60.0, log=log, on_failed=discarded)
        else:
            store.set(f"ready/{replica}/{incarnation}/{rank}", "1")
            switch_to(trainer, cross.board.wait_joining(replica, 60.0), wait_s=60.0, log=log, on_failed=discarded)
            if rank == 0:
                sink.event("replica_rejoined", {"replicas": [replica], "epoch": log[-1]["epoch"]})
        while trainer.step < cfg.train.steps:
            report = replica_step(trainer, wait_s=60.0, log=log, on_discarded=discarded)
            if rank == 0:
                store.set(f"progress/{replica}", str(report.step))
            if corrupt_at is not None and report.step == corrupt_at:
                exp_avg = local_tensor(trainer.optimizers[0].state[next(trainer.parts[0].parameters())]["exp_avg"])
                exp_avg.view(-1).view(torch.int64)[0] ^= 1 << 40  # (no probe sees it: only a comparison can)
    except ReplicaBroken:
        removed = True
    except SilentDataCorruption as e:
        sdc = str(e)
    out = {"log": log, "events": sink.events, "step": trainer.step, "removed": removed, "sdc": sdc,
           "checksum": checksum(state_tensors(trainer.parts, trainer.optimizers)),
           "params": {name: full(p).detach().clone() for part in trainer.parts for name, p in part.named_parameters()}}
    cross.abort()
    dist.destroy_process_group()
    return out


class RosterController:
    """The test's controller: the store, the membership board, a Roster, and a thread that reads what
    the ranks say and acts on it as the worker group does (a discard with nothing lost: the resync
    epoch; a contained SDC: the suspect replicas lost; a rejoin: a holder from now on; a replica ready:
    the epoch that lists it joining). `lose` is the test's kill, told to the roster."""

    def __init__(self, replicas: int) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.board = MembershipBoard(self.store)
        self.roster, first = Roster.start(replicas)
        self.board.publish(first)
        self.replicas = replicas
        self.per = 0
        self.seen: list[dict[str, Any]] = []
        self.published: list[Any] = [first]
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def start(self, cfg: TrainerConfig, replica: int, incarnation: int = 0, **kwargs: Any) -> Ranks:
        self.per = cfg.mesh.world_size
        if incarnation:
            with self.lock:
                self.roster.form(replica, incarnation)
        return Ranks(race_rank, cfg.mesh.world_size, port=self.store.port, replica=replica, incarnation=incarnation,
                     config=config_to_dict(cfg), replicas=self.replicas, **kwargs)

    def lose(self, replica: int) -> None:
        with self.lock:
            self._publish(self.roster.lose([replica]))

    def _publish(self, membership: Any) -> None:
        if membership is not None:
            self.board.publish(membership)
            self.published.append(membership)

    def _loop(self) -> None:
        read = 0
        while not self._stop.is_set():
            count = int(self.store.add("events", 0))
            with self.lock:
                while read < count:
                    read += 1
                    said = json.loads(self.store.get(f"event/{read}"))
                    said["time"] = time.time()
                    self.seen.append(said)
                    self._act(said)
                ready = [k for k, inc in self.roster.forming.items()
                         if self.per and self.store.check([f"ready/{k}/{inc}/{r}" for r in range(self.per)])]
                self._publish(self.roster.ready(ready))
            time.sleep(0.05)

    def _act(self, said: dict[str, Any]) -> None:
        kind, detail = said["kind"], said["detail"]
        if kind == "replica_step_discarded":
            self._publish(self.roster.resolve_discard(int(detail["epoch"])))
        elif kind == "sdc_suspect" and detail.get("contained"):
            try:
                self._publish(self.roster.lose(int(k) for k in detail.get("replicas", ())))
            except NotContainable:
                pass
        elif kind == "replica_rejoined":
            self.roster.rejoined(int(k) for k in detail["replicas"])

    def progress(self, replica: int) -> int:
        key = f"progress/{replica}"
        return int(self.store.get(key)) if self.store.check([key]) else 0

    def wait(self, what: str, done: Any, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"waited {timeout_s:.0f} s for {what}"
            time.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
