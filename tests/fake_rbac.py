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

    def allows(self, group: str, resource: str, verb: str, namespace: str | None = None, name: str = "") -> bool:
        """Whether some rule grants the verb on the resource (in `namespace`, for a namespaced request).

        A rule with ``resourceNames`` grants only requests that name one of those objects: never a list, a
        watch or a create of a new object (such a request names none), as kube-apiserver's RBAC authorizer."""
        rules = self.rules + (self.namespaced.get(namespace, []) if namespace else [])
        return any((group in r.get("apiGroups", []) or "*" in r.get("apiGroups", []))
                   and (resource in r.get("resources", []) or "*" in r.get("resources", []))
                   and (verb in r.get("verbs", []) or "*" in r.get("verbs", []))
                   and (not r.get("resourceNames") or name in r["resourceNames"]) for r in rules)

    def refuse(self, authorization: str | None, method: str, path: str) -> tuple[int, dict[str, Any]] | None:
        """401 without the token, 403 (with the real server's message) for what the role does not grant."""
        if authorization != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        v = rbac_verb(method, path)
        parts = path.strip("/").split("/")
        namespace = parts[parts.index("namespaces") + 1] if "namespaces" in parts[:-1] else None
        name = _object_name(parts)
        if v is None or self.allows(*v, namespace=namespace, name=name):
            return None
        return self.forbidden(method, path)

    def forbidden(self, method: str, path: str, why: str = "") -> tuple[int, dict[str, Any]] | None:
        """The 403 the server answers this request with when no rule grants it (``why`` is the authorizer's reason,
        appended as the server appends it); None for a path RBAC does not cover."""
        v = rbac_verb(method, path)
        if v is None:
            return None
        parts = path.strip("/").split("/")
        namespace = parts[parts.index("namespaces") + 1] if "namespaces" in parts[:-1] else None
        name = _object_name(parts)
        group, resource, verb = v
        scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
        # As the server words it: `leases.coordination.k8s.io "kmend-healer" is forbidden`, `nodes is forbidden`.
        what = resource.split("/")[0] + (f".{group}" if group else "") + (f' "{name}"' if name else "")
        return _status(403, "Forbidden", f'{what} is forbidden: User "{self.user}" cannot {verb} resource '
                                         f'"{resource}" in API group "{group}" {scope}' + (f": {why}" if why else ""))


def _object_name(parts: list[str]) -> str:
    """The object a request names (a get, update, patch or delete of it, or a subresource of it); "" for a
    request on a whole collection (a list, a watch, a create)."""
    rest = parts[2:] if parts[:1] == ["api"] else parts[3:]  # after /api/v1 or /apis/<group>/<version>
    if len(rest) > 2 and rest[0] == "namespaces":
        rest = rest[2:]
    return rest[1] if len(rest) > 1 else ""
