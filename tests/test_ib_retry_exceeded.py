"""IB completion status 12 (retry exceeded): one occurrence is reported, not a node replacement; a node that
keeps losing its peers within the hour is taken out (both NCCL spellings, `NET/IB :` and `NET/IB:`)."""

from __future__ import annotations

from analyzer.pipeline import Analyzer
from analyzer.records import Action
from analyzer.rules import default_rules_dir, load_rules
from collector.signal import LogLine, Signal, Source

RULES = load_rules([default_rules_dir()])
# https://github.com/NVIDIA/nccl/issues/1698 (NCCL 2.2x) and https://github.com/NVIDIA/nccl/issues/426 (older).
NEW = ("mycl-g2:353236:353423 [6] transport/net_ib.cc:2244 NCCL WARN NET/IB: Got completion from peer "
       "192.168.3.5<53908> with status=12 opcode=129 len=1048576 vendor err 129 (Recv) localGid ::ffff:192.168.6.3 "
       "remoteGids::ffff:192.168.6.5 hca mlx5_10")
OLD = ("-worker-1:946:988 [0] transport/net_ib.cc:839 NCCL WARN NET/IB : Got completion with error 12, opcode 1, "
       "len 0, vendor err 129")


def _line(node: str, ts: float, text: str) -> Signal:
    return Signal(id=f"{node}:{ts}", node=node, source=Source.CONTAINER, ts=ts,
                  payload=LogLine(text=text, namespace="ml", pod="train-0", container="trainer", job="train"))


def test_one_retry_exceeded_is_reported_not_a_node_replacement() -> None:
    for text in (NEW, OLD):
        found, _ = Analyzer(RULES).process([_line("a", 100.0, text)])
        assert [(f.rule_id, f.recommended_action) for f in found] == [("nccl-ib-retry-exceeded", Action.NOTIFY)]


def test_a_node_that_keeps_losing_its_peers_is_replaced() -> None:
    analyzer = Analyzer(RULES)
    actions = []
    for n, ts in enumerate((100.0, 400.0, 900.0)):
        found, _ = analyzer.process([_line("a", ts, NEW if n % 2 else OLD)])
        actions += [f.recommended_action for f in found]
    assert actions[-1] is Action.REPLACE_NODE and Action.REPLACE_NODE not in actions[:-1]
    # Lines of one burst (within a minute) count once.
    burst = Analyzer(RULES)
    found, _ = burst.process([_line("b", 100.0 + i, NEW) for i in range(5)])
    assert Action.REPLACE_NODE not in {f.recommended_action for f in found}
