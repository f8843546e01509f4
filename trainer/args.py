"""What a rank's training process is given (WorkerArgs) and what it returns (WorkerSummary): torch-free,
so a rank actor that only relays them (controller/ray/rank_actor.py) never imports torch."""

from __future__ import annotations

from dataclasses import dataclass

from checkpointing.peer import PeerPoint
from trainer.config import TrainerConfig


@dataclass(frozen=True, kw_only=True)
class WorkerArgs:
    rank: int
    """Global rank of this process."""
    world_size: int
    """dp * pp * tp of this attempt."""
    store_host: str
    """Host of the rendezvous TCPStore (never a rank that can die)."""
    store_port: int
    """Port of the rendezvous TCPStore."""
    store_prefix: str
    """Key prefix of this attempt, so a new attempt never reads an old one's keys."""
    config: TrainerConfig
    """What to train, on which mesh."""
    attempt: int = 0
    """Attempt number of the run."""
    start_step: int = 0
    """Step to continue from (with `cursor`, from a checkpoint's manifest)."""
    cursor: int = 0
    """Global sample cursor at `start_step`."""
    collective_timeout_s: float = 120.0
    """Process-group timeout: a collective waiting longer than this fails."""
    run_id: str = "run"
    """Run id; names the checkpoint folder."""
    checkpoint_uri: str | None = None
    """Object store of the checkpoints (file://PATH or s3://BUCKET/PREFIX); None saves nothing."""
    checkpoint_every: int = 0
    """Save every this many steps (and at the last step); 0 saves nothing."""
    checkpoint_auto: bool = False
    """Choose the interval by the Young/Daly rule from the measured save cost and `mtbf_s`."""
    checkpoint_async: bool = True
    """Block only for staging; write, upload and commit in the background."""
    checkpoint_keep: int = 3
    """Committed steps to keep."""
    mtbf_s: float | None = None
    """Mean time between failures for the Young/Daly rule (configured or observed)."""
    resume_step: int | None = None
    """Committed step to load before training (from `checkpoint_uri`); None starts from the seeded init."""
    staging_dir: str = "/tmp/goodput-staging"
    """Local scratch for shards on their way to a remote store: each rank stages into a folder of its own
    there, and removes what ranks killed mid-save left (checkpointing/staging.py)."""
    store_retry_budget_s: float = 30.0
    """How long a checkpoint write the store refuses for now (an outage) keeps being retried."""
    peer_every: int = 0
    """Snapshot the state into host memory (own node and buddy's) every this many steps; 0: never."""
    peer_buddy: tuple[int, ...] | None = None
    """rank -> the rank on another node that keeps its snapshot's copy (None: own copies only)."""
    peer_dir: str | None = None
    """This rank's node's snapshot folder (checkpointing.peer); None: no peer snapshots here."""
    peer_key: str | None = None
    """The run's folder in it (checkpointing.peer.run_key); None: `run_id`."""
    peer_restore: PeerPoint | None = None
    """Load this peer snapshot step before training (instead of `resume_step` from the store)."""
    in_place: bool = False
    """This process trained an earlier attempt of the run and stayed (its process group rebuilt in
    place, controller/ray/rank_actor.py); said in its `restored` event."""
    replica_domain: bool = False
    """failure_domain replica (trainer/replica.py): this rank's world is its data-parallel replica
    (`config.mesh.dp_replicas` of them, `world_size / dp_replicas` ranks each); the gradient meets
    the other replicas' in one cross-replica group per shard position, re-formed at each membership
    epoch the controller publishes in the store (epoch 0 before the launch)."""
    batch_while_healing: str = "keep"
    """failure_domain replica, while replicas are out: `keep` the global batch or `shrink` it."""
    interface: str | None = None
    """The run's network interface for collectives (cluster.interface), where the node sets none."""
    incarnation: int = 0
    """failure_domain replica: how many times this rank's replica was formed before (0: at the launch).
    A replica formed again waits for the epoch that lists it as joining and takes a live one's state."""
    stoppable: bool = False
    """Look for a stop the controller asks for at every step boundary (trainer/stop.py: a preemption or a
    drain; one all-reduce of a flag per step); world failure domain only."""


@dataclass(frozen=True, kw_only=True)
class WorkerSummary:
    rank: int
    """Who."""
    step: int
    """Steps done when the worker returned."""
    cursor: int
    """Sample cursor when the worker returned."""
    last_loss: float | None
    """Loss of the last step (last-stage ranks)."""
    stopped: str | None = None
    """Stopped at a step boundary as the controller asked (trainer/stop.py): how the state was kept
    (store, peers); None when it trained to the end."""
