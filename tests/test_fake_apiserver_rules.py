"""The loopback API server refuses what a real one refuses, one test per rule of KUBERNETES-API.md.

Each test drives the fake through the official client, as kmend does, so a rule kmend depends on
cannot silently pass here and fail on a real cluster.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.fake_apiserver import FakeApiServer


@pytest.fixture
def core() -> Iterator[tuple[FakeApiServer, client.CoreV1Api]]:
    with FakeApiServer() as server:
        server.add_node("gpu-1")
        yield server, client.CoreV1Api(client.ApiClient(client.Configuration(host=server.url)))


def _node_event(namespace: str, involved_namespace: str | None = None) -> client.CoreV1Event:
    return client.CoreV1Event(
        metadata=client.V1ObjectMeta(generate_name="gpu-1.", namespace=namespace),
        involved_object=client.V1ObjectReference(kind="Node", name="gpu-1", api_version="v1",
                                                 namespace=involved_namespace),
        reason="Test", message="m", type="Normal")


def test_event_about_a_node_outside_default_is_422_naming_the_field(
        core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, api = core
    with pytest.raises(ApiException) as err:
        api.create_namespaced_event("kmend-system", _node_event("kmend-system"))
    assert err.value.status == 422
    message = json.loads(err.value.body)["message"]
    assert 'involvedObject.namespace: Invalid value: "": does not match event.namespace' in message
    assert server.events == []


def test_event_about_a_node_in_default_is_accepted(core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    server, api = core
    api.create_namespaced_event("default", _node_event("default"))
    [ev] = server.events
    assert ev["metadata"]["namespace"] == "default" and not ev["involvedObject"].get("namespace")


def test_event_about_a_namespaced_object_lives_in_its_namespace(
        core: tuple[FakeApiServer, client.CoreV1Api]) -> None:
    _, api = core
    with pytest.raises(ApiException) as err:
        api.create_namespaced_event("default", _node_event("default", involved_namespace="team-a"))
    assert err.value.status == 422
    assert '"team-a": does not match event.namespace' in json.loads(err.value.body)["message"]
    api.create_namespaced_event("team-a", _node_event("team-a", involved_namespace="team-a"))
