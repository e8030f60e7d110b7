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


def test_planner_reports_sizing_figures(capsys):
    """`k3jax plan` prints k3jax.sizing's figures for k3 at tp=8 (MXFP4 experts, bf16 rest)."""
    from k3jax.cli import main
    from k3jax.sizing import MXFP4_BITS, smallest_deployment

    assert main(["plan", "--model", "k3", "--mesh", "tp=8", "--hbm", "141GB", "--context", "128K"]) == 0
    out = capsys.readouterr().out
    cfg = preset("k3")
    p = memory_plan(cfg, tp=8, expert_bits=MXFP4_BITS)
    assert f"weights per device       {p.weight_bytes_per_device / 1e9:,.2f} GB" in out
    assert f"recurrent {p.kda_recurrent_bytes_per_request:,} B f32" in out and "54,263,808" in out
    assert f"MLA KV per token         {p.mla_kv_bytes_per_token:,} B" in out and "27,648" in out
    assert f"max concurrent requests  {p.max_requests(141e9, 131072)} at 131,072" in out
    assert "fits                     no" in out  # 198 GB of weights per device on one node
    best = smallest_deployment(cfg, 141e9, 131072, expert_bits=MXFP4_BITS)
    assert best.nodes == 2 and (best.plan.tp, best.plan.ep) == (8, 2)
    assert "smallest deployment      2 node(s) of 8 x 141.00 GB: mesh tp=8,ep=2" in out
    assert main(["plan", "--mesh", "tp=7"]) == 2
    assert "tp=7 does not divide the 96 KDA heads" in capsys.readouterr().err


def test_ep_dp_and_dp_attention():
    from sharding.rules import Rules

    cfg = preset("k3")
    a, b = memory_plan(cfg, tp=8, expert_bits=4.25), memory_plan(cfg, tp=8, ep=8, expert_bits=4.25)
    assert b.expert_weight_bytes_per_device * 8 == pytest.approx(a.expert_weight_bytes_per_device, rel=1e-9)
    assert a.weight_bytes_per_device - a.expert_weight_bytes_per_device == \
        b.weight_bytes_per_device - b.expert_weight_bytes_per_device  # the rest is replicated over ep
    dpa = memory_plan(cfg, tp=8, ep=8, dp=2, rules=Rules.dp_attention(), expert_bits=4.25)
    assert dpa.kv_shards == 2 and dpa.mla_kv_bytes_per_token == 27_648
    assert dpa.max_requests(141e9, 1 << 20) > b.max_requests(141e9, 1 << 20)
