"""GPU evidence carried out by the node agent: ``nvidia-smi -q -i <GPU>`` for the GPU an incident names.

When the healer opens a plan for a GPU fault it queues a ``gpu_query`` request for that node (``gpu``: the index
or PCI bus id the incident names; ``nvidia-smi -i`` takes either). The agent answers with the full report,
which the service keeps with the plan's evidence step: the GPU's ECC counters, retired pages and row remapping,
clocks and throttle reasons as the node saw them, before a reset or a replacement makes them unreadable.

Reading is harmless, so an interrupted query is simply run again. A node without ``nvidia-smi`` answers
``failed`` saying so, and the plan goes on without it.
"""

from __future__ import annotations

import os
import shutil
import threading

from collector.gpu_reset import pci_key, run_command
from collector.node_requests import MAX_MESSAGE, Answer, NodeRequest

MAX_REPORT = MAX_MESSAGE
"""Characters of the report sent back (one GPU's ``-q`` is about 15,000; the API takes up to this many)."""


class GpuQueryHandler:
    """RequestHandler for ``gpu_query``: the named GPU's ``nvidia-smi -q`` report."""

    kind = "gpu_query"

    def __init__(self, *, nvidia_smi: str = "nvidia-smi", timeout_s: float = 30.0) -> None:
        self.nvidia_smi = nvidia_smi
        self.timeout_s = timeout_s

    def run(self, request: NodeRequest, stop: threading.Event) -> Answer:
        target = request.params.get("gpu") or _bus_id(request.params.get("pci") or "")
        if not target:
            return Answer("failed", "the request names no GPU (gpu or pci)")
        binary = shutil.which(self.nvidia_smi)
        if binary is None:
            return Answer("failed", f"{self.nvidia_smi} not found on this node (PATH={os.environ.get('PATH', '')}): "
                                    "no nvidia-smi -q evidence")
        code, out = run_command([binary, "-q", "-i", target], self.timeout_s)
        if code != 0:
            return Answer("failed", f"nvidia-smi -q -i {target} exited {code}: {out.strip()[-500:]}")
        return Answer("done", out[:MAX_REPORT])

    def resume(self, request: NodeRequest) -> Answer:
        return self.run(request, threading.Event())


def _bus_id(pci: str) -> str:
    """A PCI id as an Xid line spells it (``0000:3b:00``) in the form ``nvidia-smi -i`` takes (``00000000:3b:00.0``)."""
    key = pci_key(pci)
    return f"{key[0]:08x}:{key[1]:02x}:{key[2]:02x}.0" if key else pci
