"""Offline diagnosis of a log bundle (what `kmend analyze PATH...` runs).

Reads files, directories (kernel logs, container logs, ``/var/log/pods`` trees, kubectl
dumps) or ``-`` for stdin; prints the incidents the rule packs and the correlator find,
as a table or as JSON. Only lines a rule matches become signals, so large bundles stay fast.

Trainers' progress lines feed the hang and straggler detectors, replayed in ticks of
bundle time and judged at the bundle's last timestamp (a rank whose log stops long
before the others' is named), and PyTorch
Flight Recorder dumps in the bundle name the ranks that never joined the stuck
collective. Their findings fold into the same incidents as the rule matches.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from analyzer.context import ContextGate
from analyzer.correlate import Correlator
from analyzer.detectors.flight_recorder import DumpError
from analyzer.detectors.suite import DetectorSuite
from analyzer.engine import MultiMatcher
from analyzer.matcher import FastMatcher
from analyzer.metric_eval import SignalEvaluator
from analyzer.metric_rules import SignalRules, default_metric_rules_dir, load_signal_rules
from analyzer.pipeline import Analyzer
from analyzer.progress import ProgressMatcher
from analyzer.progress_rules import ProgressRule, default_progress_rules_dir, load_progress_rules
from analyzer.records import Finding, Incident
from analyzer.rules import Rule, RuleError, default_rules_dir, load_rules
from collector.bundle import BundleSource, LogFile
from collector.bundle_time import (
    SAME_EVENT_S,
    boot_time,
    boot_time_of_stat,
    is_dated,
    is_yearless,
    kernel_uptime,
    place_year,
)
from collector.metric_files import looks_like_scrape, scrape_signals, webhook_signals
from collector.podmeta import parse_labels_file
from collector.signal import LogLine, Signal, Source
from collector.timestamps import parse_timestamp

BUNDLE_WINDOW_S = math.inf
"""Default correlation window: a bundle is cut around one failure, and its files may mix
dmesg boot-relative seconds with wall-clock stamps, so the whole bundle is one window."""

BATCH_LINES = 65536
"""Lines per scan of the multi-pattern engine."""

DETECTOR_TICK_S = 5.0
"""Bundle seconds between detector evaluations while replaying (the straggler detector
wants a slowdown on several consecutive evaluations, as the service sees it live)."""


def _progress_lines(texts: Sequence[str], rules: Sequence[ProgressRule]) -> set[int]:
    """Lines a progress rule extracts something from (one combined prefilter picks the rules to try)."""
    match = ProgressMatcher(rules).match
    return {i for i, text in enumerate(texts) if match(text) is not None}


def collect(source: BundleSource, engine: MultiMatcher, progress_rules: Sequence[ProgressRule] = (),
            context: ContextGate | None = None) -> tuple[list[Signal], set[tuple[str, str]], float | None]:
    """Signals for the lines some rule matches, the (job key, node) placements the bundle shows,
    and the bundle's last timestamp (None for an empty bundle).

    ``context``: lines that make a rule's finding benign are kept too, or the analyzer never sees them.
    """
    signals: list[Signal] = []
    placements: set[tuple[str, str]] = set()
    ends: list[tuple[float, LogFile]] = []
    files: list[tuple[LogFile, list[Signal], list[float | None]]] = []
    clocks = _BootClocks()
    for f in source.files():
        fl = source.lines(f)
        if Path(f.name).name == "stat":
            clocks.stat(f, fl.raw)
        metric = _metric_signals(f, fl.raw)  # the file as written, not its folded events
        if metric is not None:
            signals.extend(metric)
            if metric:
                ends.append((max(s.ts for s in metric), f))
            continue
        hit_lines: set[int] = _progress_lines(fl.texts, progress_rules)
        if context is not None:
            hit_lines |= context.lines_of(fl.texts)
        for start in range(0, len(fl.texts), BATCH_LINES):
            for hit in engine.scan(fl.texts[start:start + BATCH_LINES]):
                hit_lines.add(start + hit.line)
        hits = sorted(hit_lines)
        file_signals = [source.signal(fl, i) for i in hits]
        uptimes = [kernel_uptime(fl.raw[fl.heads[i]]) for i in hits]
        clocks.lines(f, file_signals, uptimes, fl.raw)
        files.append((f, file_signals, uptimes))
        if fl.texts:
            ends.append((source.signal(fl, len(fl.texts) - 1).ts, f))
        # A pod's log shows where its job ran even when none of its lines matched a rule.
        probe = file_signals[:1] or ([source.signal(fl, 0)] if fl.texts else [])
        for sig in probe:
            line = sig.payload
            if isinstance(line, LogLine) and line.job and sig.node != "unknown":
                placements.add((f"{line.namespace}/{line.job}" if line.namespace else line.job, sig.node))
    # Stamps without a year (syslog, glog) go into the year the bundle's dated lines say, else the file's mtime.
    dated = [s.ts for s in signals if is_dated(s.ts)] + [s.ts for _, fs, _ in files for s in fs if is_dated(s.ts)]
    dated += [ts for ts, _ in ends if is_dated(ts)]  # a file's last line, matched by a rule or not
    bundle_anchor = max(dated) if dated else None

    def placed(ts: float, f: LogFile) -> float:
        return place_year(ts, bundle_anchor if bundle_anchor is not None else _mtime(f)) if is_yearless(ts) else ts

    boots = clocks.boots(placed)
    seen = _SeenKernelEvents()
    for f, file_signals, uptimes in files:
        for sig, up in zip(file_signals, uptimes, strict=True):
            ts = placed(sig.ts, f)
            if up is not None and abs(ts - up) < 1.0:  # dmesg's seconds since boot: onto the wall clock
                boot = boots.get(sig.node, boots.get("", None))
                ts = boot + ts if boot is not None else ts
            if sig.source is Source.KERNEL and seen.again(sig, f.name, ts, up):
                continue
            signals.append(replace(sig, ts=ts) if ts != sig.ts else sig)
    last = [placed(ts, f) for ts, f in ends]
    signals.sort(key=lambda s: s.ts)
    return signals, placements, max(last) if last else None


class _BootClocks:
    """Boot times per node, from a copy of ``/proc/stat`` or from kernel lines that carry both a wall-clock
    and an uptime stamp (syslog and kern.log keep the kernel's ``[  219.470994]``)."""

    TAIL = 200
    """Lines read back from a file's end for a line with both stamps, when none of its matched lines has one."""

    def __init__(self) -> None:
        self._stat: dict[str, float] = {}
        self._pairs: dict[str, list[tuple[float, float, LogFile]]] = {}

    def stat(self, f: LogFile, raw: Sequence[str]) -> None:
        """A copy of ``/proc/stat``: its ``btime`` is the node's boot time."""
        btime = boot_time_of_stat("\n".join(raw))
        if btime is not None:
            self._stat[f.node or f.node_hint or ""] = btime

    def lines(self, f: LogFile, hits: Sequence[Signal], uptimes: Sequence[float | None], raw: Sequence[str]) -> None:
        """Wall-clock and uptime pairs of a file's matched lines, else of one of its last lines."""
        pairs = [(s.ts, up, f) for s, up in zip(hits, uptimes, strict=True)
                 if up is not None and abs(s.ts - up) >= 1.0]
        for line in raw[:-self.TAIL - 1:-1] if not pairs else ():
            up = kernel_uptime(line)
            wall = parse_timestamp(line) if up is not None else None
            if up is not None and wall is not None and wall[1] == "epoch":
                pairs.append((wall[0], up, f))
                break
        if pairs:
            self._pairs.setdefault(f.node or f.node_hint or "", []).extend(pairs)

    def boots(self, placed: Callable[[float, LogFile], float]) -> dict[str, float]:
        """Boot time per node (key ``""``: the bundle's only one, for files that name no node)."""
        out = {node: b for node, pairs in self._pairs.items()
               if (b := boot_time((placed(wall, f), up) for wall, up, f in pairs)) is not None}
        out.update(self._stat)
        if len(set(out.values())) == 1:
            out[""] = next(iter(out.values()))
        return out


class _SeenKernelEvents:
    """One kernel message copied into several files of a bundle (syslog, kern.log, messages, dmesg) is one
    event: a copy in another file with the same uptime stamp, or stamped within a couple of seconds, is dropped."""

    def __init__(self) -> None:
        self._kept: dict[tuple[str, str], list[tuple[str, float, float | None]]] = {}

    def again(self, sig: Signal, file: str, ts: float, uptime: float | None) -> bool:
        """Whether ``sig`` repeats a kernel event already kept from another file (else it is kept)."""
        key = (sig.node, sig.payload.text if isinstance(sig.payload, LogLine) else "")
        kept = self._kept.setdefault(key, [])
        for other_file, other_ts, other_up in kept:
            if other_file != file and (
                    (uptime is not None and uptime == other_up) or abs(ts - other_ts) <= SAME_EVENT_S):
                return True
        kept.append((file, ts, uptime))
        return False


def _mtime(f: LogFile) -> float:
    """When the file was last written (stdin: now)."""
    path = Path(f.name)
    return path.stat().st_mtime if f.name != "-" and path.is_file() else time.time()


def _metric_signals(f: LogFile, texts: Sequence[str]) -> list[Signal] | None:
    """Signals of an exporter scrape or an Alertmanager webhook body in the bundle, else None."""
    path = Path(f.name)
    ts = path.stat().st_mtime if f.name != "-" and path.is_file() else 0.0
    if looks_like_scrape(f.name, texts):
        try:
            return scrape_signals(path.name, "\n".join(texts) + "\n", node=f.node, ts=ts)
        except ValueError as exc:
            print(f"kmend analyze: {f.name}: not Prometheus text format: {exc}", file=sys.stderr)
            return []
    if f.name.endswith(".json"):
        return webhook_signals("\n".join(texts), node=f.node, ts=ts)
    return None


def add_dumps(source: BundleSource, detectors: DetectorSuite, jobs: set[str], ts: float) -> int:
    """Hand the bundle's Flight Recorder dumps to the detector; returns how many were readable.

    A dump whose name and flags say no job belongs to the bundle's only job, when it has one.
    """
    added = 0
    for dump in source.dumps():
        job = dump.job or (next(iter(jobs)) if len(jobs) == 1 else None)
        if job is None:
            print(f"kmend analyze: {dump.path}: no job for this Flight Recorder dump (use --job)", file=sys.stderr)
            continue
        try:
            detectors.add_flight_recorder_dump(job, dump.rank, dump.node or "unknown", dump.path.read_bytes(), ts,
                                               source=str(dump.path))
        except DumpError as exc:
            print(f"kmend analyze: {dump.path}: {exc}", file=sys.stderr)
            continue
        added += 1
    return added


def diagnose(args: argparse.Namespace) -> list[Incident]:
    """Incidents of the bundle named by the parsed arguments."""
    rules = load_rules(args.rules or [default_rules_dir()])
    progress_rules = load_progress_rules([default_progress_rules_dir()])
    labels_file = getattr(args, "pod_labels_file", None)
    labels = parse_labels_file(labels_file.read_text(encoding="utf-8"), str(labels_file)) if labels_file else {}
    source = BundleSource(args.paths, node=args.node, job=args.job, pod_labels=labels)
    window = args.window if args.window is not None else BUNDLE_WINDOW_S
    return diagnose_source(source, rules, FastMatcher(rules), progress_rules, window)


def diagnose_source(source: BundleSource, rules: Sequence[Rule], matcher: FastMatcher,
                    progress_rules: Sequence[ProgressRule], window: float = BUNDLE_WINDOW_S,
                    signal_rules: SignalRules | None = None) -> list[Incident]:
    """Incidents of one bundle, with the rules already compiled (``kmend eval corpus`` runs many)."""
    correlator = Correlator(window_s=window, bundle=True)
    # Nothing arrives after the bundle was cut: the dumps in it are all there will be.
    detectors = DetectorSuite(progress_rules, flight_recorder_settle_s=0.0)
    # The compiled log engine is shared; metric and alert series state belongs to this bundle alone.
    bundle_matcher = copy.copy(matcher)
    bundle_matcher.signals = SignalEvaluator(
        signal_rules if signal_rules is not None else load_signal_rules([default_metric_rules_dir()]),
        xid_rules=rules)
    analyzer = Analyzer(rules, correlator=correlator, detectors=detectors, matcher=bundle_matcher,
                        one_finding_per_signal=True)
    signals, placements, last_ts = collect(source, matcher.engine, progress_rules, analyzer.context)
    for job, node in sorted(placements):
        correlator.observe_placement(job, node)
    replay(analyzer, signals)
    if last_ts is not None:
        add_dumps(source, detectors, {job for job, _ in placements}, last_ts)
        analyzer.evaluate(last_ts)
    return correlator.incidents()


def replay(analyzer: Analyzer, signals: Sequence[Signal], tick_s: float = DETECTOR_TICK_S) -> None:
    """Feed time-ordered signals in ticks of bundle time, running the detectors around each tick.

    Before a tick the detectors see the silence that preceded it (a stall in a gap of
    the logs), after it the tick's progress. Empty stretches cost nothing.
    """
    i = 0
    while i < len(signals):
        start = signals[i].ts
        j = i
        while j < len(signals) and signals[j].ts < start + tick_s:
            j += 1
        analyzer.evaluate(start)
        analyzer.process(signals[i:j])
        analyzer.evaluate(signals[j - 1].ts)
        i = j


def _finding_json(f: Finding) -> dict[str, Any]:
    w = f.where
    return {
        "rule_id": f.rule_id, "fault_class": f.fault_class.value, "severity": f.severity.value,
        "hardware": f.hardware, "recommended_action": f.recommended_action.value, "ts": f.ts,
        "node": w.node, "gpu": w.gpu, "pci": w.pci, "port": w.port, "rank": w.rank, "job": w.job,
        "namespace": w.namespace, "message": f.message, "fields": dict(f.fields), "evidence": list(f.evidence),
    }


def incident_json(inc: Incident) -> dict[str, Any]:
    """One incident in the documented CLI JSON shape."""
    rc = inc.root_cause
    return {
        "fault_class": inc.fault_class.value,
        "hardware": inc.hardware,
        "recommended_action": inc.recommended_action.value,
        "root_cause": {"node": rc.node, "gpu": rc.gpu, "pci": rc.pci, "rank": rc.rank, "job": rc.job,
                       "namespace": rc.namespace},
        "findings": [_finding_json(f) for f in shown_findings(inc)],
    }


def shown_findings(inc: Incident) -> list[Finding]:
    """An incident's findings as reported: a finding its own escalation supersedes (Xid 48, then Xid 64 on the
    same GPU) is reported once, as the escalation, which names both lines as its evidence."""
    escalated = {f.id for f in inc.findings}
    return [f for f in inc.findings if f"{f.id}:escalated" not in escalated]


def render_table(incidents: Sequence[Incident]) -> str:
    """Human-readable summary: one row per incident, its first evidence line under it."""
    if not incidents:
        return "no incidents found"
    head = ("#", "FAULT CLASS", "HW", "ACTION", "NODE", "GPU/PCI", "RANK", "JOB", "FINDINGS", "ROOT RULE")
    rows = []
    for n, inc in enumerate(incidents, 1):
        rc = inc.root_cause
        rows.append((
            str(n), inc.fault_class.value, "yes" if inc.hardware else "no", inc.recommended_action.value,
            rc.node or "-", rc.pci or rc.gpu or "-", "-" if rc.rank is None else str(rc.rank),
            rc.job_key or "-", str(len(shown_findings(inc))), inc.root_finding.rule_id,
        ))
    widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in (head, *rows)]
    lines.append("")
    for n, inc in enumerate(incidents, 1):
        lines.append(f"#{n} {inc.root_finding.message[:160]}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``kmend analyze``; returns the process exit code."""
    try:
        incidents = diagnose(args)
    except RuleError as exc:
        print(f"kmend analyze: bad rule pack: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:
        print(f"kmend analyze: {exc}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps({"incidents": [incident_json(i) for i in incidents]}, indent=2))
    else:
        print(render_table(incidents))
    return 0 if getattr(args, "exit_zero", False) else exit_code(incidents)


EXIT_CLEAN, EXIT_HARDWARE, EXIT_OTHER = 0, 3, 4
"""``kmend analyze`` exit codes: nothing found; a hardware fault (a node or GPU at fault: gate a pre-flight
or CI job on it); only application or undetermined incidents. 2 is a bad rule pack or unreadable input."""


def exit_code(incidents: Sequence[Incident]) -> int:
    """The exit code for what the bundle showed."""
    if not incidents:
        return EXIT_CLEAN
    return EXIT_HARDWARE if any(i.hardware for i in incidents) else EXIT_OTHER
