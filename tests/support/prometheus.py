"""A real Prometheus server (Debian's `prometheus`) on 127.0.0.1 for the cluster tests: its own
config, rules and TSDB in a temp dir, started and stopped by its PID."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing() -> str | None:
    """Why no Prometheus can run here, or None."""
    for binary in ("prometheus", "promtool"):
        if shutil.which(binary) is None:
            return f"{binary} is not installed (Debian package `prometheus`; `make test` installs it when it can)"
    return None


class PrometheusServer:
    def __init__(self, root: Path, *, target: str, token_file: Path, rules: list[Path],
                 interval_s: float = 1.0) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": f"{interval_s:g}s",
                       "scrape_timeout": f"{interval_s:g}s"},
            "rule_files": [str(r) for r in rules],
            "scrape_configs": [{"job_name": "goodput", "metrics_path": "/metrics",
                                "authorization": {"credentials_file": str(token_file)},
                                "static_configs": [{"targets": [target]}]}],
        }
        self.config = root / "prometheus.yml"
        self.config.write_text(yaml.safe_dump(config))
        self.log = root / "prometheus.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> "PrometheusServer":
        check = subprocess.run(["promtool", "check", "config", str(self.config)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                ["prometheus", f"--config.file={self.config}", f"--storage.tsdb.path={self.root / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d"],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus did not get ready in {timeout_s} s:\n{self.log.read_text()[-3000:]}")

    def api(self, path: str, **params: Any) -> Any:
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = response.json()
        assert response.status_code == 200 and body["status"] == "success", (path, params, body)
        return body["data"]

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0) -> list[dict[str, Any]]:
        return self.api("query_range", query=expr, start=start, end=end, step=step)["result"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
