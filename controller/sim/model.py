"""What `goodput simulate` assumes: when things break (the failure model) and what each thing costs
(the cost model). Pure: no ray, torch or boto3.

Failure model default: the Llama 3 405B report (Dubey et al. 2024, section 3.3.4, table 5): 419
unexpected interruptions in 54 days of pre-training on 16,384 H100 GPUs (2,048 nodes of 8), about 78 %
of them attributed to hardware. Its rows (counts; the table's percentages do not all match its counts,
e.g. 148 faulty GPUs printed as 30.1 % of 419, so the counts are used), grouped by the component
goodput's attribution sees:

    gpu       268  faulty GPU 148, GPU HBM3 memory 72, GPU SRAM memory 19, GPU system processor 17,
                   silent data corruption 6, GPU thermal interface + sensor 6 (`sdc_share` 6/268)
    network    42  network switch/cable 35, NIC 7
    host       32  host maintenance 32
    storage    16  SSD 3, power supply 3, server chassis 2, IO expansion board 2, dependency 2, CPU 2,
                   system memory 2 (the node's other parts)
    software   61  software bug 54, NCCL watchdog timeouts 7

hardware (gpu, network, storage) = 326 of 419 = 77.8 %.

as rates per 1,000 node-days: count / (2,048 nodes x 54 days) x 1,000.

Silent or loud (`SILENT_COUNTS`, per row of the same table). Loud: a process ends on a live kernel,
which closes its sockets, so its peers' collectives fail at once. Silent: nothing closes, and the
survivors wait in their collectives until something times out. The table gives root causes, not how
each showed itself, so the split is goodput's judgement, one row at a time:

    gpu        0 of 268  faulty GPU, HBM3, SRAM, GPU system processor, thermal: the driver reports an
                         Xid, the rank's CUDA calls fail and its process exits on a live kernel (loud);
                         silent data corruption is the probes' (`sdc_share`). A GPU that hangs its rank
                         instead would be a hang; the table does not say how often, so none is counted
    network   42 of 42   switch/cable 35, NIC 7: a link that dies closes nothing (silent)
    host       0 of 32   host maintenance: the fleet takes a live host out and its kernel ends the
                         processes (loud)
    storage    9 of 16   power supply 3, server chassis 2, CPU 2, system memory 2: the host goes dark
                         or its kernel stops (no power, a machine check), and a dead kernel closes
                         nothing (silent); SSD 3, IO expansion board 2, dependency 2: an I/O or device
                         error to a live process (loud)
    software   7 of 61   NCCL watchdog timeouts 7: a hang, by name (silent); software bug 54: the rank
                         raises (loud)

58 of 419 = 13.8 % silent. FT-HSDP (below) is cited for its stall only: no share is taken from it.
The share is a module constant (`incidents` takes another): the spec's failure model
(controller/spec.py `FailureModelSpec`) has no field for it.

What each silent incident costs depends on whether its node still beats (health/heartbeat.py):
a dark host (storage's silent rows) beats no more, and the controller declares it lost once its
heartbeat has not moved for HEARTBEAT_TIMEOUT_S, found at its next poll and corroborated by the raylet
probe's unanswered wait: `SILENT_DETECTION_S`, 1.5 s, on both paths. It becomes a node loss (repaired
in `repair_hours.host`). A hung rank leaves its host beating (the heartbeat does not ride on the
training step), and so may a dead link (the beats reach the run's store over the node's IP network,
which a dead port of the collectives' fabric need not take down; where it does, the heartbeat would
find it sooner: the model takes the longer bound), so the survivors learn of either when their
collectives time out: `health.collective_timeout_s`, as before silence was modelled.
In every case the survivors' step in flight stalls and is discarded: they wait out the detection.

Cost model defaults grow with the world where the real costs do, and each says where it comes from:

    step           6 x parameters x tokens per step at `gpu_tflops` achieved per GPU (400: Llama 3 405B's
                   380-430 TFLOPs per GPU, Dubey et al. 2024, table 4)
    restart        a fresh rank's CUDA init (0.15 s) + communicator init for the world: 0.36 s at world 1
                   (goodput's own: benchmarks/gpu_path.py on one H100, README "Measured on a GPU") growing
                   linearly to ~150 s at 16,384 ranks ("2.5-minute init time at large scale" on NCCL's
                   default path, PyTorch's report in NVIDIA/nccl#1156, 2024). goodput forks each rank from
                   a warm image (interpreter and torch imported), so the 4.2 s of those is not paid again
    detection      a lost node, loud: from the data plane on both paths (DATA_PLANE_DETECTION_S: the
                   survivors' collectives fail at once and the controller's raylet probe confirms the
                   node; goodput measures it on the world path too, 0.83 s). Ray's own health checks
                   (src/ray/common/ray_config_def.h: 10 s timeout, dead after 5 misses, ~50 s) are
                   what a run without the probe or the heartbeat would wait: a lever, not the default.
                   A lost node, silent: the heartbeat (SILENT_DETECTION_S, above). A network fault or
                   a hung rank: the spec's collective timeout. The rest at once
    checkpoint     16 bytes per parameter (bf16 weights, fp32 master weights and Adam moments, as the
                   planner's memory model), staged at 10 GB/s per GPU (the loop's only stall), written at
                   2 GB/s per node or the store's aggregate (below), whichever binds
    restore        each rank reads only its shard, once (the load plan's ranged reads): a node's ranks
                   share its 100 Gb/s link (12.5 GB/s) and every node shares the store's aggregate
                   sustained bandwidth (2 TB/s: Llama 3's Tectonic, 7 TB/s at peak; Dubey et al. 2024,
                   section 3.3.1)
    peer snapshots the same host copy as the checkpoint's stall; to the buddy, and back in a peer
                   recovery, over the node's 100 Gb/s link shared by its ranks (12.5 GB/s per node, as
                   the store's restore); a transfer longer than the steps between snapshots stalls
                   the next snapshot for the rest of it (controller/sim/group.py)

    replica domain (elastic.failure_domain: replica; trainer/replica.py) a lost node stops its
                   data-parallel replicas only. Survivors: detection from the data plane (their
                   collective fails at once and the controller confirms the node with its raylet probe:
                   DATA_PLANE_DETECTION_S, goodput's measured node-loss detection; a silent node loss:
                   SILENT_DETECTION_S, the heartbeat's), then one cross-replica group init of size D
                   (comm_init above), then steps at D-1 of D replicas' throughput. The lost replica:
                   a warm start of its R ranks (CUDA init + comm_init(R)), then its state from a live
                   replica at a step boundary: the replica's per-node state over the 100 Gb/s link
                   (the survivors stall for it and one more cross-replica init). Pessimistic preset
                   for comparison: Meta's FT-HSDP reports ~3 minutes of stall per failure at ~100K
                   GPUs (arXiv 2602.00277): `cost.replica_stall_s`.

A spec's `cost:` overrides each (`restart_s` the whole restart; `node_loss_detection_s` the world
path's loud node loss, what a kill-node drill shows; the silent detection has no spec key).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from health.heartbeat import HEARTBEAT_TIMEOUT_S

LLAMA3_NODE_DAYS = 2048 * 54
LLAMA3_COUNTS = {"gpu": 268, "network": 42, "host": 32, "storage": 16, "software": 61}
LLAMA3_SDC = 6
DEFAULT_RATES = {k: v / LLAMA3_NODE_DAYS * 1000 for k, v in LLAMA3_COUNTS.items()}
"""Interruptions per 1,000 node-days by component."""
SILENT_COUNTS = {"gpu": 0, "network": 42, "host": 0, "storage": 9, "software": 7}
"""Of LLAMA3_COUNTS, the interruptions that close nothing (the rows in the module docstring)."""
SILENT_SHARE = {k: SILENT_COUNTS[k] / v for k, v in LLAMA3_COUNTS.items()}
"""Of each component's incidents, the share that is silent."""

BYTES_PER_PARAM = 16
STAGING_GBPS_PER_GPU = 10.0
UPLOAD_GBPS_PER_NODE = 2.0
NODE_LINK_GBPS = 12.5
"""A node's 100 Gb/s front-end link, shared by its ranks' restore reads."""
STORE_AGGREGATE_GBPS = 2000.0
"""The object store's sustained aggregate bandwidth (Llama 3's Tectonic: 2 TB/s, 7 TB/s at peak)."""
MEASURED_CUDA_INIT_S = 0.15
MEASURED_COMM_INIT_WORLD_1_S = 0.36
"""benchmarks/gpu_path.py on one H100 (torch 2.11.0+cu130): CUDA init, NCCL init at world size 1."""
PUBLISHED_COMM_INIT_S = 150.0
PUBLISHED_COMM_INIT_WORLD = 16384
"""NVIDIA/nccl#1156 (2024): 2.5 min of communicator init at large scale on NCCL's default path."""
RAY_HEALTH_CHECK_TIMEOUT_S = 10.0
RAY_HEALTH_CHECK_FAILURES = 5
"""Ray's defaults (health_check_timeout_ms 10000, health_check_failure_threshold 5): what a run without the
probe or the heartbeat would wait for a lost node (a lever of benchmarks/simulate_scale.py)."""
DEFAULT_GPU_TFLOPS = 400.0
DATA_PLANE_DETECTION_S = 1.0
"""A survivor's collective fails as soon as its peer's connection drops, and the controller confirms
the node with its raylet probe: goodput measures 0.54 s on the replica path and 0.83 s on the world
path (`python benchmarks/replica_heal.py --rounds 5`, medians of n = 5; README, "One replica as the
failure domain"); the model charges the goal's bound, 1 s, as a real cluster's network is slower than
this machine's loopback."""
CONTROLLER_POLL_S = 0.2
"""How often the controller polls a running group (controller/service/service.py's default poll_s)."""
RAYLET_PROBE_S = 0.3
"""controller/ray/liveness.py's wait for a raylet's connection (an edge: a core does not import it; a
test keeps the two equal)."""
SILENT_DETECTION_S = HEARTBEAT_TIMEOUT_S + CONTROLLER_POLL_S + RAYLET_PROBE_S
"""A dark node: its heartbeat stops, the timeout runs out, the next poll sees it and the probe's
unanswered wait corroborates it (health/heartbeat.py: "within ~1.5 s")."""


def comm_init_s(world: int) -> float:
    """Communicator init for `world` ranks: linear in the world (the default bootstrap's all-gathers go
    round a ring of every rank) between goodput's measurement at 1 and the published figure at 16,384."""
    per_rank = (PUBLISHED_COMM_INIT_S - MEASURED_COMM_INIT_WORLD_1_S) / (PUBLISHED_COMM_INIT_WORLD - 1)
    return MEASURED_COMM_INIT_WORLD_1_S + per_rank * (max(world, 1) - 1)


def restart_s(world: int) -> float:
    """A relaunch of `world` ranks forked from warm images: CUDA init and the communicators."""
    return MEASURED_CUDA_INIT_S + comm_init_s(world)


def restore_s(state_bytes: float, *, gpus: int, gpus_per_node: int) -> float:
    """Every rank reads its own shard once: a node's link or the store's aggregate, whichever binds."""
    per_node = state_bytes / max(gpus, 1) * gpus_per_node
    return max(per_node / (NODE_LINK_GBPS * 1e9), state_bytes / (STORE_AGGREGATE_GBPS * 1e9))


@dataclass(frozen=True)
class Incident:
    time: float
    """Virtual seconds since the run's submission."""
    component: str
    """gpu, host, network, storage, software, sdc or straggler."""
    node: str
    """The node it strikes (network and software strike the run wherever it is)."""
    repair_s: float
    """Seconds until the node is back (0: it is not taken out)."""
    silent: bool = False
    """Nothing closes: the survivors wait for a timeout (the module docstring says which)."""

    @property
    def lost_node(self) -> bool:
        """It takes its node out: a GPU or a host, or the node's other parts gone dark."""
        return self.component in ("gpu", "host") or (self.component == "storage" and self.silent)

    @property
    def timed_out(self) -> bool:
        """Its node lives on and beats, and the survivors learn of it when their collectives time out:
        a dead link, or a hung rank (software's silent share)."""
        return self.component == "network" or (self.component == "software" and self.silent)


@dataclass(frozen=True)
class CostModel:
    step_s: float
    checkpoint_stall_s: float
    checkpoint_save_s: float
    restore_s: float
    restart_s: float
    node_loss_detection_s: float
    collective_timeout_s: float
    peer_snapshot_stall_s: float = 0.0
    peer_transfer_s: float = 0.0
    peer_restore_s: float = 0.0
    replica_detection_s: float = DATA_PLANE_DETECTION_S
    silent_detection_s: float = SILENT_DETECTION_S
    """A dark node, on either path: the heartbeat's timeout, the next poll and the probe."""
    replica_gpus: int = 1
    """GPUs of one data-parallel replica (R)."""
    replica_transfer_s: float = 0.0
    """A replica's state to one formed again, node to node."""
    replica_stall_s: float | None = None
    """The survivors' whole stall per failure, when given (FT-HSDP's 180 s preset), instead of
    detection + a cross-replica init."""

    def regroup_s(self, replicas: int) -> float:
        """A cross-replica group init over `replicas` members."""
        return comm_init_s(replicas)

    def replica_start_s(self) -> float:
        """A lost replica's R ranks forked warm on their nodes: CUDA init and its own world's communicators."""
        return restart_s(self.replica_gpus)

    def to_dict(self) -> dict[str, float]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def cost_model(spec: Any, *, params: int, gpus: int, gpus_per_node: int,
               flops_per_token: float | None = None, replicas: int = 1) -> CostModel:
    """The spec's cost model, defaults filled in from the model size and the cluster (a provider
    model's own FLOPs per token where it says them, else 6 x parameters)."""
    c = spec.cost
    tokens = spec.train.global_batch * spec.model.seq_len
    tflops = c.gpu_tflops or DEFAULT_GPU_TFLOPS
    per_token = flops_per_token if flops_per_token is not None else 6.0 * params
    step = c.step_s if c.step_s is not None else per_token * tokens / (gpus * tflops * 1e12)
    per_gpu = BYTES_PER_PARAM * params / max(gpus, 1)
    return CostModel(
        step_s=step,
        checkpoint_stall_s=_given(c.checkpoint_stall_s, per_gpu / (STAGING_GBPS_PER_GPU * 1e9)),
        checkpoint_save_s=_given(c.checkpoint_save_s, max(per_gpu * gpus_per_node / (UPLOAD_GBPS_PER_NODE * 1e9),
                                                          BYTES_PER_PARAM * params / (STORE_AGGREGATE_GBPS * 1e9))),
        restore_s=_given(c.restore_s, restore_s(BYTES_PER_PARAM * params, gpus=gpus, gpus_per_node=gpus_per_node)),
        restart_s=_given(c.restart_s, restart_s(gpus)),
        node_loss_detection_s=_given(c.node_loss_detection_s, DATA_PLANE_DETECTION_S),
        collective_timeout_s=spec.health.collective_timeout_s,
        peer_snapshot_stall_s=_given(c.peer_snapshot_stall_s, per_gpu / (STAGING_GBPS_PER_GPU * 1e9)),
        peer_transfer_s=_given(c.peer_transfer_s, per_gpu * gpus_per_node / (NODE_LINK_GBPS * 1e9)),
        peer_restore_s=_given(c.peer_restore_s, per_gpu * gpus_per_node / (NODE_LINK_GBPS * 1e9)),
        replica_gpus=max(gpus // max(replicas, 1), 1),
        # a replica's ranks each hold 1/R of the state (16 bytes per parameter): a node's share over its link
        replica_transfer_s=BYTES_PER_PARAM * params / max(gpus // max(replicas, 1), 1)
        * min(gpus_per_node, max(gpus // max(replicas, 1), 1)) / (NODE_LINK_GBPS * 1e9),
        replica_stall_s=c.replica_stall_s,
    )


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


def incidents(failures: Any, nodes: list[str], *, horizon_s: float, seed: int,
              silent_share: dict[str, float] | None = None) -> list[Incident]:
    """Every incident in [0, horizon_s), time-ordered: a Poisson process per component over the
    cluster's node-days, each striking a node drawn uniformly, silent with its component's share
    (SILENT_SHARE unless given; a silent storage incident is a dark host, repaired as a host is).
    Deterministic for a seed; silence is drawn from a stream of its own, so the times, components and
    nodes are those the seed gave before silence was modelled."""
    rng = random.Random(seed)
    quiet = random.Random(f"{seed}/silent")
    share = SILENT_SHARE if silent_share is None else silent_share
    rates = failures.rates.model_dump() if failures.rates is not None else dict(DEFAULT_RATES)
    repair = failures.repair_hours.model_dump()
    node_days_per_s = len(nodes) / 86400.0
    out: list[Incident] = []
    for component in ("gpu", "host", "network", "storage", "software"):
        per_s = rates.get(component, 0.0) / 1000.0 * node_days_per_s
        if per_s <= 0:
            continue
        t = 0.0
        while True:
            t += rng.expovariate(per_s)
            if t >= horizon_s:
                break
            kind = component
            if component == "gpu":
                u = rng.random()
                if u < failures.sdc_share:
                    kind = "sdc"
                elif u < failures.sdc_share + failures.straggler_share:
                    kind = "straggler"
            silent = quiet.random() < share.get(component, 0.0) and kind == component
            dark = silent and component == "storage"
            out.append(Incident(time=t, component=kind, node=rng.choice(nodes),
                                repair_s=repair.get("host" if dark else component, 0.0) * 3600.0, silent=silent))
    out.sort(key=lambda i: (i.time, i.component, i.node))
    return out


def mtbf_hours(failures: Any, nodes: int) -> float:
    """The model's mean time between interruptions for a cluster of `nodes`."""
    rates = failures.rates.model_dump() if failures.rates is not None else dict(DEFAULT_RATES)
    per_day = sum(rates.values()) / 1000.0 * nodes
    return math.inf if per_day <= 0 else 24.0 / per_day
