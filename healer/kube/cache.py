"""ListWatchCache: the objects of one kind kept current from one list and a watch (client-go's reflector and store).

The healer and the gang scheduler read nodes (and PodGroups) every round; listing them each time costs a request
and the parsing of every object, and grows with the fleet. The cache lists once, remembers the list's
``resourceVersion`` and watches from it in a daemon thread (``allowWatchBookmarks``, so that an idle stream still moves
the version on). A stream that ends is watched again from the last version seen, which loses nothing; an expired
version (410 Gone, as a status or an ERROR event) means events were lost, so the kind is listed again. A kind the
server does not serve (404: a CRD not installed) reads as empty and is listed again every ``absent_retry_s``.

Reads are as fresh as the watch: a write kmend made a moment ago may show a moment later. Callers that must see
their own write (the healer's check that a node is still cordoned) read the object itself, not the cache.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import urllib3
from kubernetes.client.exceptions import ApiException

from healer.kube.rest import retry_after, server_down
from healer.reach import CAP_S, Backoff, Repeats

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
Json = dict[str, Any]
Key = tuple[str, str]
"""(namespace, name); the namespace is empty for a cluster-scoped kind."""


class _Expired(Exception):
    """The watch's resourceVersion is gone from the server's history (410)."""


class ListWatchCache(Generic[T]):
    """Every object of one kind, converted by ``convert``, kept current by a watch in its own thread.

    ``list_fn(*args, **query)`` is the client's list call for the kind (``CoreV1Api.list_node``,
    ``CustomObjectsApi.list_cluster_custom_object`` with its group, version and plural as ``args``); it is called
    with ``watch=True`` for the stream. ``start`` lists synchronously (raising the client's errors, except 404), so
    the first read is complete; ``stop`` ends the thread within ``read_timeout_s``. An object that ``convert`` turns
    into None is not kept (a finished pod): it reads as gone.

    ``on_listed`` and ``on_applied`` are told, under the cache's lock, of each list that replaced the store and of
    each object added, changed or gone (None) as it is applied: a reader that keeps its own log of changes (the pod
    informer) stays consistent with the store when it reads both under that lock (``read``).
    """

    def __init__(self, name: str, list_fn: Callable[..., Any], convert: Callable[[Json], T | None], *,
                 args: tuple[Any, ...] = (), page_size: int = 1000, timeout_s: float = 30.0,
                 watch_timeout_s: int = 300, read_timeout_s: float = 10.0, retry_s: float = 1.0,
                 absent_retry_s: float = 10.0, on_change: Callable[[], None] | None = None,
                 on_object: Callable[[T], None] | None = None,
                 on_listed: Callable[[Mapping[Key, T]], None] | None = None,
                 on_applied: Callable[[Key, T | None], None] | None = None) -> None:
        self.name = name
        self.list_fn = list_fn
        self.args = args
        self.convert = convert
        self.page_size = page_size
        self.timeout_s = timeout_s
        self.watch_timeout_s = watch_timeout_s
        """Server-side length of one watch request; the stream is then opened again."""
        self.read_timeout_s = read_timeout_s
        """Longest wait for a byte on the stream; bounds how long ``stop`` takes."""
        self.retry_s = retry_s
        """The first wait after a failed list or watch (doubled while failures go on)."""
        self.absent_retry_s = absent_retry_s
        """How often a kind the server does not serve (404) is listed again."""
        self.on_change = on_change
        """Called from the watch thread after each change is applied."""
        self.on_object = on_object
        """Called from the watch thread with each object added or changed (and kept), after it is applied."""
        self.on_listed = on_listed
        self.on_applied = on_applied
        self.lists = 0
        """Lists made (1 after ``start``; one more per expired watch)."""
        self.watches = 0
        """Watch requests made."""
        self.resource_version = ""
        """The version the next watch starts from (the list's, then each event's or bookmark's)."""
        self.absent = False
        """The server answered 404 for the kind: it reads as empty."""
        self._watching = False
        """The last list or watch request succeeded and no error came since: reads are as fresh as the stream."""
        self._store: dict[Key, T] = {}
        self._versions: dict[Key, str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stream: Any = None
        self._backoff = Backoff(first_s=retry_s, cap_s=max(CAP_S, retry_s))
        """The wait after a failed list or watch: ``retry_s``, doubling while failures go on, up to ``CAP_S``."""
        self._repeats = Repeats()

    def start(self) -> None:
        """List every object, then watch from the list's version in a daemon thread."""
        self._list()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"kmend-{self.name}-cache", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the watch thread and wait for it."""
        self._stop.set()
        stream = self._stream
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.shutdown()  # wakes a read blocked on an idle stream at once
        if self._thread is not None:
            self._thread.join(self.read_timeout_s + self.timeout_s)
            self._thread = None

    @property
    def running(self) -> bool:
        """Whether the watch thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def synced(self) -> bool:
        """Listed, and the watch is running without an error since: what the cache holds is the server's state
        as of a moment ago (a list answers instead while this is false)."""
        return self.running and self.lists > 0 and self._watching and not self._stop.is_set()

    def read(self, fn: Callable[[Mapping[Key, T]], R]) -> R:
        """``fn`` of the store, under the lock that ``on_listed`` and ``on_applied`` run under."""
        with self._lock:
            return fn(self._store)

    def items(self) -> list[T]:
        """Every object as last seen, in no particular order."""
        with self._lock:
            return list(self._store.values())

    def get(self, namespace: str, name: str) -> tuple[T, str] | None:
        """One object as last seen and its ``resourceVersion`` (for a write preconditioned on it), or None."""
        with self._lock:
            key = (namespace, name)
            found = self._store.get(key)
            return None if found is None else (found, self._versions.get(key, ""))

    # The thread.

    def _run(self) -> None:
        relist = False
        while not self._stop.is_set():
            try:
                if self.absent:
                    if self._stop.wait(self.absent_retry_s):
                        return
                    relist = True
                if relist:
                    self._list()
                    relist = False
                    if self.absent:
                        continue
                self._watch()
            except _Expired:
                self._watching = False
                log.info("%s watch expired at resourceVersion %s: listing again", self.name, self.resource_version)
                relist = True
            except (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
                if self._stop.is_set():
                    return
                if not isinstance(exc, urllib3.exceptions.ReadTimeoutError):
                    self._watching = False
                if isinstance(exc, ApiException) and exc.status == 410:
                    relist = True
                    continue
                if not isinstance(exc, urllib3.exceptions.ReadTimeoutError):
                    # Waits grow while the server stays away (its outage is logged once, by the client's requests);
                    # an error of the request itself (a 403) is said once while it repeats, and retried all the same.
                    asked = retry_after(exc) if isinstance(exc, ApiException) else 0.0
                    wait = self._backoff.next(asked)
                    if not server_down(exc) and self._repeats.new(exc):
                        log.warning("%s watch failed, retrying: %s", self.name, exc)
                    log.debug("%s watch failed, retrying in %.1fs: %s", self.name, wait, exc)
                    self._stop.wait(wait)
                    relist = relist or self.absent

    def _list(self) -> None:
        found: dict[Key, T] = {}
        versions: dict[Key, str] = {}
        token: str | None = None
        version = ""
        try:
            while True:
                resp: Any = self.list_fn(*self.args, limit=self.page_size, _continue=token, _preload_content=False,
                                         _request_timeout=self.timeout_s)
                body = json.loads(resp.data)
                meta = body.get("metadata") or {}
                # Every page of a paged list is one snapshot: the first page's version is the list's.
                version = version or meta.get("resourceVersion") or ""
                for obj in body.get("items") or ():
                    converted = self.convert(obj)
                    if converted is not None:
                        found[_key(obj)] = converted
                        versions[_key(obj)] = (obj.get("metadata") or {}).get("resourceVersion") or ""
                token = meta.get("continue")
                if not token:
                    break
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.absent = True
            found, versions, version = {}, {}, ""
        else:
            self.absent = False
        with self._lock:
            self._store = found
            self._versions = versions
            self.resource_version = version
            self.lists += 1
            if self.on_listed is not None:
                self.on_listed(found)
        self._watching = True
        if self.on_change is not None:
            self.on_change()

    def _watch(self) -> None:
        self.watches += 1
        resp: Any = self.list_fn(*self.args, watch=True, resource_version=self.resource_version,
                                 allow_watch_bookmarks=True, timeout_seconds=self.watch_timeout_s,
                                 _preload_content=False, _request_timeout=(self.timeout_s, self.read_timeout_s))
        self._stream = resp
        self._watching = True
        self._backoff.reset()
        self._repeats.cleared()
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
            key = _key(obj)
            converted = None if kind == "DELETED" else self.convert(obj)
            with self._lock:
                if converted is None:
                    self._store.pop(key, None)
                    self._versions.pop(key, None)
                else:
                    self._store[key] = converted
                    self._versions[key] = version or ""
                if self.on_applied is not None:
                    self.on_applied(key, converted)
            if converted is not None and self.on_object is not None:
                self.on_object(converted)
            if self.on_change is not None:
                self.on_change()
        if version:
            self.resource_version = version


def _key(obj: Json) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


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
