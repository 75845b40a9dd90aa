"""RBAC of the loopback fake API server: a ServiceAccount's token and the ClusterRole rules bound to it."""

from __future__ import annotations

from typing import Any

from tests.fake_apiserver_objects import rbac_verb


def _status(code: int, reason: str, message: str) -> tuple[int, dict[str, Any]]:
    return code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                  "message": message, "code": code}


class RoleRules:
    """A ServiceAccount's bearer token and the rules of the ClusterRole bound to it (RBAC as a real server
    enforces it: group, resource[/subresource] and verb must all be granted)."""

    def __init__(self, rules: list[dict[str, Any]], *, token: str, user: str) -> None:
        self.rules = rules
        self.token = token
        self.user = user

    @classmethod
    def from_manifest(cls, path: Any, role: str, *, token: str, user: str) -> RoleRules:
        """The rules of ClusterRole `role` in a manifest file."""
        import yaml

        with open(path) as fh:
            docs = [d for d in yaml.safe_load_all(fh.read()) if d]
        [cr] = [d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == role]
        return cls(cr["rules"], token=token, user=user)

    def allows(self, group: str, resource: str, verb: str) -> bool:
        """Whether some rule grants the verb on the resource."""
        return any((group in r.get("apiGroups", []) or "*" in r.get("apiGroups", []))
                   and (resource in r.get("resources", []) or "*" in r.get("resources", []))
                   and (verb in r.get("verbs", []) or "*" in r.get("verbs", [])) for r in self.rules)

    def refuse(self, authorization: str | None, method: str, path: str) -> tuple[int, dict[str, Any]] | None:
        """401 without the token, 403 (with the real server's message) for what the role does not grant."""
        if authorization != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        v = rbac_verb(method, path)
        if v is None or self.allows(*v):
            return None
        group, resource, verb = v
        parts = path.strip("/").split("/")
        scope = f'in the namespace "{parts[parts.index("namespaces") + 1]}"' if "namespaces" in parts[:-1] \
            else "at the cluster scope"
        base = resource.split("/")[0]
        return _status(403, "Forbidden", f'{base} is forbidden: User "{self.user}" cannot {verb} resource '
                                         f'"{resource}" in API group "{group}" {scope}')
