"""Running `kmend analyze` on one file from a test: through the CLI (JSON out) or through the bundle path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from analyzer.matcher import FastMatcher
from analyzer.progress_rules import default_progress_rules_dir, load_progress_rules
from analyzer.records import Incident
from analyzer.rules import Rule
from collector.bundle import BundleSource
from kmend.bundle_analysis import diagnose_source
from kmend.cli import build_parser
from kmend.corpus_eval import bundle_path


def analyze_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str) -> list[Any]:
    """`kmend analyze node.log --format json` on `text`: the incidents it prints."""
    path = tmp_path / "node.log"
    path.write_text(text)
    args = build_parser().parse_args(["analyze", str(path), "--format", "json"])
    assert args.func(args) in (0, 3, 4)  # the exit code says what was found (tests/test_analyze.py)
    incidents: list[Any] = json.loads(capsys.readouterr().out)["incidents"]
    return incidents


def analyze_bundle(tmp_path: Path, source: str, text: str, rules: list[Rule]) -> list[Incident]:
    """`text` written where a bundle holds lines arriving as `source`, diagnosed as `kmend analyze` does."""
    path = bundle_path(tmp_path, source)
    path.parent.mkdir(parents=True)
    path.write_text(text, encoding="utf-8")
    return diagnose_source(BundleSource([str(tmp_path)]), rules, FastMatcher(rules),
                           load_progress_rules([default_progress_rules_dir()]))
