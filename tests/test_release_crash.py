"""An operator's release of a quarantined node under `kmend serve --cluster kube`, killed with SIGKILL while one of its
writes is held on the API server (the uncordon, which the server then never applies), is finished by the restarted
service: the node ends fully released (kmend's label, annotations and fault taint off, tainted unvalidated, its
condition saying who released it, uncordoned, one Event), each write of the release made once."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from healer.keys import (
    CONDITION_TYPE,
    FAULT_TAINT_KEY,
    QUARANTINE_PLAN,
    QUARANTINED_BY,
    QUARANTINED_LABEL,
    UNVALIDATED_TAINT_KEY,
)
from tests.fake_apiserver import FakeApiServer
from tests.procs import Served, kube_serve_env, start_serve
from tests.waiting import until

NODE = "gpu-1"


def _write(method: str, path: str, body: Any) -> str | None:
    """What a request does to NODE: one of the release's writes (taint writes named by the taints they leave)."""
    if method == "PATCH" and path == f"/api/v1/nodes/{NODE}/status":
        return "condition " + ",".join(c["type"] for c in body["status"]["conditions"])
    if method == "PATCH" and path == f"/api/v1/nodes/{NODE}":
        spec, meta = body.get("spec") or {}, body.get("metadata") or {}
        if "unschedulable" in spec:
            return "uncordon" if not spec["unschedulable"] else "cordon"
        if "taints" in spec:
            return "taints " + ",".join(sorted(t["key"] for t in spec["taints"]))
        if QUARANTINED_LABEL in (meta.get("labels") or {}):
            return "unlabel" if meta["labels"][QUARANTINED_LABEL] is None else "label"
        return "metadata"
    if method == "POST" and path.endswith("/events") and (body.get("involvedObject") or {}).get("name") == NODE:
        return "event " + body.get("reason", "")
    return None


@pytest.mark.slow
def test_a_release_killed_mid_way_is_finished_on_restart_each_write_once(tmp_path: Path) -> None:
    with FakeApiServer() as api:
        for i in range(8):
            api.add_node(f"gpu-{i}")
        with api._lock:  # quarantined by an earlier plan: kmend's marks on the node
            node = api.nodes[NODE]
            node["spec"]["unschedulable"] = True
            node["spec"]["taints"] = [{"key": FAULT_TAINT_KEY, "value": "gpu_lost", "effect": "NoSchedule"}]
            node["metadata"]["labels"][QUARANTINED_LABEL] = "true"
            node["metadata"].setdefault("annotations", {}).update({QUARANTINED_BY: "kmend",
                                                                   QUARANTINE_PLAN: "plan-earlier"})
            api.node_changed("MODIFIED", node)
        writes: list[str] = []
        lock = threading.Lock()
        held, let_go = threading.Event(), threading.Event()
        handle = api.handle

        def watched(method: str, path: str, body: Any, ctype: str,
                    query: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
            what = _write(method, path, body)
            if what == "uncordon" and not held.is_set():  # the first uncordon: held, then never applied
                held.set()
                let_go.wait(120)
                return 503, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 503,
                             "reason": "ServiceUnavailable", "message": "the request never reached storage"}
            code, out = handle(method, path, body, ctype, query)
            if what is not None and code < 300:
                with lock:
                    writes.append(what)
            return code, out

        api.handle = watched  # type: ignore[method-assign]
        env = {"KMEND_INGEST_TOKEN": "i", "KMEND_OPERATOR_TOKEN": "o", **kube_serve_env(tmp_path, api.url, "t"),
               "KMEND_DATABASE_URL": f"sqlite:///{tmp_path / 'k.db'}"}
        first = start_serve(tmp_path, "first", env)
        second: Served | None = None
        try:
            first.wait_ready()
            answered: list[Any] = []

            def release() -> None:
                try:
                    with httpx.Client(base_url=first.url, headers={"authorization": "Bearer o"}, timeout=60) as op:
                        answered.append(op.post(f"/v1/nodes/{NODE}/release"))
                except httpx.HTTPError as exc:  # the service is killed under it
                    answered.append(exc)

            caller = threading.Thread(target=release, daemon=True)
            caller.start()
            until("the release's uncordon held on the server", held.is_set)
            first.proc.kill()  # SIGKILL: no shutdown, no last write
            first.proc.wait(timeout=30)
            let_go.set()
            caller.join(timeout=60)
            with lock:
                before = list(writes)
            assert "uncordon" not in before and "event KmendReleased" not in before, before
            second = start_serve(tmp_path, "second", env)
            second.wait_ready()

            def released() -> bool:
                with api._lock:
                    n = api.nodes[NODE]
                    taints = {t["key"] for t in n["spec"].get("taints") or []}
                    conditions = {c["type"]: c for c in n["status"].get("conditions") or []}
                    return (not n["spec"].get("unschedulable") and FAULT_TAINT_KEY not in taints
                            and UNVALIDATED_TAINT_KEY in taints
                            and QUARANTINED_LABEL not in n["metadata"].get("labels", {})
                            and QUARANTINE_PLAN not in (n["metadata"].get("annotations") or {})
                            and conditions.get(CONDITION_TYPE, {}).get("reason") == "ReleasedByOperator"
                            and any(e.get("reason") == "KmendReleased" for e in api.events))

            until(f"{NODE} fully released by the restarted service", released)
        except AssertionError as exc:
            tails = first.tail() + "\n---\n" + (second.tail() if second else "")
            raise AssertionError(f"{exc}\nwrites: {writes}\n{tails}") from None
        finally:
            first.stop()
            if second is not None:
                second.stop()
    with lock:
        order = list(writes)
    # The release's writes: everything up to its Event (the node's health check follows, tainting it again).
    release = order[:order.index("event KmendReleased") + 1]
    assert release == ["unlabel", f"taints {FAULT_TAINT_KEY},{UNVALIDATED_TAINT_KEY}",
                       f"taints {UNVALIDATED_TAINT_KEY}", "condition KmendHealthy", "condition KmendFault", "uncordon",
                       "event KmendReleased"], order
    assert order.count("event KmendReleased") == 1 and order.count("uncordon") == 1, order
    assert sum(1 for e in api.events if e.get("reason") == "KmendReleased") == 1
