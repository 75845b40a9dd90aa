"""The API server's own validation of what kmend writes, beyond the schema's field names and types.

Each rule and message is what kube-apiserver answered (seen on servers built from the Kubernetes tree, v1.24
and v1.36, with etcd on loopback; the wording is v1.36's): label values and annotation keys, taints (value,
effect, unique by key and effect), object names (lowercase RFC 1123 subdomains; a Job's at most 63
characters, as its pods carry it in a label), ConfigMap keys, a Job's pod template ``restartPolicy``, a
Lease's duration, and the name a Binding or Eviction body gives against the pod in the URL. Event names are
not checked (the server takes any). A strategic-merge patch of a custom resource is refused whole (415):
only JSON, merge and apply patches apply to one.
"""

from __future__ import annotations

import re
from typing import Any

from tests import fake_schema

Reply = tuple[int, dict[str, Any]]

_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")
_LABEL_VALUE_HELP = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
                     "and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or "
                     "'12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")
_NAME_PART_HELP = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                   "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation "
                   "is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")
_SUBDOMAIN_HELP = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and "
                   "must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation "
                   "is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')")
_CONFIG_KEY_HELP = ("a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  "
                    "or 'KEY_NAME',  or 'key-name', regex used for validation is '[-._a-zA-Z0-9]+')")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_GROUPS = {"Job": "Job.batch", "Lease": "Lease.coordination.k8s.io"}


_PATCH_TYPES = "application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml"


def refusal(method: str, path: str, body: Any, ctype: str) -> Reply | None:
    """The API server's answer to a write its validation refuses; None when it passes."""
    if method == "PATCH" and "strategic-merge-patch" in ctype and fake_schema.custom_write(method, path):
        # A custom resource has no strategic-merge schema: the server refuses the patch type itself (v1.36).
        return _status(415, "UnsupportedMediaType", "the body of the request was in an unknown format - accepted "
                                                    f"media types include: {_PATCH_TYPES}")
    target = fake_schema.checked_write(method, path, ctype)
    if target is None or not isinstance(body, dict):
        return None
    kind, _, patch = target
    meta = body.get("metadata") or {}
    if kind in ("Binding", "Eviction"):
        in_url = path.rstrip("/").split("/")[-2]
        if meta.get("name") and meta["name"] != in_url:
            return _status(400, "BadRequest", f"name in URL does not match name in {kind} object")
        target_kind = (body.get("target") or {}).get("kind") or ""
        if kind == "Binding" and target_kind not in ("", "Node"):
            return _status(500, "InternalError",
                           f'target.kind: Unsupported value: "{target_kind}": supported values: "Node", "<empty>"')
        return None
    name = meta.get("name") or path.rstrip("/").split("/")[-1]
    problems = _meta_problems(kind, meta, patch) + _spec_problems(kind, body)
    if not problems:
        return None
    return _status(422, "Invalid", f'{_GROUPS.get(kind, kind)} "{name}" is invalid: {problems[0]}')


def _meta_problems(kind: str, meta: dict[str, Any], patch: bool) -> list[str]:
    out = []
    name = meta.get("name")
    if not patch and name and kind != "Event" and (len(name) > 253 or not _SUBDOMAIN.fullmatch(name)):
        out.append(f'metadata.name: Invalid value: "{name}": {_SUBDOMAIN_HELP}')
    for key, value in (meta.get("labels") or {}).items():
        out += _key_problems("metadata.labels", key)
        if value is not None:
            out += _label_value_problems("metadata.labels", value)
    for key in meta.get("annotations") or {}:
        out += _key_problems("metadata.annotations", key)
    return out


def _label_value_problems(field: str, value: str) -> list[str]:
    """Length first, then the characters: each its own error, as v1.36 words them."""
    out = [f'{field}: Invalid value: "{value}": must be no more than 63 bytes'] if len(value) > 63 else []
    if not _LABEL_VALUE.fullmatch(value):
        out.append(f'{field}: Invalid value: "{value}": {_LABEL_VALUE_HELP}')
    return out


def _key_problems(field: str, key: str) -> list[str]:
    prefix, _, name = key.rpartition("/")
    if len(name) > 63:
        return [f'{field}: Invalid value: "{key}": name part must be no more than 63 bytes']
    if not _NAME_PART.fullmatch(name):
        return [f'{field}: Invalid value: "{key}": {_NAME_PART_HELP}']
    if prefix and (len(prefix) > 253 or not _SUBDOMAIN.fullmatch(prefix)):
        return [f'{field}: Invalid value: "{key}": prefix part {_SUBDOMAIN_HELP}']
    return []


def _spec_problems(kind: str, body: dict[str, Any]) -> list[str]:
    spec = body.get("spec") or {}
    out = []
    if kind == "Node":
        seen: set[tuple[str, str]] = set()
        for i, t in enumerate(spec.get("taints") or []):
            value, effect = t.get("value") or "", t.get("effect") or ""
            out += _label_value_problems(f"metadata.taints[{i}].value", value)
            if effect not in _EFFECTS:
                out.append(f'metadata.taints[{i}].effect: Unsupported value: "{effect}": supported values: '
                           + ", ".join(f'"{e}"' for e in _EFFECTS))
            if (t.get("key"), effect) in seen:
                out.append(f"metadata.taints[{i}]: Duplicate value: {t}: taints must be unique by key and effect pair")
            seen.add((t.get("key"), effect))
    if kind == "ConfigMap":
        out += [f'data[{k}]: Invalid value: "{k}": {_CONFIG_KEY_HELP}'
                for k in (body.get("data") or {}) if not _CONFIG_KEY.fullmatch(k)]
    if kind == "Job" and "template" in spec:
        name = (body.get("metadata") or {}).get("name") or ""
        if len(name) > 63:
            out.append(f'spec.template.labels: Invalid value: "{name}": must be no more than 63 bytes')
        if ((spec.get("template") or {}).get("spec") or {}).get("restartPolicy") not in ("OnFailure", "Never"):
            out.append('spec.template.spec.restartPolicy: Required value: valid values: "OnFailure", "Never"')
    if kind == "Lease" and "leaseDurationSeconds" in spec and not int(spec["leaseDurationSeconds"] or 0) > 0:
        out.append(f"spec.leaseDurationSeconds: Invalid value: {spec['leaseDurationSeconds']}: must be greater than 0")
    return out


def _status(code: int, reason: str, message: str) -> Reply:
    return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "message": message,
                  "code": code}
