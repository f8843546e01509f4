"""One rank on a GPU with the probes on and dtype auto (bf16 compute): CUDA + NCCL are chosen, the
compute clock runs on CUDA events, the periodic self-test is repeatable, a bit flip is caught, and
the probes' share of the step is printed.

    python benchmarks/gpu_probe_check.py
"""

from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch.distributed as dist  # noqa: E402

from trainer.config import DataConfig, MeshShape, ModelConfig, ProbeConfig, TrainConfig, TrainerConfig  # noqa: E402
from trainer.parallel import build_mesh, choose_device, init_process_group  # noqa: E402
from trainer.probes import SilentDataCorruption  # noqa: E402
from trainer.report import ListSink  # noqa: E402
from trainer.switches import DrillSwitches  # noqa: E402
from trainer.train import Trainer  # noqa: E402


def main() -> None:
    config = TrainerConfig(model=ModelConfig(n_layers=8, d_model=1024, n_heads=16, vocab_size=32000, seq_len=1024),
                           data=DataConfig(seed=0, branching=4),
                           train=TrainConfig(steps=1000, global_batch=8, micro_batch=4, lr=3e-4),
                           mesh=MeshShape(), probes=ProbeConfig(sdc_every_steps=10))
    choice = choose_device("auto")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    init_process_group(rank=0, world_size=1, store=store, backend=choice.backend, timeout_s=60)
    print(f"device {choice.device}, backend {choice.backend}, params {choice.param_dtype}, compute {choice.compute_dtype}")
    sink, switches = ListSink(), DrillSwitches()
    on = Trainer(config, build_mesh(config.mesh, choice.device.type), choice, sink=sink, switches=switches)
    off_config = TrainerConfig(model=config.model, data=config.data, train=config.train, mesh=config.mesh,
                               probes=ProbeConfig(enabled=False))
    off = Trainer(off_config, build_mesh(config.mesh, choice.device.type), choice)
    t_on, t_off, probe, compute = [], [], [], []
    for i in range(42):
        a, b = on.train_step(), off.train_step()
        if i >= 2:
            t_on.append(a.step_time_s)
            t_off.append(b.step_time_s)
            probe.append(a.probe_s)
            compute.append(a.compute_s)
    print(f"step with probes {statistics.mean(t_on) * 1e3:.2f} ms, without {statistics.mean(t_off) * 1e3:.2f} ms, "
          f"ratio {statistics.mean(t_on) / statistics.mean(t_off):.3f}; probes {statistics.mean(probe) * 1e3:.2f} ms/step; "
          f"compute clock {statistics.mean(compute) * 1e3:.2f} ms/step")
    print(f"losses match: {on.train_step().loss == off.train_step().loss}")
    flags = [k for k, _ in sink.events if k in ("sdc_suspect", "sdc_transient", "loss_anomaly")]
    print(f"flags in {len(t_on) + 3} clean steps: {flags}")
    switches.slow(2.0)
    slow = statistics.median(on.train_step().compute_s for _ in range(5))
    switches.slow(1.0)
    print(f"slow-rank 2x: compute {slow * 1e3:.2f} ms vs {statistics.median(compute) * 1e3:.2f} ms "
          f"({slow / statistics.median(compute):.2f}x)")
    switches.request_bitflip()
    try:
        on.train_step()
        print("bitflip NOT caught")
    except SilentDataCorruption as e:
        print(f"bitflip caught: {e}")
    print(f"events: {[k for k, _ in sink.events]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
