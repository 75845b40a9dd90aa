"""The rule benchmark runs end to end on a small mix and prints one JSON object per result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_rule_benchmark_prints_one_json_object_per_result() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/rules.py", "--mb", "0.5", "--naive-mb", "0.05"],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=True,
    )
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    [summary] = [r for r in results if "summary" in r]
    results = [r for r in results if r is not summary]
    raw = [r for r in results if r["engine"].startswith("raw hyperscan")]
    assert all(r["findings"] >= r["fault_lines"] for r in raw)  # hits before confirmation: never fewer
    results = [r for r in results if r not in raw]
    assert [r["input"] for r in results[:2] + results[4:]] == ["file bytes", "list of str lines", "list of str lines"]
    fast, lines, service, received, naive = results
    # The service path is ingest's own call, on batches as the service decodes the agent's bodies.
    assert service["measures"].startswith("FastMatcher.match(signals) per batch")
    assert service["input"].startswith("POST /v1/signals bodies of 1000 log signals")
    assert received["measures"].startswith("FastMatcher.match_lines(")
    assert fast["findings"] == lines["findings"] == fast["fault_lines"] > 0
    # The service path builds findings (container rules only, as a pod's lines get): the same from either input.
    assert service["findings"] == received["findings"] > 0
    assert naive["measured_on_subset"] is True
    # The quoted figures are the same run's ratios to raw hyperscan, as the per-path lines give them.
    assert (summary["file_path"], summary["service_path"], summary["service_path_received_bytes"]) == (
        fast["ratio_to_raw"], service["ratio_to_raw"], received["ratio_to_raw"])
    assert all(summary[k] > 0 for k in ("file_path", "service_path", "line_list_path"))
    assert all(r["mb_per_s_per_core"] > 0 and r["lines_per_s_per_core"] > 0 for r in results)


@pytest.mark.slow
def test_fuzz_campaign_finds_no_server_error_and_no_schema_violation(database_url: str) -> None:
    if not (Path(sys.executable).parent / "st").exists():
        pytest.skip("schemathesis is not installed")
    examples = os.environ.get("KMEND_FUZZ_EXAMPLES", "5")
    proc = subprocess.run([sys.executable, "bench/fuzz.py", "--max-examples", examples, "--database-url", database_url],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, result
    assert result["operations_tested"] == result["operations"] >= 20
    assert result["failures"] == result["errors"] == 0
    print(json.dumps({k: result[k] for k in ("operations", "max_examples", "seconds")}
                     | {"cases": [r["summary"] for r in (result["ingest_token_run"], result["operator_token_run"])]}))


def test_progress_rule_benchmark_compares_both_matchers_on_the_same_lines() -> None:
    proc = subprocess.run(
        [sys.executable, "bench/progress_rules.py", "--lines", "3000", "--repeat", "1"],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=True,
    )
    by_rule, combined = [json.loads(line) for line in proc.stdout.splitlines()]
    assert by_rule["progress_lines"] == combined["progress_lines"] > 0
    assert by_rule["lines"] == combined["lines"] == 3000
    assert by_rule["ratio_to_rule_by_rule"] == 1.0 and combined["us_per_line"] > 0


def test_survey_benchmark_samples_the_loop_and_prints_its_cost() -> None:
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, "bench/survey.py", "--rounds", "1", "--seconds", "2"],
                          capture_output=True, text=True, cwd=REPO, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [result] = [json.loads(line) for line in proc.stdout.splitlines()]
    assert result["surveys"] >= 1 and result["main_thread_samples_per_survey"] > 50
    assert result["steps_per_s_unsampled"][0] > 0 and result["sampled_over_unsampled_median"] > 0
    assert 0 < result["py_spy_cpu_s_per_survey"] < 2.0
