"""A log whose first line opens with a metric-like prefix (UCX's ``ib_mlx5_log.c``) is read as a log, not a scrape."""

from __future__ import annotations

import pytest

from analyzer.corpus import parse_entries
from analyzer.records import FaultClass
from analyzer.rules import default_rules_dir
from collector.metric_files import looks_like_scrape
from kmend.corpus_eval import run_entries

# UCX's completion error as it prints it (openucx/ucx#5199), without the rank prefix some launchers add.
UCX_LINE = "ib_mlx5_log.c:139  Transport retry count exceeded on mlx5_0:1/IB (synd 0x15 vend 0x81 hw_synd 0/0)"


def test_a_container_log_opening_with_ib_prefix_is_diagnosed() -> None:
    [entry] = parse_entries({"entries": [{
        "id": "ucx-log", "url": "https://github.com/openucx/ucx/issues/5199",
        "thread": "https://github.com/openucx/ucx/issues/5199", "source": "container",
        "text": f"{UCX_LINE}\nib_mlx5_log.c:139  DCI QP 0xa9f wqe[0]: SEND s-e [rqpn 0xa66 rlid 703] [inl len 18]\n",
        "expect": {"fault_class": "network", "actions": ["notify", "restart_job"]},
        "why": "UCX's transport retries towards the peer ran out."}]}, "inline.yaml")
    [outcome] = run_entries([entry], [default_rules_dir()])
    assert outcome.fault_class is FaultClass.NETWORK


@pytest.mark.parametrize("first", [
    'DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-1"} 79',
    "ib_port_rcv_errors 3 1700000000000",
    'nvml_xid_events_total{gpu="0"} 1.5e+00',
    'DCGM_FI_DEV_GPU_TEMP{gpu="0"} ',
    "# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).",
])
def test_exporter_output_is_still_a_scrape(first: str) -> None:
    assert looks_like_scrape("metrics.txt", [first])
