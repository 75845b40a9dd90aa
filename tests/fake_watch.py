"""Streaming watches (pods, nodes, PodGroups) for the loopback fake API server (``tests/fake_apiserver.py``).

As kube-apiserver does: ``GET /api/v1/pods?watch=true&resourceVersion=N`` answers 200 with a
chunked stream of JSON lines ``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}``
holding every pod change after version N, then the changes as they happen, until
``timeoutSeconds`` runs out. With ``allowWatchBookmarks=true`` an idle stream gets a BOOKMARK
carrying the current version every ``bookmark_s``. A version older than the history kept
answers an ERROR event with a 410 Status and ends the stream.

Test controls: ``end_streams`` ends every open stream cleanly (a dropped connection, as a load
balancer or an API server restart does), ``expire`` forgets the history (etcd compaction): open
streams get the 410 ERROR and a watch from any older version is refused.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

Json = dict[str, Any]


class PodWatchLog:
    """Every pod change with its resourceVersion, and the streams' controls.

    The condition shares the server's lock: changes are recorded by code that holds it already.
    """

    def __init__(self, lock: threading.Lock, *, bookmark_s: float = 0.1, kind: str = "Pod",
                 api_version: str = "v1") -> None:
        self.changed = threading.Condition(lock)
        self.kind = kind
        """The kind the stream's BOOKMARK events name."""
        self.api_version = api_version
        """The apiVersion the stream's BOOKMARK events name (``group/version`` for a custom resource)."""
        self.bookmark_s = bookmark_s
        """Seconds an idle stream waits before a BOOKMARK."""
        self.events: list[tuple[int, str, Json]] = []
        self.version = 0
        """The server's current resourceVersion (as a number), set by the server on every write."""
        self.compacted = 0
        """Watches from a version below this get 410."""
        self.streams: list[Json] = []
        """The query of every watch request served, in order."""
        self._ended = 0
        self._expired = 0

    # Called by the server with its lock held.

    def record(self, kind: str, pod: Json) -> None:
        """A pod was added, changed or deleted; ``pod`` is its state after (before, for DELETED)."""
        rv = int(pod["metadata"]["resourceVersion"])
        self.events.append((rv, kind, copy.deepcopy(pod)))
        self.changed.notify_all()

    # Test controls.

    def end_streams(self) -> None:
        """End every open stream cleanly; clients watch again from their last version."""
        with self.changed:
            self._ended += 1
            self.changed.notify_all()

    def expire(self) -> None:
        """Forget the history: open streams get 410 Gone, and so does a watch from an older version."""
        with self.changed:
            self.compacted = self.version
            self.events.clear()
            self._expired += 1
            self.changed.notify_all()

    # Serving.

    def serve(self, handler: BaseHTTPRequestHandler, query: dict[str, str]) -> None:
        """Answer one watch request on ``handler``'s connection, streaming until it ends."""
        start = int(query.get("resourceVersion") or 0)
        deadline = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") == "true"
        handler.protocol_version = "HTTP/1.1"
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.close_connection = True
        with self.changed:
            self.streams.append(dict(query))
            ended, expired = self._ended, self._expired
            too_old = start < self.compacted
        try:
            if too_old:
                self._send(handler, _gone(start))
                return
            pos = start
            while True:
                with self.changed:
                    pending = [e for e in self.events if e[0] > pos]
                    if not pending and ended == self._ended and expired == self._expired:
                        self.changed.wait(max(0.0, min(self.bookmark_s, deadline - time.monotonic())))
                        pending = [e for e in self.events if e[0] > pos]
                    now_version = self.version
                    was_ended, was_expired = ended != self._ended, expired != self._expired
                for rv, kind, obj in pending:
                    self._send(handler, {"type": kind, "object": obj})
                    pos = rv
                if was_expired:
                    self._send(handler, _gone(pos))
                    return
                if was_ended or time.monotonic() >= deadline:
                    return
                if not pending and bookmarks:
                    self._send(handler, {"type": "BOOKMARK", "object": {
                        "kind": self.kind, "apiVersion": self.api_version,
                        "metadata": {"resourceVersion": str(now_version)}}})
                    pos = max(pos, now_version)
        except OSError:
            return  # the client went away
        finally:
            try:
                handler.wfile.write(b"0\r\n\r\n")
                handler.wfile.flush()
            except OSError:
                pass

    @staticmethod
    def _send(handler: BaseHTTPRequestHandler, event: Json) -> None:
        data = json.dumps(event).encode() + b"\n"
        handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        handler.wfile.flush()


def _gone(version: int) -> Json:
    return {"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired", "code": 410,
        "message": f"too old resource version: {version}"}}
