"""The agent's DCGM and NVML sources emit GPU utilisation and SM clock under the names the detectors read."""

from __future__ import annotations

from analyzer.detectors.book import METRIC_FEATURES
from analyzer.detectors.suite import DetectorSuite
from collector.signal import MetricSample
from collector.sources.dcgm import DcgmSource, parse_scrape
from collector.sources.nvml import NvmlSource
from collector.sources.nvml_fake import FakeGpu, FakeNvml
from tests.agent_helpers import FIXTURES


def test_dcgm_scrape_feeds_utilisation_and_sm_clock_to_the_detectors() -> None:
    text = (FIXTURES / "dcgm-exporter.txt").read_text()
    names = {s.name for s in parse_scrape(text)}
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_SM_CLOCK"} <= names
    assert {METRIC_FEATURES[n] for n in names if n in METRIC_FEATURES} >= {"util", "sm_clock", "temp", "throttle"}
    suite = DetectorSuite()
    suite.observe(DcgmSource(node="gpu-node-07", fetch=lambda: text, clock=lambda: 50.0).poll().signals)
    gpus = suite.book.gpu["gpu-node-07"]
    assert (gpus["0"]["util"], gpus["1"]["util"]) == ((50.0, 100.0), (50.0, 0.0))
    assert gpus["0"]["sm_clock"] == (50.0, 1980.0)


def test_nvml_samples_utilisation_and_sm_clock_per_gpu() -> None:
    fake = FakeNvml([FakeGpu("GPU-aaaa", "00000000:3B:00.0", utilization=(97, 40), sm_clock_mhz=1410),
                     FakeGpu("GPU-bbbb", "00000000:5E:00.0", utilization=(3, 1), sm_clock_mhz=None)])
    sigs = NvmlSource(node="n1", load=lambda: fake, clock=lambda: 10.0).poll().signals
    names = {(s.payload.labels["gpu"], s.payload.name) for s in sigs if isinstance(s.payload, MetricSample)}
    assert ("0", "nvml_clocks_sm_mhz") in names and ("1", "nvml_clocks_sm_mhz") not in names  # unsupported: skipped
    suite = DetectorSuite()
    suite.observe(sigs)
    gpus = suite.book.gpu["n1"]
    assert gpus["0"]["util"] == (10.0, 97.0) and gpus["0"]["sm_clock"] == (10.0, 1410.0)
    assert gpus["1"]["util"] == (10.0, 3.0) and "sm_clock" not in gpus["1"]
    assert gpus["0"]["temp"] == (10.0, 40.0) and "throttle" in gpus["0"]
