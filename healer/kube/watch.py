"""PodInformer: every pod kept current from one list and a watch, for ``KubePodScheduling.changes``.

client-go's reflector, reduced to what the gang scheduler needs: list all pods once and remember
the list's ``resourceVersion``, then watch from it in a background thread (``allowWatchBookmarks``
so an idle stream still moves the version on) and record each ADDED / MODIFIED / DELETED in a
change log that ``drain`` hands over. A stream that ends or breaks is watched again from the last
version seen, which loses nothing; an expired version (410 Gone, as an HTTP status or an ERROR
event) means events were lost, so the pods are listed again and the next drain is a full one.

Events are read raw (``_preload_content=False``) and parsed as JSON lines, as the lists are:
building client models for every pod event would cost more than the rest of the cycle.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from healer.gang.port import PodKey
from healer.gang.records import PodRecord

log = logging.getLogger(__name__)

Json = dict[str, Any]


class _Expired(Exception):
    """The watch's resourceVersion is gone from the server's history (410)."""


@dataclass(frozen=True, slots=True)
class Drained:
    """What the informer saw since the previous drain."""

    full: bool
    """The pods were listed again (first list or an expired watch): ``pods`` is every pod."""
    pods: tuple[PodRecord, ...]
    """Pods added or changed, latest state; every unfinished pod when ``full``."""
    gone: tuple[PodKey, ...]
    """Pods deleted or finished and not recreated (empty when ``full``)."""


class PodInformer:
    """All unfinished pods of the cluster, kept current by a watch running in its own thread.

    ``start`` lists synchronously (raising the client's errors), so the first drain is complete;
    ``stop`` ends the thread within ``read_timeout_s``. Between the two the thread never gives up:
    errors are logged and the watch (or the list) is tried again after ``retry_s``.
    """

    def __init__(self, core: client.CoreV1Api, record: Callable[[Json], PodRecord], *, page_size: int = 1000,
                 timeout_s: float = 30.0, watch_timeout_s: int = 300, read_timeout_s: float = 10.0,
                 retry_s: float = 1.0, on_change: Callable[[PodRecord], None] | None = None) -> None:
        self.core = core
        self.record = record
        self.on_change = on_change
        """Called from the watch thread with each pod added or changed (not deleted), after it is recorded."""
        self.page_size = page_size
        self.timeout_s = timeout_s
        self.watch_timeout_s = watch_timeout_s
        """Server-side length of one watch request; the stream is then opened again."""
        self.read_timeout_s = read_timeout_s
        """Longest wait for a byte on the stream; bounds how long ``stop`` takes."""
        self.retry_s = retry_s
        self.lists = 0
        """Pod lists made (1 after ``start``; one more per expired watch)."""
        self.watches = 0
        """Watch requests made."""
        self.resource_version = ""
        """The version the next watch starts from (the list's, then each event's or bookmark's)."""
        self._store: dict[PodKey, PodRecord] = {}
        self._log: dict[PodKey, PodRecord | None] = {}
        self._full = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stream: Any = None

    # Lifecycle.

    def start(self) -> None:
        """List every pod, then watch from the list's version in a daemon thread."""
        self._list()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kmend-pod-informer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the watch thread and wait for it."""
        self._stop.set()
        stream = self._stream
        if stream is not None:
            # Wakes a read blocked on an idle stream at once instead of after the read timeout.
            with contextlib.suppress(Exception):
                stream.shutdown()
        if self._thread is not None:
            self._thread.join(self.read_timeout_s + self.timeout_s)
            self._thread = None

    @property
    def running(self) -> bool:
        """Whether the watch thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    # Reading.

    def drain(self, *, everything: bool = False) -> Drained:
        """Changes since the previous drain (every pod after a list, or when asked), and clear them."""
        with self._lock:
            if self._full or everything:
                out = Drained(True, tuple(self._store.values()), ())
            else:
                out = Drained(False, tuple(p for p in self._log.values() if p is not None),
                              tuple(k for k, p in self._log.items() if p is None))
            self._full = False
            self._log.clear()
            return out

    # The thread.

    def _run(self) -> None:
        relist = False
        while not self._stop.is_set():
            try:
                if relist:
                    self._list()
                    relist = False
                self._watch()
            except _Expired:
                log.info("pod watch expired at resourceVersion %s: listing again", self.resource_version)
                relist = True
            except (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
                if self._stop.is_set():
                    return
                if isinstance(exc, ApiException) and exc.status == 410:
                    relist = True
                    continue
                if not isinstance(exc, urllib3.exceptions.ReadTimeoutError):
                    # A broken stream is watched again from the last version; the server says 410 if that is gone.
                    log.warning("pod watch failed, retrying in %.1fs: %s", self.retry_s, exc)
                    self._stop.wait(self.retry_s)

    def _list(self) -> None:
        pods: dict[PodKey, PodRecord] = {}
        token: str | None = None
        version = ""
        while True:
            resp: Any = self.core.list_pod_for_all_namespaces(limit=self.page_size, _continue=token,
                                                         _preload_content=False, _request_timeout=self.timeout_s)
            body = json.loads(resp.data)
            meta = body.get("metadata") or {}
            # Every page of a paged list is one snapshot: the first page's version is the list's.
            version = version or meta.get("resourceVersion") or ""
            for obj in body.get("items") or ():
                pod = self.record(obj)
                if not pod.finished:
                    pods[(pod.namespace, pod.name)] = pod
            token = meta.get("continue")
            if not token:
                break
        with self._lock:
            self._store = pods
            self._log.clear()
            self._full = True
            self.resource_version = version
            self.lists += 1

    def _watch(self) -> None:
        self.watches += 1
        resp: Any = self.core.list_pod_for_all_namespaces(
            watch=True, resource_version=self.resource_version, allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout_s, _preload_content=False,
            _request_timeout=(self.timeout_s, self.read_timeout_s))
        self._stream = resp
        try:
            for event in events(resp):
                if self._stop.is_set():
                    return
                self._apply(event)
        finally:
            self._stream = None
            resp.release_conn()

    def _apply(self, event: Json) -> None:
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Expired(obj.get("message") or "resource version expired")
            raise ValueError(f"watch error: {obj.get('message') or obj}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            pod = self.record(obj)
            key = (pod.namespace, pod.name)
            with self._lock:
                if kind == "DELETED" or pod.finished:
                    self._store.pop(key, None)
                    self._log[key] = None
                else:
                    self._store[key] = pod
                    self._log[key] = pod
            if kind != "DELETED" and not pod.finished and self.on_change is not None:
                self.on_change(pod)
        if version:
            self.resource_version = version


def events(resp: Any) -> Iterator[Json]:
    """The JSON objects of a watch stream, one per line, as the chunks arrive."""
    buffer = b""
    for chunk in resp.stream(amt=None, decode_content=False):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
    if buffer.strip():
        yield json.loads(buffer)
