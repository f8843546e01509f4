"""A TCP relay on a loopback address that fails the two ways a network does, for tests and benchmarks
that need a faulty link to one server without a network namespace:
- `go_dark()`: from then on it relays nothing and closes nothing, what a client sees of a server
  behind a partition or on a host that lost power (its sockets stay open, no answer comes);
- `drop()`: every connection is reset, and every new one until `heal()` (a proxy or a link that
  restarts: the kernel says so at once)."""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any


class Relay:
    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.target = target
        self._listener = socket.create_server((host, 0))
        self.port: int = self._listener.getsockname()[1]
        self._dark = threading.Event()
        self._dropping = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []

    def start(self) -> "Relay":
        threading.Thread(target=self._accept, daemon=True, name="relay-accept").start()
        return self

    def go_dark(self) -> None:
        """From now on nothing is relayed either way (what is sent is read and dropped)."""
        self._dark.set()

    def drop(self) -> None:
        """Reset every connection, and every new one until `heal()`."""
        self._dropping.set()
        for s in self._take_sockets():
            _reset(s)

    def heal(self) -> None:
        """New connections are relayed again (those reset stay reset)."""
        self._dropping.clear()

    def close(self) -> None:
        self._closed.set()
        for s in [self._listener, *self._take_sockets()]:
            try:
                s.close()
            except OSError:
                pass

    def _take_sockets(self) -> list[socket.socket]:
        """Every relayed connection's two sockets, no longer tracked here."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        return [s for pair in pairs for s in pair]

    def __enter__(self) -> "Relay":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self._dropping.is_set():
                _reset(client)
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._pairs.append((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._relay, args=(a, b), daemon=True, name="relay-pipe").start()

    def _relay(self, source: socket.socket, sink: socket.socket) -> None:
        while not self._closed.is_set():
            try:
                data = source.recv(65536)
            except OSError:
                return
            if not data:  # (the sender closed: said on, unless dark)
                if not self._dark.is_set():
                    try:
                        sink.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                return
            if self._dark.is_set():
                continue  # (dropped: a partition says nothing)
            try:
                sink.sendall(data)
            except OSError:
                return


def _reset(s: socket.socket) -> None:
    """End a connection at once, as a restarting peer does: shut down first (a relay thread blocked in
    its recv wakes; a close alone would not end the connection under it), then closed with linger 0 (a
    reset where nothing was in flight)."""
    for end in (lambda: s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)),
                lambda: s.shutdown(socket.SHUT_RDWR), s.close):
        try:
            end()
        except OSError:
            pass
