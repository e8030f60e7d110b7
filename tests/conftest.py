"""Test session setup: CPU JAX unless a GPU test run asks otherwise.

Sharded tests (tests/test_sharding*.py, engine tests with `mesh=`) need 8 host devices. XLA reads
the device count once, when JAX starts, so the whole session gets them; single-device tests still
run on device 0 and are as fast (tests/test_forward.py: 65 s with 1 device, 62 s with 8 and the
thread pools below, on the 2-core CI machine). `PJRT_NPROC` sizes XLA:CPU's thread pools (default:
the core count, at least the device count): each device program blocks a pool thread inside every
collective it waits in, and with 8 devices on 2 cores the default pools run out and a sharded step
deadlocks. Idle threads cost nothing.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("PJRT_NPROC", "32")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _module_isolation():
    """After each module: drop its compiled programs and arrays (XLA:CPU executables of every bucket of
    every module would otherwise stay resident for the whole session), and remove logging handlers
    it left behind (an in-process server's handler on a captured, since closed, stderr)."""
    import logging

    loggers = [logging.getLogger(), logging.getLogger("k3jax")]
    before = [list(lg.handlers) for lg in loggers]
    yield
    import jax

    for lg, hs in zip(loggers, before):
        for h in [h for h in lg.handlers if h not in hs]:
            lg.removeHandler(h)
    jax.clear_caches()
    gc.collect()
