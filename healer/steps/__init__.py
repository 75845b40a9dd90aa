"""Runbook steps: each turns one ActionStep into idempotent calls on the Cluster and Workloads ports."""
