"""Host and fabric kernel faults in every kernel-log format real tools print (dmesg plain, -T, -H, -x,
syslog RFC 3164/5424, journald, /dev/kmsg): the same OOM kill, NFS stall and NIC firmware timeout are
one finding each, with the node and time the prefix carries.

The messages are quoted from public threads (URL next to each); the prefixes are the ones each tool writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.analyze_helpers import analyze_cli

# (rule, the fields it must extract, the message as the kernel printed it)
MESSAGES: dict[str, tuple[str, dict[str, str], str]] = {
    # https://github.com/0jc1/py-autovod/issues/7
    "oom kill": ("host-oom-killer", {"pid": "7899", "comm": "python"},
                 "Out of memory: Killed process 7899 (python) total-vm:26,184,840kB, anon-rss:153,700,88kB, "
                 "file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:38964kB oom_score_adj:0"),
    # https://github.com/openrisc/linux/issues/12
    "nfs stall": ("nfs-not-responding", {"server": "10.0.0.27"}, "nfs: server 10.0.0.27 not responding, still trying"),
    # https://github.com/RROrg/rr/issues/3556
    "nic firmware timeout": ("mlx5-command-timeout", {"pci": "0000:00:11.0", "command": "MANAGE_PAGES"},
                             "mlx5_core 0000:00:11.0: 0000:00:11.0:wait_func:790:(pid 3851): MANAGE_PAGES(0x108) "
                             "timeout. Will cause a leak of a command resource"),
}
EPOCH = 1761213792.0  # 2025-10-23T10:03:12Z
PREFIXES: dict[str, tuple[str, str | None, float | None]] = {
    # name: (prefix, node the prefix names, time it carries)
    "dmesg": ("[ 1843.308145] ", None, 1843.308145),
    "dmesg -T": ("[Thu Oct 23 10:03:12 2025] ", None, EPOCH),
    "dmesg -H relative": ("[  +0.000844] ", None, None),
    "dmesg -x": ("kern  :err   : [ 1843.308145] ", None, 1843.308145),
    "syslog RFC 3164": ("Oct 23 10:03:12 gpu-node-7 kernel: [ 1843.308145] ", "gpu-node-7", None),
    "syslog RFC 5424": ("<4>1 2025-10-23T10:03:12.000Z gpu-node-7 kernel - - - ", "gpu-node-7", EPOCH),
    "journalctl -o short-iso": ("2025-10-23T10:03:12+0000 gpu-node-7 kernel: ", "gpu-node-7", EPOCH),
    "/dev/kmsg": ("3,1234,1843308145,-;", None, 1843.308145),
}


@pytest.mark.parametrize("fmt", list(PREFIXES))
@pytest.mark.parametrize("what", list(MESSAGES))
def test_a_host_fault_line_is_one_finding_in_every_kernel_format(
    what: str, fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    rule, fields, message = MESSAGES[what]
    prefix, node, ts = PREFIXES[fmt]
    [incident] = analyze_cli(tmp_path, capsys, prefix + message + "\n")
    [finding] = incident["findings"]
    assert finding["rule_id"] == rule
    assert {k: finding["fields"][k] for k in fields} == fields
    assert finding["message"] == message, "the prefix is stripped: the rule sees the message"
    if node is not None:
        assert finding["node"] == node
    if ts is not None:
        assert finding["ts"] == pytest.approx(ts)
