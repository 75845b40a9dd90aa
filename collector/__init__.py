"""Node-side collection: sources, batching and shipping of Signals."""
