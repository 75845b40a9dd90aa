"""Fault injection: the kernel lines a node prints when its hardware fails."""

from __future__ import annotations

from collector.signal import LogLine, Signal, Source
from sim.job import DGX_PCI_BUSES


class KernelLog:
    """One node's kernel ring buffer: dmesg-style lines with stable sequence ids."""

    def __init__(self, node: str, boot_ts: float) -> None:
        self.node = node
        self.boot_ts = boot_ts
        self.seq = 0

    def line(self, ts: float, text: str) -> Signal:
        """A kernel log signal at wall time `ts`."""
        self.seq += 1
        up = ts - self.boot_ts
        return Signal(id=f"{self.node}/kernel/{self.seq}", node=self.node, source=Source.KERNEL, ts=ts,
                      payload=LogLine(text=f"[{up:12.6f}] {text}"))

    def xid(self, ts: float, gpu: int, xid: int, pid: int = 0) -> list[Signal]:
        """The NVRM lines of one Xid on local GPU `gpu`."""
        pci = f"0000:{DGX_PCI_BUSES[gpu % len(DGX_PCI_BUSES)]}:00"
        if xid == 79:
            return [self.line(ts, f"NVRM: Xid (PCI:{pci}): 79, pid={pid}, GPU has fallen off the bus.")]
        if xid == 48:
            return [self.line(ts, f"NVRM: Xid (PCI:{pci}): 48, pid='<unknown>', name=<unknown>, An uncorrectable "
                                  "double bit error (DBE) has been detected on GPU in the framebuffer at "
                                  "partition 5, subpartition 1")]
        if xid == 13:
            return [self.line(ts, f"NVRM: Xid (PCI:{pci}): 13, pid={pid}, name=python3, Graphics SM Warp "
                                  "Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address")]
        raise ValueError(f"no simulated message for Xid {xid}")
