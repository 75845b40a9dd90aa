"""A round-robin TCP proxy on loopback: one address in front of several `kmend serve` replicas (tests only).

Each accepted connection goes to the next backend in turn; a backend that refuses is skipped, so when a replica
dies its agents reconnect to a live one, as behind a Kubernetes Service.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import socketserver
import threading
from collections import Counter
from types import TracebackType


class RoundRobinProxy:
    """Listens on 127.0.0.1 and splices each connection to one of `backends` ((host, port) pairs) in turn."""

    def __init__(self, backends: list[tuple[str, int]]) -> None:
        self.backends = backends
        self._next = itertools.cycle(range(len(backends)))
        self._lock = threading.Lock()
        self.connections: Counter[tuple[str, int]] = Counter()
        """Connections spliced to each backend."""
        proxy = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._splice(self.request)

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Handler, bind_and_activate=True)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    def __enter__(self) -> RoundRobinProxy:
        self._thread.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _connect(self) -> socket.socket | None:
        for _ in range(len(self.backends)):
            with self._lock:
                backend = self.backends[next(self._next)]
            try:
                up = socket.create_connection(backend, timeout=2)
            except OSError:
                continue
            up.settimeout(None)
            with self._lock:
                self.connections[backend] += 1
            return up
        return None

    def _splice(self, down: socket.socket) -> None:
        up = self._connect()
        if up is None:
            return
        pump = threading.Thread(target=_pipe, args=(up, down), daemon=True)
        pump.start()
        _pipe(down, up)
        pump.join(timeout=5)
        up.close()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy src to dst until either side ends, then end both directions."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    for s in (dst, src):
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
