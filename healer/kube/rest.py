"""Rest: plain-dict requests through the official client's transport, without its generated API classes and models.

The client's ``CoreV1Api`` module alone takes a third of a second to import, and each call of a generated method is
checked by pydantic (whose validators are built on the first call); the gang scheduler's list, watch and bind need
neither. This adapter keeps what the client does well — the kubeconfig's TLS, client certificates, tokens (refreshed
through the configuration's hook, as exec plugins and in-cluster token rotation need) and its pooled urllib3
connections — and sends the request itself: a path, a query, a JSON body. Errors are the client's ``ApiException``
(built from the response, as the generated methods raise it), so callers map them as before.

``lister`` gives a callable with the generated list methods' keywords (``limit``, ``_continue``, ``watch``,
``resource_version``, ...) for ``ListWatchCache``.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote, urlencode

import urllib3
from kubernetes.client.api_client import ApiClient
from kubernetes.client.exceptions import ApiException

from healer.reach import Reachability

Json = dict[str, Any]
Timeout = float | tuple[float, float] | None

MERGE_PATCH = "application/merge-patch+json"
"""JSON merge patch: what custom resources accept (they have no strategic-merge schema)."""
STRATEGIC_PATCH = "application/strategic-merge-patch+json"
"""Strategic merge patch of a built-in object."""

_QUERY_NAMES = {"_continue": "continue", "field_selector": "fieldSelector", "label_selector": "labelSelector",
                "resource_version": "resourceVersion", "allow_watch_bookmarks": "allowWatchBookmarks",
                "timeout_seconds": "timeoutSeconds", "field_validation": "fieldValidation", "limit": "limit",
                "watch": "watch"}
"""The generated methods' keyword → the API's query parameter."""


def server_down(exc: BaseException) -> bool:
    """The call failed for the server's availability: no answer (refused, reset, timed out, cut short) or a
    5xx/429 answer. A loop backs off on these; anything else (403, 404, 409, 422) is the request's own fault."""
    if isinstance(exc, ApiException):
        # An eviction a PodDisruptionBudget holds back is a 429 too: the answer to that request, not the server's.
        return ((exc.status or 0) == 429 and "DisruptionBudget" not in (exc.body or "")) or (exc.status or 0) >= 500
    return isinstance(exc, urllib3.exceptions.HTTPError | socket.timeout | ConnectionError | TimeoutError)


def retry_after(exc: ApiException) -> float:
    """The seconds a ``Retry-After`` header of the answer asks for (a 429 or 503 has one); 0 without one."""
    for key, value in (exc.headers or {}).items():
        if key.lower() == "retry-after":
            with contextlib.suppress(ValueError):
                return max(0.0, float(value))
    return 0.0


def reachability(api: ApiClient) -> Reachability:
    """The one ``Reachability`` of the server ``api`` talks to, shared by every adapter built on that client: an
    outage is said once, whichever loop meets it first."""
    found = getattr(api, "kmend_reachability", None)
    if not isinstance(found, Reachability):
        found = Reachability(api.configuration.host)
        setattr(api, "kmend_reachability", found)  # noqa: B010 - kept with the client it describes
    return found


NODES = "/api/v1/nodes"
"""Nodes, cluster-scoped."""


def path(*parts: str) -> str:
    """A URL path from its segments, each quoted (a name never reaches into the next segment)."""
    return "/" + "/".join(quote(p, safe="") for p in parts)


def _query_value(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


class Rest:
    """Requests to the API server an ``ApiClient`` is configured for."""

    def __init__(self, api: ApiClient) -> None:
        self.api = api
        self.host = api.configuration.host.rstrip("/")
        self.reach = reachability(api)
        """Told of every answer and of every call the server's availability failed."""

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json", **self.api.default_headers}
        if content_type:
            headers["Content-Type"] = content_type
        for auth in self.api.configuration.auth_settings().values():  # refreshes an expiring token first
            if auth["in"] == "header" and auth["value"]:
                headers[auth["key"]] = auth["value"]
        return headers

    def send(self, method: str, url_path: str, *, query: Mapping[str, Any] | None = None, body: Any = None,
             content_type: str | None = None, timeout: Timeout = None) -> urllib3.BaseHTTPResponse:
        """The response, its body not read (``.data`` reads it and frees the connection; ``.stream`` for a watch).

        A status other than 2xx raises ``ApiException`` with the server's body, as the generated methods do.
        """
        url = self.host + url_path
        if query:
            url += "?" + urlencode({k: _query_value(v) for k, v in query.items() if v is not None})
        if body is not None and content_type is None:
            content_type = "application/json"
        try:
            resp = self.api.rest_client.request(  # type: ignore[no-untyped-call]
                method, url, headers=self._headers(content_type), body=body, _request_timeout=timeout)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            if server_down(exc):
                self.reach.failed(getattr(exc, "reason", None) or exc)  # urllib3's last error, not its retry count
            raise
        if not 200 <= resp.status <= 299:
            resp.read()
            refused = ApiException.from_response(http_resp=resp, body=resp.data.decode("utf-8", "replace"), data=None)
            if server_down(refused):
                self.reach.failed(f"{refused.status} {refused.reason}: {resp.data.decode('utf-8', 'replace')[:200]}")
            else:
                self.reach.answered()
            raise refused
        self.reach.answered()
        raw: urllib3.BaseHTTPResponse = resp.response
        return raw

    def call(self, method: str, url_path: str, **kw: Any) -> bytes:
        """The whole body of the answer (read to the end: the connection goes back to the pool)."""
        return bytes(self.send(method, url_path, **kw).data)

    def lister(self, url_path: str) -> Callable[..., urllib3.BaseHTTPResponse]:
        """A list (or, with ``watch=True``, watch) call with the generated methods' keywords, for ``ListWatchCache``."""

        def list_fn(*args: str, _request_timeout: Timeout = None, _preload_content: bool = False,
                    **kw: Any) -> urllib3.BaseHTTPResponse:
            where = url_path.format(*args) if args else url_path
            return self.send("GET", where, query={_QUERY_NAMES[k]: v for k, v in kw.items()},
                             timeout=_request_timeout)

        return list_fn
