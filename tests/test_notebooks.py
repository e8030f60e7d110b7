"""Every notebook in notebooks/ executes top to bottom (as users run it)."""

import os
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def _user_env():
    """The kernel's environment: a user's, without this suite's 8 host devices and PJRT_NPROC
    (tests/conftest.py; the notebook needs one device, and extra XLA:CPU threads slow it down)."""
    env = dict(os.environ)
    env.pop("PJRT_NPROC", None)
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    return env


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=_user_env())
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert (tmp_path / "cache_occupancy.png").exists() or path.name != "quickstart.ipynb"
