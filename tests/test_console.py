"""The web console: served pages need a token, show incidents with root cause and evidence, the topology map and
plans; actions need the operator token and a form token; in a real headless Chromium a person logs in and approves
a plan with the keyboard alone, every page's text meets WCAG AA contrast, and screenshots are kept."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from collector.signal import LogLine, Signal, Source
from tests.builders import XID79, kernel, nccl_timeout
from tests.test_runbook_api import Served, _serve

REPO = Path(__file__).resolve().parents[1]
SHOTS = REPO / "var" / "console-screenshots"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _approval_waiting(s: Served) -> dict[str, Any]:
    s.post_signals([kernel("gpu-node-03", XID79)])
    [plan] = s.wait(lambda: s.plans(state="awaiting_approval"))
    return plan


def test_console_needs_a_token_and_a_form_token_to_act(tmp_path: Path) -> None:
    with _serve(tmp_path, require_approval=True, reader_token="read-token") as s:
        plan = _approval_waiting(s)
        c = httpx.Client(base_url=str(s.client.base_url), follow_redirects=True)
        assert c.get("/console/incidents").url.path == "/console/login"
        assert c.post("/console/login", data={"token": "wrong"}).status_code == 401
        # The collectors' token opens nothing; the read-only token may look but not act.
        assert c.post("/console/login", data={"token": "agent-token"}).status_code == 401
        viewer = httpx.Client(base_url=str(s.client.base_url), follow_redirects=True)
        page = viewer.post("/console/login", data={"token": "read-token", "name": "eve"})
        assert page.status_code == 200 and "gpu-node-03" in page.text and "gpu_lost" in page.text
        assert "Approve" not in viewer.get(f"/console/plans/{plan['id']}").text
        assert viewer.post(f"/console/plans/{plan['id']}/approve", data={"csrf": "x"}).status_code == 403

        c.post("/console/login", data={"token": "op-token", "name": "alice"})
        detail = c.get(f"/console/incidents/{plan['incident_id']}").text
        assert "GPU has fallen off the bus" in detail and "0000:3b:00" in detail
        nodes = c.get("/console/nodes").text
        assert "Spine spine-0" in nodes and "Leaf leaf-0" in nodes and 'aria-label="gpu-node-03: suspect"' in nodes
        page = c.get(f"/console/plans/{plan['id']}").text
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
        assert csrf is not None
        assert c.post(f"/console/plans/{plan['id']}/approve", data={"csrf": "forged"}).status_code == 403
        assert not s.world.cluster.get_node("gpu-node-03").unschedulable
        done = c.post(f"/console/plans/{plan['id']}/approve", data={"csrf": csrf.group(1)})
        assert done.status_code == 200 and s.world.cluster.get_node("gpu-node-03").unschedulable
        audit = s.client.get("/v1/audit", headers={"authorization": "Bearer op-token"}).json()["entries"]
        assert any(e["actor"] == "alice (console)" and e["path"].endswith("/approve") for e in audit)


def test_console_and_cli_name_a_job_with_its_namespace(tmp_path: Path) -> None:
    from kmend.commands.ctl import describe_incident, describe_plan

    line = LogLine(nccl_timeout(1), namespace="team-a", pod="llama-worker-1", container="trainer", job="llama", rank=1)
    with _serve(tmp_path) as s:
        s.post_signals([Signal("gpu-node-01/container/1", "gpu-node-01", Source.CONTAINER, time.time(), line)])
        [plan] = s.wait(lambda: [p for p in s.plans() if p.get("job")])
        c = httpx.Client(base_url=str(s.client.base_url), follow_redirects=True)
        c.post("/console/login", data={"token": "op-token", "name": "alice"})
        # Every page that shows the job shows it as namespace/job: "llama" may run in another namespace too.
        for page in ("/console/incidents", f"/console/incidents/{plan['incident_id']}", "/console/plans",
                     f"/console/plans/{plan['id']}"):
            text = c.get(page).text
            assert "team-a/llama" in text, page
            assert not re.search(r"(?<!team-a/)\bllama\b(?!-worker)", text), page
        inc = s.client.get(f"/v1/incidents/{plan['incident_id']}", headers={"authorization": "Bearer op-token"}).json()
        described = describe_incident(inc, time.time())
        assert "job=team-a/llama" in described and "namespace=" not in described
        assert "Job:       team-a/llama" in describe_plan(plan, time.time())


_CONTRAST_JS = """
() => {
  const lum = c => { const v = c.match(/[\\d.]+/g).slice(0, 3).map(Number).map(x => x / 255)
      .map(x => x <= 0.03928 ? x / 12.92 : Math.pow((x + 0.055) / 1.055, 2.4));
      return 0.2126 * v[0] + 0.7152 * v[1] + 0.0722 * v[2]; };
  const bg = el => { for (let e = el; e; e = e.parentElement) {
      const c = getComputedStyle(e).backgroundColor; const a = c.match(/[\\d.]+/g);
      if (a && (a.length < 4 || Number(a[3]) > 0.5)) return c; } return 'rgb(255,255,255)'; };
  const bad = [];
  for (const el of document.querySelectorAll('body *')) {
    if (!el.childNodes.length || ![...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim())) continue;
    const r = el.getBoundingClientRect(); if (!r.width || !r.height) continue;
    const a = lum(getComputedStyle(el).color), b = lum(bg(el));
    const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
    if (ratio < 4.5) bad.push(el.tagName + ' "' + el.textContent.trim().slice(0, 30) + '" ' + ratio.toFixed(2));
  }
  return bad;
}
"""


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_a_person_approves_a_plan_in_chromium_with_the_keyboard(tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with _serve(tmp_path, require_approval=True) as s, sync_api.sync_playwright() as pw:
        plan = _approval_waiting(s)
        base = str(s.client.base_url)
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"] if os.geteuid() == 0 else [])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{base}/console/incidents")
            assert page.url.endswith("/console/login?next=/console/incidents")
            # The token field has focus on load (autofocus); typing starts once it has, as a person's would.
            page.wait_for_function("document.activeElement && document.activeElement.id === 'token'")
            page.keyboard.type("op-token")
            page.keyboard.press("Tab")
            page.keyboard.press("Control+A")
            page.keyboard.type("alice")
            page.keyboard.press("Enter")
            page.wait_for_url(f"{base}/console/incidents")
            assert "gpu-node-03" in page.inner_text("main")
            page.screenshot(path=str(SHOTS / "incidents.png"), full_page=True)
            problems: dict[str, list[str]] = {}
            for path in ("/console/incidents", f"/console/incidents/{plan['incident_id']}", "/console/nodes",
                         "/console/plans", "/console/spares", "/console/audit", f"/console/plans/{plan['id']}"):
                page.goto(base + path)
                if low := page.evaluate(_CONTRAST_JS):
                    problems[path] = low
            assert problems == {}, problems
            page.goto(f"{base}/console/nodes")
            page.screenshot(path=str(SHOTS / "nodes.png"), full_page=True)
            page.goto(f"{base}/console/plans/{plan['id']}")
            page.screenshot(path=str(SHOTS / "plan-awaiting-approval.png"), full_page=True)
            # Keyboard only: Tab to the Approve button, press Enter.
            for _ in range(40):
                page.keyboard.press("Tab")
                if page.evaluate("document.activeElement.textContent.trim()") == "Approve":
                    break
            else:
                raise AssertionError("the Approve button cannot be reached with Tab")
            page.keyboard.press("Enter")
            page.wait_for_url(f"{base}/console/plans/{plan['id']}")
            s.wait(lambda: s.world.cluster.get_node("gpu-node-03").unschedulable)
            # A running plan's page refreshes itself: a navigation of ours may meet one of its own.
            for _ in range(10):
                try:
                    page.goto(f"{base}/console/plans/{plan['id']}")
                    break
                except sync_api.Error:
                    page.wait_for_timeout(300)
            assert "awaiting_approval" not in page.inner_text("h1")
            page.screenshot(path=str(SHOTS / "plan-approved.png"), full_page=True)
        finally:
            browser.close()
    for name in ("incidents.png", "nodes.png", "plan-awaiting-approval.png", "plan-approved.png"):
        assert (SHOTS / name).stat().st_size > 10_000
