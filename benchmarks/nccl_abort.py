"""The survivors' abortable cross-replica groups (trainer/abandon.py), created, used and aborted again
and again in one process: no leak, no hang. What can be checked of the NCCL path on one GPU (NCCL
refuses two ranks on one device, so the multi-rank abort of a collective in flight cannot run there):
a group of size 1, built as a survivor builds one (non-blocking communicator, connected eagerly, its
errors handled without tearing the process down), one all-reduce through `abandon.wait`, the group's
error asked (`abandon.errored`, what a survivor asks before its vote), then `abandon.abort`,
`--rounds` times.

    python benchmarks/nccl_abort.py [--rounds 100] [--round-timeout-s 60]

(`run_rounds` is the whole check as a function: benchmarks/gpu_suite.py runs it too.)

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
from typing import Any, Callable

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


def run_rounds(rounds: int, device: torch.device, round_timeout_s: float, *,
               on_hang: Callable[[int, float], None] | None = None,
               say: Callable[[str], None] = print) -> dict[str, Any]:
    """`rounds` rounds after one of warm-up, watched: a round slower than `round_timeout_s` calls
    `on_hang(round, round_timeout_s)` from the watchdog thread (`end_on_hang` unless given). The
    rounds' times, and what was kept after the warm-up (threads, open files, device bytes) with the
    leaks past the bounds."""
    graveyard = Graveyard()
    times = [one_round(0, device, graveyard, round_timeout_s)]  # (warm-up: the library's own first allocations)
    before = threads(), files(), device_bytes(device)
    current = {"round": 0, "since": time.monotonic()}
    finished = threading.Event()

    def watchdog() -> None:
        while not finished.wait(1):
            if time.monotonic() - current["since"] > round_timeout_s:
                (on_hang or end_on_hang)(int(current["round"]), round_timeout_s)
                return

    threading.Thread(target=watchdog, daemon=True, name="nccl-abort-watchdog").start()
    for k in range(1, rounds + 1):
        current.update(round=k, since=time.monotonic())
        times.append(one_round(k, device, graveyard, round_timeout_s))
        if k % 10 == 0:
            say(f"round {k}: threads {threads()}, files {files()}, device {device_bytes(device) / 2**20:.0f} MiB, "
                f"slowest {max(times):.3f} s")
    current["since"] = float("inf")
    graveyard.prune()
    after = threads(), files(), device_bytes(device)
    finished.set()
    kept = after[0] - before[0], after[1] - before[1], after[2] - before[2]
    leaks = [what for what, grew, bound in (("threads", kept[0], LEAK_THREADS), ("open files", kept[1], LEAK_FILES),
                                            ("device memory", kept[2], LEAK_BYTES)) if grew > bound]
    return {"rounds": rounds, "round_s": times[1:], "warm_up_s": times[0], "slowest_s": max(times),
            "before": before, "after": after, "kept": kept, "held": len(graveyard), "leaks": leaks}


def end_on_hang(round_: int, timeout_s: float) -> None:
    """Every thread's stack, then the process ends with 1 (a hung NCCL call cannot be taken back)."""
    print(f"HANG: round {round_} took over {timeout_s:g} s; every thread:", flush=True)
    faulthandler.dump_traceback(all_threads=True)
    os._exit(1)


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
    result = run_rounds(opts.rounds, device, opts.round_timeout_s, say=lambda line: print(line, flush=True))
    before, after, kept = result["before"], result["after"], result["kept"]
    print(f"{opts.rounds} rounds on {'NCCL' if cuda else 'gloo'}: slowest round {result['slowest_s']:.3f} s; "
          f"kept after the warm-up: {kept[0]} threads ({before[0]} -> {after[0]}), {kept[1]} open files ({before[1]} -> "
          f"{after[1]}), {kept[2] / 2**20:.1f} MiB of device memory; groups still held: {result['held']}")
    if result["leaks"]:
        print(f"LEAK: {', '.join(result['leaks'])} grew past the bound")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
