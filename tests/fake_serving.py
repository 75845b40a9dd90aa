"""How the loopback fake API server (``tests/fake_apiserver.py``) lives: its HTTP server, which can be stopped with
every connection reset and started again on the same port, and the start-up window of a real API server."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any

from tests.fake_rbac import RoleRules


class StartupWindow:
    """The first ``seconds`` after the API server starts answering (from the first request it gets), and at least
    ``at_least`` requests: its
    RBAC authorizer has not loaded the roles yet (403 naming the request and `RBAC: clusterrole... "<role>" not
    found`, with RBAC on) and priority-and-fairness is still settling (429 `Too many requests, please try again
    later.` with `Retry-After: 1`). The two alternate request by request, so a client meets both; ``answered``
    records each refusal (code, verb, path)."""

    def __init__(self, seconds: float, rbac: RoleRules | None, role: str, *, at_least: int = 0) -> None:
        self.seconds = seconds
        self.at_least = at_least
        """Refusals answered before the window may end, however long they take to come (a test's client that
        starts slowly on a loaded machine still meets the window)."""
        self.rbac = rbac
        self.role = role
        self.answered: list[tuple[int, str, str]] = []
        self._began: float | None = None
        self._lock = threading.Lock()

    def again(self, seconds: float | None = None) -> StartupWindow:
        """The window of the next start (of ``seconds``, or as long as this one)."""
        return StartupWindow(self.seconds if seconds is None else seconds, self.rbac, self.role,
                             at_least=self.at_least)

    def refusal(self, verb: str, path: str) -> tuple[int, dict[str, Any], None, dict[str, str]] | None:
        """The start-up answer to this request, or None once the window is over (or with none)."""
        if self.seconds <= 0 and self.at_least <= 0:
            return None
        with self._lock:
            now = time.monotonic()
            self._began = now if self._began is None else self._began
            if now - self._began >= self.seconds and len(self.answered) >= self.at_least:
                return None
            throttled = len(self.answered) % 2 == 1 or self.rbac is None
            method = "GET" if verb == "WATCH" else verb
            forbidden = None if throttled or self.rbac is None else self.rbac.forbidden(
                method, path, f'RBAC: clusterrole.rbac.authorization.k8s.io "{self.role}" not found')
            if forbidden is not None:
                self.answered.append((403, verb, path))
                return forbidden[0], forbidden[1], None, {}
            self.answered.append((429, verb, path))
            return 429, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                         "message": "Too many requests, please try again later.", "reason": "TooManyRequests",
                         "details": {"retryAfterSeconds": 1}, "code": 429}, None, {"Retry-After": "1"}


class Server(ThreadingHTTPServer):
    # A real server's accept queue is deep; the default of 5 drops connections under a burst of parallel
    # clients, and each dropped SYN costs the client a one-second retransmit.
    request_queue_size = 1024
    allow_reuse_address = True  # ``up`` binds the port ``down`` closed a moment ago

    def __init__(self, address: tuple[str, int], handler: Any) -> None:
        self.serving = False
        """Between ``start`` and ``stop``."""
        self.open_connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self.open_connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self.open_connections.discard(request)
        super().shutdown_request(request)

    def start(self) -> None:
        """Serve in a daemon thread."""
        threading.Thread(target=self.serve_forever, daemon=True).start()
        self.serving = True

    def stop(self) -> None:
        """Close the port, then reset every connection still open (nothing when not serving)."""
        if not self.serving:
            return
        self.serving = False
        self.shutdown()
        self.server_close()
        self.reset_connections()

    def reset_connections(self) -> None:
        """Reset every connection still open (keep-alive ones and watch streams): the peer reads a reset or EOF."""
        with self._connections_lock:
            conns = list(self.open_connections)
            self.open_connections.clear()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
