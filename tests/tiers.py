"""`make test`'s pytest: two sessions, the second beside the first at the lowest CPU priority.

The cluster tier keeps a 2-core machine ~85 % busy (the rest is its waits: detection windows, process
starts, sleeps in drills), and the unit tier is one process. Run after the others, the unit tier
added its whole time to the suite; run beside them at nice 19, it takes only what they leave idle.
Linux gives a nice-19 process ~1.5 % of a core that a nice-0 process wants (and its session's
autogroup is niced too: `lowest_priority` says why), so the first session's timing stays its own,
and the second still moves forward when the first never pauses.

- First session: the cluster tier, then the dist tier (pytest collects tests/cluster first), and
  the unit tests that bound a wall-clock time (marked `timing`: an answer within 10 s, a beat within
  0.6 s), which would measure the starvation instead of the code.
- Second session: the rest of the unit tier. Not the dist tests: their 4-8 ranks all need the CPU
  at once, and each collective waits for the most starved one. Tried with the dist tests that only
  compare results, beside test_service: the second session passed 58 tests in 12.5 minutes, dist
  first (the unit tier alone passed ~335 in that time beside test_fault_tolerance), and test_service
  took 655 s against 562 s alone.

Each session gets the same arguments (a `--session-timeout`, say, or a -k); the second one's output
is printed after the first's, then a line for each. Exit status: the worse of the two.

    python -m tests.tiers [pytest options...]
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOREGROUND = "cluster or dist or timing"
BACKGROUND = f"not ({FOREGROUND})"
NICE = 19
NO_TESTS_RAN = 5
TAIL_BYTES = 1 << 18
"""How much of the first session's output is kept for the verdict at the end (its short summary)."""


def lowest_priority() -> None:
    """In the child, before it runs pytest: a session of its own, niced 19, its session's autogroup
    too. Linux (autogroups on, as on these VMs) first shares the CPU among sessions' autogroups, then
    among a group's tasks by their nice. Measured beside test_fault_tolerance (its tests but the one
    whose time varies with its outcome): 490 s alone; 590 s beside a unit tier niced 19 in make's
    session; 493 s beside one in its own session with its autogroup niced 19 as well."""
    os.setsid()
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(NICE))
    except OSError:  # no autogroups here: the task's nice is what counts
        pass
    os.nice(NICE)


def main(args: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "-q", "--instafail"]
    with tempfile.NamedTemporaryFile("w+", prefix="goodput-tests-beside-", suffix=".log", delete=False) as log:
        t0 = time.monotonic()
        # No cache plugin: the two sessions would both write .pytest_cache. --timeout: pytest-timeout's
        # per-test limit (600 s) is for hangs, and a starved test is not hung.
        beside = subprocess.Popen([*pytest, "-p", "no:cacheprovider", "--durations=10", "--timeout=1800",
                                   "-m", BACKGROUND, *args, "tests"],
                                  cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=lowest_priority)
        print(f"tests/tiers: the unit tier runs beside the others at nice {NICE} "
              f"(pid {beside.pid}); its output follows (meanwhile: {log.name})", flush=True)
        try:
            first, first_tail = _echo([*pytest, "--durations=25", "-m", FOREGROUND, *args, "tests"])
            first_s = time.monotonic() - t0
            if beside.poll() is None:
                print(f"\ntests/tiers: waiting for the unit tier (pid {beside.pid})", flush=True)
            second = beside.wait()
            second_s = time.monotonic() - t0
        except BaseException:
            beside.send_signal(signal.SIGINT)  # our own child (its own session: ^C does not reach it)
            try:
                beside.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(beside.pid, signal.SIGKILL)  # its session: pytest and whatever it started
                beside.wait()
            raise
        log.seek(0)
        second_out = log.read()
    os.unlink(log.name)
    print(f"\n{'=' * 20} the unit tier (nice {NICE}, beside the others) {'=' * 20}")
    print(second_out, end="", flush=True)
    # The end of the output is what a CI log shows: both sessions' verdicts, failures named.
    print(f"\n{'=' * 30} tests/tiers: both sessions {'=' * 30}")
    for name, code, took, tail in (("cluster, dist and timing tests", first, first_s, first_tail),
                                   ("unit tests", second, second_s, second_out.splitlines())):
        print(f"{name}: exit {code}, {took:.0f} s after the start")
        for line in _verdict(tail):
            print(f"  {line}")
    return verdict(first, second)


def verdict(*codes: int) -> int:
    """make's exit status from the sessions': the worst, where a session ended by a signal (Popen's
    -N) counts as the shell's 128 + N, never as a pass; 5 (a session that a -k or -m of the caller's
    left with nothing to run) only when every session had nothing to run."""
    ran = [128 - code if code < 0 else code for code in codes if code != NO_TESTS_RAN]
    return max(ran, default=NO_TESTS_RAN)


def _echo(command: list[str]) -> tuple[int, list[str]]:
    """Run `command`, its output passed on as it comes (pytest's progress dots too, before a line
    ends); its exit status and its last lines."""
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    kept = b""
    while chunk := os.read(proc.stdout.fileno(), 65536):
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        kept = (kept + chunk)[-TAIL_BYTES:]
    return proc.wait(), kept.decode(errors="replace").splitlines()


def _verdict(lines: list[str]) -> list[str]:
    """A session's failures and errors (its short summary) and its last line of counts."""
    named = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    counts = [line for line in lines if re.search(r"\b(passed|failed|errors?|no tests ran)\b.* in [0-9.]+s", line)
              or "session-timeout" in line]
    return named + counts[-2:]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
