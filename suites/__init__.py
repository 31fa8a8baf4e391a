"""Sweeps that judge and time implementations: accuracy, roundtrip, metadata, equivalence, latency, placement."""
