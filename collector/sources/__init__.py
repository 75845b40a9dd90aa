"""Node signal sources: kernel log, container logs, GPU (NVML, DCGM) and InfiniBand sysfs."""
