"""Test session setup: CPU JAX unless a GPU test run asks otherwise.

Sharded tests (tests/test_sharding*.py, engine tests with `mesh=`) need 8 host devices. XLA reads
the device count once, when JAX starts, so the whole session gets them; single-device tests still
run on device 0. `PJRT_NPROC` sizes XLA:CPU's two thread pools, the client's (default: the core
count, at least the device count) and the intra-op one (default: the core count). Each device program
blocks a client pool thread inside every collective it waits in: with 8 devices a pool of 8 deadlocks
a sharded step (measured), 10 and more do not. More intra-op threads than cores cost time, though: on
the 2-core CI machine the tests/test_engine.py page-size-16 identity test takes 78 s with 12 and 104 s
with 32, the three tests/test_sharding_engine.py mesh tests 92 s with 12 and 346 s with 32. Subprocesses
that need one device (the CLI, the server, the notebook kernel) drop both settings. Mosaic GPU interpret
mode runs a two-warpgroup kernel as two threads on the pool, which hangs with fewer than 3
(`pallas_kernels.mgpu_common.gpu_interpret_params`).

On the CPU the suite compiles with `--xla_backend_optimization_level=0` (below).

Compiled programs go to a persistent compilation cache private to this session (deleted at exit): a
later module that builds an engine with the same shapes as an earlier one (tests/test_engine.py's
settings recur in five modules) loads the executable instead of compiling it again after the
per-module `jax.clear_caches()` below (~7 s instead of ~20 s for the k3-tiny engine step).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("PJRT_NPROC", "12")
if os.environ["JAX_PLATFORMS"] == "cpu" and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    # the suite is compile-bound: unoptimised XLA:CPU code compiles ~1.5-2x faster (tests/test_media.py 38 s
    # against 50 s), tokens and tolerances unchanged (tests/test_cli.py's CLI subprocesses use it too)
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"


import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import jax  # noqa: E402

    _cache_dir = tempfile.mkdtemp(prefix="k3jax-test-jaxcache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _cache_dir)


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
