"""mla-bench: a correctness and performance test-bench for Multi-head Latent Attention."""

__version__ = "0.1.0"
