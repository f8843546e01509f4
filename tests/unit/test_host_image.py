"""The embedded cluster's shared warm image (controller/ray/host_image.py) without Ray: a stand-in raylet
(a sleeping process named "raylet", a child of this test as an embedded cluster's raylets are of their
owner) gets a node image that serves a zygote's requests and ends the moment the raylet does; a
raylet that is not the owner's gets none."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch.distributed as dist

from controller.ray import host_image
from controller.ray.zygote import ZygoteClient


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("host-image")
    path = str(folder / "sock")
    with pytest.MonkeyPatch.context() as env, open(folder / "log", "ab") as log:
        env.setenv("RAY_TMPDIR", str(folder))  # (the node images' sockets go there, as in a cluster's temp dir)
        proc = host_image.start(path, log)
    try:
        yield path
    finally:
        proc.terminate()
        proc.wait(10)
        print((folder / "log").read_text()[-4000:])


def raylet(folder: Path) -> subprocess.Popen[bytes]:
    """A child of this process whose name is "raylet" (a copy of sleep)."""
    exe = folder / "raylet"
    if not exe.exists():
        shutil.copy(shutil.which("sleep") or "/bin/sleep", exe)
    proc = subprocess.Popen([str(exe), "300"])
    deadline = time.monotonic() + 10
    while host_image._comm(proc.pid) != "raylet":  # (Popen may return before exec has renamed it)
        assert time.monotonic() < deadline, "the stand-in raylet did not start"
        time.sleep(0.01)
    return proc


def ask(path: str, node: str, raylet_pid: int) -> dict[str, Any]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(120)
    try:
        sock.connect(path)
        host_image._send(sock, {"node": node, "raylet": raylet_pid})
        answer: dict[str, Any] = host_image._receive(sock)
        return answer
    finally:
        sock.close()


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


def test_a_node_image_serves_its_node_and_ends_with_its_raylet(image: str, tmp_path: Path) -> None:
    node = raylet(tmp_path)
    try:
        first = ask(image, "node-a", node.pid)
        assert first["path"] and first["pid"], first
        assert ask(image, "node-a", node.pid) == first, "one image per node, forked once"
        assert os.getpgid(first["pid"]) == first["pid"], "it leads a process group of its own"
        # it serves as a zygote does: a heartbeat moves the store's counter
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
        ours, lifeline = os.pipe()
        ZygoteClient(first["path"]).beat("127.0.0.1", store.port, "beat/0", ours)
        os.close(ours)
        deadline = time.monotonic() + 10
        while store.add("beat/0", 0) < 2:
            assert time.monotonic() < deadline, "the node image did not beat"
            time.sleep(0.1)
        os.close(lifeline)
        node.kill()  # the node goes
        node.wait()
        deadline = time.monotonic() + 10  # (at once as a rule; the bound allows for a loaded machine)
        while not gone(first["pid"]):
            assert time.monotonic() < deadline, "the node image outlived its raylet"
            time.sleep(0.02)
        assert not os.path.exists(os.path.dirname(first["path"])), "its socket's folder goes with it"
        again = raylet(tmp_path)  # the node back (a new Ray node id): a new image
        try:
            back = ask(image, "node-a-again", again.pid)
            assert back["pid"] not in (None, first["pid"]) and back["path"] != first["path"]
        finally:
            again.kill()
            again.wait()
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_a_raylet_that_is_not_the_clusters_gets_no_image(image: str, tmp_path: Path) -> None:
    # a grandchild of this test (under a shell), not a sibling of the host image: not one of its cluster's nodes
    children: list[int] = []
    shell = subprocess.Popen(["sh", "-c", f"cp {shutil.which('sleep')} {tmp_path}/raylet && exec {tmp_path}/raylet 300 & wait"])
    try:
        deadline = time.monotonic() + 10
        while True:
            children = [int(p) for p in Path(f"/proc/{shell.pid}/task/{shell.pid}/children").read_text().split()]
            if children and host_image._comm(children[0]) == "raylet":
                break
            assert time.monotonic() < deadline, "the stand-in raylet did not start"
            time.sleep(0.05)
        assert ask(image, "node-b", children[0]) == {"path": None, "pid": None}
        assert ask(image, "node-c", os.getpid())["path"] is None, "a process that is not a raylet"
    finally:
        shell.kill()
        shell.wait()
        for pid in children:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
