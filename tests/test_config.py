"""ModelConfig: presets, layer schedule, hashability as a static jit argument, HF config.json."""

import json

import jax
import jax.numpy as jnp
import pytest

from k3jax.config import ModelConfig, preset, preset_names, to_hf_dict


def test_k3_schedule_matches_public_config():
    cfg = preset("k3")
    mla = [i + 1 for i, k in enumerate(cfg.layer_kinds) if k == "mla"]
    assert mla == list(range(4, 89, 4)) + [92, 93]
    assert cfg.num_kda_layers == 69 and cfg.num_mla_layers == 24
    assert cfg.ffn_kinds[0] == "dense" and cfg.ffn_kinds.count("moe") == 92
    assert cfg.layer_kinds[0] == "kda"
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_experts, cfg.num_experts_per_token) == (7168, 163840, 896, 16)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.routed_expert_hidden_size) == (512, 64, 3584)
    assert cfg.attn_res_block_size == 12 and cfg.attn_res_num_blocks == 8
    assert cfg.kda_gate == "safe" and cfg.kda_full_rank_output_gate and cfg.mla_output_gate


def test_kimi_linear_schedule():
    cfg = preset("kimi-linear-48b")
    assert [i + 1 for i, k in enumerate(cfg.layer_kinds) if k == "mla"] == [4, 8, 12, 16, 20, 24, 27]
    assert cfg.num_kda_layers == 20 and cfg.kda_num_heads == 32 and cfg.kda_gate == "softplus"
    assert cfg.q_lora_rank is None and not cfg.uses_attn_res and cfg.routed_scaling_factor == 2.446


def test_tiny_has_every_k3_feature():
    cfg = preset("k3-tiny")
    assert cfg.kda_gate == "safe" and cfg.kda_full_rank_output_gate
    assert cfg.hidden_act == "situ" and cfg.routed_expert_hidden_size and cfg.latent_moe_use_norm
    assert cfg.uses_attn_res and cfg.num_layers > cfg.attn_res_block_size  # more than one block
    assert cfg.ffn_kinds[0] == "dense" and "moe" in cfg.ffn_kinds
    assert cfg.mla_output_gate and cfg.q_lora_rank and "mla" in cfg.layer_kinds and "kda" in cfg.layer_kinds
    assert cfg.num_shared_experts >= 1


def test_mini_is_one_tp8_rank_of_k3():
    mini, k3 = preset("k3-mini"), preset("k3")
    assert mini.kda_num_heads == k3.kda_num_heads // 8 == 12 and mini.kda_head_dim == 128
    assert (mini.kv_lora_rank, mini.qk_rope_head_dim) == (512, 64)
    assert mini.uses_attn_res and mini.routed_expert_hidden_size == k3.routed_expert_hidden_size


def test_hashable_static_jit_argument():
    cfg = preset("k3-tiny")
    assert hash(cfg) == hash(preset("k3-tiny").replace()) and cfg == cfg.replace()
    assert cfg != cfg.replace(num_layers=4, full_attn_layers=(3,))
    f = jax.jit(lambda x, c: x * c.hidden_size, static_argnums=1)
    assert int(f(jnp.int32(2), cfg)) == 512


@pytest.mark.parametrize("name", preset_names())
def test_hf_round_trip(name, tmp_path):
    cfg = preset(name)
    (tmp_path / "config.json").write_text(json.dumps(to_hf_dict(cfg)))
    back = ModelConfig.from_hf(tmp_path)
    assert back.replace(name=cfg.name, kda_a_log_size=cfg.kda_a_log_size) == cfg


def test_from_hf_k3_nested_text_config():
    raw = {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "text_config": {
            "model_type": "kimi_linear", "hidden_size": 7168, "num_hidden_layers": 93, "vocab_size": 163840,
            "rms_norm_eps": 1e-5, "hidden_act": "situ", "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0, "attn_res_block_size": 12, "intermediate_size": 33792,
            "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
            "mla_use_output_gate": True, "num_experts": 896, "num_experts_per_token": 16,
            "num_shared_experts": 2, "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584,
            "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid", "moe_renormalize": True,
            "routed_scaling_factor": 1.0, "first_k_dense_replace": 1, "moe_layer_freq": 1,
            "linear_attn_config": {
                "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                "use_full_rank_gate": True, "full_attn_layers": list(range(4, 89, 4)) + [92, 93],
                "kda_layers": [i for i in range(1, 94) if i not in set(range(4, 89, 4)) | {92, 93}],
            },
        },
    }
    assert ModelConfig.from_hf(raw).vision is None  # no vision_config: a text-only model
    # the vision tower as Moonshot's config.json spells it (vt_* sizes; mm_hidden_size is the vision width)
    raw["media_placeholder_token_id"] = 163605
    raw["vision_config"] = {
        "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed", "vt_num_attention_heads": 16, "vt_num_hidden_layers": 27,
        "vt_hidden_size": 1152, "vt_intermediate_size": 4304, "merge_kernel_size": [2, 2],
        "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger",
        "mm_hidden_size": 1152, "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
    }
    cfg = ModelConfig.from_hf(raw)
    assert cfg.replace(name="k3", kda_a_log_size=128) == preset("k3")
    assert cfg.vision.text_hidden_size == 7168 and cfg.vision.hidden_size == 1152


def test_bad_configs_are_rejected():
    with pytest.raises(ValueError, match="unknown preset"):
        preset("k4")
    with pytest.raises(ValueError, match="full_attn_layers"):
        preset("k3-tiny").replace(full_attn_layers=(7,))
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf({"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1, "vocab_size": 8})
    with pytest.raises(ValueError, match="rotary"):
        ModelConfig.from_hf({"model_type": "kimi_linear", "hidden_size": 8, "num_hidden_layers": 1,
                             "vocab_size": 8, "num_attention_heads": 1, "mla_use_nope": False})
