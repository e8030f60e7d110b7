"""Test helpers shared by several modules."""

import os
import re


def one_device_env(**extra) -> dict:
    """The environment of a subprocess that runs like a user's (the CLI, the server, a notebook
    kernel): os.environ without this suite's 8 host devices and PJRT_NPROC (tests/conftest.py),
    which it does not need and which slow a one-device step on 2 cores; plus `extra`."""
    env = dict(os.environ, **extra)
    env.pop("PJRT_NPROC", None)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    return env
