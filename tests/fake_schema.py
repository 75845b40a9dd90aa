"""Field validation of what clients write against the Kubernetes OpenAPI schema, as ``fieldValidation=Strict``.

The schema is kubernetes-validate's copy of the upstream OpenAPI (v1.36, the version kmend is checked
against). Whole objects (creates, replaces, subresource bodies such as Binding and Eviction) are checked
completely; a patch body is checked as the partial object it is: every field it names must exist and have
the right type, but required fields may be left out (the stored object has them) and ``null`` (remove this
key) and strategic-merge directives (``$patch``, ``$setElementOrder/...``) are allowed. The fake API server
turns a ``Problem`` into the answer the real server gives for the request's ``fieldValidation`` mode.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
import referencing
from kubernetes_validate import utils

SCHEMA_VERSION = "1.36.0"


@functools.lru_cache(maxsize=64)
def _validator(kind: str, api_version: str) -> jsonschema.protocols.Validator:
    """The strict schema of one kind, loaded once (loading it costs milliseconds, requests are many)."""
    version = [v for v in utils.all_versions() if utils.major_minor(v) <= utils.major_minor(SCHEMA_VERSION)][-1]
    directory = f"v{version}-local-strict"
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = utils.schema_contents(f"kubernetes-json-schema/{directory}/{kind.lower()}-{group_version}.json",
                                   SCHEMA_VERSION)
    definitions = utils.schema_contents(f"kubernetes-json-schema/{directory}/_definitions.json", SCHEMA_VERSION)
    registry: referencing.Registry[Any] = (referencing.Resource.from_contents(definitions)
                                           @ (referencing.Resource.from_contents(schema) @ referencing.Registry()))
    validator: jsonschema.protocols.Validator = jsonschema.validators.Draft202012Validator(schema,
                                                                                           registry=registry)
    return validator


def known(kind: str, api_version: str) -> bool:
    """Whether the schema has ``kind`` (custom resources are checked against their CRDs instead)."""
    try:
        _validator(kind, api_version)
    except FileNotFoundError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Problem:
    """What field validation found wrong with a body."""

    unknown: bool
    """An unknown field (refused only with ``fieldValidation=Strict``; a warning otherwise), else a wrong value."""
    path: str
    """The field's path as the API server writes it (``spec.taints[0].reason``)."""
    message: str
    """What is wrong with a wrong value (empty for an unknown field)."""


def problem(kind: str, api_version: str, body: Any, *, patch: bool = False) -> Problem | None:
    """None if ``body`` (a whole ``kind``, or a merge/strategic-merge patch of one) passes field validation.

    Kinds the schema does not have (custom resources, checked against their CRDs instead) always pass.
    """
    if not isinstance(body, dict):
        return Problem(False, "", f"the body of a {kind} must be a JSON object")
    if not known(kind, api_version):
        return None
    obj = {**(_patch_fields(body) if patch else body), "kind": body.get("kind") or kind,
           "apiVersion": body.get("apiVersion") or api_version}
    errors = [e for e in _validator(kind, api_version).iter_errors(obj) if not (patch and e.validator == "required")]
    if not errors:
        return None
    error = sorted(errors, key=lambda e: e.validator != "additionalProperties")[0]  # decoding meets these first
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")
    if error.validator == "additionalProperties":
        known_fields = set(error.schema.get("properties", {}))
        unknown = sorted(set(error.instance) - known_fields) if isinstance(error.instance, dict) else []
        return Problem(True, ".".join(filter(None, [path, unknown[0] if unknown else ""])), "")
    return Problem(False, path, error.message)


def _patch_fields(value: Any) -> Any:
    """The patch without what only a patch may say: ``null`` (remove) and ``$``-directives."""
    if isinstance(value, dict):
        return {k: _patch_fields(v) for k, v in value.items() if v is not None and not k.startswith("$")}
    if isinstance(value, list):
        return [_patch_fields(v) for v in value if not (isinstance(v, dict) and "$patch" in v)]
    return value


_KINDS = {"nodes": "Node", "pods": "Pod", "configmaps": "ConfigMap", "events": "Event", "namespaces": "Namespace",
          "jobs": "Job", "leases": "Lease", "poddisruptionbudgets": "PodDisruptionBudget", "binding": "Binding",
          "eviction": "Eviction"}
"""Built-in resources (and subresources with a body kind of their own) whose writes are field-validated."""

_PATH = re.compile(r"/api/(v1)/(?:namespaces/[^/]+/)?([^/]+)(?:/[^/]+(?:/([^/]+))?)?"
                   r"|/apis/([^/]+/[^/]+)/(?:namespaces/[^/]+/)?([^/]+)(?:/[^/]+(?:/([^/]+))?)?")


def checked_write(method: str, path: str, ctype: str) -> tuple[str, str, bool] | None:
    """(kind, apiVersion, is a patch) of a write whose fields the API server validates against the schema."""
    if method not in ("POST", "PUT", "PATCH") or "json-patch" in ctype:
        return None
    m = _PATH.fullmatch(path)
    if m is None:
        return None
    group_version, plural, sub = (m.group(1), m.group(2), m.group(3)) if m.group(1) else m.group(4, 5, 6)
    if sub in ("binding", "eviction"):
        return _KINDS[sub], "policy/v1" if sub == "eviction" else "v1", False
    if plural in _KINDS and sub in (None, "status"):
        return _KINDS[plural], group_version, method == "PATCH"
    return None


_CUSTOM = re.compile(r"/apis/([^/]+\.[^/]+)/[^/]+/namespaces/[^/]+/[^/]+(?:/[^/]+(?:/status)?)?")


def custom_write(method: str, path: str) -> bool:
    """Whether this is a write of a custom resource (a group of its own, not one of Kubernetes' ``*.k8s.io``)."""
    m = _CUSTOM.fullmatch(path) if method in ("POST", "PUT", "PATCH") else None
    return m is not None and not m.group(1).endswith(".k8s.io")


def field_check(method: str, path: str, body: Any, ctype: str,
                query: dict[str, str]) -> tuple[tuple[int, dict[str, Any]] | None, str | None]:
    """The refusal (status code and Status body) or the ``Warning`` a real API server answers to a write.

    As kube-apiserver does: a field of the wrong type is refused whatever the mode (400 on a create, 422 on a
    patch); an unknown field is refused with ``fieldValidation=Strict`` (400 on a create, 422 on a patch), and
    otherwise (``Warn``, the default) the write goes through with a ``299`` warning and the field dropped
    (``Ignore``: silently). Creates and replaces are checked as whole objects, Binding and Eviction bodies as
    their own kinds, merge and strategic-merge patches (of the object or its ``status``) as partial objects.
    Unknown fields that are let through are removed from ``body`` in place, as the server drops them.
    """
    target = checked_write(method, path, ctype)
    if target is None:
        return None, None
    kind, group_version, patch = target
    found = problem(kind, group_version, body, patch=patch)
    if found is None:
        return None, None
    mode = query.get("fieldValidation", "Warn")
    if found.unknown and mode != "Strict":
        _drop_unknown(kind, group_version, body, patch)
        if (rest := problem(kind, group_version, body, patch=patch)) is not None:
            return _answer(kind, group_version, body, patch, rest), None
        return None, (f'unknown field "{found.path}"' if mode == "Warn" else None)
    return _answer(kind, group_version, body, patch, found), None


def _drop_unknown(kind: str, api_version: str, body: dict[str, Any], patch: bool) -> None:
    obj = {**(_patch_fields(body) if patch else body), "kind": kind, "apiVersion": api_version}
    for error in list(_validator(kind, api_version).iter_errors(obj)):
        if error.validator != "additionalProperties" or not isinstance(error.instance, dict):
            continue
        at: Any = body
        for step in error.absolute_path:
            present = (isinstance(at, dict) and step in at) or (isinstance(at, list) and step < len(at))
            at = at[step] if present else None
        if isinstance(at, dict):
            for key in set(error.instance) - set(error.schema.get("properties", {})):
                at.pop(key, None)


def _answer(kind: str, group_version: str, body: Any, patch: bool, found: Problem) -> tuple[int, dict[str, Any]]:
    what = f'strict decoding error: unknown field "{found.path}"' if found.unknown else \
        f"{found.path}: Invalid value: {found.message}"
    version = group_version.rpartition("/")[2]
    if patch:
        code, reason = 422, "Invalid"
        message = f'{kind} "" is invalid: patch: Invalid value: {json.dumps(body)}: {what}'
    else:
        code, reason = 400, "BadRequest"
        message = f'{kind} in version "{version}" cannot be handled as a {kind}: {what}'
    return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message,
                  "code": code}
