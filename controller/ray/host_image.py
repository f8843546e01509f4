"""One warm image for every node of an embedded cluster (controller/ray/cluster.py, LocalRayCluster): the
nodes are processes of one machine, and they share one import of torch and the trainer.

Why: each node's warm image (controller/ray/zygote.py) imported torch and the trainer, ~6 s of CPU.
Nodes that are machines of their own pay that side by side; an embedded cluster's nodes pay it one
after another on the same cores: five of them were most of `make run`'s first launch
(benchmarks/startup.py). So LocalRayCluster starts one process, the host image, while its raylets
start; it imports everything once and, when a node's first rank actor asks, forks that node's image.

A node's image serves the node's rank actors as a zygote does (NodeZygote's fork and beat requests,
on a socket of its own). It lives exactly as long as the node's raylet: it leads a process group of
its own (every training process it forks is in it) and waits on the raylet's pidfd; when the raylet
ends (the node killed, the cluster shut down), it SIGKILLs the whole group at once, as a machine that
goes down ends every process on it.

Only a node that is a child of the same process as the host image, on a loopback address, gets one
(the host image checks the first, the rank actor the second); any other node keeps a zygote of its
own: a node of the lab (its own network namespace, where a silent fault on its link must reach its
training processes), a `ray start` node, a machine or a pod.

    python -m controller.ray.host_image SOCKET    (LocalRayCluster starts it, and ends it by its PID)
"""

from __future__ import annotations

import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import IO, Any

from controller.ray.zygote import _HEADER, _recv_exact, _request

HOST_IMAGE_ENV = "GOODPUT_HOST_IMAGE"
"""The host image's socket, for the embedded cluster's processes (set by LocalRayCluster while it runs)."""

ASK_TIMEOUT_S = 300.0
"""How long a rank actor waits for its node's image (the host image may still be importing torch)."""



def start(path: str, log: IO[Any]) -> subprocess.Popen[bytes]:
    """The host image, listening at `path` (a Unix socket) when this returns (its imports go on), its
    output to `log`."""
    proc = subprocess.Popen([sys.executable, "-m", "controller.ray.host_image", path], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log)
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the embedded cluster's host image did not start (exit {proc.returncode}; "
                               f"its output: {getattr(log, 'name', 'the cluster log')})")
        time.sleep(0.02)
    return proc


def node_image(node_id: str) -> str | None:
    """From a rank actor: the socket of its node's image, forked now if the node has none yet; None where
    this node does not share the host image (no host image here, a node of its own network, a raylet that
    is not the embedded cluster's), or it cannot be reached (said on stderr): then the node keeps a
    zygote of its own."""
    import ipaddress

    import ray

    path = os.environ.get(HOST_IMAGE_ENV)
    if not path or not ipaddress.ip_address(ray.util.get_node_ip_address()).is_loopback:
        return None
    raylet = os.getppid()
    if _comm(raylet) != "raylet":
        return None
    sock: socket.socket | None = None
    try:
        sock = _request(path, {"node": node_id, "raylet": raylet}, [])
        sock.settimeout(ASK_TIMEOUT_S)
        answer = _receive(sock)
    except OSError as e:
        print(f"goodput: the host image at {path} did not answer ({type(e).__name__}: {e}); this node "
              "imports torch in a zygote of its own", file=sys.stderr, flush=True)
        return None
    finally:
        if sock is not None:
            sock.close()
    return answer.get("path")


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _send(sock: socket.socket, message: Any) -> None:
    """A message in the zygote's framing (its length, then its pickle)."""
    data = pickle.dumps(message)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _receive(sock: socket.socket) -> Any:
    head = _recv_exact(sock, _HEADER.size)
    body = _recv_exact(sock, _HEADER.unpack(head)[0]) if head else b""
    if not body:
        raise ConnectionError("the connection closed before a whole message")
    return pickle.loads(body)


def serve(path: str) -> None:
    """The host image: listen at `path` first (a rank actor that asks early waits for the imports), import
    what a zygote imports, then fork a node's image for each node asked for, one at a time. Ends when
    its parent (the cluster's owner) does, or on SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a terminal's ^C is the owner's to handle: it ends us by PID)
    owner = os.getppid()
    owner_fd = os.pidfd_open(owner)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    from controller.ray.zygote import import_trainer

    import_trainer()
    images: dict[str, tuple[int, str]] = {}
    """Ray node id -> (pid, socket) of its image."""
    while True:
        ready, _, _ = select.select([server.fileno(), owner_fd], [], [], 1.0)
        _reap(images)
        if owner_fd in ready:
            return
        if not ready:
            continue
        conn, _ = server.accept()
        with conn:
            try:
                conn.settimeout(10.0)
                request = _receive(conn)
                node = str(request["node"])
                image = _image_for(node, int(request["raylet"]), images, owner,
                                   [server.fileno(), owner_fd, conn.fileno()])
                _send(conn, {"path": image, "pid": images[node][0] if image is not None else None})
            except Exception as e:  # noqa: BLE001 - one bad request (its actor gone) ends only itself
                print(f"goodput host image: a request failed: {type(e).__name__}: {e}", flush=True)


def _reap(images: dict[str, tuple[int, str]]) -> None:
    """Reap node images that ended (their raylet did) and forget them."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        for node, (image, _) in list(images.items()):
            if image == pid:
                del images[node]


def _image_for(node: str, raylet: int, images: dict[str, tuple[int, str]], owner: int,
               inherited: list[int]) -> str | None:
    """The socket of `node`'s image, forked now if it has none (None: not one of this cluster's nodes)."""
    if node in images:
        return images[node][1]
    if _comm(raylet) != "raylet" or _parent(raylet) != owner:
        return None  # not one of this cluster's nodes: it keeps a zygote of its own
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the node's image
        code = 1
        try:
            for fd in (read, *inherited):
                os.close(fd)
            _node_image(raylet, write)
            code = 0
        except BaseException:  # noqa: BLE001 - said on stderr; the host image answers None
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        path = answer.read().decode()
    if not path:
        os.waitpid(pid, 0)
        return None
    images[node] = (pid, path)
    return path


def _node_image(raylet: int, ready: int) -> None:
    """A node's image: its own process group, a zygote's server, its socket path written to `ready`;
    then wait for the raylet to end, remove the socket's folder and SIGKILL the group (this process
    and every one it forked)."""
    from controller.ray.zygote import NodeZygote

    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (the training processes it forks inherit it)
    raylet_fd = os.pidfd_open(raylet)  # (raises if it is already gone: nothing to serve)
    path = NodeZygote().listen()
    os.write(ready, path.encode())
    os.close(ready)
    select.select([raylet_fd], [], [])
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)  # (its socket's folder: one entry)
    os.killpg(0, signal.SIGKILL)


if __name__ == "__main__":
    serve(sys.argv[1])
