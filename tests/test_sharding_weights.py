"""Weight loading straight into shards: safetensors (published and MXFP4 layouts) and orbax give arrays
with the rules' shardings and the values of an unsharded load, and the safetensors reader never reads
a sharded tensor whole. Needs 8 host devices (tests/conftest.py)."""

import jax
import numpy as np
import pytest

from k3jax import weights as W
from k3jax.config import preset
from k3jax.weights.safetensors_io import _Reader
from sharding.mesh import make_mesh
from sharding.rules import param_shardings
from tests.test_weights import random_params

CFG = preset("k3-tiny")
pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py sets XLA_FLAGS)")


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("tp=2,ep=4")  # experts 8 -> 2 per shard, expert intermediate 128 -> 64, heads 4 -> 2


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, 5)


def _check(got, want, mesh):
    shardings = param_shardings(CFG, mesh)
    flat = jax.tree_util.tree_flatten_with_path(got)[0]
    for (path, a), b, sh in zip(flat, jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(shardings)):
        name = jax.tree_util.keystr(path)
        assert a.sharding.is_equivalent_to(sh, a.ndim), (name, a.sharding, sh)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("mxfp4", [False, True])
def test_safetensors_load_into_shards(params, mesh, tmp_path, monkeypatch, mxfp4):
    W.save_safetensors(params, CFG, tmp_path, mxfp4_experts=mxfp4, progress=False)
    _, want = W.load_checkpoint(tmp_path)  # unsharded, for the values (MXFP4 experts are lossy)
    whole = []
    get = _Reader.get
    monkeypatch.setattr(_Reader, "get", lambda self, canon: whole.append(canon) or get(self, canon))
    cfg, got = W.load_checkpoint(tmp_path, shardings=lambda c: param_shardings(c, mesh))
    assert cfg.name == tmp_path.name
    _check(got, want, mesh)
    # sharded tensors are read slice by slice, never whole (replicated ones, e.g. AttnRes, may be)
    sliced = ("q_proj.", "k_proj.", "v_proj.", "o_proj.", "g_proj.", "kv_b_proj.", "q_b_proj.", "f_b_proj.",
              "experts.", "embed_tokens", "lm_head", "routed_expert_")
    assert not [n for n in whole if any(s in n for s in sliced)], whole[:5]


def test_orbax_restore_into_shards(params, mesh, tmp_path):
    W.save_orbax(params, CFG, tmp_path / "o")
    _, got = W.load_checkpoint(tmp_path / "o", shardings=param_shardings(CFG, mesh))
    _check(got, params, mesh)
