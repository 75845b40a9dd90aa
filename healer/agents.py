"""Which node agents are alive and what they can do, as their polls of the request queue show.

A step that needs the node agent (a GPU reset, a checkpoint search on a volume only that
node mounts) must not wait half an hour for an agent that is not there: it fails within
``grace_s`` with the reason, and the plan says so.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AgentSeen:
    """The last poll of one node's agent."""

    at: float
    """When it polled (service clock)."""
    capabilities: frozenset[str]
    """Request kinds it carries out (``reset_gpu``, ``find_checkpoint``)."""


class NodeAgents:
    """Thread-safe map node → last poll. In memory: agents poll every few seconds, so a new
    leader knows them again within one interval (``grace_s`` covers that)."""

    def __init__(self, *, stale_s: float = 120.0, grace_s: float = 60.0) -> None:
        self.stale_s = stale_s
        self.grace_s = grace_s
        self._seen: dict[str, AgentSeen] = {}
        self._since: float | None = None
        self._lock = threading.Lock()

    def seen(self, node: str, capabilities: frozenset[str], now: float) -> None:
        """An agent polled for its node's requests."""
        with self._lock:
            self._seen[node] = AgentSeen(now, capabilities)

    def get(self, node: str) -> AgentSeen | None:
        """The last poll from the node's agent."""
        with self._lock:
            return self._seen.get(node)

    def unable(self, node: str, kind: str, *, now: float, waiting_since: float) -> str:
        """Why no agent will carry out ``kind`` on ``node`` (empty: one will, or it is too early to say)."""
        with self._lock:
            if self._since is None:
                self._since = now
            since = self._since
            seen = self._seen.get(node)
        if now - max(waiting_since, since) < self.grace_s:
            return ""
        if seen is None:
            return (f"no kmend agent on {node} has polled for requests in {now - max(waiting_since, since):.0f} s; "
                    f"nothing can carry out {kind} there")
        if now - seen.at > self.stale_s:
            return f"the kmend agent on {node} last polled {now - seen.at:.0f} s ago; {kind} cannot run there"
        if kind not in seen.capabilities:
            can = ", ".join(sorted(seen.capabilities)) or "nothing"
            return f"the kmend agent on {node} does not carry out {kind} (it can: {can})"
        return ""
