"""What the contract suites need on a real API server that a bare one (no controller manager) lacks."""

from __future__ import annotations

from typing import Any

from kubernetes import client


def create_namespace(core: client.CoreV1Api, name: str) -> None:
    """A namespace and its ``default`` ServiceAccount, as the serviceaccount controller makes it.

    Without that account the ServiceAccount admission plugin refuses every pod in the namespace (403 ``error
    looking up service account``); on a cluster whose controller got there first the create answers 409.
    """
    core.create_namespace({"metadata": {"name": name}})
    account: dict[str, Any] = {"metadata": {"name": "default"}}
    try:
        core.create_namespaced_service_account(name, account)
    except client.ApiException as exc:
        if exc.status != 409:
            raise
