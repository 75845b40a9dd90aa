"""Straggler detector: a rank (or node) that is persistently slower than its peers.

In synchronous training every rank's *step* time is the same (all wait for the
slowest), so the score uses each rank's own work: the compute phases when the hook
reports them, else the step time (which still separates ranks that are not
lock-stepped). Per rank, the median over a window of steps; across ranks, a robust
z-score (median/MAD) and the slowdown factor (rank median ÷ reference median).
A rank is a straggler when both pass their thresholds for `persistence`
consecutive evaluations, so a one-off blip is not one.

Per node, GPU metrics (SM clock, harmful throttle reasons, temperature, NIC
throughput) feed an IsolationForest; a node it isolates that also shows robust
evidence (clock well below its peers, thermal/power throttling, temperature far
above) is a slow node even without progress phases, and it makes a rank's
straggler finding a hardware one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial

import numpy as np

from analyzer.detectors.arrivals import common_arrivals, lag_window
from analyzer.detectors.book import JobBook, JobState
from analyzer.detectors.own_times import OwnWindows
from analyzer.records import Action, FaultClass, Finding, Severity, job_location
from models.isolation import NodeOutlierModel
from models.robust import MAD_TO_SIGMA, RobustScorer

DETECTOR_ID = "straggler-detector"
NODE_DETECTOR_ID = "straggler-node-detector"

HARMFUL_THROTTLE = 0x8 | 0x20 | 0x40 | 0x80
"""HW slowdown, SW thermal, HW thermal and HW power-brake clock-event reasons (NVML bitmask)."""


@dataclass(frozen=True, slots=True)
class StragglerConfig:
    """Thresholds for the rank and node scores."""

    window: int = 20
    """Steps per rank in the rank's median."""
    min_samples: int = 6
    """Steps a rank needs before it is scored."""
    min_ranks: int = 4
    """Ranks with data needed for a reference median."""
    z_min: float = 5.0
    """Robust z-score a straggler must reach."""
    min_slowdown: float = 1.05
    """Slowdown factor (rank median ÷ reference median) a straggler must reach."""
    persistence: int = 3
    """Consecutive evaluations (one per job step) a rank must stay flagged; for the arrival lag, see below."""
    persistence_in_steps: bool = True
    """The arrival lag counts `persistence` in the steps every rank reported, however many an evaluation brought
    (an agent's summary of step lines brings up to 16 at once), and is judged again when a late rank catches up;
    False: in evaluations, as the own-time score does."""
    noise_z: float = 4.0
    """The rank's excess over the reference must be this many standard errors of a median over the window,
    from the ranks' own step-to-step spread: contention that slows every rank unevenly is spread, not a straggler."""
    range_noise_z: float = 5.0
    """For a summary of hook reports (`_score_ranges`): its mean's excess must be this many standard errors (one
    judgement stands for up to 16 steps, with no per-step test behind it)."""
    above_fraction: float = 0.8
    """... and the rank must be slower than that step's median rank in at least this fraction of the window's
    steps (a slow rank is slow nearly every step; ranks slowed at random are not)."""
    replace_slowdown: float = 1.10
    """Slowdown from which a hardware-explained straggler is worth replacing the node."""
    node_min: int = 8
    """Nodes with metrics needed for the node model."""
    node_every_steps: int = 5
    """The node model runs every this many job steps (node metrics move slower than steps)."""
    clock_drop: float = 0.9
    """SM clock below this fraction of the peers' median is evidence of a slow node."""
    temp_z: float = 5.0
    """Temperature robust z-score that is evidence of a slow (hot) node."""
    random_state: int = 0
    """Seed of the node model."""
    lag_min_s: float = 0.1
    """A lock-stepped rank reporting each step at least this much later than its peers is behind
    (well above scheduling jitter and the clock offset between nodes) ..."""
    lag_fraction: float = 0.25
    """... and at least this fraction of the job's step period."""


@dataclass(slots=True)
class _Episode:
    streak: int = 0
    calm: int = 0
    open_step: int | None = None
    at: int = -1
    """The job's step at the episode's last evaluation."""


class StragglerDetector:
    """Emits one straggler finding per episode of a slow rank or node."""

    id = DETECTOR_ID

    def __init__(self, book: JobBook, config: StragglerConfig | None = None) -> None:
        self.book = book
        self.config = config or StragglerConfig()
        self._last_step: dict[str, tuple[int, int, int]] = {}
        self._ranks: dict[tuple[str, int], _Episode] = {}
        self._nodes: dict[tuple[str, str], _Episode] = {}
        self.failures: list[tuple[str, str]] = []
        """(job, error) for jobs whose data could not be scored; the suite drains and reports them."""
        self._lags: dict[tuple[str, int], _Episode] = {}
        self._range_at: dict[str, int] = {}
        """Job -> the last step of the newest summary range its ranks were compared over."""
        self._lag_mark: dict[str, tuple[tuple[int, tuple[int, ...]], list[int], np.ndarray] | None] = {}
        """Job -> ((run, ranks), common steps, arrival times) of its last arrival-lag score: the next reads only the
        steps reported since."""
        self._own: dict[str, tuple[int, OwnWindows]] = {}
        """Job -> (run, its ranks' newest own-time samples), kept from the samples added since the last score."""

    def forget(self, job: str) -> None:
        """Drop the episodes of a job that left the book."""
        self._last_step.pop(job, None)
        self._ranks = {k: e for k, e in self._ranks.items() if k[0] != job}
        self._nodes = {k: e for k, e in self._nodes.items() if k[0] != job}
        self._lags = {k: e for k, e in self._lags.items() if k[0] != job}
        self._range_at.pop(job, None)
        self._lag_mark.pop(job, None)
        self._own.pop(job, None)

    def evaluate(self, now: float) -> list[Finding]:
        """Findings for jobs whose step advanced since the last evaluation (the arrival lag also when a late rank
        caught up: its steps complete the ones its peers reported first)."""
        out: list[Finding] = []
        in_steps = self.config.persistence_in_steps
        for name, job in self.book.jobs.items():
            run, seen, seen_version = self._last_step.get(name, (job.run, -1, -1))
            if run != job.run:
                # A new run of the job: earlier episodes and steps belong to the old one.
                seen = seen_version = -1
                self._ranks = {k: e for k, e in self._ranks.items() if k[0] != name}
                self._nodes = {k: e for k, e in self._nodes.items() if k[0] != name}
                self._lags = {k: e for k, e in self._lags.items() if k[0] != name}
                self._range_at.pop(name, None)
            stepped = job.max_step > seen
            if not stepped and not (in_steps and job.version != seen_version):
                continue
            self._last_step[name] = (job.run, job.max_step, job.version)
            try:
                # Computed when first needed (a finding to explain, the node model's turn): most evaluations of a
                # busy fleet's jobs find nothing, and reading every GPU of a 64-node job each time was a third of it.
                evidence = cache(partial(self._node_evidence, name))
                found = self._score_ranks(name, job, now, evidence, stepped=stepped)
                found += self._score_lags(name, job, now, evidence)
                if stepped and job.max_step % self.config.node_every_steps == 0:
                    found += self._score_nodes(name, job, now, evidence())
            except Exception as exc:  # one job's data must not stop the other jobs' scoring
                self.failures.append((name, f"{type(exc).__name__}: {str(exc)[:300]}"))
                continue
            out.extend(found)
        return out

    # -- ranks -----------------------------------------------------------------

    def _score_ranks(self, name: str, job: JobState, now: float, hw: Callable[[], dict[str, str]], *,
                     stepped: bool = True) -> list[Finding]:
        cfg = self.config
        ranged = self._score_ranges(name, job, now, hw) if cfg.persistence_in_steps else None
        if ranged is not None or not stepped:
            return ranged or []
        run, own = self._own.get(name, (-1, None))
        if own is None or run != job.run:
            own = OwnWindows(cfg.window)
            self._own[name] = (job.run, own)
        own.update([(r, s) for r, s in job.ranks.items() if r >= 0])
        ranks = [r for r, s in job.ranks.items() if r >= 0 and len(s.times) >= cfg.min_samples]
        if len(ranks) < cfg.min_ranks:
            return []
        rows = own.newest(ranks)
        m = rows.shape[1]
        med = np.median(rows, axis=1)
        scorer = RobustScorer().fit(med)
        z, slow = scorer.score(med), scorer.ratio(med)
        candidates = (z >= cfg.z_min) & (slow >= cfg.min_slowdown)
        if candidates.any():
            candidates &= self._unusual(rows, med, scorer.center_)
        out = []
        for i, r in enumerate(ranks):
            ep = self._ranks.setdefault((name, r), _Episode())
            flagged = bool(candidates[i])
            if not self._step(ep, flagged, job.max_step):
                continue
            st = job.ranks[r]
            reason = hw().get(st.node)
            hardware = reason is not None
            action = Action.REPLACE_NODE if hardware and slow[i] >= cfg.replace_slowdown else Action.NOTIFY
            fields = {"slowdown": f"{slow[i]:.3f}", "z": f"{z[i]:.1f}", "window_steps": str(m),
                      "basis": st.basis, "rank_median_s": f"{med[i]:.4f}",
                      "reference_median_s": f"{scorer.center_:.4f}", "step": str(st.last_step)}
            if reason:
                fields["node_evidence"] = reason
            msg = (f"rank {r} on {st.node} is {slow[i]:.2f}x slower than the median rank ({st.basis} "
                   f"{med[i]:.3f} s vs {scorer.center_:.3f} s over {m} steps)")
            if reason:
                msg += f"; node: {reason}"
            out.append(Finding(
                id=f"{DETECTOR_ID}:{name}:{r}:{ep.open_step}", ts=now, fault_class=FaultClass.STRAGGLER,
                severity=Severity.WARNING, hardware=hardware, where=job_location(name, node=st.node, rank=r),
                rule_id=DETECTOR_ID, recommended_action=action,
                evidence=(st.signal_id,) if st.signal_id else (), message=msg, fields=fields,
            ))
        return out

    def _score_ranges(self, name: str, job: JobState, now: float, hw: Callable[[], dict[str, str]]
                      ) -> list[Finding] | None:
        """Ranks whose own work was slower than their peers' over the same steps: the agents' summaries of hook
        reports, which close at the same steps on every rank (None: the job's ranks sent no such summaries).

        The steps up to each step that every rank's summaries end at are judged once, when the last of them
        arrives: the rank's mean (each summary's slowest step set aside) against the ranks' median, in robust
        z-scores across ranks, and against the noise of a mean over those steps (the larger of its own spread
        without that step and the ranks' median spread over all steps). CPU contention or a pause makes every hit
        rank's work unsteady over those steps, so its mean is noise; a slow rank is slower step after step. Flagged
        steps count towards `persistence`; fewer than `min_samples` (summaries cut short by time) wait to be judged
        with the next.
        """
        cfg = self.config
        ranks = [r for r, st in job.ranks.items() if r >= 0 and st.has_phases and st.ranges]
        if len(ranks) < cfg.min_ranks:
            return None
        seen = [list(job.ranks[r].ranges) for r in ranks]
        common = sorted(set.intersection(*({x[0] for x in d} for d in seen)))
        if not common:
            return None
        prev = self._range_at.get(name, -1)
        out: list[Finding] = []
        for end in (e for e in common if e > prev):
            # Every rank's summaries since the last judged step up to this one cover the same steps (summaries cut
            # by time end at other steps on other nodes): pooled, one row per rank.
            n, mean, sd, full = (np.array(col, dtype=np.float64) for col in zip(
                *(_pooled([x[1:] for x in d if prev < x[0] <= end]) for d in seen), strict=True))
            if n.min() < cfg.min_samples:
                continue  # cut short by time: judged together with the next
            span = end - prev if prev >= 0 else int(n.min())
            prev = end
            scorer = RobustScorer().fit(mean)
            z, slow = scorer.score(mean), scorer.ratio(mean)
            se = np.maximum(np.maximum(sd, float(np.median(full))) / np.sqrt(n), 1e-12)
            flagged = ((z >= cfg.z_min) & (slow >= cfg.min_slowdown)
                       & ((mean - scorer.center_) / se >= cfg.range_noise_z))
            for i, r in enumerate(ranks):
                ep = self._ranks.setdefault((name, r), _Episode())
                if not self._step(ep, bool(flagged[i]), end, span=span, recovered=bool(slow[i] < cfg.min_slowdown)):
                    continue
                st = job.ranks[r]
                reason = hw().get(st.node)
                hardware = reason is not None
                action = Action.REPLACE_NODE if hardware and slow[i] >= cfg.replace_slowdown else Action.NOTIFY
                fields = {"slowdown": f"{slow[i]:.3f}", "z": f"{z[i]:.1f}", "window_steps": str(int(n[i])),
                          "basis": st.basis, "rank_mean_s": f"{mean[i]:.4f}",
                          "reference_median_s": f"{scorer.center_:.4f}", "step": str(end)}
                if reason:
                    fields["node_evidence"] = reason
                msg = (f"rank {r} on {st.node} is {slow[i]:.2f}x slower than the median rank ({st.basis} "
                       f"{mean[i]:.3f} s vs {scorer.center_:.3f} s a step, {int(n[i])} steps to step {end})")
                out.append(Finding(
                    id=f"{DETECTOR_ID}:{name}:{r}:{ep.open_step}", ts=now, fault_class=FaultClass.STRAGGLER,
                    severity=Severity.WARNING, hardware=hardware, where=job_location(name, node=st.node, rank=r),
                    rule_id=DETECTOR_ID, recommended_action=action,
                    evidence=(st.signal_id,) if st.signal_id else (),
                    message=msg + (f"; node: {reason}" if reason else ""), fields=fields,
                ))
        self._range_at[name] = prev
        return out

    def _unusual(self, rows: np.ndarray, med: np.ndarray, center: float) -> np.ndarray:
        """Ranks slower than the job's own noise explains, and slower in most steps of the window."""
        cfg = self.config
        spread = float(np.median(MAD_TO_SIGMA * np.median(np.abs(rows - med[:, None]), axis=1)))
        # Standard error of a median of m samples: about 1.2533 sigma / sqrt(m).
        se = max(1.2533 * spread / np.sqrt(rows.shape[1]), 1e-12)
        above = (rows > np.median(rows, axis=0)).mean(axis=1)
        result: np.ndarray = ((med - center) / se >= cfg.noise_z) & (above >= cfg.above_fraction)
        return result

    def _score_lags(self, name: str, job: JobState, now: float, hw: Callable[[], dict[str, str]]) -> list[Finding]:
        """Ranks of a lock-stepped job that report every step late.

        In synchronous data parallelism every rank's step takes the same wall time (all wait in
        the gradient all-reduce), so step times cannot tell the slow rank; but a rank whose own
        work between the all-reduce and its log line (optimizer step, host-side work) is slow
        reports each step after its peers, and they then wait for it. Ranks that report phases
        through the hook are scored on their compute time instead.
        """
        cfg = self.config
        ranks = [r for r, st in job.ranks.items() if r >= 0 and not st.has_phases]
        if len(ranks) < cfg.min_ranks:
            return []
        arrivals = [job.ranks[r].arrivals for r in ranks]
        key = (job.run, tuple(ranks))
        last = self._lag_mark.get(name)
        if cfg.persistence_in_steps and all(arrivals) and last is not None and last[0] == key \
                and last[1][-1] == min(a[-1][0] for a in arrivals):
            # Counted in common steps, the episodes move only when the newest step every rank reported does: until
            # the last rank reports it, a job whose other ranks stepped is not scored again.
            return []
        # Twice the window: a summary brings up to 16 new steps at once, and the window ending at each of them is
        # judged over the `window` steps before it.
        common, at = common_arrivals(arrivals, 2 * cfg.window,
                                     last[1:] if last is not None and last[0] == key else None)
        self._lag_mark[name] = (key, common, at) if common else None
        if len(common) < cfg.min_samples:
            return []
        lag = at - at.min(axis=0)
        windows: dict[int, tuple[np.ndarray, float, float, int]] = {}  # by the index of the window's last step
        out = []
        for i, r in enumerate(ranks):
            ep = self._lags.setdefault((name, r), _Episode())
            # Each common step not judged yet is judged on the window of steps ending at it: an agent's summary
            # brings up to 16 steps at once, and a rank late at each of them has been late for those steps, so a
            # slow rank is named at the first summary that shows `persistence` late windows in a row, not at the
            # next one (the windows slide a step at a time; without `persistence_in_steps`, the newest alone).
            ends = [j for j in range(cfg.min_samples - 1, len(common)) if common[j] > ep.at]
            if not cfg.persistence_in_steps:
                ends = ends[-1:]
            report: tuple[float, float, int] | None = None
            for j in ends:
                if j not in windows:
                    windows[j] = lag_window(at, lag, common, j, window=cfg.window, lag_min_s=cfg.lag_min_s,
                                            lag_fraction=cfg.lag_fraction)
                excess, period, threshold, n = windows[j]
                if (self._step(ep, bool(excess[i] >= threshold), job.max_step,
                               common=common[j] if cfg.persistence_in_steps else None)
                        and report is None):
                    report = (float(excess[i]), period, n)
            if report is None:
                continue
            lag_s, period, n = report
            st = job.ranks[r]
            slow = period / max(period - lag_s, 1e-3)
            reason = hw().get(st.node)
            fields = {"slowdown": f"{slow:.3f}", "window_steps": str(n), "basis": "arrival_lag",
                      "lag_s": f"{lag_s:.4f}", "period_s": f"{period:.4f}", "step": str(st.last_step)}
            if reason:
                fields["node_evidence"] = reason
            out.append(Finding(
                id=f"{DETECTOR_ID}:{name}:{r}:{ep.open_step}", ts=now, fault_class=FaultClass.STRAGGLER,
                severity=Severity.WARNING, hardware=reason is not None, where=job_location(name, node=st.node, rank=r),
                rule_id=DETECTOR_ID, recommended_action=Action.NOTIFY,
                evidence=(st.signal_id,) if st.signal_id else (), fields=fields,
                message=(f"rank {r} on {st.node} reports each step {lag_s:.3f} s after its peers "
                         f"(step period {period:.3f} s over {n} steps): the others wait for it"
                         + (f"; node: {reason}" if reason else "")),
            ))
        return out

    def _step(self, ep: _Episode, flagged: bool, step: int, *, common: int | None = None,
              span: int | None = None, recovered: bool = True) -> bool:
        """Advance an episode; True exactly when it should be reported (at the job's `step`).

        With `common` (the newest step every rank reported: the arrival lag's data), the streak counts the common
        steps since the episode's last evaluation, not evaluations: an agent's summary brings up to 16 steps at
        once (``collector.progress_summary.STEP_CUT``), and a rank flagged with all of them in its window has been
        late for those steps, not for one; an evaluation that brought no new common step moves nothing. With `span`,
        the streak counts that many steps (a summary range judged across ranks). An open episode is calm only in
        evaluations where the rank `recovered` (a short summary that is merely inconclusive does not end it).
        """
        if span is not None:
            n = span
        elif common is None:
            n = 1
        else:
            n = common - ep.at if ep.at >= 0 else 1
            ep.at = common
            if n <= 0:
                return False
        if flagged:
            ep.streak += n
            ep.calm = 0
            if ep.open_step is None and ep.streak >= self.config.persistence:
                ep.open_step = step
                return True
            return False
        ep.streak = 0
        if ep.open_step is not None and recovered:
            ep.calm += n
            if ep.calm >= self.config.persistence:
                ep.open_step = None  # recovered: a later slowdown is a new episode
        return False

    # -- nodes -------------------------------------------------------------------

    def _features(self, name: str) -> tuple[list[str], np.ndarray]:
        nodes, rows = [], []
        for node in sorted(self.book.nodes_of(name)):
            devs = self.book.gpu.get(node)
            if not devs:
                continue
            def vals(feat: str, devs: dict[str, dict[str, tuple[float, float]]] = devs) -> list[float]:
                return [f[feat][1] for f in devs.values() if feat in f]
            clock, temp, thr, nic = vals("sm_clock"), vals("temp"), vals("throttle"), vals("nic_tx")
            rows.append([
                min(clock) if clock else np.nan,
                max(temp) if temp else np.nan,
                float(any(int(t) & HARMFUL_THROTTLE for t in thr)) if thr else np.nan,
                sum(nic) if nic else np.nan,
            ])
            nodes.append(node)
        x = np.array(rows, dtype=np.float64).reshape(len(rows), 4)
        # Drop features no node reports; fill a node's gap with the column median.
        keep = ~np.all(np.isnan(x), axis=0)
        x = x[:, keep]
        if x.size:
            med = np.nanmedian(x, axis=0)
            x = np.where(np.isnan(x), med, x)
        return nodes, x

    def _node_evidence(self, name: str) -> dict[str, str]:
        """Robust, explainable evidence of a slow node: clock drop, harmful throttling, heat."""
        cfg = self.config
        out: dict[str, str] = {}
        clocks: dict[str, float] = {}
        temps: dict[str, float] = {}
        for node in self.book.nodes_of(name):
            for dev, f in self.book.gpu.get(node, {}).items():
                if "throttle" in f and int(f["throttle"][1]) & HARMFUL_THROTTLE:
                    out[node] = f"GPU {dev} clock throttled (reasons 0x{int(f['throttle'][1]):x})"
                if "sm_clock" in f:
                    clocks[node] = min(clocks.get(node, np.inf), f["sm_clock"][1])
                if "temp" in f:
                    temps[node] = max(temps.get(node, -np.inf), f["temp"][1])
        if len(clocks) >= cfg.min_ranks:
            ref = float(np.median(list(clocks.values())))
            for node, c in clocks.items():
                if ref > 0 and c < cfg.clock_drop * ref:
                    out.setdefault(node, f"SM clock {c:.0f} MHz vs {ref:.0f} MHz on peers")
        if len(temps) >= cfg.min_ranks:
            sc = RobustScorer(rel_floor=0.02).fit(np.array(list(temps.values())))
            for node, t in temps.items():
                if float(sc.score(np.array([t]))[0]) >= cfg.temp_z:
                    out.setdefault(node, f"GPU temperature {t:.0f} C vs {sc.center_:.0f} C on peers")
        return out

    def _score_nodes(self, name: str, job: JobState, now: float, evidence: dict[str, str]) -> list[Finding]:
        cfg = self.config
        nodes, x = self._features(name)
        if len(nodes) < cfg.node_min or x.shape[1] == 0:
            return []
        flagged: set[str] = set()
        if evidence:
            model = NodeOutlierModel(random_state=cfg.random_state).fit(x)
            pred = model.predict(x)
            flagged = {n for n, p in zip(nodes, pred, strict=True) if p == -1 and n in evidence}
        out = []
        for node in nodes:
            ep = self._nodes.setdefault((name, node), _Episode())
            if not self._step(ep, node in flagged, job.max_step):
                continue
            ranks = sorted(r for r, s in job.ranks.items() if s.node == node and r >= 0)
            out.append(Finding(
                id=f"{NODE_DETECTOR_ID}:{name}:{node}:{ep.open_step}", ts=now, fault_class=FaultClass.STRAGGLER,
                severity=Severity.WARNING, hardware=True, where=job_location(name, node=node),
                rule_id=NODE_DETECTOR_ID, recommended_action=Action.NOTIFY, evidence=(),
                message=f"{node} is an outlier among the {len(nodes)} nodes of {name}: {evidence[node]}",
                fields={"node_evidence": evidence[node], "ranks": ",".join(map(str, ranks[:16])),
                        "nodes": str(len(nodes))},
            ))
        return out



def _pooled(parts: list[tuple[int, float, float, float]]) -> tuple[int, float, float, float]:
    """Consecutive summaries of one rank, each (steps, mean, sd, sd of all steps), as one."""
    steps = sum(p[0] for p in parts)
    if steps == 0:
        return 0, 0.0, 0.0, 0.0
    mean = sum(p[0] * p[1] for p in parts) / steps

    def sd(k: int) -> float:
        return float(max(sum(p[0] * (p[k] ** 2 + p[1] ** 2) for p in parts) / steps - mean * mean, 0.0) ** 0.5)

    return steps, mean, sd(2), sd(3)
