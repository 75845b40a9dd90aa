"""RBAC of the loopback fake API server: a ServiceAccount's token and the ClusterRole rules bound to it."""

from __future__ import annotations

from typing import Any

from tests.fake_apiserver_objects import rbac_verb


def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
    return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                  "message": message, "code": code}


class RoleRules:
    """A ServiceAccount's bearer token and the rules bound to it (RBAC as a real server enforces it: group,
    resource[/subresource] and verb must all be granted, by the ClusterRole anywhere or by a Role in the
    request's namespace)."""

    def __init__(self, rules: list[dict[str, Any]], *, token: str, user: str,
                 namespaced: dict[str, list[dict[str, Any]]] | None = None) -> None:
        self.rules = rules
        self.namespaced = namespaced or {}
        """Role rules by the namespace they hold in."""
        self.token = token
        self.user = user

    @classmethod
    def from_manifest(cls, path: Any, role: str, *, token: str, user: str) -> RoleRules:
        """The rules of ClusterRole `role` in a manifest file, and of the Roles of that name in it."""
        import yaml

        with open(path) as fh:
            docs = [d for d in yaml.safe_load_all(fh.read()) if d]
        [cr] = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == role]
        namespaced: dict[str, list[dict[str, Any]]] = {}
        for d in docs:
            if d["kind"] == "Role" and d["metadata"]["name"] == role:
                namespaced.setdefault(d["metadata"]["namespace"], []).extend(d["rules"])
        return cls(cr["rules"], token=token, user=user, namespaced=namespaced)

    def allows(self, group: str, resource: str, verb: str, namespace: str | None = None) -> bool:
        """Whether some rule grants the verb on the resource (in `namespace`, for a namespaced request)."""
        rules = self.rules + (self.namespaced.get(namespace, []) if namespace else [])
        return any((group in r.get("apiGroups", []) or "*" in r.get("apiGroups", []))
                   and (resource in r.get("resources", []) or "*" in r.get("resources", []))
                   and (verb in r.get("verbs", []) or "*" in r.get("verbs", [])) for r in rules)

    def refuse(self, authorization: str | None, method: str, path: str) -> tuple[int, dict[str, Any]] | None:
        """401 without the token, 403 (with the real server's message) for what the role does not grant."""
        if authorization != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        v = rbac_verb(method, path)
        parts = path.strip("/").split("/")
        namespace = parts[parts.index("namespaces") + 1] if "namespaces" in parts[:-1] else None
        if v is None or self.allows(*v, namespace=namespace):
            return None
        group, resource, verb = v
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        base = resource.split("/")[0]
        return _status(403, "Forbidden", f'{base} is forbidden: User "{self.user}" cannot {verb} resource '
                                         f'"{resource}" in API group "{group}" {scope}')
