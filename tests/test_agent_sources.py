"""Agent sources on fixture trees: kmsg, kern.log, CRI logs with rotation, IB sysfs, DCGM text, fake NVML."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from analyzer.rules import Rule
from collector.bundle import BundleSource
from collector.podmeta import StaticPodMetadata, job_and_rank
from collector.prefilter import RegexPrefilter
from collector.signal import LogLine, MetricSample, Signal
from collector.sources.cri import CriLogSource, TimestampParser
from collector.sources.dcgm import DcgmSource, parse_scrape
from collector.sources.ib import IbSysfsSource
from collector.sources.kernel import DeviceKmsgReader, KernLogSource, KmsgSource, parse_records
from collector.sources.nvml import NvmlSource
from collector.sources.nvml_fake import FakeGpu, FakeNvml
from tests.agent_helpers import FIXTURES, CriWriter, texts

XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus."


# -- kernel ------------------------------------------------------------------------------


def _boot(tmp_path: Path, boot: str = "b00t-1") -> Path:
    p = tmp_path / "boot_id"
    p.write_text(boot + "\n")
    return p


def test_kmsg_records_with_continuation_lines_and_escapes() -> None:
    recs = parse_records((FIXTURES / "kmsg.txt").read_bytes())
    assert [r.seq for r in recs] == [1201, 1202, 1203, 1204, 1205]
    xid = recs[1]
    assert xid.message == XID79 and xid.level == 4 and xid.usec == 5140900
    assert xid.fields == {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:3b:00.0"}
    assert recs[3].message == "mlx5_core 0000:5e:00.0 ibp94s0: Link down\n(port 1)"


def test_kmsg_source_ids_timestamps_and_resume_after_restart(tmp_path: Path) -> None:
    boot = _boot(tmp_path)
    src = KmsgSource(node="n1", path=FIXTURES / "kmsg.txt", boot_id_path=boot,
                     clock=lambda: 1_000_000.0, monotonic=lambda: 10_000.0)
    polled = src.poll()
    assert [s.id for s in polled.signals][:2] == ["n1/kernel/b00t-1/1201", "n1/kernel/b00t-1/1202"]
    assert polled.signals[1].text == XID79
    assert polled.signals[1].ts == pytest.approx(1_000_000.0 - 10_000.0 + 5.1409)
    assert polled.cursors == {"position": {"boot": "b00t-1", "seq": 1205}}
    src.close()
    # Restarted with the checkpoint: /dev/kmsg replays its ring buffer, nothing is re-shipped.
    again = KmsgSource(node="n1", path=FIXTURES / "kmsg.txt", boot_id_path=boot,
                       resume={"position": {"boot": "b00t-1", "seq": 1202}})
    assert [s.id.rsplit("/", 1)[1] for s in again.poll().signals] == ["1203", "1204", "1205"]
    # After a reboot sequence numbers restart: the old checkpoint does not apply.
    rebooted = KmsgSource(node="n1", path=FIXTURES / "kmsg.txt", boot_id_path=_boot(tmp_path, "b00t-2"),
                          resume={"position": {"boot": "b00t-1", "seq": 1205}})
    assert len(rebooted.poll().signals) == 5


class _OverrunReader:
    """Behaves like /dev/kmsg: one record per read, EPIPE after an overrun, EAGAIN when empty."""

    def __init__(self, records: list[bytes | type[Exception]]) -> None:
        self.records = records

    def read(self) -> bytes:
        if not self.records:
            raise BlockingIOError
        item = self.records.pop(0)
        if isinstance(item, type):
            raise item()
        return item

    def close(self) -> None:
        pass


def test_kmsg_ring_buffer_overrun_is_survived_and_counted(tmp_path: Path) -> None:
    reader = _OverrunReader([b"6,10,100,-;first\n", BrokenPipeError, b"6,50,900,-;" + XID79.encode() + b"\n"])
    src = KmsgSource(node="n1", boot_id_path=_boot(tmp_path), open_reader=lambda _p: reader)
    polled = src.poll()
    assert texts(polled.signals) == ["first", XID79]
    assert polled.lost == 1 and src.overruns == 1
    assert src.poll().signals == []


def test_kmsg_device_reader_reads_real_file_nonblocking(tmp_path: Path) -> None:
    f = tmp_path / "kmsg"
    f.write_bytes(b"6,1,1,-;a\n")
    reader = DeviceKmsgReader(f)
    assert reader.read() == b"6,1,1,-;a\n"
    assert reader.read() == b""
    reader.close()


def test_kmsg_prefilter_ships_only_candidates(tmp_path: Path) -> None:
    src = KmsgSource(node="n1", path=FIXTURES / "kmsg.txt", boot_id_path=_boot(tmp_path),
                     prefilter=RegexPrefilter([r"NVRM: Xid"]))
    polled = src.poll()
    assert texts(polled.signals) == [XID79] and polled.lines == 5


def test_kern_log_lines_rotation_and_gz(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    shutil.copy(FIXTURES / "kern.log", log)
    src = KernLogSource(node="n1", path=log, clock=lambda: 5.0, hold_s=0)
    first = src.poll().signals
    assert texts(first)[0] == XID79
    assert first[0].ts == pytest.approx(1_795_255_200.1)  # RFC 3339 prefix parsed
    assert first[2].ts == 5.0  # classic syslog stamp has no year: read time instead
    with open(log, "a") as fh:
        fh.write("2026-11-21T10:00:02+00:00 h kernel: [ 1.0] before rotation\n")
    log.rename(tmp_path / "kern.log.1")
    log.write_text("2026-11-21T10:00:03+00:00 h kernel: [ 1.0] after rotation\n")
    assert texts(src.poll().signals) == ["before rotation", "after rotation"]


def test_kern_log_in_rfc5424_and_journald_iso_forms_ships_the_bare_message(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text(f"<4>1 2026-11-21T10:00:00.100Z gpu-7 kernel - - - {XID79}\n"
                   f"2026-11-21T10:00:01+0000 gpu-7 kernel: [ 1843.308145] {XID79}\n")
    assert texts(KernLogSource(node="n1", path=log, clock=lambda: 5.0, hold_s=0).poll().signals) == [XID79, XID79]


# -- container logs -------------------------------------------------------------------------


def test_cri_fixture_partial_lines_reassembled_with_job_and_rank() -> None:
    meta = StaticPodMetadata({"train/llama-worker-3": {
        "training.kubeflow.org/job-name": "llama", "training.kubeflow.org/replica-index": "3"}})
    src = CriLogSource(node="n1", root=FIXTURES / "pods", pod_metadata=meta, clock=lambda: 1.0)
    sigs = src.poll().signals
    assert len(sigs) == 3
    oom = sigs[1].payload
    assert isinstance(oom, LogLine)
    assert oom.text == ("[rank3]: Traceback (most recent call last): torch.OutOfMemoryError: CUDA out of memory. "
                        "Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 79.15 GiB of which 1.20 GiB "
                        "is free.")
    assert (oom.namespace, oom.pod, oom.container, oom.job, oom.rank) == (
        "train", "llama-worker-3", "trainer", "llama", 3)
    assert sigs[0].ts == pytest.approx(1_795_255_200.000000001)
    assert sigs[2].ts == pytest.approx(1_795_255_202.0)
    assert meta.calls == 1
    src.poll()
    assert meta.calls == 1  # labels are fetched once per pod


def test_rank_prefix_overrides_label_rank(tmp_path: Path) -> None:
    w = CriWriter(tmp_path)
    w.line("[rank17]: RuntimeError: CUDA error: an illegal memory access was encountered")
    w.line("plain line")
    meta = StaticPodMetadata({"train/llama-worker-0": {"jobset.sigs.k8s.io/jobset-name": "js",
                                                        "jobset.sigs.k8s.io/job-index": "2"}})
    sigs = CriLogSource(node="n1", root=tmp_path, pod_metadata=meta).poll().signals
    ranks = [s.payload.rank for s in sigs if isinstance(s.payload, LogLine)]
    assert ranks == [17, 2]


@pytest.mark.parametrize(("labels", "expected"), [
    ({"kmend.io/job": "j", "kmend.io/rank": "4"}, ("j", 4)),
    ({"training.kubeflow.org/job-name": "pt", "training.kubeflow.org/replica-index": "0"}, ("pt", 0)),
    ({"jobset.sigs.k8s.io/jobset-name": "js", "jobset.sigs.k8s.io/job-index": "5"}, ("js", 5)),
    ({"volcano.sh/job-name": "vj", "volcano.sh/task-index": "1"}, ("vj", 1)),
    ({"app": "web"}, (None, None)),
])
def test_job_and_rank_from_labels(labels: dict[str, str], expected: tuple[str | None, int | None]) -> None:
    assert job_and_rank(labels) == expected


def test_cri_rotation_by_rename_mid_line_then_gzip_loses_nothing(tmp_path: Path) -> None:
    w = CriWriter(tmp_path)
    src = CriLogSource(node="n1", root=tmp_path)
    w.line("one")
    assert texts(src.poll().signals) == ["one"]
    w.line("two")
    w.line("long line first half, ", tag="P")
    rotated = w.rotate_rename()
    w.line("second half")
    w.line("three")
    got = src.poll().signals
    assert texts(got) == ["two", "long line first half, second half", "three"]
    w.compress(rotated)
    w.line("four")
    assert texts(src.poll().signals) == ["four"]
    assert len({s.id for s in got}) == 3


def test_cri_restart_mid_partial_line_resumes_without_loss_or_duplicates(tmp_path: Path) -> None:
    w = CriWriter(tmp_path)
    w.line("a")
    w.line("half ", tag="P")
    src = CriLogSource(node="n1", root=tmp_path)
    polled = src.poll()
    assert texts(polled.signals) == ["a"]
    saved = {k: v for k, v in polled.cursors.items() if v is not None}
    w.rotate_rename()
    w.line("done")
    # The agent crashed before shipping more; a new one starts from the checkpoint.
    again = CriLogSource(node="n1", root=tmp_path, resume=saved)
    assert texts(again.poll().signals) == ["half done"]


def test_cri_copytruncate(tmp_path: Path) -> None:
    w = CriWriter(tmp_path)
    src = CriLogSource(node="n1", root=tmp_path)
    w.line("before")
    assert texts(src.poll().signals) == ["before"]
    w.line("written before the copy")
    w.copytruncate()
    w.line("after truncate")
    got = src.poll().signals
    assert texts(got) == ["written before the copy", "after truncate"]
    # Same inode, new content: the new lines get new ids, never colliding with the old ones.
    assert len({s.id for s in got}) == 2


def test_cri_new_pods_appear_and_gone_pods_are_forgotten(tmp_path: Path) -> None:
    a = CriWriter(tmp_path, pod="a")
    a.line("from a")
    src = CriLogSource(node="n1", root=tmp_path)
    assert texts(src.poll().signals) == ["from a"]
    b = CriWriter(tmp_path, pod="b", uid="2222")
    b.line("from b")
    assert texts(src.poll().signals) == ["from b"]
    shutil.rmtree(a.dir.parent)
    polled = src.poll()
    assert polled.signals == [] and None in polled.cursors.values()


def test_cri_prefilter_fast_path_ships_candidates_with_exact_ids(tmp_path: Path) -> None:
    w = CriWriter(tmp_path)
    for i in range(50):
        w.line(f"step {i} loss 1.0")
        if i == 25:
            w.line("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    plain = CriLogSource(node="n1", root=tmp_path).poll().signals
    pre = RegexPrefilter([r"CUDA out of memory\. Tried to allocate (?P<size>[0-9.]+ [KMGT]iB)"])
    filtered = CriLogSource(node="n1", root=tmp_path, prefilter=pre)
    polled = filtered.poll()
    assert len(polled.signals) == 1 and polled.lines == 51
    same = [s for s in plain if s.id == polled.signals[0].id]
    assert same and same[0].text == polled.signals[0].text


def test_prefilter_engines_agree() -> None:
    pats = [r"^NVRM: Xid", r"Watchdog caught collective operation timeout"]
    buf = b"x NVRM: Xid (PCI:0000:3b:00): 79\nnothing\n[Rank 1] Watchdog caught collective operation timeout\n"
    hs, re_ = RegexPrefilter(pats), RegexPrefilter(pats, use_hyperscan=False)
    assert re_.engine == "re"
    ends_re = re_.scan(buf)
    assert len(ends_re) == 2
    lines_hs = {buf.rfind(b"\n", 0, e - 1) for e in hs.scan(buf)}
    assert lines_hs == {buf.rfind(b"\n", 0, e - 1) for e in ends_re}


def test_timestamp_parser_offsets() -> None:
    p = TimestampParser()
    assert p("2026-11-21T10:00:00.5+01:00") == pytest.approx(1_795_255_200.5 - 3600)
    assert p("not a time") is None


# -- metrics sources -----------------------------------------------------------------------------


def _metrics(sigs: list[Signal]) -> dict[tuple[str, str], MetricSample]:
    out = {}
    for s in sigs:
        assert isinstance(s.payload, MetricSample)
        out[(s.payload.labels.get("device", s.payload.labels.get("gpu", "")), s.payload.name)] = s.payload
    return out


def test_ib_sysfs_state_rate_counters_and_deltas(tmp_path: Path) -> None:
    root = tmp_path / "infiniband"
    shutil.copytree(FIXTURES / "ib", root)
    now = [100.0]
    src = IbSysfsSource(node="n1", root=root, interval=10, clock=lambda: now[0])
    first = _metrics(src.poll().signals)
    assert first[("mlx5_0", "ib_port_state")].value == 4
    assert first[("mlx5_0", "ib_port_state")].labels["state"] == "ACTIVE"
    assert first[("mlx5_1", "ib_port_phys_state")].labels["phys_state"] == "Disabled"
    assert first[("mlx5_0", "ib_port_rate_gbps")].value == 400
    assert first[("mlx5_0", "ib_symbol_error")].value == 12
    assert ("mlx5_0", "ib_symbol_error_delta") not in first
    assert src.poll().signals == []  # not due yet
    (root / "mlx5_1/ports/1/counters/link_downed").write_text("9\n")
    now[0] += 10
    second = _metrics(src.poll().signals)
    assert second[("mlx5_1", "ib_link_downed_delta")].value == 2
    assert second[("mlx5_0", "ib_symbol_error_delta")].value == 0


def test_dcgm_scrape_keeps_health_fields() -> None:
    text = (FIXTURES / "dcgm-exporter.txt").read_text()
    samples = parse_scrape(text)
    names = {s.name for s in samples}
    assert "DCGM_FI_DEV_FB_USED" not in names  # usage series stay with Prometheus
    xid = next(s for s in samples if s.name == "DCGM_FI_DEV_XID_ERRORS" and s.value)
    assert xid.value == 79 and xid.labels["gpu"] == "0" and xid.labels["pci"] == "00000000:3B:00.0"
    assert xid.labels["uuid"].startswith("GPU-b9f9")
    src = DcgmSource(node="n1", fetch=lambda: text, clock=lambda: 50.0)
    sigs = src.poll().signals
    assert len(sigs) == len(samples) and len({s.id for s in sigs}) == len(sigs)


def test_dcgm_source_failure_is_raised_once_per_interval() -> None:
    calls = []

    def fetch() -> str:
        calls.append(1)
        raise ConnectionError("exporter down")

    now = [0.0]
    src = DcgmSource(node="n1", fetch=fetch, interval=15, clock=lambda: now[0])
    with pytest.raises(ConnectionError):
        src.poll()
    assert src.poll().signals == [] and len(calls) == 1


def test_nvml_xid_events_and_health_counters() -> None:
    gpu = FakeGpu("GPU-aaaa", "00000000:3B:00.0", ecc={(1, 0): 2}, remapped_rows=(0, 1, 1, 0),
                  nvlinks={0: {2: 17}}, temperature=88, power_mw=512000, throttle=0x40)
    fake = FakeNvml([gpu, FakeGpu("GPU-bbbb", "00000000:5E:00.0", remapped_rows=None)])
    src = NvmlSource(node="n1", load=lambda: fake, clock=lambda: 10.0)
    assert src.available
    fake.inject_xid(0, 79)
    sigs = src.poll().signals
    byname = {(s.payload.labels["uuid"], s.payload.name): s.payload for s in sigs
              if isinstance(s.payload, MetricSample)}
    xid = byname[("GPU-aaaa", "nvml_xid")]
    assert xid.value == 79 and xid.labels["pci"] == "00000000:3B:00.0"
    assert byname[("GPU-aaaa", "nvml_ecc_uncorrected_volatile")].value == 2
    assert byname[("GPU-aaaa", "nvml_remapped_rows_pending")].value == 1
    assert byname[("GPU-aaaa", "nvml_power_watts")].value == 512
    assert byname[("GPU-aaaa", "nvml_nvlink_crc_flit_errors_total")].labels["link"] == "0"
    assert ("GPU-bbbb", "nvml_remapped_rows_pending") not in byname  # not supported: skipped
    assert len({s.id for s in sigs}) == len(sigs)
    assert src.poll().signals == []  # counters wait for the interval, no events pending


def test_nvml_absent_reports_unavailable_once(caplog: pytest.LogCaptureFixture) -> None:
    def missing() -> FakeNvml:
        raise ImportError("No module named 'pynvml'")

    with caplog.at_level("INFO"):
        src = NvmlSource(node="n1", load=missing)
        for _ in range(3):
            assert src.poll().signals == []
    assert not src.available and "pynvml" in src.reason
    assert sum("NVML unavailable" in r.message for r in caplog.records) == 1
    src.close()


def test_real_pynvml_without_driver_is_unavailable_not_fatal() -> None:
    src = NvmlSource(node="n1")
    if src.available:
        pytest.skip("this machine has an NVIDIA driver")
    assert src.poll().signals == []


def test_prefilter_from_every_shipped_rule_keeps_their_examples(shipped_rules: list[Rule]) -> None:
    for engine in (True, False):
        pre = RegexPrefilter([r.pattern for r in shipped_rules], use_hyperscan=engine)
        for rule in shipped_rules:
            for example in rule.examples:
                buf = b"2026-11-21T10:00:00.000000001Z stdout F " + example.encode() + b"\n"
                assert pre.matches(example) and pre.scan(buf), (rule.id, example)


def test_cri_cursors_only_when_positions_move(tmp_path: Path) -> None:
    w = CriWriter(tmp_path)
    w.line("a")
    src = CriLogSource(node="n1", root=tmp_path)
    assert src.poll().cursors
    assert src.poll().cursors == {}
    w.line("b")
    (cursor,) = src.poll().cursors.values()
    assert cursor["offset"] == w.live.stat().st_size


def test_cri_one_unreadable_container_does_not_cost_the_others(tmp_path: Path) -> None:
    good, bad = CriWriter(tmp_path, pod="good", uid="1"), CriWriter(tmp_path, pod="bad", uid="2")
    good.line("fine")
    bad.line("x")
    src = CriLogSource(node="n1", root=tmp_path)
    bad.live.unlink()
    bad.live.mkdir()  # "0.log" that cannot be read as a file
    (bad.dir / "0.log.1").symlink_to(bad.live)
    polled = src.poll()
    assert texts(polled.signals) == ["fine"] and polled.errors == 1


# A real AER report as rsyslog writes it to kern.log (https://github.com/pop-os/pop/issues/3363).
AER_REPORT = [
    "Sep 19 16:18:04 bubz kernel: [68185.875052] pcieport 0000:00:03.1: AER: Multiple Correctable error message"
    " received from 0000:00:00.0",
    "Sep 19 16:18:04 bubz kernel: [68185.875237] pcieport 0000:00:03.1: PCIe Bus Error: severity=Correctable,"
    " type=Data Link Layer, (Transmitter ID)",
    "Sep 19 16:18:04 bubz kernel: [68185.875244] pcieport 0000:00:03.1:   device [1022:1453] error status/mask"
    "=000011c0/00006000",
    "Sep 19 16:18:04 bubz kernel: [68185.875252] pcieport 0000:00:03.1:    [ 6] BadTLP                ",
    "Sep 19 16:18:04 bubz kernel: [68185.875259] pcieport 0000:00:03.1:    [ 7] BadDLLP               ",
    "Sep 19 16:18:04 bubz kernel: [68185.875265] pcieport 0000:00:03.1:    [ 8] Rollover              ",
    "Sep 19 16:18:04 bubz kernel: [68185.875270] pcieport 0000:00:03.1:    [12] Timeout               ",
    "Sep 19 16:18:04 bubz kernel: [68185.875295] nvidia 0000:07:00.0: PCIe Bus Error: severity=Correctable,"
    " type=Data Link Layer, (Transmitter ID)",
    "Sep 19 16:18:04 bubz kernel: [68185.875301] nvidia 0000:07:00.0:   device [10de:2184] error status/mask"
    "=00001000/0000a000",
    "Sep 19 16:18:04 bubz kernel: [68185.875308] nvidia 0000:07:00.0:    [12] Timeout               ",
]


def _analyze_events(path: Path) -> list[str]:
    source = BundleSource([str(path)])
    return source.lines(source.files()[0]).texts


def test_kern_log_folds_an_aer_report_into_the_events_analyze_finds(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("\n".join(AER_REPORT) + "\n")
    want = _analyze_events(log)
    assert 1 <= len(want) < len(AER_REPORT)
    polled = KernLogSource(node="n1", path=log, clock=lambda: 5.0, hold_s=0).poll()
    assert texts(polled.signals) == want
    assert polled.signals[0].id == f"n1/kernel/{next(iter(polled.cursors))}/0"
    assert polled.lines == len(AER_REPORT)


def test_kern_log_holds_a_report_cut_by_a_poll_until_its_last_lines_arrive(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("\n".join(["2026-11-21T10:00:00+00:00 h kernel: [ 1.0] eth0: link up", *AER_REPORT[:3]]) + "\n")
    now = [100.0]
    src = KernLogSource(node="n1", path=log, clock=lambda: now[0], hold_s=1.0)
    first = src.poll()
    assert texts(first.signals) == ["eth0: link up"]
    (cursor,) = first.cursors.values()
    first_line = "2026-11-21T10:00:00+00:00 h kernel: [ 1.0] eth0: link up\n"
    assert isinstance(cursor, dict) and cursor["offset"] == len(first_line)  # a restart reads the report again
    with open(log, "a") as fh:
        fh.write("\n".join(AER_REPORT[3:]) + "\n")
    now[0] += 0.2
    second = src.poll()
    now[0] += 2.0
    third = src.poll()  # nothing new: whatever was still held goes out now
    whole = tmp_path / "whole.log"
    whole.write_text("\n".join(AER_REPORT) + "\n")
    assert texts(second.signals) + texts(third.signals) == _analyze_events(whole)
    assert not src.poll().signals


def test_kern_log_ships_a_folded_report_whole_through_the_rule_prefilter(tmp_path: Path) -> None:
    log = tmp_path / "kern.log"
    log.write_text("\n".join(AER_REPORT) + "\n")
    prefilter = RegexPrefilter([r"PCIe Bus Error: severity=Correctable"])
    signals = KernLogSource(node="n1", path=log, clock=lambda: 5.0, hold_s=0, prefilter=prefilter).poll().signals
    assert texts(signals) == [t for t in _analyze_events(log) if "severity=Correctable" in t]
    assert any("error status/mask=000011c0/00006000" in t and "Timeout" in t for t in texts(signals))
