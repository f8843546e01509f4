"""A real PostgreSQL server for tests: Debian's `postgresql` binaries, a temporary data directory,
127.0.0.1 on a port of its own, run as the `postgres` user when the tests run as root (PostgreSQL
refuses to run as root). Stopped by its own pg_ctl, so only the server this started ends."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from tests.support.s3 import free_port


def bin_dir() -> Path | None:
    """Where initdb and pg_ctl are (Debian keeps them off PATH, under /usr/lib/postgresql/N/bin)."""
    found = shutil.which("initdb")
    if found:
        return Path(os.path.realpath(found)).parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(versions[-1]).parent if versions else None


def unavailable() -> str | None:
    """Why no server can be started here (None: one can)."""
    if bin_dir() is None:
        return "PostgreSQL is not installed (make test installs Debian's postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a postgres user to run the server as"
    return None


class PostgresServer:
    def __init__(self, host: str = "127.0.0.1", *, within: Callable[[list[str]], list[str]] | None = None) -> None:
        """`within`: how a command runs where the server must (a lab host's `Lab.command`)."""
        self.within = within or (lambda argv: argv)
        root = Path(tempfile.mkdtemp(prefix="goodput-pg-"))  # not under pytest's root-only tmp tree
        self.root = root
        bins = bin_dir()
        assert bins is not None, unavailable()
        self.bins = bins
        self.data = root / "pgdata"
        self.socket_dir = root / "pgsocket"
        self.log = root / "postgres.log"
        self.port = free_port()
        self.data.mkdir(parents=True)
        self.socket_dir.mkdir()
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            for path in (root, self.data, self.socket_dir):
                os.chown(path, user.pw_uid, user.pw_gid)
            self.log.touch()
            os.chown(self.log, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        if not host.startswith("127."):  # (a lab host: its clients are the lab's other hosts)
            with open(self.data / "pg_hba.conf", "a") as hba:
                hba.write(f"host all all {host.rpartition('.')[0]}.0/24 trust\n")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", "-o",
                  f"-h {host} -p {self.port} -k {self.socket_dir} -c fsync=off", "start")
        self._run("createdb", "-h", host, "-p", str(self.port), "-U", "postgres", "goodput")
        self.url = f"postgresql+psycopg://postgres@{host}:{self.port}/goodput"

    def _run(self, tool: str, *args: str) -> None:
        proc = subprocess.run(self.within([*self._as, str(self.bins / tool), *args]), capture_output=True,
                              text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{tool} failed: {proc.stderr.strip() or proc.stdout.strip()}")

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def module_server(host: str = "127.0.0.1") -> Iterator[PostgresServer]:
    """A test module's server (`yield from` it in a fixture): skipped where PostgreSQL cannot be
    installed, a failure in CI, which must test the registry on PostgreSQL."""
    import pytest

    why = unavailable()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must test the registry on PostgreSQL: {why}")
        pytest.skip(why)
    server = PostgresServer(host)
    try:
        yield server
    finally:
        server.stop()
