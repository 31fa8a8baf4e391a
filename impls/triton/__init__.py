"""Our Triton kernels: paged MLA decode, prefill, sparse, cache ops."""
