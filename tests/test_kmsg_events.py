"""The agent's /dev/kmsg source ships one PCIe AER report, or one NVRM message the kernel split over
records, as one signal: real dumps from the corpus (dev half) give the live path the same events and
findings as `kmend analyze`; a report cut by a poll is held back, never lost, never checkpointed past."""

from __future__ import annotations

from pathlib import Path

import pytest

from analyzer.pipeline import Analyzer
from analyzer.rules import Rule, default_rules_dir, load_rules
from collector.normalize import events_of, strip_prefix
from collector.signal import LogLine, Signal, Source
from collector.sources.kernel import KmsgSource
from kmend.corpus_eval import load_corpus

CORPUS = Path(__file__).resolve().parent / "corpus"
NOW = 10_000.0
"""Monotonic time of the tests' polls; records are stamped a few seconds before it."""


@pytest.fixture(scope="module")
def rules() -> list[Rule]:
    return load_rules([default_rules_dir()])


def _messages(text: str) -> list[str]:
    """The excerpt's lines as the kernel logged them: dmesg/syslog prefixes off, blank lines dropped."""
    return [ln[strip_prefix(ln).length:] for ln in text.splitlines() if ln.strip()]


def _kmsg(messages: list[str], *, first_seq: int = 100, usec: int = 9_990_000_000) -> bytes:
    """``/dev/kmsg`` records (``pri,seq,usec,flags;message``), a microsecond apart."""
    return b"".join(f"3,{first_seq + i},{usec + i},-;{m}\n".encode() for i, m in enumerate(messages))


def _boot(tmp_path: Path) -> Path:
    p = tmp_path / "boot_id"
    p.write_text("b00t\n")
    return p


def _multi_record_excerpts() -> list[tuple[str, str]]:
    """Kernel excerpts of the dev half in which one event spans several lines (AER reports, NVRM splits)."""
    out = []
    for e in load_corpus(CORPUS):
        if e.split != "dev" or e.source != "kernel":
            continue
        if len(events_of(e.text)) < len(_messages(e.text)) and ("AER" in e.text or "NVRM: " in e.text):
            out.append((e.id, e.text))
    return out


EXCERPTS = _multi_record_excerpts()


def test_the_corpus_has_multi_record_aer_and_nvrm_excerpts() -> None:
    ids = [i for i, _ in EXCERPTS]
    assert sum("aer" in i or "pcie" in i or "badtlp" in i or "corrected" in i for i in ids) >= 3, ids
    assert any("PCIe Bus Error" in t for _, t in EXCERPTS) and any("NVRM: " in t for _, t in EXCERPTS)


@pytest.mark.parametrize(("entry", "text"), EXCERPTS, ids=[i for i, _ in EXCERPTS])
def test_live_kmsg_events_and_findings_equal_kmend_analyze(tmp_path: Path, rules: list[Rule], entry: str,
                                                          text: str) -> None:
    dev = tmp_path / "kmsg"
    msgs = _messages(text)
    dev.write_bytes(_kmsg(msgs))
    src = KmsgSource(node="gpu-1", path=dev, boot_id_path=_boot(tmp_path), clock=lambda: 2e9, monotonic=lambda: NOW)
    live = src.poll().signals
    events = events_of(text)
    assert [s.text for s in live] == events
    assert len(live) < len(msgs)
    # The same findings as the offline path that reads the dump as a file.
    offline = [Signal(f"x/{i}", "gpu-1", Source.KERNEL, float(i), LogLine(t)) for i, t in enumerate(events)]
    got = [f.rule_id for f in Analyzer(rules).findings(live)]
    assert got == [f.rule_id for f in Analyzer(rules).findings(offline)]
    # One AER report is one finding, however many records the kernel printed it in.
    reports = [t for t in events if "AER" in t or "PCIe Bus Error" in t]
    assert sum(r.startswith("pcie-aer") for r in got) <= len(reports)


DASHARO = "dasharo-815-correctable-badtlp"


def test_one_correctable_report_is_one_finding_not_one_per_record(tmp_path: Path, rules: list[Rule]) -> None:
    [text] = [t for i, t in EXCERPTS if i == DASHARO]
    dev = tmp_path / "kmsg"
    dev.write_bytes(_kmsg(_messages(text)))
    src = KmsgSource(node="gpu-1", path=dev, boot_id_path=_boot(tmp_path), clock=lambda: 2e9, monotonic=lambda: NOW)
    found = Analyzer(rules).findings(src.poll().signals)
    # Ten records: the root port's two "received" lines, then each device's error with its bits.
    assert [f.rule_id for f in found] == ["pcie-aer-corrected"]


class _Reader:
    """Hands out the records given to it, a batch per poll (what the device has printed so far)."""

    def __init__(self) -> None:
        self.batches: list[bytes] = []

    def read(self) -> bytes:
        if not self.batches:
            raise BlockingIOError
        return self.batches.pop(0)

    def close(self) -> None:
        pass


AER = [
    "pcieport 0000:00:03.0: AER: Multiple Uncorrected (Fatal) error received: 0000:00:03.0",
    "pcieport 0000:00:03.0: PCIe Bus Error: severity=Uncorrected (Fatal), type=Transaction Layer, (Requester ID)",
    "pcieport 0000:00:03.0:   device [8086:6f08] error status/mask=00004020/00000000",
    "pcieport 0000:00:03.0:    [ 5] SDES",
    "pcieport 0000:00:03.0:    [14] CmpltTO                (First)",
]


def test_a_report_cut_by_a_poll_is_held_back_then_shipped_whole(tmp_path: Path) -> None:
    reader = _Reader()
    now = [NOW]
    src = KmsgSource(node="n1", boot_id_path=_boot(tmp_path), open_reader=lambda _p: reader, clock=lambda: 2e9,
                     monotonic=lambda: now[0])
    usec = int(NOW * 1e6) - 2000
    reader.batches = [_kmsg(["usb 1-1: new device"], first_seq=10, usec=usec - 100) + _kmsg(AER[:2], first_seq=11,
                                                                                             usec=usec)]
    first = src.poll()
    # The plain line ships; the report's start waits, and the checkpoint stays before it.
    assert [s.text for s in first.signals] == ["usb 1-1: new device"]
    assert first.cursors == {"position": {"boot": "b00t", "seq": 10}}
    reader.batches = [_kmsg(AER[2:], first_seq=13, usec=usec + 2)]
    now[0] += 0.01
    assert src.poll().signals == []  # the last bit line may still be followed by more
    now[0] += 2.0
    second = src.poll()
    assert [s.id for s in second.signals] == ["n1/kernel/b00t/11"]
    assert second.signals[0].text == " ".join(AER)
    assert second.cursors == {"position": {"boot": "b00t", "seq": 15}}


def test_a_restart_while_a_report_is_held_reads_it_again_from_the_checkpoint(tmp_path: Path) -> None:
    dev = tmp_path / "kmsg"
    dev.write_bytes(_kmsg(["usb 1-1: new device", *AER[:3]], first_seq=10, usec=int(NOW * 1e6) - 1000))
    src = KmsgSource(node="n1", path=dev, boot_id_path=_boot(tmp_path), clock=lambda: 2e9, monotonic=lambda: NOW)
    polled = src.poll()
    assert [s.text for s in polled.signals] == ["usb 1-1: new device"]
    src.close()  # the agent stops with the report held: it was never shipped nor checkpointed
    again = KmsgSource(node="n1", path=dev, boot_id_path=_boot(tmp_path), resume=polled.cursors, clock=lambda: 2e9,
                       monotonic=lambda: NOW + 5.0)
    assert [(s.id, s.text) for s in again.poll().signals] == [("n1/kernel/b00t/11", " ".join(AER[:3]))]
