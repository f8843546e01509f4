"""`goodput run` from a user's point of view: another shell reaches the running run through its API
(`goodput status`, `goodput drill` with a real worker SIGKILLed and recovered), then Ctrl-C cancels
cleanly: the run ends cancelled and nothing it started (raylets, GCS, workers) is left running."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[2]


def goodput(url: str, *args: str) -> dict:
    """Another shell: `goodput ARGS --json` against the run's API."""
    proc = subprocess.run([sys.executable, "-m", "controller", *args, "--json"], capture_output=True, text=True,
                          env={**os.environ, "GOODPUT_URL": url}, timeout=240)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def at_a_terminal() -> None:
    """The child's Ctrl-C as a user's shell gives it: a suite started in the background by a shell
    without job control (`make test &`, nohup) ignores SIGINT, and every child inherits that, so
    Python would never raise KeyboardInterrupt in `goodput run` (seen: the test failed only there)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_drill_from_another_shell_then_ctrl_c_stops_everything(tmp_path: Path) -> None:
    spec = yaml.safe_load((ROOT / "examples" / "tiny-gpt.yaml").read_text())
    spec.update(name="cancel-me", drills=[])
    spec["checkpoint"]["uri"] = f"file://{tmp_path}/ckpt"
    spec["train"]["steps"] = 1000
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "goodput-ray-*")))
    log = open(tmp_path / "stderr.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "controller", "run", str(path), "--api", "127.0.0.1:0"],
                            stdout=subprocess.DEVNULL,
                            stderr=log, cwd=tmp_path, preexec_fn=at_a_terminal)
    ours: set[str] = set()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            ours |= set(glob.glob(os.path.join(tempfile.gettempdir(), "goodput-ray-*"))) - before
            if re.search(r"^step \d+:", (tmp_path / "stderr.log").read_text(), re.MULTILINE):
                break
            assert proc.poll() is None, (tmp_path / "stderr.log").read_text()[-2000:]
            time.sleep(0.5)
        else:  # say where it is: its events, its stderr and its stacks (goodput dumps them on SIGUSR1)
            proc.send_signal(signal.SIGUSR1)
            time.sleep(3)
            events = tmp_path / "goodput-out" / "cancel-me" / "events.log"
            pytest.fail("the run did not reach its first step in 180 s; its events:\n"
                        + (events.read_text()[-4000:] if events.exists() else "(none)\n")
                        + "its stderr and stacks:\n" + (tmp_path / "stderr.log").read_text()[-12000:])
        found = re.search(r"API on (http://127\.0\.0\.1:\d+)", (tmp_path / "stderr.log").read_text())
        assert found, "goodput run says where its API is"
        url = found.group(1)
        assert goodput(url, "status", "cancel-me")["state"] == "running"
        report = goodput(url, "drill", "cancel-me", "kill-rank", "--target", "5", "--timeout", "200")
        assert report["outcome"] == "recovered", report
        assert report["cause"] == "rank_died" and report["attributed_to"]["ranks"] == [5]
        assert report["decision"] == "restart" and report["recovery_s"] > 0
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(90)
        except subprocess.TimeoutExpired:  # say where it is stuck (goodput dumps its stacks on SIGUSR1)
            proc.send_signal(signal.SIGUSR1)
            time.sleep(3)
            pytest.fail("goodput run did not end within 90 s of Ctrl-C; its stderr and stacks:\n"
                        + (tmp_path / "stderr.log").read_text()[-12000:])
    finally:
        if proc.poll() is None:  # a failed test: Ctrl-C stops the run's cluster too, a SIGKILL would orphan it
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
    stderr = (tmp_path / "stderr.log").read_text()
    assert code == 130 and stderr.strip().splitlines()[-1] == "goodput: cancelled", stderr[-2000:]
    assert len(ours) == 1, ours
    (tmp,) = ours
    time.sleep(2)
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(tmp in part for part in (p.info["cmdline"] or [])) and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p.info["pid"])
        except psutil.NoSuchProcess:
            continue
    assert not left, f"processes of the cancelled run still running: {left}"
    assert not os.path.exists(tmp), "the embedded cluster's temp dir is removed"
