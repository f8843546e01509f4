"""A run's checkpoints as its controller sees them: where the next attempt starts, the discards still
owed, the save interval one attempt hands the next, and whether the store answers.

The controller holds one `RunCheckpoints` per run and asks it before each launch; the rules themselves
(commit, retention, discard, which step may be loaded) live in checkpointing.manifest.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from checkpointing.fence import raise_fence
from checkpointing.manifest import Discards, resume_point
from checkpointing.peer import Held, PeerPoint, peer_point, replica_peer_point, run_key
from checkpointing.schedule import observed_mtbf_s
from checkpointing.store import ObjectStore, StoreOutage
from controller.events import EventKind
from controller.placement import Placement
from controller.spec import RunSpec
from trainer.config import state_fingerprint, state_identity


@dataclass(frozen=True)
class LoadPoint:
    """Where the next attempt starts."""

    start_step: int
    cursor: int
    """The data cursor saved with `resume_step` (0 from scratch)."""
    resume_step: int | None
    """The committed step to load (None: start from scratch)."""
    unusable: list[str]
    """Why newer committed steps could not be used."""
    discarded: list[tuple[int, str]]
    """Steps the owed discards removed, and why."""
    peer: PeerPoint | None = None
    """The peer snapshot step to load instead of the store's (then `start_step` is its step)."""
    peer_unusable: str = ""
    """Why no peer snapshot could be used, when peer snapshots are on."""
    peer_replicas: tuple[int, ...] | None = None
    """failure_domain replica: the replicas whose own nodes hold every copy of `peer` (they load it;
    the others receive their state at the launch); None: every rank loads it."""

    @property
    def source(self) -> str | None:
        """Where the next attempt's state comes from: peer, store, or None (from scratch)."""
        return "peer" if self.peer is not None else "store" if self.resume_step is not None else None


class RunCheckpoints:
    def __init__(self, run_id: str, store: ObjectStore | None, *, retry_budget_s: float, created_at: float,
                 own_only: bool) -> None:
        self.run_id = run_id
        self.store = store
        self.created_at = created_at
        self.peer_key = run_key(run_id, created_at)
        """The run's snapshot folder on every node: another run under the same id never reads it."""
        self.discards = Discards(run_id)
        """Discards owed before the next launch reads: a resume's step (newer commits go), an SDC rollback."""
        self.outage = StoreOutage(retry_budget_s)
        self.auto_interval = 0
        """`auto`: the interval the last attempt chose, for the next one to start with (it measures the
        save cost again at its first save); 0 before any was chosen."""
        self.own_only = own_only
        """A submitted run (goodput serve) is a new run: it never loads a checkpoint committed before it
        was submitted (another run's, under the same id) unless resumed on purpose (`adopted`)."""
        self.adopted = False
        """Resumed on purpose (goodput resume): the checkpoints under its id are its to load, whoever wrote them."""
        self.peer_excluded: list[tuple[int, int]] = []
        """(attempt, step): that attempt's peer snapshots after the step are never loaded (an SDC
        rollback: they may hold the corruption; a resume to an older step)."""

    def restore(self, events: list[dict[str, Any]]) -> None:
        """What a restarted service's timeline says: the interval last chosen, whether resumed on purpose."""
        intervals = [e["detail"].get("steps", 0) for e in events if e["kind"] == EventKind.CHECKPOINT_INTERVAL]
        self.auto_interval = int(intervals[-1]) if intervals else 0
        self.adopted = any(e["kind"] == EventKind.RESUME_REQUESTED for e in events)

    def load_point(self, spec: RunSpec, held: Mapping[str, list[Held]] | None = None,
                   nodes: set[str] | None = None, replica_nodes: list[set[str]] | None = None) -> LoadPoint:
        """Where the next attempt starts, after the discards still owed (a resume to an older step, an
        SDC rollback): the store's latest usable step, or a newer (or as new) peer snapshot step that
        every rank has a copy of on `nodes` (`held`: what each node holds). An attempt whose replicas
        are their own worlds (`replica_nodes`: each one's nodes) needs it whole on one replica's nodes
        only (`replica_peer_point`). Store I/O: StoreError when the store cannot be reached (nothing is
        decided from an outage), IdentityMismatch / ForeignCheckpoints when what is there cannot be
        this run's."""
        point = self._store_point(spec)
        if held is None:
            return point
        identity = state_fingerprint(spec.to_model_config())
        loaders: tuple[int, ...] | None = None
        if replica_nodes is not None:
            peer, loaders, why = replica_peer_point(held, identity=identity, replica_nodes=replica_nodes,
                                                    excluded=self.peer_excluded)
        else:
            peer, why = peer_point(held, identity=identity, nodes=nodes or set(), excluded=self.peer_excluded)
        if peer is None or peer.step < point.start_step:
            return dataclasses.replace(point, peer_unusable=why or f"the store's step {point.start_step} is newer")
        return dataclasses.replace(point, start_step=peer.step, cursor=peer.cursor, resume_step=None, peer=peer,
                                   peer_replicas=loaders)

    def raise_fence(self, attempt: int, start_step: int) -> None:
        """Attempt `attempt` starts from `start_step`: no earlier attempt commits after that
        (checkpointing/fence.py: the store's record), and no peer snapshot of a later step taken by the
        attempt before it is loaded (a node back from a partition). Store I/O: StoreError when the store cannot be reached."""
        if attempt > 0:  # (the one before it; each earlier one was fenced when its successor started)
            self.exclude_peers(attempt - 1, start_step)
        if self.store is not None:
            raise_fence(self.store, self.run_id, attempt, start_step)

    def exclude_peers(self, attempt: int, after_step: int) -> None:
        """Attempt `attempt`'s peer snapshots after `after_step` are never loaded."""
        self.peer_excluded.append((attempt, after_step))

    def _store_point(self, spec: RunSpec) -> LoadPoint:
        if self.store is None:
            return LoadPoint(0, 0, None, [], [])
        self.discards.settle(self.store)
        model = spec.to_model_config()
        found = resume_point(self.store, self.run_id, identity=state_fingerprint(model),
                             identity_detail=state_identity(model),
                             not_before=self.created_at if self.own_only and not self.adopted else None)
        discarded = self.discards.take_done()  # kept across tries: an outage after a discard loses no event
        if found is None:
            return LoadPoint(0, 0, None, [], discarded)
        manifest, skipped = found
        return LoadPoint(manifest.step, manifest.cursor, manifest.step, skipped, discarded)

    def unreachable(self, now: float, error: Exception) -> dict[str, Any] | None:
        """The store did not answer: back off. The `store_unavailable` event detail the first time the
        outage outlasts `checkpoint.retry_budget_s`, else None."""
        if not self.outage.failed(now):
            return None
        return dict(error=str(error), since=self.outage.since, retry_in_s=self.outage.backoff_s,
                    uri=self.store.uri if self.store else None)

    def roll_back(self, through: int) -> list[tuple[int, str]]:
        """SDC: commits after `through` go (now, or before the next launch reads if the store is down)."""
        return self.discards.roll_back(self.store, through)

    def reject(self, step: int, why: str) -> list[tuple[int, str]]:
        """A loading rank found `step`'s bytes corrupt: it goes (now, or before the next launch reads)."""
        return self.discards.reject(self.store, step, why)

    def attempt_settings(self, spec: RunSpec, *, run_s: float, failures: int) -> dict[str, Any]:
        """The checkpoint fields of the next AttemptSpec: where, how often, how many kept."""
        c = spec.checkpoint
        return dict(checkpoint_uri=self.store.uri if self.store else None,
                    checkpoint_every=c.every_steps if isinstance(c.every_steps, int) else self.auto_interval,
                    checkpoint_auto=c.every_steps == "auto", checkpoint_keep=c.keep,
                    store_retry_budget_s=c.retry_budget_s,
                    mtbf_s=observed_mtbf_s(run_s, failures, c.mtbf_hours * 3600 if c.mtbf_hours else None))

    def peer_settings(self, spec: RunSpec, placement: Placement, point: LoadPoint, *,
                      replicas: bool = False) -> dict[str, Any]:
        """The peer snapshot fields of the next AttemptSpec: how often, who keeps whose copy (within
        each replica when `replicas`: each is its own world), what to load and which replicas load it."""
        every = spec.checkpoint.peer_every_steps
        return dict(peer_every=every, peer_buddy=placement.peer_buddies(replicas=replicas) if every else None,
                    peer_restore=point.peer,
                    peer_replicas=point.peer_replicas, peer_key=self.peer_key)
