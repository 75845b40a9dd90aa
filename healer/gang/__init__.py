"""The built-in gang scheduler: all-or-nothing, topology-aware placement over cluster snapshots.

The core (records, filters, placement, statement) is pure: snapshots in, placements out.
``scheduler.GangScheduler`` drives it through the ``port.PodScheduling`` Protocol.
"""
