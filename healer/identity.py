"""Who is calling the API: the TokenReview port (Kubernetes authenticates bearer tokens for us)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Identity:
    """An authenticated caller, as the API server named it."""

    username: str
    """``system:serviceaccount:<namespace>:<name>`` for a ServiceAccount token."""
    groups: frozenset[str] = frozenset()
    """Its groups (``system:serviceaccounts:<namespace>``, ...)."""


class TokenReviewer(Protocol):
    """Asks the cluster whether a bearer token is valid.

    Guarantees: returns the Identity for a valid token and None for one the API server
    does not accept; raises only when the API server cannot be asked (the caller answers 503).
    """

    def review(self, token: str) -> Identity | None:
        """The identity behind `token`, or None when it is not a valid token."""
        ...


class StaticTokenReviewer:
    """A reviewer over a fixed token -> identity table (tests, and clusters without TokenReview)."""

    def __init__(self, tokens: dict[str, Identity]) -> None:
        self.tokens = dict(tokens)
        self.calls = 0

    def review(self, token: str) -> Identity | None:
        """See TokenReviewer."""
        self.calls += 1
        return self.tokens.get(token)
