"""The Kubernetes adapters: the only modules that import the official ``kubernetes`` client.

``cluster`` (nodes: cordon, taints, conditions, Events), ``workloads`` (pods, evictions, owners,
ConfigMaps, Jobs), ``pods`` and ``watch`` (the gang scheduler's informer and bindings), ``lease``
(leader election) and ``tokenreview`` (authenticating Kubernetes tokens). Everything else in kmend
talks to the ports these implement.
"""
