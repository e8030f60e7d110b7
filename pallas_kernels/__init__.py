"""Kernel families: each module holds the jnp reference, the kernels, and `impl=` dispatch."""
