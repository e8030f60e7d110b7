"""Tests that need an H100/H200 (run through the device tool:
`JAX_PLATFORMS=cuda,cpu python3 -m pytest -m gpu tests/gpu`); skipped, not failed, elsewhere."""

import pytest


def require_gpu():
    """Skip the calling test module unless JAX's default backend is a GPU."""
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.default_backend() == "gpu"
    except Exception:  # no backend could start
        gpu = False
    if not gpu:
        pytest.skip("needs a GPU (run through the device tool)", allow_module_level=True)
