"""TokenReviewer on the official client: ``POST /apis/authentication.k8s.io/v1/tokenreviews``.

The service's ServiceAccount needs ``create`` on ``tokenreviews`` (the built-in ClusterRole
``system:auth-delegator`` grants it; deploy/service/kmend.yaml binds it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kubernetes import client, config

from healer.identity import Identity
from healer.kube.cluster import call_api


class KubeTokenReviewer:
    """Reviews bearer tokens through the API server."""

    def __init__(self, api: client.ApiClient, *, audiences: Sequence[str] = (), timeout: float = 5.0) -> None:
        self.auth = client.AuthenticationV1Api(api)
        self.audiences = list(audiences)
        self.timeout = timeout

    @classmethod
    def from_config(cls, kubeconfig: str | None = None, *, in_cluster: bool = False,
                    **kwargs: Any) -> KubeTokenReviewer:
        """Build from a kubeconfig file or the in-cluster service account."""
        if in_cluster:
            config.load_incluster_config()  # type: ignore[no-untyped-call]
            return cls(client.ApiClient(), **kwargs)
        cfg = client.Configuration()
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)  # type: ignore[no-untyped-call]
        return cls(client.ApiClient(cfg), **kwargs)

    def review(self, token: str) -> Identity | None:
        """See TokenReviewer."""
        spec = client.V1TokenReviewSpec(token=token, audiences=self.audiences or None)
        body = client.V1TokenReview(api_version="authentication.k8s.io/v1", kind="TokenReview", spec=spec)
        got = call_api(self.auth.create_token_review, body, _request_timeout=self.timeout)
        status = got.status
        if status is None or not status.authenticated or status.user is None:
            return None
        return Identity(username=status.user.username or "", groups=frozenset(status.user.groups or ()))
