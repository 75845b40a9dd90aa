"""The C-speed decoder of /v1/signals bodies accepts nothing the pydantic wire model refuses and decodes what it
accepts to the same signals; refused bodies still get the 422 naming the field."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from collector.shipper import encode_batch
from collector.signal import LogLine, MetricSample, ProgressSample, Signal, Source
from collector.wire import SignalBatch, to_record, to_wire
from kmend.api.signal_decode import decode_fast
from tests.hostile import serve

T0 = 1_700_000_000.0
GOOD = [
    Signal("n1/container/1", "gpu-node-01", Source.CONTAINER, T0,
           LogLine("[rank3]: iteration 10/100 | lm loss: 2.0", "ns", "pod-a", "trainer", "job-a", 3)),
    Signal("n1/kernel/2", "gpu-node-01", Source.KERNEL, T0 + 0.5,
           LogLine("NVRM: Xid (PCI:0000:3b:00): 79, pid=0, GPU has fallen off the bus.")),
    Signal("n1/dcgm/3", "gpu-node-01", Source.DCGM, T0, MetricSample("DCGM_FI_DEV_GPU_TEMP", 61.5, {"gpu": "0"})),
    Signal("n1/progress/4", "gpu-node-01", Source.PROGRESS, T0,
           ProgressSample("job-a", 3, 10, 0.85, {"forward": 0.3}, "step")),
    Signal("n1/progress/5", "gpu-node-01", Source.PROGRESS, T0, ProgressSample("job-a", 4, 11)),
]
BAD_VALUES: list[Any] = [None, True, -1, 0, 1.5, 1e309, "", "x", "7", "\x00", "a\nb", "A_B", [], {}, "x" * 70000,
                         2**70, -0.0]
FIELDS = {"": ["id", "node", "source", "ts", "payload", "extra"],
          "payload": ["kind", "text", "namespace", "pod", "container", "job", "rank", "name", "value", "labels",
                      "step", "step_time", "phases", "event", "extra"]}


def _pydantic(body: bytes) -> list[Signal] | None:
    try:
        return [to_record(s) for s in SignalBatch.model_validate_json(body).signals]
    except ValidationError:
        return None


def _mutate(doc: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    sig = rng.choice(doc["signals"])
    where = rng.choice(["", "payload"])
    target = sig if where == "" else sig["payload"]
    key = rng.choice(FIELDS[where])
    roll = rng.random()
    if roll < 0.15 and key in target:
        del target[key]
    elif roll < 0.25 and key in ("labels", "phases"):
        target[key] = {str(i): (str(i) if key == "labels" else float(i)) for i in range(rng.choice((3, 64, 65)))}
    else:
        target[key] = rng.choice(BAD_VALUES)
    return doc


@pytest.mark.parametrize("seed", range(6))
def test_the_fast_decoder_never_accepts_what_pydantic_refuses_and_agrees_on_what_both_accept(seed: int) -> None:
    rng = random.Random(seed)
    good = {"signals": [to_wire(s) for s in GOOD]}
    body = json.dumps(good).encode()
    fast = decode_fast(body)
    assert fast is not None and (list(fast[0]), fast[1]) == (GOOD, None) and _pydantic(body) == GOOD
    refused = 0
    for _ in range(400):
        bad = json.dumps(_mutate(good, rng)).encode()
        fast, slow = decode_fast(bad), _pydantic(bad)
        if slow is None:
            refused += 1
            assert fast is None, bad
        elif fast is not None:
            assert list(fast[0]) == slow, bad
    assert refused > 200


def test_escaped_nul_bad_node_names_and_non_finite_numbers_go_to_the_model() -> None:
    for mangle in (lambda d: d["signals"][0]["payload"].update(text="a\x00b"),
                   lambda d: d["signals"][1].update(node="gpu-node-01\n"),
                   lambda d: d["signals"][1].update(node="GPU_node"),
                   lambda d: d["signals"][2]["payload"].update(value=1e309),
                   lambda d: d["signals"][3]["payload"]["phases"].update(x=-1e309)):
        doc = {"signals": [to_wire(s) for s in GOOD]}
        mangle(doc)
        body = json.dumps(doc).encode()
        assert decode_fast(body) is None and _pydantic(body) is None


def test_a_refused_body_is_a_422_naming_the_field_and_a_good_gzip_body_is_stored(tmp_path: Path) -> None:
    doc = {"signals": [to_wire(s) for s in GOOD]}
    doc["signals"][1]["payload"]["text"] = 5
    with serve(tmp_path) as s:
        r = s.client.post("/v1/signals", content=json.dumps(doc), headers={"content-type": "application/json"})
        assert r.status_code == 422
        assert r.json()["errors"][0]["field"] == "signals.1.payload.log.text"
        ok = s.client.post("/v1/signals", content=encode_batch(GOOD),
                           headers={"content-type": "application/json", "content-encoding": "gzip"})
        assert ok.status_code == 200 and ok.json()["accepted"] == len(GOOD)
        [inc] = s.incidents()
        assert inc["fault_class"] == "gpu_lost" and inc["root_cause"]["node"] == "gpu-node-01"
