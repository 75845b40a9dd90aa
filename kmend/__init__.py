"""The kmend service: composition root (HTTP API, store, metrics, CLI)."""
