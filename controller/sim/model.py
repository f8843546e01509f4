"""What `goodput simulate` assumes: when things break (the failure model) and what each thing costs
(the cost model). Pure: no ray, torch or boto3.

Failure model default: the Llama 3 405B report (Dubey et al. 2024, section 3.3.4): 419 unexpected
interruptions in 54 days of pre-training on 16,384 H100 GPUs (2,048 nodes of 8), about 78 % of them
attributed to hardware. Grouped by the component goodput's attribution sees:

    gpu       252  faulty GPU, HBM3, SRAM, GPU system processor, thermal, and 6 silent data
                   corruptions (60.1 %; `sdc_share` 6/252 of them are SDC)
    network    42  switch/cable, NIC (10.0 %)
    host       32  unplanned host maintenance (7.6 %)
    storage    32  SSD, power supply, chassis, IO board, CPU, system memory, dependencies (7.6 %)
    software   61  software bugs, NCCL watchdog timeouts (14.6 %)

hardware (gpu, network, storage) = 326 of 419 = 77.8 %.

as rates per 1,000 node-days: count / (2,048 nodes x 54 days) x 1,000.

Cost model defaults are goodput's own measurements where it has them (detection of a lost node
0.9 s and the re-launch ~5 s, `benchmarks/recovery_drills.py`; the async checkpoint blocks the loop
only for staging, `benchmarks/checkpoint_stall.py`), and otherwise derived from the spec: step time
from 6 x parameters x tokens per step at `gpu_tflops` achieved per GPU; checkpoint bytes = 16 per
parameter (bf16 weights, fp32 master weights and Adam moments, as the planner's memory model),
staged at 10 GB/s per GPU, written at 2 GB/s per node, read back at 5 GB/s per GPU. Peer snapshots
(`checkpoint.peer_every_steps`) stall the loop for the same host copy, go to the buddy and come back
in a peer recovery at 12.5 GB/s per GPU (a 100 Gb/s share of the node's network). A spec's `cost:`
overrides each.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

LLAMA3_NODE_DAYS = 2048 * 54
LLAMA3_COUNTS = {"gpu": 252, "network": 42, "host": 32, "storage": 32, "software": 61}
LLAMA3_SDC = 6
DEFAULT_RATES = {k: v / LLAMA3_NODE_DAYS * 1000 for k, v in LLAMA3_COUNTS.items()}
"""Interruptions per 1,000 node-days by component."""

BYTES_PER_PARAM = 16
STAGING_GBPS_PER_GPU = 10.0
UPLOAD_GBPS_PER_NODE = 2.0
RESTORE_GBPS_PER_GPU = 5.0
PEER_LINK_GBPS_PER_GPU = 12.5
MEASURED_NODE_LOSS_DETECTION_S = 0.9
MEASURED_RESTART_S = 5.0
DEFAULT_GPU_TFLOPS = 400.0


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

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def cost_model(spec: Any, *, params: int, gpus: int, gpus_per_node: int) -> CostModel:
    """The spec's cost model, defaults filled in from the model size and the cluster."""
    c = spec.cost
    tokens = spec.train.global_batch * spec.model.seq_len
    tflops = c.gpu_tflops or DEFAULT_GPU_TFLOPS
    step = c.step_s if c.step_s is not None else 6.0 * params * tokens / (gpus * tflops * 1e12)
    per_gpu = BYTES_PER_PARAM * params / max(gpus, 1)
    return CostModel(
        step_s=step,
        checkpoint_stall_s=_given(c.checkpoint_stall_s, per_gpu / (STAGING_GBPS_PER_GPU * 1e9)),
        checkpoint_save_s=_given(c.checkpoint_save_s, per_gpu * gpus_per_node / (UPLOAD_GBPS_PER_NODE * 1e9)),
        restore_s=_given(c.restore_s, per_gpu / (RESTORE_GBPS_PER_GPU * 1e9)),
        restart_s=_given(c.restart_s, MEASURED_RESTART_S),
        node_loss_detection_s=_given(c.node_loss_detection_s, MEASURED_NODE_LOSS_DETECTION_S),
        collective_timeout_s=spec.health.collective_timeout_s,
        peer_snapshot_stall_s=_given(c.peer_snapshot_stall_s, per_gpu / (STAGING_GBPS_PER_GPU * 1e9)),
        peer_transfer_s=_given(c.peer_transfer_s, per_gpu / (PEER_LINK_GBPS_PER_GPU * 1e9)),
        peer_restore_s=_given(c.peer_restore_s, per_gpu / (PEER_LINK_GBPS_PER_GPU * 1e9)),
    )


def _given(value: float | None, default: float) -> float:
    return default if value is None else value


def incidents(failures: Any, nodes: list[str], *, horizon_s: float, seed: int) -> list[Incident]:
    """Every incident in [0, horizon_s), time-ordered: a Poisson process per component over the
    cluster's node-days, each striking a node drawn uniformly. Deterministic for a seed."""
    rng = random.Random(seed)
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
            out.append(Incident(time=t, component=kind, node=rng.choice(nodes),
                                repair_s=repair.get(component, 0.0) * 3600.0))
    out.sort(key=lambda i: (i.time, i.component, i.node))
    return out


def mtbf_hours(failures: Any, nodes: int) -> float:
    """The model's mean time between interruptions for a cluster of `nodes`."""
    rates = failures.rates.model_dump() if failures.rates is not None else dict(DEFAULT_RATES)
    per_day = sum(rates.values()) / 1000.0 * nodes
    return math.inf if per_day <= 0 else 24.0 / per_day
