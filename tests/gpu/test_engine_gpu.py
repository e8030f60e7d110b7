"""The engine on the H200's kernels, end to end, with a k3-tiny whose KDA heads have K3's 128 x 128
state (the kernels' shapes): the model's logits on the Pallas path against the XLA path, and the
greedy tokens of speculative decoding (the verify kernel, then `fold_pool` replaying the accepted
prefix in place on the pool) against plain decoding on the decode kernel, with the prefix cache and
overlap on.

Run through the device tool: `JAX_PLATFORMS=cuda python3 -m pytest -m gpu tests/gpu`."""

import dataclasses

import numpy as np
import pytest

from tests.gpu import require_gpu

require_gpu()
from k3jax import LLM  # noqa: E402
from k3jax.api import load_model  # noqa: E402
from k3jax.model.forward import split_layers  # noqa: E402
from k3jax.model.init import init_params  # noqa: E402
from k3jax.spec.drafter import OracleDrafter  # noqa: E402
from tests.test_engine import ENGINE_KW, run_workload, workload  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    base = load_model("k3-tiny", seed=0)  # f32
    cfg = base.config.replace(name="k3-tiny-k128", kda_head_dim=128)
    # the per-layer layout, as load_model gives it
    return dataclasses.replace(base, config=cfg, params=split_layers(init_params(cfg, 0)), impl="pallas")


def test_logits_pallas_path_vs_xla_path(model):
    """200 tokens (four chunks, the last one partial): prefill on the chunk kernels (bf16 operands)
    against the jnp path in f32."""
    ids = np.random.default_rng(0).integers(0, 256, 200).tolist()
    got = model.logits(ids)
    want = dataclasses.replace(model, impl="xla").logits(ids)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


def test_speculative_on_kernels_equals_plain(model):
    llm = LLM(model, prefix_cache=True, overlap=True, **ENGINE_KW)
    want = run_workload(llm)  # checks the engine's invariants after each run
    phase1, phase2 = workload()
    prompts = phase1 + phase2(want[: len(phase1)])
    oracle = OracleDrafter({tuple(p): o for p, o in zip(prompts, want)}, model.config.vocab_size)
    spec = LLM(model, prefix_cache=True, overlap=True, speculative=oracle, num_draft_tokens=4, **ENGINE_KW)
    assert run_workload(spec) == want
    st = spec.stats
    assert 0 < st["spec_accepted"] < st["spec_drafted"]  # partial acceptance: the fold replays a prefix
