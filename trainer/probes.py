"""Health probes inside the training step: the measuring half (torch); verdicts are pure, in `health/`.

Every step (cheap: two passes over this rank's parameter shard and one over its gradients):
- own compute time on a compute clock that does not run while the rank waits (CPU: the thread's CPU
  time, since gloo waits block; CUDA: events around the rank's compute);
- parameter integrity at rest: an exact bit checksum of the shard after the optimizer step must be
  unchanged when the next step starts;
- one all-reduce of [gradient norm^2, loss, corrupt ranks] before the optimizer step, so every rank
  sees the same anomaly (NaN/Inf, spike, a corrupt rank) and none applies a poisoned update.
Every `sdc_every_steps`: a compute self-test (a seeded matmul chain, run twice) and replica
fingerprints (exact checksums of parameters other ranks hold identically), all-gathered.
An anomaly is triaged by re-running the step from the same inputs (health.sdc.triage).
"""

from __future__ import annotations

import math
import platform
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from health.sdc import RankEvidence, Triage, sdc_verdict, step_anomaly, triage
from trainer.config import MeshAxis
from trainer.optim import local_grad_sq
from trainer.report import ReportSink
from trainer.switches import DrillSwitches
from trainer.tensors import INT_VIEW, bits_checksum, local_tensor

_HIGH_EXPONENT_BIT = {torch.float32: 30, torch.float64: 62, torch.bfloat16: 14, torch.float16: 14}
SELFTEST_SEED = 20261122


class SilentDataCorruption(RuntimeError):
    """The probes found a device that corrupts data; every rank of the attempt stops with this."""


def _params(parts: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [p for part in parts for p in part.parameters()]


def _tp_replicated(p: torch.Tensor) -> bool:
    """True for parameters TP does not shard (norms, embeddings, head): identical on every tp rank."""
    mesh = getattr(p, "device_mesh", None)
    return mesh is None or "tp" not in (mesh.mesh_dim_names or ())


def selftest(device: torch.device, dtype: torch.dtype) -> int:
    """A fixed, seeded chain of matmuls: bit-identical on a repeat and across ranks of the same hardware."""
    g = torch.Generator().manual_seed(SELFTEST_SEED)
    a = (torch.randn(96, 96, generator=g) / 9.8).to(device=device, dtype=dtype)
    x = torch.randn(96, 96, generator=g).to(device=device, dtype=dtype)
    for _ in range(6):
        x = torch.tanh(a @ x)
    return bits_checksum([x])


def hardware_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.machine()}-{platform.processor() or 'cpu'}-threads{torch.get_num_threads()}"


class ComputeClock:
    """Seconds this rank spends computing, not waiting for peers."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._start: Any = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.thread_time()

    def elapsed(self) -> float:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return float(self._start.elapsed_time(end)) / 1000.0
        return time.thread_time() - float(self._start)


def spin(seconds: float, clock: Callable[[], float] = time.thread_time) -> None:
    """Busy for `seconds` on `clock` (this thread's CPU time by default: a slow CPU device keeps
    computing, it does not sleep)."""
    end = clock() + seconds
    x = 1.0
    while clock() < end:
        for _ in range(200):
            x = x * 1.0000001 + 1e-9


class Probes:
    """One per rank and attempt; the trainer calls it at fixed points of every step."""

    def __init__(self, trainer: Any, *, sink: ReportSink | None, switches: DrillSwitches | None) -> None:
        self.trainer = trainer
        self.config = trainer.config.probes
        self.sink = sink
        self.switches = switches
        self.bitflips_done = switches.bitflips if switches is not None else 0
        self.recorded: int | None = None
        """Checksum of the parameter shard after the last optimizer step (None before the first)."""
        self.intact = True
        self.grad_norms: list[float] = []
        self.last_grad_norm = float("nan")
        """The global gradient norm of the last check (the step's, once `check` returned)."""
        self.last_clean_step = 0
        """Newest step whose state passed an SDC check (or the attempt's start step)."""
        self.hardware = hardware_name(trainer.choice.device)
        mesh = trainer.mesh
        self.coords = {axis.value: mesh[axis.value].get_local_rank() for axis in MeshAxis}

    # -- every step ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Before the step: drills due on this slot, then the integrity check of the resting shard."""
        if self.switches is not None and self.switches.bitflips > self.bitflips_done:
            self.bitflips_done = self.switches.bitflips
            self._event("bitflip_injected", self.flip_bit())
        self.intact = self.recorded is None or self.checksum() == self.recorded

    def check(self, loss: torch.Tensor | None, rerun: Any) -> tuple[float | None, bool]:
        """After forward/backward, before the optimizer: (global loss, apply the update?). Triages an
        anomaly; raises SilentDataCorruption on every rank when a device is suspect."""
        loss_value, reason = self._reduce(loss, intact=self.intact)
        if reason is None:
            return loss_value, True
        self._zero_grads()
        again = rerun()
        loss2, reason2 = self._reduce(again, intact=self.intact)
        evidence = self._gather(selftest_now=True, local_anomaly=reason2 is not None and self._local_nonfinite(again))
        result = triage(reason, reason2, evidence)
        step = self.trainer.step + 1
        # Every rank reached the same verdict from the same gathered evidence; rank 0 reports it.
        if result.kind is Triage.TRANSIENT:
            self._event("sdc_transient", {"step": step, "anomaly": reason}, once=True)
            return loss2, True
        if result.kind is Triage.NOT_HARDWARE:
            self._zero_grads()
            self._event("loss_anomaly", {"step": step, "anomaly": reason, "action": "skipped_update",
                                         "why": "reproduced on every rank with no device evidence"}, once=True)
            return loss2, False
        # A shard that changed at rest explains everything else it shows: the state of the last
        # finished step was clean. Any other evidence reaches back to the last passing check.
        at_rest = all(any("at rest" in why for why in result.reasons[rank]) for rank in result.suspects)
        # A replica's probes judge its gradient before it meets the other replicas' (failure_domain
        # replica): corruption found at rest reached no other replica, whose state is vouched.
        self._suspect(step, "anomaly", reason, result.suspects, result.reasons,
                      clean_through=self.trainer.step if at_rest else self.last_clean_step,
                      contained=at_rest and getattr(self.trainer, "replicas", None) is not None)
        raise AssertionError("unreachable")

    def after_optimizer(self, step: int) -> None:
        """Record the shard's checksum; every sdc_every_steps, self-test and compare replicas."""
        self.recorded = self.checksum()
        every = self.config.sdc_every_steps
        if every <= 0 or step % every:
            return
        evidence = self._gather(selftest_now=True, local_anomaly=False)
        verdict = sdc_verdict(evidence)
        if verdict.clean:
            self.last_clean_step = step
            return
        self._suspect(step, "periodic", None, verdict.suspects, verdict.reasons, clean_through=self.last_clean_step)

    # -- pieces -------------------------------------------------------------------------------------
    def checksum(self) -> int:
        return bits_checksum(local_tensor(p) for p in _params(self.trainer.parts))

    def _reduce(self, loss: torch.Tensor | None, *, intact: bool) -> tuple[float | None, str | None]:
        """One all-reduce over every rank: gradient norm^2, the dp ranks' losses, corrupt ranks."""
        t = self.trainer

        # each element of the gradient once, over every rank (what clipping needs too: trainer/optim.py)
        grad_sq = local_grad_sq(t.parts, t.config.mesh.dp * t.config.mesh.tp, t.choice.device).reshape(())
        counts_loss = loss is not None and self.coords["tp"] == 0
        buf = torch.stack([
            grad_sq,
            loss.detach().double().reshape(()) if counts_loss and loss is not None else grad_sq.new_zeros(()),
            grad_sq.new_tensor(1.0 if counts_loss else 0.0),
            grad_sq.new_tensor(0.0 if intact else 1.0),
        ])
        dist.all_reduce(buf)
        grad_sq_sum, loss_sum, loss_count, corrupt = buf.tolist()  # one read (one sync on a GPU)
        grad_norm = math.sqrt(grad_sq_sum) if grad_sq_sum >= 0 else float("nan")
        self.last_grad_norm = grad_norm
        global_loss = loss_sum / loss_count if loss_count else None
        reason = None
        if corrupt > 0:
            reason = f"{int(corrupt)} rank(s) found their parameters changed at rest"
        else:
            reason = step_anomaly(global_loss, grad_norm, self.grad_norms[-20:], spike_factor=self.config.spike_factor)
        if reason is None:
            self.grad_norms.append(grad_norm)
        return (global_loss if loss is not None else None), reason

    def _local_nonfinite(self, loss: torch.Tensor | None) -> bool:
        if loss is not None and not bool(torch.isfinite(loss).all()):
            return True
        return any(p.grad is not None and not bool(torch.isfinite(local_tensor(p.grad)).all())
                   for p in _params(self.trainer.parts))

    def _gather(self, *, selftest_now: bool, local_anomaly: bool) -> list[RankEvidence]:
        """Every rank's evidence, on every rank (one all-gather of a few int64s)."""
        t = self.trainer
        params = _params(t.parts)
        fingerprints = []
        if t.config.mesh.tp > 1:
            fingerprints.append(bits_checksum(local_tensor(p) for p in params if _tp_replicated(p)))
        if t.config.mesh.dp_replicas > 1:
            fingerprints.append(bits_checksum(local_tensor(p) for p in params))
        first = selftest(t.choice.device, t.choice.param_dtype) if selftest_now else -1
        repeat = selftest(t.choice.device, t.choice.param_dtype) if selftest_now else -1
        mine = torch.tensor([int(self.intact), first, repeat, int(local_anomaly), *fingerprints], dtype=torch.int64,
                            device=t.choice.device)  # NCCL moves CUDA tensors only
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        # The hardware name is the same string on every rank of one device model; ranks on other
        # models would need it gathered too (all_gather_object), which a mixed fleet can add.
        shape = t.config.mesh
        out = []
        for rank, row in enumerate(everyone):
            values = row.tolist()
            coords = shape.rank_coords(rank)
            groups = []
            if shape.tp > 1:
                groups.append(f"tp-replicated params of dp{coords['dp']}/pp{coords['pp']}")
            if shape.dp_replicas > 1:
                shard = coords["dp"] % (shape.dp // shape.dp_replicas)
                groups.append(f"hsdp params of shard{shard}/pp{coords['pp']}/tp{coords['tp']}")
            out.append(RankEvidence(
                rank=rank, params_intact=bool(values[0]),
                selftest=values[1] if selftest_now else None, selftest_repeat=values[2] if selftest_now else None,
                hardware=self.hardware, replicas=dict(zip(groups, values[4:])), local_anomaly=bool(values[3])))
        return out

    def _suspect(self, step: int, check: str, anomaly: str | None, suspects: tuple[int, ...],
                 reasons: dict[int, list[str]], *, clean_through: int, contained: bool = False) -> None:
        # the ranks of this world as the run numbers them (a replica's world is one slice of the run's)
        offset = getattr(self.trainer, "rank_offset", 0)
        suspects = tuple(r + offset for r in suspects)
        reasons = {r + offset: why for r, why in reasons.items()}
        self._event("sdc_suspect", {"step": step, "check": check, "anomaly": anomaly, "ranks": list(suspects),
                                    "evidence": {str(r): reasons[r] for r in suspects},
                                    "clean_through_step": clean_through, "contained": contained}, once=True)
        raise SilentDataCorruption(f"silent data corruption suspected on ranks {list(suspects)} at step {step}: "
                                   + "; ".join(f"rank {r}: {', '.join(reasons[r])}" for r in suspects))

    def flip_bit(self) -> dict[str, Any]:
        """The bitflip drill: flip one high exponent bit of one element of this rank's shard, in place."""
        named = [(f"{i}.{name}", p) for i, part in enumerate(self.trainer.parts) for name, p in part.named_parameters()]
        candidates = [(name, p) for name, p in named if local_tensor(p).numel() > 0]
        name, p = candidates[len(candidates) // 2]
        shard = local_tensor(p).detach()
        assert shard.is_contiguous(), f"{name}'s shard is not contiguous: a flip would land in a copy"
        flat = shard.view(-1)
        index = flat.numel() // 2
        bit = _HIGH_EXPONENT_BIT[flat.dtype]
        with torch.no_grad():
            before = float(flat[index].item())
            ints = flat.view(INT_VIEW[flat.dtype])
            ints[index] = ints[index] ^ (1 << bit)
            after = float(flat[index].item())
        return {"param": name, "index": index, "bit": bit, "before": before, "after": after}

    def _zero_grads(self) -> None:
        for opt in self.trainer.optimizers:
            opt.zero_grad(set_to_none=True)

    def _event(self, kind: str, detail: dict[str, Any], *, once: bool = False) -> None:
        """`once`: a verdict every rank reached alike, reported by rank 0 only."""
        if self.sink is not None and not (once and dist.get_rank() != 0):
            self.sink.event(kind, detail)
