"""`kmend rules test --file` reads a saved log as `kmend analyze` does (terminal-wrapped lines joined, NVRM
messages split over lines folded, prefixes off): on real development excerpts that need it, both name the
same rules with the same extracted fields."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from analyzer.corpus import CorpusEntry
from kmend.corpus_eval import load_corpus
from tests.conftest import REPO

CORPUS = Path(__file__).resolve().parent / "corpus"
# nvidia-docker#543: the container hook's requirement error, wrapped by the terminal across five lines;
# cosmic-epoch#3411: NVRM's open-module probe message over eight "NVRM:" lines.
WANTED = {"nvidia-docker-543-requirement-wrapped-terminal": "nvidia-container-requirement-unsatisfied",
          "cosmic-epoch-3411-open-module-no-gsp": "nvidia-gpu-unsupported-by-driver"}


@pytest.fixture(scope="module")
def entries() -> dict[str, CorpusEntry]:
    found = {e.id: e for e in load_corpus(CORPUS) if e.id in WANTED}
    assert set(found) == set(WANTED) and {e.split for e in found.values()} == {"dev"}
    return found


def _kmend(*args: str, stdin: str | None = None) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "kmend.cli", *args], cwd=REPO, input=stdin, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@pytest.mark.parametrize("entry_id", list(WANTED))
def test_rules_test_names_what_analyze_finds(entries: dict[str, CorpusEntry], entry_id: str,
                                             tmp_path: Path) -> None:
    entry = entries[entry_id]
    log = tmp_path / "saved.log"
    log.write_text(entry.text, encoding="utf-8")
    analyzed = _kmend("analyze", "--format", "json", "--exit-zero", str(log))
    found = {(f["rule_id"], json.dumps(f["fields"], sort_keys=True))
             for inc in analyzed["incidents"] for f in inc["findings"]}
    assert WANTED[entry_id] in {rule for rule, _ in found}
    for how in ("file", "stdin"):
        tested = (_kmend("rules", "test", "--file", str(log), "--json") if how == "file" else
                  _kmend("rules", "test", "--file", "-", "--json", stdin=entry.text))
        events = tested["events"]
        matched = {(m["rule_id"], json.dumps(m["extracted"], sort_keys=True)) for ev in events for m in ev["matches"]}
        assert matched == found, how
        # One event for the message the terminal or the driver spread over lines, as analyze reads it.
        [event] = [ev for ev in events if ev["matches"]]
        assert len(event["event"]) > max(len(ln) for ln in entry.text.splitlines())
        assert len(events) < len([ln for ln in entry.text.splitlines() if ln.strip()])


def test_blank_lines_are_no_events() -> None:
    assert _kmend("rules", "test", "--file", "-", "--json", stdin="\n  \n\n")["events"] == []
