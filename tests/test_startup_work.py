"""`kmend serve` start-up does each piece of work once: the rule database is compiled once (a rebuild reuses it),
and the rule packs read with libyaml give the documents the pure-Python parser gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import analyzer.matcher
from analyzer.metric_rules import default_metric_rules_dir
from analyzer.progress_rules import default_progress_rules_dir
from analyzer.rules import default_rules_dir, load_yaml
from healer.notify import LogNotifier
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster
from tests.builders import XID79, kernel


def test_the_rule_database_is_compiled_once_at_start_and_not_again_on_rebuild(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []
    real = analyzer.matcher.MultiMatcher

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(analyzer.matcher, "MultiMatcher", counting)
    k = make_kmend(Settings(database_url=f"sqlite:///{tmp_path / 'k.db'}", cluster="sim"),
                   cluster=build_cluster(4), notifier=LogNotifier())
    k.start()
    # Compiling the shipped rules' hyperscan database is about a third of a CPU second: once is enough.
    assert len(built) == 1
    k.rebuild()  # as after a batch that failed for good
    assert len(built) == 1
    # The rebuilt analyzer still matches with it.
    assert [f.fault_class.value for f in k.ingest([kernel("gpu-node-0001", XID79)]).findings] == ["gpu_lost"]
    k.store.close()


def test_libyaml_reads_every_shipped_pack_as_the_python_parser_does() -> None:
    files = [p for d in (default_rules_dir(), default_progress_rules_dir(), default_metric_rules_dir())
             for p in sorted(Path(d).glob("*.yaml"))]
    assert len(files) > 10
    assert getattr(yaml, "CSafeLoader", None) is not None  # PyYAML built with libyaml (the wheels are)
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert load_yaml(text) == yaml.safe_load(text), path
