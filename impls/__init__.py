"""Implementations under test: torch_eager (baseline), triton (ours), external (third-party adapters)."""
