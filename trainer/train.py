"""One rank's training loop body: build the parallel model on a mesh, run one optimizer step at a time.

A step consumes global samples [cursor, cursor + global_batch): this rank's share comes from
`local_sample_ids`, split in micro-batches either by the pipeline schedule (pp > 1) or by gradient
accumulation (pp = 1). Everything about launching, rendezvous and reporting lives in `worker.py`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.stage import _PipelineStageBase
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    PipelineScheduleSingle,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from trainer.config import Schedule, TrainerConfig
from trainer.data import build_source, check_pure, local_sample_ids
from trainer.optim import ShardLocalAdamW, clip_to, global_grad_norm, set_learning_rate
from trainer.parallel import DeviceChoice, build_model_parts
from trainer.provider import load_provider
from trainer.probes import ComputeClock, Probes, spin
from trainer.protocol import PROTOCOL_POINTS, ProtocolFault
from trainer.replica import CrossReplica, Membership, StepDiscarded, state_tensors
from trainer.replica_sdc import disagreement, state_fingerprint
from trainer.report import ReportSink, StepReport
from trainer.switches import DrillSwitches


class Trainer:
    def __init__(self, config: TrainerConfig, mesh: DeviceMesh, choice: DeviceChoice, *, attempt: int = 0,
                 sink: ReportSink | None = None, switches: DrillSwitches | None = None,
                 replicas: CrossReplica | None = None) -> None:
        """`replicas`: this rank's world is one data-parallel replica (`config.mesh` is the replica's:
        dp is its dp_shard) and its gradients meet the other replicas' there (trainer/replica.py);
        configure it with the first membership before the first step."""
        config.validate(world_size=dist.get_world_size())
        if replicas is not None and config.mesh.dp_replicas > 1:
            raise ValueError("a replica's own mesh has no dp_replicas: its dp is its dp_shard")
        self.config = config
        self.replicas = replicas
        self.rank_offset = replicas.replica * dist.get_world_size() if replicas is not None else 0
        """This world's rank 0 in the run's numbering (a replica's world is one slice of it)."""
        self.next_epoch: int | None = None
        """The membership epoch every replica agreed to switch to after this step (`switch`)."""
        self.mesh = mesh
        self.choice = choice
        self.attempt = attempt
        self.rank = dist.get_rank()
        self.dp_rank = mesh["dp"].get_local_rank()
        self.provider = load_provider(config.model)
        self.parts, self.stage_ids, num_stages = build_model_parts(config, mesh, choice, self.provider)
        self.is_first = 0 in self.stage_ids
        self.is_last = num_stages - 1 in self.stage_ids
        # One optimizer per stage module: DCP's optimizer state dict is per module. On a GPU the fused
        # kernel (one launch for every tensor's update); on CPU torch's default (a loop over the tensors).
        fused = True if choice.device.type == "cuda" else None
        self.optimizers = [
            ShardLocalAdamW(part.parameters(), lr=config.train.lr, weight_decay=config.train.weight_decay,
                            fused=fused)
            for part in self.parts
        ]
        self.num_stages = num_stages
        self.n_micro = config.num_microbatches()
        self.schedule: PipelineScheduleSingle | PipelineScheduleMulti | None = None
        if config.mesh.pp > 1:
            self.schedule = self._build_schedule(num_stages)
        self.source = build_source(config.data, config.model)
        check_pure(self.source, seq_len=config.model.seq_len, vocab_size=config.model.vocab_size,
                   what=f"data.kind {config.data.kind}" + (f" ({config.data.source})" if config.data.source else ""))
        self.step = 0
        """Optimizer steps done."""
        self.cursor = 0
        """Global sample cursor: the next step starts at this sample id."""
        self.clock = ComputeClock(choice.device)
        self.switches = switches
        self.faults_armed = switches.collective_faults - switches.holds_collective_fault if switches is not None else 0
        """Collective-fault drills already armed (a slot's earlier requests are not this process's, but
        one the slot holds for a step to come is)."""
        self.sink = sink
        self.probes = Probes(self, sink=sink, switches=switches) if config.probes.enabled else None
        self.update_waits: list[Any] = []
        """CUDA events the next optimizer step waits for (a peer snapshot's copy still reading the
        state on a side stream: trainer/peer.py); the forward and backward do not wait."""

    def _build_schedule(self, num_stages: int) -> PipelineScheduleSingle | PipelineScheduleMulti:
        pp_group = self.mesh["pp"].get_group()
        stages: list[_PipelineStageBase] = [
            PipelineStage(part, stage, num_stages, self.choice.device, group=pp_group)
            for part, stage in zip(self.parts, self.stage_ids)
        ]
        n_micro = self.n_micro
        schedule = self.config.train.schedule
        if schedule is Schedule.INTERLEAVED_1F1B:
            return ScheduleInterleaved1F1B(stages, n_microbatches=n_micro, loss_fn=self.provider.loss)
        single = Schedule1F1B if schedule is Schedule.ONE_F_ONE_B else ScheduleGPipe
        return single(stages[0], n_microbatches=n_micro, loss_fn=self.provider.loss)

    def local_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of this dp rank for the step starting at `self.cursor`."""
        t = self.config.train
        dp, dp_rank = self.config.mesh.dp, self.dp_rank
        if self.replicas is not None:
            dp, dp_rank = self.replicas.data_split(self.dp_rank, self.config.mesh.dp)
        ids = local_sample_ids(cursor=self.cursor, global_batch=t.global_batch, dp=dp, dp_rank=dp_rank,
                               micro_batch=t.micro_batch)
        rows = torch.from_numpy(self.source.batch(ids)).to(self.choice.device)
        return rows[:, :-1], rows[:, 1:]

    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Gradients of the mean loss over this rank's samples; returns that loss on the last stage."""
        n_micro = self.n_micro
        if self.schedule is not None:
            losses: list[torch.Tensor] = []
            args = (inputs,) if self.is_first else ()
            target = targets if self.is_last else None
            self.schedule.step(*args, target=target, losses=losses if self.is_last else None)
            return torch.stack(losses).mean().detach() if self.is_last else None
        model = self.parts[0]
        total = torch.zeros((), device=self.choice.device, dtype=torch.float64)
        for i, (inp, tgt) in enumerate(zip(inputs.chunk(n_micro), targets.chunk(n_micro))):
            # FSDP reduces gradients only after the last micro-batch.
            model.set_requires_gradient_sync(i == n_micro - 1)  # type: ignore[operator]
            loss = self.provider.loss(model(inp), tgt) / n_micro
            loss.backward()
            total += loss.detach().double()
        return total

    def train_step(self) -> StepReport:
        """One optimizer step. Times: data, own compute (forward, backward, optimizer: the compute
        clock stops while this rank waits for peers), probes, and the rest of the wall time, which
        is waiting in collectives and pipeline receives."""
        t0 = time.perf_counter()
        if self.probes is not None:
            self.probes.start()
        inputs, targets = self.local_batch()
        t1 = self._sync_clock()
        self.clock.start()
        loss = self.forward_backward(inputs, targets)
        compute = self.clock.elapsed()
        probe_s = 0.0
        apply_update = True
        if self.probes is not None:  # (a replica's probes judge its own gradient, before it meets the others')
            p0 = time.perf_counter()
            loss_value, apply_update = self.probes.check(loss, lambda: self.forward_backward(inputs, targets))
            probe_s += time.perf_counter() - p0
        if self.replicas is not None:
            self.clock.start()
            loss_value, apply_update = self._across_replicas(loss, apply_update)
            compute += self.clock.elapsed()
        self.clock.start()
        if apply_update:
            self._prepare_update()
        if self.update_waits:
            stream = torch.cuda.current_stream(self.choice.device)
            for event in self.update_waits:
                stream.wait_event(event)
            self.update_waits = []
        for opt in self.optimizers:
            if apply_update:
                opt.step()
            opt.zero_grad(set_to_none=True)
        compute += self.clock.elapsed()
        if self.switches is not None and self.switches.slow_factor > 1.0:
            self.clock.start()
            self._slow_down(compute)
            compute += self.clock.elapsed()
        if self.probes is not None:
            p0 = time.perf_counter()
            self.probes.after_optimizer(self.step + 1)
            probe_s += time.perf_counter() - p0
        elif self.replicas is None:
            loss_value = self._global_loss(loss)
        t4 = self._sync_clock()
        self.step += 1
        self.cursor += self.config.train.global_batch
        tokens = self.config.train.global_batch * self.config.model.seq_len
        if self.replicas is not None and self.replicas.skipped():  # the batch shrank while replicas are out
            tokens = tokens * self.replicas.live // (self.replicas.live + len(self.replicas.skipped()))
        return StepReport(
            rank=self.rank, attempt=self.attempt, step=self.step, cursor=self.cursor, loss=loss_value,
            step_time_s=t4 - t0, data_s=t1 - t0, compute_s=compute, probe_s=probe_s,
            wait_s=max(0.0, t4 - t1 - compute - probe_s), tokens_per_s=tokens / (t4 - t0), end_time=time.time(),
        )

    def _arm_collective_faults(self) -> None:
        """A collective-fault drill asked of this GPU slot since the last step: this rank fails (or
        delays) the named point of the protocol the next time it gets there, from the step the drill
        names (the controller asks ahead of it, so the step is exact however late it hears the run
        reach it) or at once."""
        r = self.replicas
        if self.switches is None or r is None or self.switches.collective_faults <= self.faults_armed:
            return
        point, delay_s, from_step = self.switches.collective_fault
        if from_step is not None and r.at_step < from_step:
            return  # (held in the switch until then)
        self.faults_armed = self.switches.collective_faults
        self.switches.collective_fault_armed()
        r.faults.append(ProtocolFault(PROTOCOL_POINTS[point], self.rank, None, delay_s))

    def _across_replicas(self, loss: torch.Tensor | None, apply_update: bool = True) -> tuple[float | None, bool]:
        """The gradient of the whole global batch from every live replica's, or StepDiscarded (nothing
        applied) when any replica could not give its part; (the run's loss on last-stage ranks, apply
        the update: not when any replica's probes held theirs back). Agrees on the membership epoch
        to switch to after this step (`next_epoch`)."""
        r = self.replicas
        assert r is not None and r.membership is not None
        current = r.membership.epoch
        r.at_step = self.step + 1
        self._arm_collective_faults()
        ok = r.reduce(self.parts)
        loss_value = None
        seen = r.board.due(current, self.step + 2) if dist.get_rank() == 0 else current  # (the replica's rank 0)
        # a replica whose probes held its update back (a loss anomaly) skips the update, so every one does
        ok, epoch, skip, _ = r.vote(ok, seen, not apply_update)
        fingerprint = state_fingerprint(self)
        fingerprints = None
        if ok:  # (with the state at rest each replica holds: they differ only if one was corrupted)
            ok, epoch, skip, fingerprints, loss_value = r.agree(ok, epoch, skip, fingerprint, loss)
        # Each position agreed with its peers in the other replicas on its own: a peer that died
        # between two positions' agreements leaves them split. The replica decides as one.
        ok, epoch, skip, odd = r.vote(ok, epoch, skip, r.odd_marks(fingerprints))
        if not ok:
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            raise StepDiscarded(f"step {self.step + 1} discarded: a replica of epoch {current} failed"
                                + (f" ({r.last_error})" if r.last_error else ""))
        if any(odd):  # nothing of this step is applied: it was computed from states that differ
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
            disagreement(self, odd, fingerprints)
        if fingerprint is not None:
            r.agreed_step = self.step
        self.next_epoch = epoch if epoch > current else None
        if skip:
            for opt in self.optimizers:
                opt.zero_grad(set_to_none=True)
        return loss_value, not skip

    def switch(self, membership: Membership) -> int | None:
        """Train under `membership` from the next step: this position's cross-replica group of its
        live replicas, every member's state made the newest member's (a joining replica receives it
        all), and the data split over the live replicas. The replica the state came from, if any."""
        r = self.replicas
        assert r is not None
        r.at_step, r.forming = self.step + 1, True
        try:
            r.configure(membership)
            intact = (None if self.probes is None or self.probes.recorded is None
                      else self.probes.checksum() == self.probes.recorded)
            self.step, self.cursor, source, _ = r.sync(lambda: state_tensors(self.parts, self.optimizers),
                                                       self.step, self.cursor, intact=intact)
        finally:
            r.forming = False
        r.agreed_step = self.step  # (every member now holds the vouched state of this step)
        if self.probes is not None:  # what was received is this rank's state at rest now
            self.probes.recorded = self.probes.checksum()
        self.next_epoch = None
        t = self.config.train
        dp_total, _ = r.data_split(0, self.config.mesh.dp)
        if t.global_batch % (dp_total * t.micro_batch):
            raise ValueError(f"train.global_batch = {t.global_batch} cannot be split over {r.live} replica(s) x "
                             f"dp_shard {self.config.mesh.dp} x micro_batch {t.micro_batch}: choose a global batch "
                             "divisible by every replica count the run may train with")
        n_micro = t.global_batch // (dp_total * t.micro_batch)
        if n_micro != self.n_micro:
            self.n_micro = n_micro
            if self.schedule is not None:
                self.schedule = self._build_schedule(self.num_stages)
        return source

    def _prepare_update(self) -> None:
        """The step's learning rate (a pure function of the step) and, when asked, the gradient
        clipped to train.grad_clip by its global norm (the probes' when they ran, else one all-reduce)."""
        t = self.config.train
        set_learning_rate(self.optimizers, t.lr_at(self.step + 1))
        if t.grad_clip > 0:
            # (a replica's probes saw its own gradient, not the one the replicas now share)
            norm = (self.probes.last_grad_norm if self.probes is not None and self.replicas is None
                    else global_grad_norm(self.parts, self.config.mesh.dp * self.config.mesh.tp, self.choice.device))
            clip_to(self.parts, norm, t.grad_clip)

    def _slow_down(self, compute_s: float) -> None:
        """The slow-rank drill: this rank's compute takes `factor` times as long."""
        assert self.switches is not None
        extra = (self.switches.slow_factor - 1.0) * compute_s
        if self.choice.device.type == "cuda":  # the compute clock reads GPU time: hold the stream that long
            torch.cuda.synchronize(self.choice.device)
            spin(extra, time.perf_counter)
        else:
            spin(extra)

    def _global_loss(self, loss: torch.Tensor | None) -> float | None:
        """Average of the dp ranks' losses (= the global batch's mean loss), on last-stage ranks."""
        if loss is None:
            return None
        buf = loss.detach().double().reshape(1)
        if self.config.mesh.dp > 1:
            dist.all_reduce(buf, group=self.mesh["dp"].get_group())
            buf /= self.config.mesh.dp
        return float(buf.item())

    def _sync_clock(self) -> float:
        if self.choice.device.type == "cuda":
            torch.cuda.synchronize(self.choice.device)
        return time.perf_counter()
