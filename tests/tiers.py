"""`make test`'s pytest: the unit tier beside the others, at the lowest CPU priority.

The cluster tier keeps a 2-core machine ~87 % busy (the rest is its waits: detection windows, process
starts, sleeps in drills), and the unit tier is one process. Run after the others, it adds its whole
time to the suite; run beside them at nice 19, it takes only what they leave idle. Linux gives a
nice-19 process ~1.5 % of a core that a nice-0 process wants (and its session's autogroup is niced
too: `lowest_priority` says why), so the cluster and dist tiers' timing stays theirs, and the unit
tier still moves forward when they never pause.

The unit tests that bound a wall-clock time (marked `timing`: an answer within 2 s, a beat within
0.6 s) would measure the starvation instead of the code, so they run with the cluster and dist
tiers. Each session gets the same arguments (a `--session-timeout`, say); the unit tier's output is
printed after the others', then one line for each session. Exit status: the worse of the two.

    python -m tests.tiers [pytest args...]
"""

from __future__ import annotations

import os
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
    with tempfile.NamedTemporaryFile("w+", prefix="goodput-unit-tier-", suffix=".log", delete=False) as log:
        t0 = time.monotonic()
        # no cache plugin: the two sessions would both write .pytest_cache
        # --timeout: pytest-timeout's per-test limit (600 s) is for hangs; a starved test is not hung.
        unit = subprocess.Popen([*pytest, "-p", "no:cacheprovider", "--durations=10", "--timeout=1800",
                                 "-m", BACKGROUND, *args, "tests"],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, preexec_fn=lowest_priority)
        print(f"tests/tiers: the unit tier runs beside the others at nice {NICE} (pid {unit.pid}); "
              f"its output follows theirs (meanwhile: {log.name})", flush=True)
        try:
            rest = subprocess.call([*pytest, "--durations=25", "-m", FOREGROUND, *args, "tests"], cwd=ROOT)
            rest_s = time.monotonic() - t0
            if unit.poll() is None:
                print(f"\ntests/tiers: waiting for the unit tier (pid {unit.pid})", flush=True)
            unit_code = unit.wait()
            unit_s = time.monotonic() - t0
        except BaseException:
            unit.send_signal(signal.SIGINT)  # our own child (its own session: ^C does not reach it)
            try:
                unit.wait(30)
            except subprocess.TimeoutExpired:
                unit.kill()
            raise
        log.seek(0)
        print(f"\n{'=' * 30} the unit tier (nice {NICE}, beside the others) {'=' * 30}")
        print(log.read(), end="", flush=True)
    os.unlink(log.name)
    print(f"\ntests/tiers: cluster, dist and timing tiers: exit {rest} after {rest_s:.0f} s; "
          f"unit tier: exit {unit_code}, done {unit_s:.0f} s after the start")
    # 5: a session that a -k or -m of the caller's left with nothing to run
    codes = [code for code in (rest, unit_code) if code != NO_TESTS_RAN]
    return max(codes, default=NO_TESTS_RAN)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
