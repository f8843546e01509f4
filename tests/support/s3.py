"""A real S3-protocol server for tests: moto in server mode on 127.0.0.1, behind a small
fault-injecting HTTP proxy (the `store.fail_next_put()` of the checkpoint tests).

The proxy forwards every request unchanged, except writes (PUT/POST) it is told to refuse: it then
answers 503 SlowDown, as S3 does when throttling.
"""

from __future__ import annotations

import http.client
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
              b"<Message>Please reduce your request rate.</Message></Error>")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._lock = threading.Lock()
        self._refuse_count = 0
        self._refuse_pattern: re.Pattern | None = None
        self._refuse_until = 0.0
        self.refused = 0
        self.sent_bytes = 0
        """Body bytes the server sent back through the proxy (what a restore costs the store)."""
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                if self.command in ("PUT", "POST") and proxy._should_refuse(self.path):
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(_SLOW_DOWN)))
                    self.end_headers()
                    self.wfile.write(_SLOW_DOWN)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = self.headers.get("Host", "")
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                    with proxy._lock:
                        proxy.sent_bytes += len(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def _should_refuse(self, path: str) -> bool:
        with self._lock:
            refuse = False
            if self._refuse_count > 0:
                self._refuse_count -= 1
                refuse = True
            elif self._refuse_pattern is not None and self._refuse_pattern.search(path):
                refuse = True
            elif time.monotonic() < self._refuse_until:
                refuse = True
            self.refused += refuse
            return refuse

    def fail_next_writes(self, count: int) -> None:
        with self._lock:
            self._refuse_count = count

    def refuse_writes_matching(self, pattern: str | None) -> None:
        with self._lock:
            self._refuse_pattern = re.compile(pattern) if pattern else None

    def refuse_writes_for(self, seconds: float) -> None:
        with self._lock:
            self._refuse_until = time.monotonic() + seconds

    def heal(self) -> None:
        with self._lock:
            self._refuse_count, self._refuse_pattern, self._refuse_until = 0, None, 0.0

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class S3Server:
    """moto_server on loopback plus the proxy; `endpoint` is the proxy's URL."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        moto = Path(sys.executable).with_name("moto_server")  # else moto installed without its scripts
        command = [str(moto)] if moto.exists() else [sys.executable, "-m", "moto.server"]
        self._log = open(log_dir / "moto.log", "w")
        self.proc = subprocess.Popen([*command, "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("moto_server did not start; see moto.log")
                time.sleep(0.1)
        self.proxy = FaultProxy(self.port)
        self.endpoint = f"http://127.0.0.1:{self.proxy.port}"

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="test", aws_secret_access_key="test",
                     region_name="us-east-1").create_bucket(Bucket=name)

    def stop(self) -> None:
        if hasattr(self, "proxy"):
            self.proxy.close()
        self.proc.terminate()  # our own child, by its PID
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def set_env(values: dict[str, str]) -> dict[str, str | None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    return saved


def restore_env(saved: dict[str, str | None]) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
