"""What a peer snapshot every step costs the steps (issue 21: <= 1.02), measured paired in one run.

benchmarks/peer_recovery.py compares whole runs, and on this shared 2-core machine step times drift
by 10-25 % from run to run: more than the effect. Here the same 8 ranks (make run's model and mesh,
dp2 x pp2 x tp2, 4 "nodes" of 2 ranks, buddies on other nodes as the controller picks them) alternate
blocks of --block steps with a snapshot after every step (the copy into host memory in the loop, the
send to the buddy in the background, as trainer/worker.py does) and blocks without, ABAB... for
--blocks blocks each, the order alternating from pair to pair. A step's time is from its start to
the next step's start on rank 0 (so the snapshot's stall and the background copy's contention are
both in it); the first step of each block is left out (it still overlaps the other regime).

Prints the median and mean step time of each regime, and their ratios.

    python benchmarks/peer_snapshot_cost.py [--blocks 10] [--block 4]

Its record: benchmarks/records/peer_snapshot_cost.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import records  # noqa: E402
from checkpointing.peer import buddies  # noqa: E402
from tests.dist.harness import run_ranks  # noqa: E402
from trainer.config import (  # noqa: E402
    DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig, config_from_dict, config_to_dict,
    state_fingerprint,
)

NODES = ["node-0", "node-0", "node-1", "node-1", "node-2", "node-2", "node-3", "node-3"]


def alternate(*, rank: int, world_size: int, store_port: int, config: dict, root: str, blocks: int,
              block: int) -> list[tuple[bool, float]]:
    """(snapshots on, step time) of every timed step."""
    import torch.distributed as dist

    from trainer.parallel import build_mesh, choose_device, init_process_group
    from trainer.peer import PeerSnapshots
    from trainer.report import ListSink
    from trainer.train import Trainer

    cfg = config_from_dict(config)
    store = dist.PrefixStore("cost", dist.TCPStore("127.0.0.1", store_port, is_master=False))
    init_process_group(rank=rank, world_size=world_size, store=store, backend="gloo", timeout_s=300)
    trainer = Trainer(cfg, build_mesh(cfg.mesh, "cpu"), choose_device("float32"))
    peers = PeerSnapshots(folder=Path(root) / NODES[rank] / "cost", run_id="cost", attempt=0,
                          buddy=buddies(NODES, {n: n for n in NODES}), sink=ListSink(),
                          identity=state_fingerprint(cfg.model), mesh=cfg.mesh.axes())
    for _ in range(2):  # warm-up (DTensor's first use of every op), and the snapshot file laid out
        trainer.train_step()
        peers.take(trainer)
    peers.wait()
    timed: list[tuple[bool, float]] = []
    order = [k % 2 == 0 for k in range(2 * blocks)]
    order = [on if (k // 2) % 2 == 0 else not on for k, on in enumerate(order)]  # AB BA AB ...
    start = time.perf_counter()
    for on in order:
        for i in range(block):
            trainer.train_step()
            if on:
                peers.take(trainer)
            now = time.perf_counter()
            if i > 0:
                timed.append((on, now - start))
            start = now
    peers.close()
    dist.destroy_process_group()
    return timed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=10, help="blocks per regime (>= 5)")
    parser.add_argument("--block", type=int, default=4, help="steps per block (the first is not timed)")
    opts = parser.parse_args()
    blocks, block = max(5, opts.blocks), max(2, opts.block)
    config = TrainerConfig(model=ModelConfig(n_layers=4, d_model=128, n_heads=4, vocab_size=256, seq_len=128),
                           data=DataConfig(seed=0),
                           train=TrainConfig(steps=10**6, global_batch=16, micro_batch=2, lr=3e-3, dtype="float32"),
                           mesh=MeshShape(dp=2, pp=2, tp=2))
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:
        timed = run_ranks(alternate, 8, timeout_s=3600, config=config_to_dict(config), root=root,
                          blocks=blocks, block=block)[0]
    on = [t for snap, t in timed if snap]
    off = [t for snap, t in timed if not snap]
    print(f"dp2 x pp2 x tp2, 8 gloo ranks; {blocks} blocks of {block} steps per regime, alternating; "
          f"{len(on)} + {len(off)} timed steps")
    for name, values in (("snapshot every step", on), ("no snapshot", off)):
        print(f"  {name:<20} median {statistics.median(values):.4f} s, mean {statistics.fmean(values):.4f} s "
              f"(min {min(values):.4f}, max {max(values):.4f})")
    medians, means = statistics.median(on) / statistics.median(off), statistics.fmean(on) / statistics.fmean(off)
    print(f"ratio with / without: medians {medians:.3f}, means {means:.3f} (goal <= 1.02)")
    figures = [records.figure("snapshot cost: step time, a peer snapshot every step", on, "s"),
               records.figure("snapshot cost: step time, no snapshot", off, "s"),
               records.figure("snapshot cost: with / without (medians)", [medians], "ratio", goal="<= 1.02"),
               records.figure("snapshot cost: with / without (means)", [means], "ratio", goal="<= 1.02")]
    records.write("peer_snapshot_cost", figures, code=["trainer/peer.py", "checkpointing/peer.py"],
                  extra={"blocks": blocks, "block": block})


if __name__ == "__main__":
    main()
