"""A TCP forwarder on 127.0.0.1 that can go dark: until `cut()` it relays every connection to its
target; after, it relays nothing and closes nothing (what a client sees of a server behind a
partition: its sockets stay open and no answer comes). For tests that need a silent peer without a
network namespace."""

from __future__ import annotations

import socket
import threading
from typing import Any


class Blackhole:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._dark = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []

    def start(self) -> "Blackhole":
        threading.Thread(target=self._accept, daemon=True, name="blackhole-accept").start()
        return self

    def cut(self) -> None:
        """From now on nothing is relayed either way (what is sent is read and dropped)."""
        self._dark.set()

    def close(self) -> None:
        self._closed.set()
        for s in [self._listener, *self._sockets]:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> "Blackhole":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            self._sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._relay, args=(a, b), daemon=True, name="blackhole-relay").start()

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
