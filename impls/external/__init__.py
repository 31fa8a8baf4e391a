"""Adapters to third-party MLA kernels (vLLM, FlashInfer, FlashMLA), loaded lazily."""
