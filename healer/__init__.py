"""Healing: policy, plans, safe execution through the Cluster port."""
