"""Stateful detectors: hang, straggler and PyTorch Flight Recorder analysis (pure)."""

from analyzer.records import FaultClass

HARDWARE_CAUSES = frozenset({
    FaultClass.GPU_LOST, FaultClass.GPU_MEMORY, FaultClass.GPU_HARDWARE, FaultClass.GPU_THERMAL_POWER,
    FaultClass.NVLINK, FaultClass.PCIE, FaultClass.NETWORK, FaultClass.NODE, FaultClass.STORAGE,
})
"""Faults that explain a hang: when one is found on a node of the job nearby, the hang is its symptom."""

APPLICATION_CAUSES = frozenset({FaultClass.APP_ERROR, FaultClass.OOM_GPU, FaultClass.OOM_HOST})
"""Application faults that stop a job: the hang that follows a crash on every rank is their symptom."""

HANG_CAUSES = HARDWARE_CAUSES | APPLICATION_CAUSES
"""What a hang finding is a symptom of (``symptom_of`` of hang and Flight Recorder findings)."""
