"""Count XLA backend compilations (the engine promises none after warm-up)."""

from __future__ import annotations

import contextlib
import threading

from jax import monitoring

_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_count = 0
_installed = False


def _listener(name, duration, **kw):
    global _count
    if name == _EVENT:
        with _lock:
            _count += 1


def compile_count() -> int:
    """Backend compilations in this process since the first call of this function."""
    global _installed
    if not _installed:
        monitoring.register_event_duration_secs_listener(_listener)
        _installed = True
    return _count


@contextlib.contextmanager
def count_compiles():
    """`with count_compiles() as c: ...; c()` -> compilations inside the block so far."""
    start = compile_count()
    yield lambda: compile_count() - start
