"""Formats real tools print: one fault line is one finding in every dmesg, syslog, journald, kmsg and
CRI spelling; multi-line events (AER dumps, split NVRM messages, nvidia-smi -q sections,
tracebacks) are one event; wrapped lines are re-joined; benign tool output stays silent.

The fault lines are quoted from public threads (URL next to each); the transport prefixes around
them are the ones each tool writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from collector.bundle import BundleSource
from collector.normalize import events_of, strip_prefix
from collector.timestamps import parse_timestamp
from kmend.cli import build_parser

# https://github.com/NVIDIA/NVSentinel/issues/155
XID79 = "NVRM: Xid (PCI:0000:44:00): 79, GPU has fallen off the bus"
EPOCH = 1761213792.0  # 2025-10-23T10:03:12Z

FORMATS: dict[str, tuple[str, str | None, float | None]] = {
    # name: (file text, node the line names, time the line carries)
    "dmesg": (f"[ 1843.308145] {XID79}\n", None, 1843.308145),
    "dmesg -T": (f"[Thu Oct 23 10:03:12 2025] {XID79}\n", None, EPOCH),
    "dmesg -H relative": (f"[  +0.000844] {XID79}\n", None, None),
    "dmesg -H": (f"[Oct23 10:03] {XID79}\n", None, None),
    "dmesg -x": (f"kern  :err   : [ 1843.308145] {XID79}\n", None, 1843.308145),
    "syslog RFC 3164": (f"Oct 23 10:03:12 gpu-node-7 kernel: {XID79}\n", "gpu-node-7", None),
    "syslog RFC 3164 with dmesg stamp": (f"Oct 23 10:03:12 gpu-node-7 kernel: [ 1843.308145] {XID79}\n",
                                         "gpu-node-7", None),
    "syslog RFC 5424": (f"<4>1 2025-10-23T10:03:12.000Z gpu-node-7 kernel - - - {XID79}\n",
                        "gpu-node-7", EPOCH),
    "journalctl -o short-iso": (f"2025-10-23T10:03:12+0000 gpu-node-7 kernel: {XID79}\n",
                                "gpu-node-7", EPOCH),
    "journalctl -o short-precise": (f"Oct 23 10:03:12.308145 gpu-node-7 kernel: {XID79}\n", "gpu-node-7", None),
    "journalctl -k -o cat": (f"kernel: {XID79}\n", None, None),
    "/dev/kmsg": (f"3,1234,1843308145,-;{XID79}\n SUBSYSTEM=pci\n DEVICE=+pci:0000:44:00.0\n", None, 1843.308145),
    "CRI (driver pod)": (f"2025-10-23T10:03:12.000000000Z stdout F {XID79}\n", None, EPOCH),
    "CRI partial": (f"2025-10-23T10:03:12.000000000Z stdout P {XID79[:30]}\n"
                    f"2025-10-23T10:03:12.000000000Z stdout F {XID79[30:]}\n", None, EPOCH),
    "forum wrap": (f"[ 1843.308145] {XID79[:XID79.index(' off')]}\n{XID79[XID79.index(' off') + 1:]}\n",
                   None, 1843.308145),
    "terminal wrap at 80 columns": (
        (lambda s: s[:80] + "\n" + s[80:] + "\n")(f"Oct 23 10:03:12 gpu-node-7 kernel: [ 1843.308145] {XID79}"),
        "gpu-node-7", None),
}


def analyze(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, name: str = "node.log") -> list[Any]:
    path = tmp_path / name
    path.write_text(text)
    args = build_parser().parse_args(["analyze", str(path), "--format", "json"])
    assert args.func(args) in (0, 3, 4)  # the exit code says what was found (tests/test_analyze.py)
    incidents: list[Any] = json.loads(capsys.readouterr().out)["incidents"]
    return incidents


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_same_xid_line_is_the_same_single_finding_in_every_format(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    text, node, ts = FORMATS[fmt]
    [incident] = analyze(tmp_path, capsys, text)
    [finding] = incident["findings"]
    assert (finding["rule_id"], finding["pci"]) == ("xid-79", "0000:44:00")
    assert incident["recommended_action"] == "replace_node"
    assert finding["message"].startswith("NVRM: Xid"), "the prefix is stripped: the rule sees the message"
    assert finding["message"].endswith("GPU has fallen off the bus")
    if node is not None:
        assert finding["node"] == node
    if ts is not None:
        assert finding["ts"] == pytest.approx(ts)


# https://github.com/rwth-i6/returnn/issues/1500 (dmesg -H, one fatal AER report and its recovery)
AER_FATAL = """\
[  +0.000001] pcieport 0000:00:03.0: AER: Multiple Uncorrected (Fatal) error received: 0000:00:03.0
[  +0.000004] pcieport 0000:00:03.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, (Requester ID)
[  +0.000898] pcieport 0000:00:03.0:   device [8086:6f08] error status/mask=00004020/00000000
[  +0.000889] pcieport 0000:00:03.0:    [ 5] SDES                  
[  +0.000894] pcieport 0000:00:03.0:    [14] CmpltTO                (First)
[  +0.000921] nvidia 0000:03:00.0: AER: can't recover (no error_detected callback)
[  +0.000002] snd_hda_intel 0000:03:00.1: AER: can't recover (no error_detected callback)
[  +1.050439] pcieport 0000:00:03.0: AER: Root Port link has been reset (0)
[  +0.000041] pcieport 0000:00:03.0: AER: device recovery failed
"""  # noqa: W291, E501 (verbatim, trailing blanks as the kernel printed them)

# https://github.com/pop-os/pop/issues/3363 (syslog; one report covering the root port and the GPU)
AER_CORRECTED = """\
Sep 19 16:18:04 bubz kernel: [68185.875052] pcieport 0000:00:03.1: AER: Multiple Correctable error message received from 0000:00:00.0
Sep 19 16:18:04 bubz kernel: [68185.875237] pcieport 0000:00:03.1: PCIe Bus Error: severity=Correctable, type=Data Link Layer, (Transmitter ID)
Sep 19 16:18:04 bubz kernel: [68185.875244] pcieport 0000:00:03.1:   device [1022:1453] error status/mask=000011c0/00006000
Sep 19 16:18:04 bubz kernel: [68185.875252] pcieport 0000:00:03.1:    [ 6] BadTLP                
Sep 19 16:18:04 bubz kernel: [68185.875259] pcieport 0000:00:03.1:    [ 7] BadDLLP               
Sep 19 16:18:04 bubz kernel: [68185.875295] nvidia 0000:07:00.0: PCIe Bus Error: severity=Correctable, type=Data Link Layer, (Transmitter ID)
Sep 19 16:18:04 bubz kernel: [68185.875301] nvidia 0000:07:00.0:   device [10de:2184] error status/mask=00001000/0000a000
Sep 19 16:18:04 bubz kernel: [68185.875308] nvidia 0000:07:00.0:    [12] Timeout               
"""  # noqa: W291, E501


def test_a_fatal_aer_dump_is_one_finding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    [incident] = analyze(tmp_path, capsys, AER_FATAL)
    [finding] = incident["findings"]
    assert (finding["rule_id"], finding["pci"], incident["fault_class"]) == ("pcie-aer-fatal", "0000:00:03", "pcie")
    assert "CmpltTO" in finding["message"] and "can't recover" in finding["message"]


def test_a_corrected_aer_report_naming_two_devices_is_one_event_and_no_alarm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    [event] = events_of(AER_CORRECTED)
    assert event.startswith("pcieport 0000:00:03.1: AER: Multiple Correctable") and "nvidia 0000:07:00.0" in event
    assert analyze(tmp_path, capsys, AER_CORRECTED) == [], "corrected-only, below the escalation rate"


def test_a_storm_of_aer_reports_stays_one_event_per_report() -> None:
    # https://github.com/endlessm/linux/pull/625: a report repeated; each repetition counts for the escalation
    storm = ("pcieport 0000:00:1c.5: AER: Corrected error received: id=00e5\n"
             "pcieport 0000:00:1c.5: can't find device of ID00e5\n") * 3
    assert events_of(storm).count("pcieport 0000:00:1c.5: AER: Corrected error received: id=00e5") == 3


def test_trainer_lines_a_terminal_wrapped_mid_word_are_rejoined(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    # https://github.com/huggingface/open-r1/issues/620: every line broken at the same terminal width
    text = (
        "[rank2]:[E424 01:11:21.160832730 ProcessGroupNCCL.cpp:629] [Rank 2] Watchdog caught collective operation"
        " timeout: WorkNCCL(SeqNum=4, OpTy\n"
        "pe=BROADCAST, NumelIn=112, NumelOut=112, Timeout(ms)=1800000) ran for 1800010 milliseconds"
        " before timing out.\n"
        "[rank3]:[E424 01:11:21.160815008 ProcessGroupNCCL.cpp:629] [Rank 3] Watchdog caught collective operation"
        " timeout: WorkNCCL(SeqNum=4, OpTy\n"
        "pe=BROADCAST, NumelIn=112, NumelOut=112, Timeout(ms)=1800000) ran for 1800011 milliseconds"
        " before timing out.\n"
    )
    [incident] = analyze(tmp_path, capsys, text)
    assert incident["fault_class"] == "nccl_timeout"
    findings = incident["findings"]
    assert sorted(f["rank"] for f in findings) == [2, 3]
    assert {f["fields"]["op"] for f in findings} == {"BROADCAST"}


def test_an_nvrm_message_dmesg_printed_on_three_lines_is_one_event(tmp_path: Path) -> None:
    # https://github.com/NVIDIA/NVSentinel/issues/155
    path = tmp_path / "dmesg.log"
    path.write_text(
        "[ 1843.308145] NVRM: The NVIDIA GPU 0000:b3:00.0\n"
        "               NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
        "               NVRM: fallen off the bus and is not responding to commands.\n"
        "[ 1843.439662] NVRM: The NVIDIA probe routine failed for 1 device(s).\n")
    source = BundleSource([str(path)])
    [f] = source.files()
    lines = source.lines(f)
    assert lines.texts == [
        "NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:26b5) installed in this system has "
        "fallen off the bus and is not responding to commands.",
        "NVRM: The NVIDIA probe routine failed for 1 device(s).",
    ]
    assert source.signal(lines, 1).ts == pytest.approx(1843.439662)


def test_an_nvrm_sentence_continued_on_the_next_nvrm_line_is_joined() -> None:
    # https://github.com/NVIDIA/NVSentinel/issues/155, as journalctl prints it (each line prefixed)
    assert events_of(
        "Feb 14 05:03:41 gpu-1 kernel: NVRM: The NVIDIA GPU 0000:b3:00.0\n"
        "Feb 14 05:03:41 gpu-1 kernel: NVRM: (PCI ID: 10de:26b5) installed in this system has\n"
        "Feb 14 05:03:41 gpu-1 kernel: NVRM: fallen off the bus and is not responding to commands.\n"
    ) == ["NVRM: The NVIDIA GPU 0000:b3:00.0 (PCI ID: 10de:26b5) installed in this system has "
          "fallen off the bus and is not responding to commands."]


def test_an_nvidia_smi_q_section_is_one_finding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # https://github.com/leptonai/gpud/pull/80
    [incident] = analyze(tmp_path, capsys, (
        "    Remapped Rows\n"
        "        Correctable Error                 : 0\n"
        "        Uncorrectable Error               : 4\n"
        "        Pending                           : Yes\n"), name="nvidia-smi-q.txt")
    [finding] = incident["findings"]
    assert (finding["rule_id"], incident["fault_class"], incident["recommended_action"]) == (
        "nvidia-smi-remapped-rows-pending", "gpu_memory", "reset_gpu")
    assert finding["fields"]["count"] == "4"


def test_a_section_under_its_gpu_names_the_gpu() -> None:
    text = events_of("GPU 00000000:3B:00.0\n    Remapped Rows\n"
                     "        Uncorrectable Error : 4\n        Pending : Yes\n")
    assert text == ["GPU 00000000:3B:00.0", "GPU 00000000:3B:00.0 Remapped Rows: Uncorrectable Error: 4, Pending: Yes"]


def test_a_traceback_is_one_finding_from_its_final_exception_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    # https://github.com/NVIDIA/Stable-Diffusion-WebUI-TensorRT/issues/163, as a rank's CRI log lines
    tb = [
        "[rank3]: Traceback (most recent call last):",
        '[rank3]:   File "C:\\sd_webui_aki\\sd-webui-aki-v4.4\\python\\lib\\site-packages'
        '\\torch\\nn\\modules\\module.py", line 905, in <lambda>',
        "[rank3]:     return self._apply(lambda t: t.cuda(device))",
        "[rank3]: RuntimeError: CUDA error: an illegal memory access was encountered",
        "[rank3]: CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below"
        " might be incorrect.",
        "[rank3]: For debugging consider passing CUDA_LAUNCH_BLOCKING=1.",
        "[rank3]: Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    ]
    text = "".join(f"2024-12-06T18:44:12.715298746Z stderr F {ln}\n" for ln in tb)
    [incident] = analyze(tmp_path, capsys, text)
    [finding] = incident["findings"]
    assert (finding["rule_id"], finding["rank"], incident["hardware"]) == ("cuda-illegal-memory-access", 3, False)
    assert finding["message"].startswith("[rank3]: RuntimeError: CUDA error: an illegal memory access")


def test_only_the_final_exception_of_a_chained_traceback_is_an_event() -> None:
    # https://github.com/pytorch/pytorch/issues/18853 (frames shortened)
    events = events_of(
        "Traceback (most recent call last):\n"
        '  File "memtestcase.py", line 78, in fwbw\n'
        "    yhat = model(X)\n"
        "RuntimeError: CUDA out of memory. Tried to allocate 1024.00 MiB (GPU 0; 15.90 GiB total capacity;"
        " 14.25 GiB already allocated; 991.56 MiB free; 607.00 KiB cached)\n"
        "\n"
        "During handling of the above exception, another exception occurred:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "memtestcase.py", line 155, in <module>\n'
        "    main()\n"
        "KeyboardInterrupt\n")
    assert events[0].startswith("RuntimeError: CUDA out of memory")
    assert events[1:] == ["During handling of the above exception, another exception occurred:", "KeyboardInterrupt"]


# Health-check output that reports zero errors, and start-up warnings about hardware that is absent.
BENIGN = {
    # https://github.com/NVIDIA/gpu-operator/issues/610 (two A40s, no NVSwitch: fabric manager has nothing to do)
    "fabric manager without NVSwitch": (
        "11月 15 14:15:47 leon-NF5468M6 systemd[1]: Starting NVIDIA fabric manager service...\n"
        "11月 15 14:15:47 leon-NF5468M6 nv-fabricmanager[4177]: request to query NVSwitch device information from"
        " NVSwitch driver failed with error:WARNING Nothing to do [NV_WARN_NOTHING_TO_DO]\n"),
    # https://github.com/data-infra/cube-studio/issues/29 (two RTX 4090s)
    "fabric manager on a pre-NVL5 system without NVSwitch": (
        "Sep 18 03:19:01 ubuntu2404 nvidia-fabricmanager-start.sh[4753]: Detected Pre-NVL5 system\n"
        "Sep 18 03:19:01 ubuntu2404 nvidia-fabricmanager-start.sh[4756]: request to query NVSwitch device information"
        " from NVSwitch driver failed with error:WARNING Nothing to do [NV_WARN_NOTHING_TO_DO]\n"),
    # https://github.com/kubeflow/kubeflow/issues/68
    "nvidia-smi -q throttle reasons, none active": (
        "    Clocks Throttle Reasons\n"
        "        Idle                        : Active\n"
        "        Applications Clocks Setting : Not Active\n"
        "        SW Power Cap                : Not Active\n"
        "        HW Slowdown                 : Not Active\n"
        "            HW Thermal Slowdown     : Not Active\n"
        "            HW Power Brake Slowdown : Not Active\n"
        "        Sync Boost                  : Not Active\n"
        "        SW Thermal Slowdown         : Not Active\n"),
    # https://github.com/NVIDIA/DCGM/issues/253 (the passing part of a dcgmi diag table)
    "dcgmi diag passing": (
        "Successfully ran diagnostic for group.\n"
        "+---------------------------+------------------------------------------------+\n"
        "| Diagnostic                | Result                                         |\n"
        "+===========================+================================================+\n"
        "|-----  Metadata  ----------+------------------------------------------------|\n"
        "| DCGM Version              | 4.2.3                                          |\n"
        "| Driver Version Detected   | 570.148.08                                     |\n"
        "| GPU Device IDs Detected   | 26b9, 26b9, 26b9, 26b9                         |\n"
        "|-----  Deployment  --------+------------------------------------------------|\n"
        "| software                  | Pass                                           |\n"
        "|                           | GPU0: Pass                                     |\n"
        "|                           | GPU1: Pass                                     |\n"),
}


@pytest.mark.parametrize("case", list(BENIGN))
def test_benign_tool_output_produces_nothing(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert analyze(tmp_path, capsys, BENIGN[case]) == []


def test_a_dcgmi_row_continued_on_the_next_row_is_one_event() -> None:
    # https://github.com/NVIDIA/DCGM/issues/253
    assert events_of(
        "| software                  | Pass                                           |\n"
        "|                           | GPU0: Pass                                     |\n"
        "|                           | GPU1: Pass                                     |\n"
    ) == ["| software: Pass GPU0: Pass GPU1: Pass"]


@pytest.mark.parametrize(("line", "expected"), [
    ("[Thu Oct 23 10:03:12 2025] x", (EPOCH, "epoch")),
    ("<4>1 2025-10-23T10:03:12.000Z gpu-node-7 kernel - - - x", (EPOCH, "epoch")),
    ("3,1234,1843308145,-;x", (1843.308145, "boot")),
    ("2025-10-23T10:03:12+0000 gpu-node-7 kernel: x", (EPOCH, "epoch")),
])
def test_timestamps_of_every_prefix(line: str, expected: tuple[float, str]) -> None:
    parsed = parse_timestamp(line)
    assert parsed is not None
    assert parsed[0] == pytest.approx(expected[0]) and parsed[1] == expected[1]


def test_a_prefix_names_its_host_and_whether_the_kernel_wrote_it() -> None:
    p = strip_prefix("<4>1 2025-10-23T10:03:12.000Z gpu-node-7 kernel - - - NVRM: x")
    assert (p.host, p.kernel) == ("gpu-node-7", True)
    p = strip_prefix("Oct 23 10:03:12 gpu-node-7 kubelet[1234]: E1023 x")
    assert (p.host, p.kernel) == ("gpu-node-7", False)
    assert strip_prefix("RuntimeError: CUDA error").length == 0
