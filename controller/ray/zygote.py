"""The node's warm image: one detached actor per Ray node (the "zygote") imports torch and the trainer
once, and forks every training process its node's rank actors ask for; it also sends their heartbeats.

Why: importing torch and the trainer is ~4 s of CPU. Paid by every rank actor, it was most of a launch
(benchmarks/startup.py) and, on a 2-core test machine, about a third of a cluster test's CPU. Paid once
per node, a launch on a node that trained before starts in about a second: a rank actor imports Ray
and this package's torch-free modules only, and its training process is a fork of a process that
has already imported everything.

A rank actor talks to its node's zygote over a Unix socket (the node's processes share its file
system, whatever network namespace they are in), one connection per request, passing file
descriptors with the request (SCM_RIGHTS):
- `fork`: the rank's pipes (reports up, commands down), a lifeline (the write end stays in the rank
  actor: when the actor dies, the training process reads EOF and exits), the slot's shared memory
  (drill switches and the process's heartbeat), and the actor's stdout and stderr. The zygote forks
  the training process, answers its pid, and, once it has reaped it, its exit code (as
  multiprocessing's: -N for a signal).
- `beat`: the store, key and a lifeline. The zygote adds one to the key every HEARTBEAT_PERIOD_S until
  the lifeline closes (the actor moved on to the next attempt's key, or died). A node that is gone,
  cut off or frozen goes silent, as before; so does a rank actor that died.

The training process runs as before (controller/ray/training.py `train_in_child`): it never
touches Ray, parks after a failed attempt and trains the slot's next one in place. A node's death
ends its zygote and every process it forked (they are all under its raylet).

An embedded cluster's node has no zygote actor: its image is a fork of the machine's host image
(controller/ray/host_image.py), which serves the same requests with this class (`listen`)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import pickle
import select
import signal
import socket
import struct
import tempfile
import threading
import time
from typing import Any, Iterator, MutableSequence, cast

from trainer.switches import SIZE as SWITCHES

ZYGOTE_PREFIX = "goodput-zygote/"
"""Name of a node's zygote actor: this prefix and the Ray node id (namespace controller.ray.run_store.NAMESPACE)."""

SLOT_DOUBLES = SWITCHES + 1
"""A slot's shared memory: its drill switches (trainer/switches.py), then its training process's last beat."""

_HEADER = struct.Struct("!Q")
_CODE = struct.Struct("!q")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            return b""
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _request(path: str, message: Any, fds: list[int]) -> socket.socket:
    """Connect to the zygote at `path`, send `message` (pickled) with `fds`; the connection."""
    data = pickle.dumps(message)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        socket.send_fds(sock, [_HEADER.pack(len(data))], fds)
        sock.sendall(data)
    except BaseException:
        sock.close()
        raise
    return sock


class SlotMemory:
    """A GPU slot's shared memory (a memfd): the drill switches every training process of the slot
    shares, and the current process's heartbeat (unix seconds). Mapped again, from the same fd, in
    the training process."""

    def __init__(self, fd: int | None = None) -> None:
        size = SLOT_DOUBLES * ctypes.sizeof(ctypes.c_double)
        if fd is None:
            fd = os.memfd_create("goodput-slot", 0)
            os.ftruncate(fd, size)
        self.fd = fd
        self._map = mmap.mmap(fd, size)
        self.switches = cast(MutableSequence[float], (ctypes.c_double * SWITCHES).from_buffer(self._map))
        self._beat = (ctypes.c_double * 1).from_buffer(self._map, SWITCHES * ctypes.sizeof(ctypes.c_double))

    @property
    def value(self) -> float:
        """The training process's last beat (what multiprocessing.Value's `value` was before)."""
        return float(self._beat[0])

    @value.setter
    def value(self, now: float) -> None:
        self._beat[0] = now


class ForkedProcess:
    """A training process the zygote forked for this slot: the parts of multiprocessing.Process the rank
    actor uses (pid, is_alive, join, exitcode). The exit code comes from the zygote, which reaps it."""

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self.exitcode: int | None = None
        self._conn = conn
        self._ended = threading.Event()
        threading.Thread(target=self._wait, name=f"goodput-rank-{pid}-exit", daemon=True).start()

    def _wait(self) -> None:
        try:
            data = _recv_exact(self._conn, _CODE.size)
        except OSError:
            data = b""
        finally:
            self._conn.close()
        if data:
            self.exitcode = _CODE.unpack(data)[0]
        else:  # the zygote is gone (its node, as a rule): the process ends with it, or is ended
            while _running(self.pid):
                time.sleep(0.2)
            self.exitcode = -signal.SIGKILL
        self._ended.set()

    def is_alive(self) -> bool:
        return not self._ended.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._ended.wait(timeout)


def _running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


class ZygoteClient:
    """A rank actor's side: ask the node's zygote to fork a training process, or to beat a key."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fork(self, args: Any, *, report: int, commands: int, lifeline: int, memory: SlotMemory) -> ForkedProcess:
        """Fork the training process of `args` (training.train_in_child) with these fds: the write end
        of its report pipe, the read end of its command pipe and of its lifeline."""
        message = {"kind": "fork", "args": args, "env": dict(os.environ), "cwd": os.getcwd()}
        conn = _request(self.path, message, [report, commands, lifeline, memory.fd, 1, 2])
        data = _recv_exact(conn, _CODE.size)
        if not data:
            conn.close()
            raise RuntimeError(f"the node's zygote ({self.path}) did not fork the training process")
        return ForkedProcess(_CODE.unpack(data)[0], conn)

    def beat(self, host: str, port: int, key: str, lifeline: int) -> None:
        """Beat `key` of the store at host:port until `lifeline`'s write end closes."""
        conn = _request(self.path, {"kind": "beat", "host": host, "port": port, "key": key}, [lifeline])
        try:
            _recv_exact(conn, 1)  # taken
        finally:
            conn.close()


def import_trainer() -> None:
    """What a warm image imports once, so that every training process it forks starts with it."""
    import torch  # noqa: F401 - the point: pay the imports once per node

    import trainer.checkpoint  # noqa: F401
    import trainer.train  # noqa: F401
    import trainer.worker  # noqa: F401


class NodeZygote:
    """The Ray actor: `warm` imports torch and the trainer and starts serving; its answer is the socket's
    path. Requests are served one at a time by one thread, so a request's fds are open in the zygote
    only while its own fork happens (another's child never inherits them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._path: str | None = None
        self._server: socket.socket | None = None
        self._conns: set[int] = set()
        """Connections to actors waiting for a process's exit code (closed in every forked child)."""
        self._conns_lock = threading.Lock()
        self._calls = _Gate()
        """Beats inside the store client, and forks: a training process forked while a beat held a lock
        of c10d's would inherit it held, and its own store would hang; beats do not wait for each
        other (one blocked by a store that does not answer must not hold the node's others back)."""

    def warm(self) -> str:
        with self._lock:
            if self._path is None:
                import_trainer()
                self._path = self.listen()
            return self._path

    def listen(self) -> str:
        """Serve requests on a new socket, from a thread of its own (the imports done); its path."""
        # In the cluster's temp folder where it has one (removed with it); a socket path is <= 107 bytes.
        base = os.environ.get("RAY_TMPDIR", "")
        folder = tempfile.mkdtemp(prefix="goodput-zygote-", dir=base if 0 < len(base) <= 64 else "/tmp")
        path = os.path.join(folder, "sock")
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(64)
        self._server = server
        threading.Thread(target=self._serve, name="goodput-zygote", daemon=True).start()
        return path

    def pid(self) -> int:
        return os.getpid()

    def _serve(self) -> None:
        assert self._server is not None
        while True:
            conn, _ = self._server.accept()
            fds: list[int] = []
            try:
                head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 8)
                if len(head) < _HEADER.size:
                    head += _recv_exact(conn, _HEADER.size - len(head))
                message = pickle.loads(_recv_exact(conn, _HEADER.unpack(head)[0]))
                if message["kind"] == "fork":
                    self._fork(conn, message, fds)
                elif message["kind"] == "beat":
                    (lifeline,) = fds
                    fds = []
                    threading.Thread(target=self._beat, args=(message["host"], message["port"], message["key"], lifeline),
                                     name="goodput-heartbeat", daemon=True).start()
                    conn.sendall(b"k")
                    conn.close()
                else:
                    conn.close()
            except Exception as e:  # noqa: BLE001 - one bad request (its actor gone mid-way) ends only itself
                print(f"goodput zygote: a request failed: {type(e).__name__}: {e}", flush=True)
                if conn.fileno() not in self._conns:  # (a forked one's is the reaper's to close)
                    conn.close()
            finally:
                for fd in fds:
                    try:
                        os.close(fd)
                    except OSError:
                        pass

    def _fork(self, conn: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
        assert self._server is not None
        with self._conns_lock:
            inherited = [self._server.fileno(), conn.fileno(), *self._conns]
        with self._calls.alone():
            pid = os.fork()
            if pid == 0:
                _child(message, fds, inherited)  # never returns
        with self._conns_lock:
            self._conns.add(conn.fileno())
        try:
            conn.sendall(_CODE.pack(pid))  # (before the reaper can send the exit code on the same connection)
        finally:  # reaped whatever happens (an actor gone before it reads the pid leaves no zombie behind)
            threading.Thread(target=self._reap, args=(pid, conn), name=f"goodput-reap-{pid}", daemon=True).start()

    def _reap(self, pid: int, conn: socket.socket) -> None:
        _, status = os.waitpid(pid, 0)
        with self._conns_lock:
            self._conns.discard(conn.fileno())
        try:
            conn.sendall(_CODE.pack(os.waitstatus_to_exitcode(status)))
        except OSError:
            pass
        finally:
            conn.close()

    def _beat(self, host: str, port: int, key: str, lifeline: int) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        from health.heartbeat import HEARTBEAT_PERIOD_S

        client: Any = None
        try:
            while True:
                try:
                    with self._calls.shared():
                        if client is None:
                            client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                                                   timeout=timedelta(seconds=HEARTBEAT_PERIOD_S * 5))
                        client.add(key, 1)
                except Exception:  # noqa: BLE001 - unreachable now (a partition, a store moving): next beat
                    client = None
                ended, _, _ = select.select([lifeline], [], [], HEARTBEAT_PERIOD_S)
                if ended:  # EOF: the actor moved on to another key, or is gone
                    return
        finally:
            os.close(lifeline)


class _Gate:
    """Many may be inside together (`shared`), or one alone (`alone`: waits until the others are out,
    and lets none in meanwhile)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inside = 0
        self._alone = False

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._alone)
            self._inside += 1
        try:
            yield
        finally:
            with self._cond:
                self._inside -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._alone)
            self._alone = True
            self._cond.wait_for(lambda: self._inside == 0)
        try:
            yield
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()


def _child(message: dict[str, Any], fds: list[int], inherited: list[int]) -> None:
    """The forked training process: the actor's stdout, stderr, environment and working directory, none
    of the zygote's sockets; then the rank's training (training.train_in_child); then exit."""
    from multiprocessing.connection import Connection

    code = 1
    try:
        report, commands, lifeline, memory_fd, out, err = fds
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in (out, err, *inherited):
            try:
                os.close(fd)
            except OSError:
                pass
        os.environ.clear()
        os.environ.update(message["env"])
        os.chdir(message["cwd"])
        import torch.cuda

        torch.cuda._cached_device_count = None  # (the slot's CUDA_VISIBLE_DEVICES is the actor's, not the zygote's)
        from controller.ray.training import train_in_child

        memory = SlotMemory(memory_fd)
        from trainer.switches import DrillSwitches

        train_in_child(message["args"], Connection(report, readable=False), memory, lifeline,
                        DrillSwitches(memory.switches), Connection(commands, writable=False))
        code = 0
    except BaseException:  # noqa: BLE001 - said on stderr; the exit code tells the actor
        import traceback

        traceback.print_exc()
    finally:
        try:
            import sys

            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
