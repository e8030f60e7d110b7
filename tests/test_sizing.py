"""Sizing figures for the full-size presets, computed from the model's own parameter shapes."""

import pytest

from k3jax.config import preset
from k3jax.sizing import memory_plan


@pytest.fixture(scope="module")
def k3_tp8():
    return memory_plan(preset("k3"), tp=8)


def test_k3_state_and_kv(k3_tp8):
    assert k3_tp8.kda_recurrent_bytes_per_request == 69 * 12 * 128 * 128 * 4 == 54_263_808
    assert k3_tp8.mla_kv_bytes_per_token == 24 * 576 * 2 == 27_648
    assert k3_tp8.kda_conv_bytes_per_request == 69 * 3 * (3 * 12 * 128) * 2
    assert k3_tp8.kda_state_bytes_per_request == 54_263_808 + 69 * 3 * 4608 * 2


def test_k3_param_count_near_published(k3_tp8):
    # published: 2.8T (text model here; the vision tower is not counted)
    assert 2.75e12 < k3_tp8.param_count < 2.85e12
    assert k3_tp8.expert_param_count == 92 * 896 * 3 * 3072 * 3584


def test_weight_bytes_per_device():
    cfg = preset("k3")
    bf16 = memory_plan(cfg, tp=8)
    mx = memory_plan(cfg, tp=8, expert_bits=4.25)
    assert bf16.weight_bytes_per_device > 2 * bf16.param_count / 8  # a few replicated pieces
    assert bf16.weight_bytes_per_device < 1.01 * 2 * bf16.param_count / 8
    saved = (16 - 4.25) / 8 * mx.expert_param_count / 8
    assert abs((bf16.weight_bytes_per_device - mx.weight_bytes_per_device) - saved) < 1e3
    one = memory_plan(cfg, tp=1)
    assert one.weight_bytes_per_device == pytest.approx(2 * one.param_count, rel=1e-3)


def test_kimi_linear_figures():
    p = memory_plan(preset("kimi-linear-48b"), tp=1)
    assert 47e9 < p.param_count < 50e9
    assert p.kda_recurrent_bytes_per_request == 20 * 32 * 128 * 128 * 4
    assert p.mla_kv_bytes_per_token == 7 * 576 * 2


def test_bad_tp():
    with pytest.raises(ValueError, match="tp"):
        memory_plan(preset("k3"), tp=7)
