"""The Kubernetes Pod Security Standards (baseline and restricted, as the PodSecurity admission plugin checks them
in 1.30+) over a pod spec: the list of what a pod does that the level forbids, empty when it passes."""

from __future__ import annotations

from typing import Any

BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod.get("containers", []), *pod.get("ephemeralContainers", [])]


def baseline_violations(pod: dict[str, Any]) -> list[str]:
    """What the pod spec does that Pod Security `baseline` forbids."""
    out = [f"{k}: true" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    psc = pod.get("securityContext", {})
    if psc.get("seccompProfile", {}).get("type") == "Unconfined":
        out.append("pod seccompProfile Unconfined")
    out += [f"sysctl {s['name']}" for s in psc.get("sysctls", []) if s["name"] not in SAFE_SYSCTLS]
    out += [f"hostPath volume {v['name']}" for v in pod.get("volumes", []) if "hostPath" in v]
    for c in _containers(pod):
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("windowsOptions", {}).get("hostProcess"):
            out.append(f"{name}: hostProcess")
        extra = set(sc.get("capabilities", {}).get("add", [])) - BASELINE_CAPABILITIES
        out += [f"{name}: adds capability {cap}" for cap in sorted(extra)]
        out += [f"{name}: hostPort {p['hostPort']}" for p in c.get("ports", []) if p.get("hostPort")]
        if sc.get("procMount", "Default") != "Default":
            out.append(f"{name}: procMount {sc['procMount']}")
        if sc.get("seccompProfile", {}).get("type") == "Unconfined":
            out.append(f"{name}: seccompProfile Unconfined")
        if sc.get("appArmorProfile", {}).get("type") == "Unconfined":
            out.append(f"{name}: appArmorProfile Unconfined")
    return out


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What the pod spec does that Pod Security `restricted` forbids (baseline's rules included)."""
    out = baseline_violations(pod)
    psc = pod.get("securityContext", {})
    out += [f"volume {v['name']} of a type restricted forbids" for v in pod.get("volumes", [])
            if not (set(v) - {"name"}) <= RESTRICTED_VOLUMES]
    if psc.get("runAsUser") == 0:
        out.append("pod runAsUser 0")
    for c in _containers(pod):
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation is not false")
        if not sc.get("runAsNonRoot", psc.get("runAsNonRoot", False)):
            out.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp} (RuntimeDefault or Localhost required)")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities do not drop ALL")
        out += [f"{name}: adds capability {cap}" for cap in caps.get("add", [])
                if cap != "NET_BIND_SERVICE" and cap in BASELINE_CAPABILITIES]
    return out
