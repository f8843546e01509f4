"""The survivors' abortable cross-replica groups (trainer/abandon.py), created, used and aborted again
and again in one process: no leak, no hang. What can be checked of the NCCL path on one GPU (NCCL
refuses two ranks on one device, so the multi-rank abort of a collective in flight cannot run there):
a group of size 1, built as a survivor builds one (non-blocking communicator, connected eagerly, its
errors handled without tearing the process down), one all-reduce through `abandon.wait`, the group's
error asked (`abandon.errored`, what a survivor asks before its vote), then `abandon.abort`,
`--rounds` times.

    python benchmarks/nccl_abort.py [--rounds 100] [--round-timeout-s 60]

On a machine without CUDA it runs the same rounds on gloo (the CPU path), saying so. Prints one line
per 10 rounds and a summary: the slowest round, and threads, open files and device memory before
and after. Exits 1 on a leak (more than 4 threads, 16 files or 64 MiB of device memory kept after
the first round's warm-up) or a round slower than --round-timeout-s (a hang: the process is ended
then, after printing every thread's stack)."""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from trainer.abandon import Graveyard, abort, build, errored, wait  # noqa: E402

LEAK_THREADS, LEAK_FILES, LEAK_BYTES = 4, 16, 64 * 2**20


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def files() -> int:
    return len(os.listdir("/proc/self/fd"))


def device_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def one_round(k: int, device: torch.device, graveyard: Graveyard, timeout_s: float) -> float:
    start = time.monotonic()
    store = dist.HashStore()
    group = build(dist.PrefixStore(f"round-{k}/", store), 0, 1, device, timeout_s)
    tensor = torch.full((1024,), float(k), device=device)
    work = group.allreduce([tensor])
    wait(work, give_up=lambda: None, timeout_s=timeout_s)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    assert float(tensor[0]) == float(k), f"round {k}: the all-reduce of one rank changed its input"
    assert errored(group) is None, f"round {k}: {errored(group)}"  # (what a survivor asks before its vote)
    abort(group, [work], graveyard)
    del group, work
    return time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--round-timeout-s", type=float, default=60.0)
    opts = parser.parse_args()
    cuda = torch.cuda.is_available() and dist.is_nccl_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        print(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))} on {torch.cuda.get_device_name(device)}, "
              f"torch {torch.__version__}")
    else:
        print(f"no CUDA here: the same rounds on gloo (the CPU path), torch {torch.__version__}")
    graveyard = Graveyard()
    slowest = one_round(0, device, graveyard, opts.round_timeout_s)  # (warm-up: the library's own first allocations)
    before = threads(), files(), device_bytes(device)
    current = {"round": 0, "since": time.monotonic()}

    def watchdog() -> None:
        while True:
            time.sleep(1)
            if time.monotonic() - current["since"] > opts.round_timeout_s:
                print(f"HANG: round {current['round']} took over {opts.round_timeout_s:g} s; every thread:",
                      flush=True)
                faulthandler.dump_traceback(all_threads=True)
                os._exit(1)

    threading.Thread(target=watchdog, daemon=True).start()
    for k in range(1, opts.rounds + 1):
        current.update(round=k, since=time.monotonic())
        slowest = max(slowest, one_round(k, device, graveyard, opts.round_timeout_s))
        if k % 10 == 0:
            print(f"round {k}: threads {threads()}, files {files()}, device {device_bytes(device) / 2**20:.0f} MiB, "
                  f"slowest {slowest:.3f} s", flush=True)
    current["since"] = float("inf")
    graveyard.prune()
    after = threads(), files(), device_bytes(device)
    kept = after[0] - before[0], after[1] - before[1], after[2] - before[2]
    print(f"{opts.rounds} rounds on {'NCCL' if cuda else 'gloo'}: slowest round {slowest:.3f} s; kept after the "
          f"warm-up: {kept[0]} threads ({before[0]} -> {after[0]}), {kept[1]} open files ({before[1]} -> {after[1]}), "
          f"{kept[2] / 2**20:.1f} MiB of device memory; groups still held: {len(graveyard)}")
    leaks = [what for what, grew, bound in (("threads", kept[0], LEAK_THREADS), ("open files", kept[1], LEAK_FILES),
                                            ("device memory", kept[2], LEAK_BYTES)) if grew > bound]
    if leaks:
        print(f"LEAK: {', '.join(leaks)} grew past the bound")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
