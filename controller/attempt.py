"""The edge contract: what the controller asks of a worker group (Ray in production, a simulated one
in `goodput simulate`, fakes in tests) and what a group answers when polled."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from checkpointing.peer import PeerPoint
from controller.placement import Placement
from trainer.config import TrainerConfig
from trainer.report import StepReport


@dataclass(frozen=True, kw_only=True)
class AttemptSpec:
    """Everything a worker group needs to launch one attempt."""

    run_id: str
    """Run id (also the checkpoint folder)."""
    attempt: int
    """Attempt number."""
    config: TrainerConfig
    """Trainer config on this attempt's mesh."""
    placement: Placement
    """Rank -> (node, gpu)."""
    start_step: int = 0
    """Step to continue from."""
    cursor: int = 0
    """Sample cursor at start_step."""
    resume_step: int | None = None
    """Committed checkpoint step to load, if any."""
    checkpoint_uri: str | None = None
    """Object store of the checkpoints."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: none, unless auto)."""
    checkpoint_auto: bool = False
    """Young/Daly interval instead of a fixed one."""
    checkpoint_keep: int = 3
    """Committed steps kept."""
    mtbf_s: float | None = None
    """MTBF for the Young/Daly rule."""
    store_retry_budget_s: float = 30.0
    """How long checkpoint writes the store refuses for now are retried."""
    peer_every: int = 0
    """Steps between peer snapshots (0: none)."""
    peer_buddy: tuple[int, ...] | None = None
    """rank -> the rank on another node that keeps its snapshot's copy (failure_domain replica: the
    local rank within the same replica, whose world the copies travel on)."""
    peer_restore: PeerPoint | None = None
    """Load this peer snapshot step (from the nodes' host memory) instead of `resume_step`."""
    peer_replicas: tuple[int, ...] | None = None
    """failure_domain replica: the replicas that load `peer_restore` from their own nodes; the others
    join at epoch 0 and receive a loading replica's state (None: every rank loads it)."""
    peer_key: str | None = None
    """The run's snapshot folder on every node (checkpointing.peer.run_key); None: `run_id`."""
    failure_domain: str = "world"
    """`replica`: a lost node stops only its data-parallel replicas (the group's `lose_replicas` and
    `form_replicas` are then called while the others train); `world`: the whole attempt."""
    batch_while_healing: str = "keep"
    """While replicas are out: `keep` the global batch (survivors take their samples), or `shrink` it."""
    stoppable: bool = False
    """The ranks look for a stop at every step boundary (trainer/stop.py): a run a service may preempt."""


class GroupStatus(str, enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass
class PollResult:
    status: GroupStatus
    """Whole-group state."""
    reports: list[StepReport] = field(default_factory=list)
    """Step reports since the last poll."""
    events: list[tuple[int, str, dict]] = field(default_factory=list)
    """(rank, kind, detail) since the last poll."""
    errors: dict[int, str] = field(default_factory=dict)
    """rank -> error, when status is FAILED."""
    dead_nodes: set[str] = field(default_factory=set)
    """Nodes of this attempt that Ray reports dead."""
    dead_ranks: set[int] = field(default_factory=set)
    """Ranks whose process died (gone), as opposed to raising."""
    on_live_nodes: set[int] = field(default_factory=set)
    """Dead ranks whose node is known alive (the training process died under a live actor)."""
    unresponsive: set[int] = field(default_factory=set)
    """Ranks that did not answer a status call in time (stopped or wedged)."""
    suspect_nodes: set[str] = field(default_factory=set)
    """Nodes of this attempt not yet declared dead whose node daemon refuses connections: dying (Ray
    declares a node dead only after its health checks miss a few times). Looked at once a node is dead."""
    silent_nodes: dict[str, str] = field(default_factory=dict)
    """Nodes of this attempt whose heartbeat stopped, with the evidence that confirmed it (each is in
    `dead_nodes` too): a silent fault (health/heartbeat.py)."""
    isolated: str | None = None
    """Why the controller suspects itself rather than the nodes (every node silent at once), while it
    does: no node is declared lost for silence then."""
    compute: list[tuple[int, Any]] = field(default_factory=list)
    """(step, every rank's compute seconds in rank order): whole steps at once, as the simulator gives
    its synthetic per-rank samples to the straggler judgement (reports carry one rank's each)."""


class WorkerGroup(Protocol):
    def start(self, attempt: AttemptSpec) -> None: ...
    def poll(self) -> PollResult: ...
    def shutdown(self) -> None: ...
    # Optional, for `failure_domain: replica`: `contains_replicas()` (this attempt runs each replica as
    # its own world), `lose_replicas(replicas, nodes)` (the survivors go on
    # without them, now) and `form_replicas(replicas, placement)` (form them again where the placement
    # puts them; the group reports `replica_rejoined` once they train).
    # Optional: `abort()`, callable from any thread, makes a `start` in progress give up soon (cancel).
    # Optional: `peer_copies(peer_key, nodes) -> {node: [checkpointing.peer.Held]}`, what each of those
    # nodes holds of the run's peer snapshots (a group without it never recovers from peers).
