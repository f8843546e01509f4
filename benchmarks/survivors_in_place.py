"""Replace only the failed part? A node loss healed from peers, measured both ways side by side
(issue 21): the surviving ranks keep their training processes and rebuild their process group in
place, or every rank's training process is forked again from a warm image (what goodput does:
controller/ray/worker_group.py). Either way the lost node's two ranks are new processes on a spare
node, forked from a warm image, and take their shards from the buddies' copies.

make run's model and mesh (dp2 x pp2 x tp2), 8 ranks on 4 "nodes" (two ranks each; a node's host
memory is a folder, as in tests/dist/test_peer_snapshots.py) plus a spare. Each trial: attempt 0
forks 8 ranks from this warm process, trains 2 steps with a peer snapshot each (every copy on its
buddy), and holds. The clock starts; node 3 is lost (its ranks SIGKILLed, its memory removed); the
step to load is agreed from the copies the nodes hold (checkpointing/peer.py). Then
- in place: the 6 survivors drop their process group, join a new one under a fresh prefix, rebuild
  the model on the new mesh and load the step (their own copies: host memory), while 2 ranks are
  forked on the spare;
- re-fork: the survivors are SIGKILLed too and all 8 ranks are forked afresh (the survivors on
  their own nodes, the lost node's on the spare) and do the same.
Every rank then trains one step. Failure -> first step is the clock until the last rank finished
it (a synchronous step ends for all together). Per side: the median, min and max, and the median
time of each phase per kind of rank (survivor / replacement): join (process start or the old
group's teardown, to the new group), build, load, first step. Arms are interleaved, the order
alternating from trial to trial, n >= 5 each.

This is the mechanism alone, at its best for the in-place side: the survivors here are idle when the
node goes, while in a real loss they are blocked in a collective, which a gloo rank cannot leave
from inside its process before the peers' sockets close or the collective timeout (see
worker_group.py's docstring); the re-fork frees them with a SIGKILL.

    python benchmarks/survivors_in_place.py [--repeat 5]

Its record: benchmarks/records/survivors_in_place.json.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import records  # noqa: E402
from checkpointing.peer import buddies, held_copies, holdings, peer_point  # noqa: E402
from trainer.config import (  # noqa: E402
    DataConfig, MeshShape, ModelConfig, TrainConfig, TrainerConfig, state_fingerprint,
)

CONFIG = TrainerConfig(model=ModelConfig(n_layers=4, d_model=128, n_heads=4, vocab_size=256, seq_len=128),
                       data=DataConfig(seed=0),
                       train=TrainConfig(steps=4, global_batch=16, micro_batch=2, lr=3e-3, dtype="float32"),
                       mesh=MeshShape(dp=2, pp=2, tp=2))
WORLD = 8
NODES = ["node-0", "node-0", "node-1", "node-1", "node-2", "node-2", "node-3", "node-3"]
LOST = "node-3"
SPARE = "node-4"
RUN = "bench"
CODE = ["checkpointing/peer.py", "trainer/peer.py", "trainer/peer_load.py", "trainer/parallel.py", "trainer/train.py"]
"""What a heal from peers measures here: the agreed step, the group joined, the model built, the load from buddies."""


def _join(rank: int, port: int, prefix: str) -> Any:
    """Join the attempt's process group (the rendezvous store lives in this benchmark's process)."""
    import torch.distributed as dist

    from trainer.parallel import init_process_group

    store = dist.PrefixStore(prefix, dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False))
    init_process_group(rank=rank, world_size=WORLD, store=store, backend="gloo", timeout_s=120)
    return store


def _resume(rank: int, port: int, prefix: str, folder: Path, point: Any, started: float, out: Any) -> None:
    """Attempt 1 of one rank, from its start (a fork, or the survivor's teardown) to its first step."""
    import torch.distributed as dist

    from trainer.parallel import build_mesh, choose_device
    from trainer.peer_load import load_from_peers
    from trainer.train import Trainer

    _join(rank, port, prefix)
    joined = time.time()
    trainer = Trainer(CONFIG, build_mesh(CONFIG.mesh, "cpu"), choose_device("float32"), attempt=1)
    built = time.time()
    load_from_peers(trainer, folder / RUN, point)
    trainer.step, trainer.cursor = point.step, point.cursor
    loaded = time.time()
    trainer.train_step()
    ended = time.time()
    out.put({"rank": rank, "join": joined - started, "build": built - joined, "load": loaded - built,
             "first step": ended - loaded, "ended": ended})
    dist.destroy_process_group()


def _fresh(rank: int, port: int, prefix: str, folder: Path, point: Any, out: Any) -> None:
    """A rank forked for attempt 1 (from this warm process, as a rank actor forks)."""
    import torch

    torch.set_num_threads(1)
    try:
        _resume(rank, port, prefix, folder, point, time.time(), out)
    except BaseException:  # noqa: BLE001 - said here; the trial then times out
        traceback.print_exc()
    finally:
        os._exit(0)  # a fork leaves without running the parent's exit handlers


def _first_attempt(rank: int, port: int, prefix: str, root: Path, ready: Any, go: Any, out: Any) -> None:
    """Attempt 0: two steps with a peer snapshot after each (on the buddies too), then hold. A
    survivor told to go on (in place) tears its group down and resumes in this process."""
    import torch
    import torch.distributed as dist

    from trainer.parallel import build_mesh, choose_device
    from trainer.peer import PeerSnapshots
    from trainer.report import ListSink
    from trainer.train import Trainer

    torch.set_num_threads(1)
    try:
        _join(rank, port, prefix)
        trainer = Trainer(CONFIG, build_mesh(CONFIG.mesh, "cpu"), choose_device("float32"))
        buddy = buddies(NODES, {n: n for n in NODES})
        peers = PeerSnapshots(folder=root / NODES[rank] / RUN, run_id=RUN, attempt=0, buddy=buddy, sink=ListSink(),
                              identity=state_fingerprint(CONFIG.model), mesh=CONFIG.mesh.axes())
        for _ in range(2):
            trainer.train_step()
            peers.take(trainer)
        peers.wait()
        dist.barrier()
        ready.put(rank)
        job = go.get()  # (prefix, point); only survivors kept in place hear it
        started = time.time()
        peers.close()
        del trainer
        dist.destroy_process_group()
        _resume(rank, port, job[0], root / NODES[rank], job[1], started, out)
    except BaseException:  # noqa: BLE001 - said here; the trial then times out
        traceback.print_exc()
    finally:
        os._exit(0)


def trial(arm: str, index: int, port: int, root: Path) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    # SimpleQueues: no feeder thread in this process, whose forks must not inherit a lock held by one.
    ready, out = ctx.SimpleQueue(), ctx.SimpleQueue()
    go = [ctx.SimpleQueue() for _ in range(WORLD)]
    first = [ctx.Process(target=_first_attempt, args=(r, port, f"{index}/a0", root, ready, go[r], out), daemon=True)
             for r in range(WORLD)]
    for p in first:
        p.start()
    signal.alarm(600)  # a trial that hangs ends the benchmark rather than waiting forever
    for _ in range(WORLD):
        ready.get()
    t0 = time.time()
    lost = [r for r in range(WORLD) if NODES[r] == LOST]
    survivors = [r for r in range(WORLD) if r not in lost]
    for r in lost:
        os.kill(first[r].pid, signal.SIGKILL)  # type: ignore[arg-type]
    shutil.rmtree(root / LOST)  # the node's host memory goes with it
    after = [SPARE if n == LOST else n for n in NODES]
    held = {node: holdings(held_copies(root / node / RUN)) for node in set(after)}
    point, why = peer_point(held, identity=state_fingerprint(CONFIG.model), nodes=set(after))
    assert point is not None and point.step == 2, why
    prefix = f"{index}/a1"
    fresh = lost if arm == "in place" else list(range(WORLD))
    if arm == "in place":
        for r in survivors:
            go[r].put((prefix, point))
    else:
        for r in survivors:
            os.kill(first[r].pid, signal.SIGKILL)  # type: ignore[arg-type]
        for r in survivors:
            first[r].join()
    second = [ctx.Process(target=_fresh, args=(r, port, prefix, root / after[r], point, out), daemon=True)
              for r in fresh]
    for p in second:
        p.start()
    rows = [out.get() for _ in range(WORLD)]
    signal.alarm(0)
    for p in first + second:
        p.join(timeout=60)
    shutil.rmtree(root)
    return {"recovery": max(row["ended"] for row in rows) - t0,
            "survivor": [row for row in rows if row["rank"] in survivors],
            "replacement": [row for row in rows if row["rank"] in lost]}


def _host_store(told: Any, stop: Any) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    told.put(store.port)
    stop.wait()


def main() -> None:
    import torch

    import trainer.peer  # noqa: F401 - the warm image every rank is forked from
    import trainer.peer_load  # noqa: F401
    import trainer.train  # noqa: F401

    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    opts = parser.parse_args()
    repeat = max(5, opts.repeat)
    torch.set_num_threads(1)
    # The rendezvous store lives in a process of its own (as the controller hosts it): this one forks
    # every rank and so keeps no threads of its own (a fork inherits no thread, only the locks they held).
    spawn = mp.get_context("spawn")
    told, stop = spawn.SimpleQueue(), spawn.Event()
    host = spawn.Process(target=_host_store, args=(told, stop), daemon=True)
    host.start()
    port = told.get()
    arms = ("in place", "re-fork")
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as scratch:
        for i in range(repeat):
            for arm in (arms if i % 2 == 0 else tuple(reversed(arms))):
                r = trial(arm, len(results["in place"]) + len(results["re-fork"]), port,
                          Path(scratch) / f"t{i}-{arm.replace(' ', '-')}")
                results[arm].append(r)
                print(f"  trial {i + 1} {arm}: failure -> first step {r['recovery']:.2f} s", flush=True)

    stop.set()
    host.join()

    def line(values: list[float]) -> str:
        return (f"median {statistics.median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f}, "
                f"n={len(values)})")

    print("node loss healed from peers, dp2 x pp2 x tp2 (8 ranks, 2 per node), interleaved")
    figures: list[dict[str, Any]] = []
    for arm in arms:
        print(f"{arm}: failure -> first step {line([r['recovery'] for r in results[arm]])}")
        figures.append(records.figure(f"{arm}: failure -> first step", [r["recovery"] for r in results[arm]], "s"))
        for kind in ("survivor", "replacement"):
            phases = {k: [row[k] for r in results[arm] for row in r[kind]]
                      for k in ("join", "build", "load", "first step")}
            print(f"    {kind:<12} " + ", ".join(f"{k} {statistics.median(v):.3f} s" for k, v in phases.items()))
            figures += [records.figure(f"{arm}: a {kind}'s {k}", v, "s") for k, v in phases.items()]
    ratio = (statistics.median([r["recovery"] for r in results["in place"]])
             / statistics.median([r["recovery"] for r in results["re-fork"]]))
    print(f"ratio in place / re-fork (medians) = {ratio:.3f}")
    figures.append(records.figure("in place / re-fork: failure -> first step (medians)", [ratio], "ratio"))
    records.write("survivors_in_place", figures, code=CODE, extra={"repeat": repeat})


if __name__ == "__main__":
    main()
