"""Test session setup: CPU JAX unless a GPU test run asks otherwise."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
