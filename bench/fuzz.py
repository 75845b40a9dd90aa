"""The campaign against ``kmend serve``: schemathesis over the OpenAPI schema with both tokens.

    python bench/fuzz.py                      # 50 examples per operation, prints one JSON object
    python bench/fuzz.py --max-examples 200 --database-url postgresql+psycopg://...

A real service (simulated cluster, SQLite unless told otherwise, all three tokens set) is
served on a loopback port. The collectors' operations (tags ingest and alerts) run with the
ingest token, every other operation with the operator token; the checks are
``not_a_server_error`` and ``response_schema_conformance``. Exit status 0 only with no 5xx
and no schema violation. The hostile-input suite (``tests/test_hostile_*.py``) is the other
half of ``make fuzz``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kmend.app import create_app
from kmend.demo import serve_in_thread
from kmend.settings import Settings
from kmend.wiring import make_kmend
from sim.cluster import build_cluster

TOKENS = {"ingest_token": "fuzz-ingest", "reader_token": "fuzz-reader", "operator_token": "fuzz-operator"}
COLLECTOR_TAGS = ("ingest", "alerts")


def _st(schema: Path, url: str, token: str, filters: list[str], args: argparse.Namespace,
        report: Path) -> tuple[int, dict[str, object]]:
    cmd = [str(Path(sys.executable).with_name("st")), "run", str(schema), "--url", url,
           "-H", f"Authorization: Bearer {token}", "--max-examples", str(args.max_examples),
           "--checks", "not_a_server_error,response_schema_conformance", "--seed", str(args.seed),
           "--request-timeout", "30", "--report", "junit", "--report-junit-path", str(report),
           "--phases", "examples,coverage,fuzzing", "--continue-on-failure", *filters]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=schema.parent)  # its cache stays in tmp
    tail = proc.stdout.strip().splitlines()[-12:]
    if proc.returncode and "-v" in sys.argv:
        print(proc.stdout, file=sys.stderr)
    return proc.returncode, {"exit": proc.returncode, "summary": tail}


def main() -> int:
    ap = argparse.ArgumentParser(description="schemathesis over kmend's OpenAPI schema")
    ap.add_argument("--max-examples", type=int, default=50)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--database-url", default=None)
    ap.add_argument("-v", action="store_true", help="print schemathesis output of failing runs")
    args = ap.parse_args()
    if not Path(sys.executable).with_name("st").exists():
        print(json.dumps({"bench": "fuzz", "skipped": "schemathesis is not installed (pip install -e '.[dev]')"}))
        return 0
    with tempfile.TemporaryDirectory(prefix="kmend-fuzz-") as tmp:
        settings = Settings(database_url=args.database_url or f"sqlite:///{tmp}/k.db", cluster="sim",
                            healer_interval_s=0.2, symptom_settle_s=0.5, **TOKENS)
        kmend = make_kmend(settings, cluster=build_cluster(16))
        app = create_app(kmend, settings)
        schema = Path(tmp) / "openapi.json"
        schema.write_text(json.dumps(app.openapi()))
        operations = sum(len(ops) for ops in app.openapi()["paths"].values())
        started = time.monotonic()
        with serve_in_thread(app) as url:
            tags = [x for t in COLLECTOR_TAGS for x in ("--include-tag", t)]
            not_tags = [x for t in COLLECTOR_TAGS for x in ("--exclude-tag", t)]
            rc_i, ingest = _st(schema, url, TOKENS["ingest_token"], tags, args, Path(tmp) / "ingest.xml")
            rc_o, operator = _st(schema, url, TOKENS["operator_token"], not_tags, args, Path(tmp) / "op.xml")
            cases = _junit_counts(Path(tmp) / "ingest.xml", Path(tmp) / "op.xml")
        kmend.store.close()
    print(json.dumps({"bench": "fuzz", "operations": operations, "max_examples": args.max_examples,
                      "seed": args.seed, "seconds": round(time.monotonic() - started, 1), **cases,
                      "ingest_token_run": ingest, "operator_token_run": operator}))
    return 0 if rc_i == rc_o == 0 else 1


def _junit_counts(*paths: Path) -> dict[str, int]:
    import xml.etree.ElementTree as ET

    out = {"operations_tested": 0, "failures": 0, "errors": 0}
    for p in paths:
        if not p.is_file():
            continue
        for suite in ET.parse(p).getroot().iter("testsuite"):
            out["operations_tested"] += int(suite.get("tests", 0))
            out["failures"] += int(suite.get("failures", 0))
            out["errors"] += int(suite.get("errors", 0))
    return out


if __name__ == "__main__":
    sys.exit(main())
