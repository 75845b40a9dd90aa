"""Field validation of whole objects against the Kubernetes OpenAPI schema, as ``fieldValidation=Strict``.

The schema is kubernetes-validate's copy of the upstream OpenAPI (v1.30); an unknown field is answered
400 ``strict decoding error: unknown field "<path>"`` and a wrong type 422 with the field path.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate

SCHEMA_VERSION = "1.30.0"


def refusal(kind: str, api_version: str, body: dict[str, Any]) -> tuple[int, str] | None:
    """None if ``body`` is a valid ``kind``; else the status code and message a strict server gives."""
    obj = {**body, "kind": body.get("kind") or kind, "apiVersion": body.get("apiVersion") or api_version}
    try:
        kubernetes_validate.validate(obj, SCHEMA_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        if exc.validator == "additionalProperties":
            known = set(exc.schema.get("properties", {}))
            unknown = sorted(set(exc.instance) - known) if isinstance(exc.instance, dict) else []
            field = ".".join(filter(None, [path, unknown[0] if unknown else ""]))
            return 400, f'strict decoding error: unknown field "{field}"'
        name = obj.get("metadata", {}).get("name", "")
        return 422, f'{kind} "{name}" is invalid: {path}: Invalid value: {exc.message}'
    return None
