"""Kubernetes adapters: the only package that imports the official ``kubernetes`` client.

Each module implements one healer port against a real API server; the rest of the healer
sees only the ports, so the simulator and these adapters stay interchangeable.
"""
