"""Metric and alert rules evaluated on MetricSample signals (pure, stateful, bounded).

Counters need the previous sample and gauges a run of consecutive samples, so the
evaluator keeps one small state per series (node, metric, identifying labels). Time
comes only from the signals; series not seen for ``stale_s`` of signal time, and the
least recently seen beyond ``max_series``, are forgotten, so a fleet of churning pods
cannot grow it without bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from analyzer.matcher import normalize_pci
from analyzer.metric_rules import (
    AlertRule,
    Condition,
    MetricExample,
    MetricRule,
    SignalRules,
    labels_match,
    parse_exposition,
)
from analyzer.records import Finding, Location
from analyzer.rules import Rule, RuleError
from collector.signal import MetricSample, Signal, Source

# Labels that change without the series changing: pod mapping of the DCGM exporter, the
# health result's error code, driver version, alert text. They are not part of its identity.
_VOLATILE = frozenset({
    "pod", "namespace", "container", "exported_pod", "exported_namespace", "exported_container",
    "err_code", "err_msg", "health_error_code", "Hostname", "hostname", "modelName",
    "DCGM_FI_DRIVER_VERSION", "DCGM_FI_PROCESS_NAME", "status", "summary", "description", "state", "phys_state",
})
# Labels copied into a finding's fields when present: what an operator needs to find the part.
# DCGM reports "blank" (unsupported, not found) as values at the top of the int64 range.
_DCGM_BLANK = 9.2e18
_KEPT = ("uuid", "UUID", "pci", "pci_bus_id", "device", "port", "link", "xid", "health_watch",
         "health_error_code", "err_code", "err_msg", "modelName")


def _num(v: float) -> str:
    return str(int(v)) if v == int(v) else f"{v:g}"


class _Series:
    """Last sample of one series and, per rule, how many consecutive samples met its condition.

    The state before the last sample is kept too: a batch the store rolled back comes again,
    and its samples must give the same findings (same ids) the second time.
    """

    __slots__ = ("prev", "streak", "ts", "value")

    def __init__(self) -> None:
        self.value: float | None = None
        self.ts = 0.0
        self.streak: dict[str, int] = {}
        self.prev: tuple[float | None, float, dict[str, int]] = (None, 0.0, {})


@dataclass(frozen=True, slots=True)
class SeriesState:
    """What one series' evaluation needs from its past: stored so a restarted service goes on from it."""

    key: tuple[str, ...]
    """Node, metric name and the identifying labels (``name=value``, sorted)."""
    value: float
    """The series' last sample."""
    ts: float
    """Time of that sample."""
    streak: Mapping[str, int]
    """Per rule id, how many consecutive samples up to it met the rule's condition."""


@dataclass(frozen=True, slots=True)
class _Hit:
    rule: MetricRule
    delta: float | None
    previous: float | None


def _key(sig: Signal, sample: MetricSample) -> tuple[str, ...]:
    """A series' identity: node, metric name and its identifying labels."""
    return (sig.node, sample.name, *sorted(f"{k}={v}" for k, v in sample.labels.items() if k not in _VOLATILE))


def _location(signal: Signal, labels: Mapping[str, str]) -> Location:
    pci_raw = labels.get("pci") or labels.get("pci_bus_id")
    dev, port = labels.get("device"), labels.get("port")
    return Location(
        node=signal.node, gpu=labels.get("gpu") or None, pci=normalize_pci(pci_raw) if pci_raw else None,
        port=f"{dev}/{port}" if dev and port else None,
    )


def exposition(sample: MetricSample) -> str:
    """The sample as an exposition line (labels sorted, alert text left out)."""
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k not in ("summary", "description"))
    return f"{sample.name}{{{inner}}} {_num(sample.value)}"


class SignalEvaluator:
    """Fires metric rules on series of samples and alert rules on firing alerts."""

    def __init__(self, rules: SignalRules, *, xid_rules: Iterable[Rule] = (), max_series: int = 200_000,
                 stale_s: float = 6 * 3600.0) -> None:
        self.rules = rules
        self.by_metric: dict[str, list[MetricRule]] = {}
        for r in rules.metric:
            for name in r.metrics:
                self.by_metric.setdefault(name, []).append(r)
        # Xid codes classify like the kernel's NVRM line of the same code: one catalog for both.
        self.xid: dict[str, Rule] = {r.id: r for r in xid_rules if r.id.startswith("xid-")}
        self.max_series = max_series
        self.stale_s = stale_s
        self._series: OrderedDict[tuple[str, ...], _Series] = OrderedDict()
        self._newest = 0.0
        self._changed: set[tuple[str, ...]] = set()

    def __len__(self) -> int:
        return len(self._series)

    # -- matching --------------------------------------------------------------------

    def match(self, signals: Iterable[Signal]) -> list[Finding]:
        """Findings of the metric and alert samples of a batch, in signal order."""
        out: list[Finding] = []
        for sig in signals:
            sample = sig.payload
            if not isinstance(sample, MetricSample):
                continue
            if sig.source is Source.ALERT:
                finding = self.alert_finding(sig, sample)
                if finding is not None:
                    out.append(finding)
            elif sample.name in self.by_metric:
                out.extend(self.metric_findings(sig, sample))
        self._evict()
        return out

    def take_changed(self) -> list[SeriesState]:
        """The states of the series that took a sample since the last call (for the caller to store)."""
        out = []
        for key in self._changed:
            series = self._series.get(key)
            if series is not None and series.value is not None:
                out.append(SeriesState(key, series.value, series.ts, dict(series.streak)))
        self._changed = set()
        return out

    def restore(self, states: Iterable[SeriesState]) -> None:
        """Put back stored series states (a series already holding a newer sample keeps it).

        After a restart a counter's next sample is then judged against its last one: an increase
        across the restart is found, and a counter that did not move is no increase from zero.
        """
        for st in sorted(states, key=lambda s: s.ts):
            series = self._series.get(st.key)
            if series is not None and series.ts > st.ts:
                continue
            series = self._series[st.key] = _Series()
            self._series.move_to_end(st.key)
            series.value, series.ts, series.streak = st.value, st.ts, dict(st.streak)
            series.prev = (st.value, st.ts, dict(st.streak))
            self._newest = max(self._newest, st.ts)
        self._evict()

    def series_keys(self, signals: Iterable[Signal]) -> list[tuple[str, ...]]:
        """Keys of the watched series these signals' samples move, each once (their state is to be read first)."""
        keys: dict[tuple[str, ...], None] = {}
        for sig in signals:
            sample = sig.payload
            if (isinstance(sample, MetricSample) and sig.source is not Source.ALERT and sample.name in self.by_metric
                    and sample.value < _DCGM_BLANK):
                keys[_key(sig, sample)] = None
        return list(keys)

    def adopt(self, keys: Iterable[tuple[str, ...]], stored: Mapping[tuple[str, ...], SeriesState]) -> None:
        """Take the stored states of these series as their current ones, and forget those with none stored.

        Several replicas share PostgreSQL and a node's batches may reach any of them: what this replica kept
        from a series' earlier samples may be older than what another replica committed since, so the
        stored state (read in the batch's transaction) is the series' past.
        """
        for key in keys:
            st = stored.get(key)
            if st is None:
                self._series.pop(key, None)
                continue
            series = self._series[key] = _Series()
            self._series.move_to_end(key)
            series.value, series.ts, series.streak = st.value, st.ts, dict(st.streak)
            series.prev = (st.value, st.ts, dict(st.streak))
            self._newest = max(self._newest, st.ts)

    def watching(self, name: str) -> list[MetricRule]:
        """Metric rules that look at this metric name."""
        return list(self.by_metric.get(name, ()))

    def alert_rule(self, labels: Mapping[str, str]) -> AlertRule | None:
        """The first alert rule matching these labels."""
        return next((r for r in self.rules.alert if r.matches(labels)), None)

    def alert_finding(self, sig: Signal, sample: MetricSample) -> Finding | None:
        """The finding of a firing alert, or None (resolved, or no rule names it)."""
        labels = sample.labels
        if sample.value <= 0 or labels.get("status", "firing") != "firing":
            return None
        rule = self.alert_rule({"alertname": sample.name, **labels})
        if rule is None:
            return None
        fields = {"alertname": sample.name, "status": "firing"}
        fields.update({k: labels[k] for k in (*_KEPT, "severity", "condition", "reason") if labels.get(k)})
        text = labels.get("summary") or labels.get("description") or ""
        fault_class, severity = rule.fault_class, rule.severity
        hardware, action = rule.hardware, rule.recommended_action
        code = next((labels[k] for k in rule.xid_labels if labels.get(k, "0") not in ("", "0")), None)
        xr = self.xid.get(f"xid-{code}") if code else None
        if xr is not None:
            fault_class, severity, action = xr.fault_class, xr.severity, xr.recommended_action
            hardware = xr.hardware is True
            fields.update(xid=str(code), classified_by=xr.id)
        return Finding(
            id=f"{rule.id}:{sig.id}", ts=sig.ts, fault_class=fault_class, severity=severity,
            hardware=hardware, where=_location(sig, labels), rule_id=rule.id,
            recommended_action=action, evidence=(sig.id,),
            message=f"alert {sample.name} firing" + (f": {text}" if text else "")[:500], fields=fields,
        )

    def metric_findings(self, sig: Signal, sample: MetricSample) -> list[Finding]:
        """Findings of one metric sample; updates the series' state."""
        if sample.value >= _DCGM_BLANK:
            return []
        key = _key(sig, sample)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series()
        else:
            self._series.move_to_end(key)
            if sig.ts < series.ts:
                return []  # older than what this series has seen: a late copy, not news
            if sig.ts == series.ts and sample.value == series.value:
                series.value, series.ts, streak = series.prev  # the same sample again: judge it as before
                series.streak = dict(streak)
        series.prev = (series.value, series.ts, dict(series.streak))
        hits = [h for r in self.by_metric[sample.name] if (h := self._test(r, series, sig, sample)) is not None]
        series.value, series.ts = sample.value, sig.ts
        self._newest = max(self._newest, sig.ts)
        self._changed.add(key)
        return [self._finding(h, sig, sample) for h in hits]

    def _test(self, rule: MetricRule, series: _Series, sig: Signal, sample: MetricSample) -> _Hit | None:
        if rule.labels and not labels_match(rule.labels, sample.labels):
            return None
        value, prev = sample.value, series.value
        if rule.condition is Condition.INCREASED:
            if prev is None:
                if rule.baseline != "zero" or rule.min_rate_per_minute is not None:
                    return None
                base = 0.0
            else:
                # A counter that went down was reset (driver reload, port reset): its value is the increase.
                base = prev if value >= prev else 0.0
            delta = value - base
            if delta < rule.min_delta:
                return None
            if rule.min_rate_per_minute is not None:
                dt = sig.ts - series.ts
                if dt > 0 and delta * 60.0 / dt < rule.min_rate_per_minute:
                    return None
            return _Hit(rule, delta, prev)
        if rule.condition is Condition.LEFT:
            return self._left(rule, series, value, prev)
        if rule.condition is Condition.ABOVE:
            holds = rule.threshold is not None and value > rule.threshold
        elif rule.condition is Condition.BELOW:
            holds = rule.threshold is not None and value < rule.threshold
        elif rule.condition is Condition.EQUALS:
            holds = value in rule.values
        else:
            holds = rule.mask is not None and (int(value) & rule.mask) != 0
        streak = series.streak.get(rule.id, 0) + 1 if holds else 0
        series.streak[rule.id] = streak
        if not holds or streak < rule.for_samples:
            return None
        # Once per episode: when the run reaches for_samples, not on every later sample.
        if rule.every_sample or streak == rule.for_samples or (rule.refire_on_change and value != prev):
            return _Hit(rule, None, prev)
        return None

    @staticmethod
    def _left(rule: MetricRule, series: _Series, value: float, prev: float | None) -> _Hit | None:
        """``left``: the streak is -1 while the value is one of ``values`` (armed), then counts the samples since it
        left them; 0 for a series never seen in them. Fires once per departure, after ``for_samples`` samples."""
        if value in rule.values:
            series.streak[rule.id] = -1
            return None
        streak = series.streak.get(rule.id, 0)
        if streak == 0:
            return None
        streak = 1 if streak < 0 else streak + 1
        series.streak[rule.id] = streak
        return _Hit(rule, None, prev) if streak == rule.for_samples else None

    def _finding(self, hit: _Hit, sig: Signal, sample: MetricSample) -> Finding:
        rule, labels = hit.rule, sample.labels
        fields = {"metric": sample.name, "value": _num(sample.value)}
        if hit.delta is not None:
            fields["delta"] = _num(hit.delta)
        if hit.previous is not None:
            fields["previous"] = _num(hit.previous)
        fields.update({k.lower() if k == "UUID" else k: labels[k] for k in _KEPT if labels.get(k)})
        fault_class, severity = rule.fault_class, rule.severity
        hardware, action = rule.hardware, rule.recommended_action
        if rule.classify_xid is not None:
            code = labels.get("xid", "") if rule.classify_xid == "label" else _num(sample.value)
            fields["xid"] = code
            xr = self.xid.get(f"xid-{code}")
            if xr is not None:
                fault_class, severity, action = xr.fault_class, xr.severity, xr.recommended_action
                hardware = xr.hardware is True
                fields["classified_by"] = xr.id
        gpu = labels.get("gpu")
        where = "GPU " + gpu if gpu else ""
        change = f" (+{_num(hit.delta)})" if hit.delta is not None else ""
        return Finding(
            id=f"{rule.id}:{sig.id}", ts=sig.ts, fault_class=fault_class, severity=severity, hardware=hardware,
            where=_location(sig, labels), rule_id=rule.id, recommended_action=action, evidence=(sig.id,),
            message=(f"{where}: " if where else "") + exposition(sample)[:460] + change, fields=fields,
        )

    def _evict(self) -> None:
        series = self._series
        while len(series) > self.max_series:
            series.popitem(last=False)
        horizon = self._newest - self.stale_s
        while series:
            first = next(iter(series.values()))
            if first.ts >= horizon:
                break
            series.popitem(last=False)


def example_signals(example: MetricExample, *, node: str = "example-node") -> list[Signal]:
    """An example's exposition lines as consecutive DCGM/NVML/IB signals of one node."""
    out: list[Signal] = []
    for i, line in enumerate(example.samples):
        parsed = parse_exposition([line])
        if len(parsed) != 1:
            raise ValueError(f"{line!r} is not one sample in Prometheus text format")
        name, value, labels = parsed[0]
        source = Source.DCGM if name.startswith("DCGM_") else Source.IB if name.startswith("ib_") else Source.NVML
        out.append(Signal(f"example/{i}", node, source, i * example.seconds_apart,
                          MetricSample(name, value, labels)))
    return out


def check_examples(path: str, rule: MetricRule) -> None:
    """Replay a rule's examples (must fire on their last sample) and counter-examples (never fire)."""
    for kind, examples, want in (("examples", rule.examples, True),
                                 ("counter_examples", rule.counter_examples, False)):
        for i, ex in enumerate(examples):
            try:
                signals = example_signals(ex)
            except ValueError as exc:
                raise RuleError(path, rule.id, f"{kind}[{i}]", str(exc)) from exc
            for sig in signals:
                assert isinstance(sig.payload, MetricSample)
                if sig.payload.name not in rule.metrics:
                    raise RuleError(path, rule.id, f"{kind}[{i}]",
                                    f"metric {sig.payload.name!r} is not one of the rule's metrics")
            ev = SignalEvaluator(SignalRules(metric=(rule,)))
            fired = [bool(ev.match([s])) for s in signals]
            if want and not fired[-1]:
                raise RuleError(path, rule.id, f"{kind}[{i}]", "does not fire on its last sample")
            if not want and any(fired):
                raise RuleError(path, rule.id, f"{kind}[{i}]", "fires")
