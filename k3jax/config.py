"""Model configuration: one frozen, hashable dataclass for the whole Kimi-Linear / Kimi-K3 family.

`ModelConfig` is usable as a static argument of `jax.jit`. Layer indices in the public configs
(`full_attn_layers`, `kda_layers`) are 1-based; every method here takes and returns 0-based
layer indices.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

LayerKind = str  # "kda" | "mla"
FfnKind = str  # "dense" | "moe"


# The row block of the engines' batch-invariant mode (`EngineConfig.batch_invariant`): on the H200 a bf16
# product of 128 rows costs about its weight read (compute-bound from ~165), so a decode step pays little
# for the padding and a prefill's products stay near their compute rate.
BATCH_INVARIANT_ROWS = 128


@dataclass(frozen=True)
class VisionConfig:
    """The MoonViT3d vision tower and its patch-merger projector (Kimi-K2.5's `vision_config`, which
    K3 keeps; `k3jax.model.vision`). Field names follow the published config.json; `from_hf` also
    reads transformers' spelling (`pos_emb_height`, ...)."""

    patch_size: int = 14
    init_pos_emb_height: int = 64  # learned 2-D position table, bicubic-resized to each image's patch grid
    init_pos_emb_width: int = 64
    init_pos_emb_time: int = 4  # frames per video chunk (fixed sin-cos time embedding)
    num_attention_heads: int = 16
    num_hidden_layers: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    merge_kernel_size: tuple[int, int] = (2, 2)  # patches merged into one LM token
    mm_projector_type: str = "patchmerger"  # LayerNorm -> Linear -> GELU -> Linear to the LM width
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168  # the projector's output width (the LM's hidden size)
    rope_max_grid: int = 512  # the 2-D rotary table's height and width, in patches
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_image_tokens: int = 4096  # LM tokens per image; larger images are downscaled to fit

    def __post_init__(self):
        if self.mm_projector_type != "patchmerger":
            raise ValueError(f"mm_projector_type {self.mm_projector_type!r} is not supported (only 'patchmerger')")
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 4:
            raise ValueError("vision hidden_size / num_attention_heads must be a multiple of 4 (2-D rotary pairs)")
        if len(self.merge_kernel_size) != 2 or min(self.merge_kernel_size) < 1:
            raise ValueError(f"merge_kernel_size must be two positive ints, got {self.merge_kernel_size!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def merge_area(self) -> int:
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]

    @classmethod
    def from_hf(cls, raw: dict, text_hidden_size: int) -> "VisionConfig":
        def get(key, default, *alts):
            for k in (key, *alts):
                if raw.get(k) is not None:
                    return raw[k]
            return default

        d = cls()
        return cls(
            patch_size=int(get("patch_size", d.patch_size)),
            init_pos_emb_height=int(get("init_pos_emb_height", d.init_pos_emb_height, "pos_emb_height")),
            init_pos_emb_width=int(get("init_pos_emb_width", d.init_pos_emb_width, "pos_emb_width")),
            init_pos_emb_time=int(get("init_pos_emb_time", d.init_pos_emb_time, "pos_emb_time")),
            num_attention_heads=int(get("num_attention_heads", d.num_attention_heads, "vt_num_attention_heads")),
            num_hidden_layers=int(get("num_hidden_layers", d.num_hidden_layers, "vt_num_hidden_layers")),
            hidden_size=int(get("hidden_size", d.hidden_size, "vt_hidden_size")),
            intermediate_size=int(get("intermediate_size", d.intermediate_size, "vt_intermediate_size")),
            merge_kernel_size=tuple(int(x) for x in get("merge_kernel_size", d.merge_kernel_size)),
            mm_projector_type=str(get("mm_projector_type", d.mm_projector_type)),
            projector_ln_eps=float(get("projector_ln_eps", d.projector_ln_eps, "projection_layer_norm_eps")),
            # (not `mm_hidden_size`: Moonshot's projector reads it as the vision width, vLLM as the LM's)
            text_hidden_size=int(get("text_hidden_size", text_hidden_size)),
            max_image_tokens=int(get("max_image_tokens", d.max_image_tokens)),
        )

    def to_hf(self) -> dict:
        return {
            "patch_size": self.patch_size,
            "init_pos_emb_height": self.init_pos_emb_height,
            "init_pos_emb_width": self.init_pos_emb_width,
            "init_pos_emb_time": self.init_pos_emb_time,
            "pos_emb_type": "divided_fixed",
            "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "merge_kernel_size": list(self.merge_kernel_size),
            "video_attn_type": "spatial_temporal",
            "merge_type": "sd2_tpool",
            "mm_projector_type": self.mm_projector_type,
            "mm_hidden_size": self.hidden_size,  # the published meaning: the projector's input (vision) width
            "text_hidden_size": self.text_hidden_size,
            "projector_hidden_act": "gelu",
            "projector_ln_eps": self.projector_ln_eps,
            "max_image_tokens": self.max_image_tokens,  # k3jax's preprocessing budget (not in published configs)
        }


@dataclass(frozen=True)
class ModelConfig:
    name: str = "custom"
    vocab_size: int = 163840
    hidden_size: int = 7168
    num_layers: int = 93
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"  # parameter and activation dtype; norms, router, KDA state in f32
    # the batch-invariant mode's row block (0: off): a numerics setting of the steps, not of the model
    # (never written to a config.json); see `pallas_kernels.dispatch.rowwise` and docs/batch_invariance.md
    batch_invariant_rows: int = 0
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = 163584
    eos_token_id: int | None = 163586
    pad_token_id: int | None = 163839
    media_placeholder_token_id: int | None = 163605  # one per image token in a prompt (vision models)

    # layer schedule: 1-based indices of MLA ("full attention") layers; the rest are KDA
    full_attn_layers: tuple[int, ...] = ()

    # KDA (Kimi Delta Attention)
    kda_num_heads: int = 96
    kda_head_dim: int = 128  # K = V
    kda_conv_size: int = 4
    kda_gate: str = "safe"  # "safe" (K3: lower_bound * sigmoid) | "softplus" (Kimi-Linear)
    kda_gate_lower_bound: float = -5.0
    kda_full_rank_output_gate: bool = True  # K3: g_proj; Kimi-Linear: g_a_proj/g_b_proj (rank K)
    kda_a_log_size: int | None = None  # stored A_log length when padded (K3: 128 for 96 heads)

    # MLA (multi-head latent attention, NoPE)
    mla_num_heads: int = 96
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_output_gate: bool = True
    mla_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm (Moonshot's code: default 1e-6)

    # FFN
    hidden_act: str = "situ"  # "silu" (SwiGLU) | "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    intermediate_size: int = 33792  # dense FFN layers
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_experts: int = 896  # 0: every layer dense
    num_experts_per_token: int = 16
    num_shared_experts: int = 2
    moe_intermediate_size: int = 3072
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    routed_expert_hidden_size: int | None = 3584  # LatentMoE latent width; None = plain MoE
    latent_moe_use_norm: bool = True

    # Block Attention Residuals; None = plain residual stream
    attn_res_block_size: int | None = 12

    # the vision tower + projector (None: a text-only model)
    vision: VisionConfig | None = None

    extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False, hash=False)

    def __post_init__(self):
        for i in self.full_attn_layers:
            if not 1 <= i <= self.num_layers:
                raise ValueError(f"full_attn_layers entry {i} is outside 1..{self.num_layers}")
        if self.kda_gate not in ("safe", "softplus"):
            raise ValueError(f"kda_gate must be 'safe' or 'softplus', got {self.kda_gate!r}")
        if self.hidden_act not in ("silu", "situ"):
            raise ValueError(f"hidden_act must be 'silu' or 'situ', got {self.hidden_act!r}")
        if self.num_experts and self.num_experts_per_token > self.num_experts:
            raise ValueError("num_experts_per_token exceeds num_experts")
        if self.dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {self.dtype!r}")
        if not isinstance(self.batch_invariant_rows, int) or self.batch_invariant_rows < 0:
            raise ValueError(f"batch_invariant_rows must be an int >= 0, got {self.batch_invariant_rows!r}")
        if self.vision is not None:
            if self.vision.text_hidden_size != self.hidden_size:
                raise ValueError(f"vision text_hidden_size {self.vision.text_hidden_size} != hidden_size {self.hidden_size}")
            m = self.media_placeholder_token_id
            if m is None or not 0 <= m < self.vocab_size:
                raise ValueError(f"a vision model needs media_placeholder_token_id in [0, {self.vocab_size}), got {m!r}")

    # ---- layer schedule -------------------------------------------------------------------
    @cached_property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        full = set(self.full_attn_layers)
        return tuple("mla" if i + 1 in full else "kda" for i in range(self.num_layers))

    @cached_property
    def ffn_kinds(self) -> tuple[FfnKind, ...]:
        def kind(i: int) -> str:
            if self.num_experts and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0:
                return "moe"
            return "dense"

        return tuple(kind(i) for i in range(self.num_layers))

    @cached_property
    def kind_index(self) -> tuple[int, ...]:
        """Index of layer i within the stacked parameters of its attention kind."""
        seen = {"kda": 0, "mla": 0}
        out = []
        for k in self.layer_kinds:
            out.append(seen[k])
            seen[k] += 1
        return tuple(out)

    @cached_property
    def ffn_index(self) -> tuple[int, ...]:
        seen = {"dense": 0, "moe": 0}
        out = []
        for k in self.ffn_kinds:
            out.append(seen[k])
            seen[k] += 1
        return tuple(out)

    @property
    def num_kda_layers(self) -> int:
        return self.layer_kinds.count("kda")

    @property
    def num_mla_layers(self) -> int:
        return self.layer_kinds.count("mla")

    @property
    def num_moe_layers(self) -> int:
        return self.ffn_kinds.count("moe")

    @property
    def num_dense_layers(self) -> int:
        return self.ffn_kinds.count("dense")

    # ---- derived widths -------------------------------------------------------------------
    @property
    def kda_proj_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def kda_conv_channels(self) -> int:
        return 3 * self.kda_proj_dim  # q | k | v

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_dim(self) -> int:
        """Width of one cached MLA token per layer: latent c plus the shared k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def moe_expert_dim(self) -> int:
        """Input/output width of the routed experts (the latent for LatentMoE)."""
        return self.routed_expert_hidden_size or self.hidden_size

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts

    @property
    def uses_attn_res(self) -> bool:
        return bool(self.attn_res_block_size)

    @property
    def attn_res_num_blocks(self) -> int:
        """Rows of the AttnRes bank after the last layer (embedding plus finished blocks)."""
        b = self.attn_res_block_size
        return -(-self.num_layers // b) if b else 0

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    # ---- HF config.json -------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | dict) -> "ModelConfig":
        """Read a HF `config.json` (`kimi_linear`, or `kimi_k3` with a nested `text_config`)."""
        if isinstance(path_or_dict, dict):
            raw = path_or_dict
            name = raw.get("_name_or_path") or "hf"
        else:
            p = os.fspath(path_or_dict)
            if os.path.isdir(p):
                p = os.path.join(p, "config.json")
            if not os.path.isfile(p):
                raise FileNotFoundError(f"no config.json at {p}")
            with open(p) as f:
                raw = json.load(f)
            name = os.path.basename(os.path.dirname(os.path.abspath(p)))
        return _from_hf_dict(raw, name)


def _from_hf_dict(raw: dict, name: str) -> ModelConfig:
    top = raw
    text = raw.get("text_config") or raw
    mt = top.get("model_type", text.get("model_type"))
    if mt not in ("kimi_linear", "kimi_k3", None):
        raise ValueError(f"unsupported model_type {mt!r}; expected 'kimi_linear' or 'kimi_k3'")

    def get(key, default=None, *alts):
        for k in (key, *alts):
            if k in text and text[k] is not None:
                return text[k]
        return default

    lin = dict(get("linear_attn_config", {}) or {})
    n_layers = int(get("num_hidden_layers"))
    if "full_attn_layers" in lin:
        full = tuple(int(i) for i in lin["full_attn_layers"])
    elif get("layer_types"):
        full = tuple(i + 1 for i, t in enumerate(get("layer_types")) if t == "full_attention")
    else:  # transformers' default schedule
        full = tuple(i + 1 for i in range(n_layers) if i and i % 4 == 0)
    if "kda_layers" in lin:
        kda = set(int(i) for i in lin["kda_layers"])
        if kda | set(full) != set(range(1, n_layers + 1)) or kda & set(full):
            raise ValueError("linear_attn_config: kda_layers and full_attn_layers must partition the layers")
    if not get("mla_use_nope", True):
        raise ValueError("MLA with rotary embeddings (mla_use_nope=false) is not supported")
    if get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ValueError("only the sigmoid MoE router is supported")
    n_heads_kda = int(lin.get("num_heads", get("linear_num_heads", 32)))
    lower = lin.get("gate_lower_bound")
    act = get("hidden_act", "silu")
    eos = top.get("eos_token_id", get("eos_token_id"))
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    dtype = get("torch_dtype", None, "dtype") or top.get("torch_dtype") or "bfloat16"
    if dtype not in ("bfloat16", "float32", "float16"):
        dtype = "bfloat16"
    n_experts = int(get("num_experts", 0, "num_local_experts", "n_routed_experts") or 0)
    return ModelConfig(
        name=name,
        vocab_size=int(get("vocab_size")),
        hidden_size=int(get("hidden_size")),
        num_layers=n_layers,
        rms_norm_eps=float(get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        dtype=dtype,
        max_position_embeddings=int(get("max_position_embeddings", 1048576, "model_max_length")),
        bos_token_id=top.get("bos_token_id", get("bos_token_id")),
        eos_token_id=eos,
        pad_token_id=top.get("pad_token_id", get("pad_token_id")),
        full_attn_layers=full,
        kda_num_heads=n_heads_kda,
        kda_head_dim=int(lin.get("head_dim", get("linear_head_dim", 128))),
        kda_conv_size=int(lin.get("short_conv_kernel_size", get("linear_conv_kernel_dim", 4))),
        kda_gate="safe" if lower is not None else "softplus",
        kda_gate_lower_bound=float(lower) if lower is not None else -5.0,
        kda_full_rank_output_gate=bool(lin.get("use_full_rank_gate", False)),
        mla_num_heads=int(get("num_attention_heads")),
        q_lora_rank=get("q_lora_rank"),
        kv_lora_rank=int(get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(get("qk_rope_head_dim", 64)),
        v_head_dim=int(get("v_head_dim", 128)),
        mla_output_gate=bool(get("mla_use_output_gate", False)),
        hidden_act=act,
        situ_beta=float(get("activation_situ_beta", 4.0)),
        situ_linear_beta=float(get("activation_situ_linear_beta", 25.0)),
        intermediate_size=int(get("intermediate_size", 0)),
        first_k_dense_replace=int(get("first_k_dense_replace", 1)),
        moe_layer_freq=int(get("moe_layer_freq", 1)),
        num_experts=n_experts,
        num_experts_per_token=int(get("num_experts_per_token", 8, "num_experts_per_tok")),
        num_shared_experts=int(get("num_shared_experts", 0, "n_shared_experts")),
        moe_intermediate_size=int(get("moe_intermediate_size", 0)),
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        moe_renormalize=bool(get("moe_renormalize", True, "norm_topk_prob")),
        num_expert_group=int(get("num_expert_group", 1, "n_group")),
        topk_group=int(get("topk_group", 1)),
        routed_expert_hidden_size=get("routed_expert_hidden_size"),
        latent_moe_use_norm=bool(get("latent_moe_use_norm", False)),
        attn_res_block_size=get("attn_res_block_size"),
        media_placeholder_token_id=top.get("media_placeholder_token_id", get("media_placeholder_token_id", 163605)),
        vision=VisionConfig.from_hf(top["vision_config"], int(get("hidden_size"))) if top.get("vision_config") else None,
    )


def to_hf_dict(cfg: ModelConfig, *, k3_layout: bool | None = None) -> dict:
    """A HF-style config.json for `cfg` (the inverse of `from_hf`).

    K3-style models (AttnRes / LatentMoE / safe gate) get the `kimi_k3` layout with a nested
    `text_config`; others the flat `kimi_linear` layout.
    """
    if k3_layout is None:
        k3_layout = cfg.uses_attn_res or cfg.routed_expert_hidden_size is not None or cfg.vision is not None
    if cfg.vision is not None and not k3_layout:
        raise ValueError("a vision model is written in the kimi_k3 layout (vision_config beside text_config)")
    full = list(cfg.full_attn_layers)
    lin = {
        "num_heads": cfg.kda_num_heads,
        "head_dim": cfg.kda_head_dim,
        "short_conv_kernel_size": cfg.kda_conv_size,
        "full_attn_layers": full,
        "kda_layers": [i + 1 for i in range(cfg.num_layers) if i + 1 not in set(full)],
    }
    if cfg.kda_gate == "safe":
        lin["gate_lower_bound"] = cfg.kda_gate_lower_bound
    if cfg.kda_full_rank_output_gate:
        lin["use_full_rank_gate"] = True
    text = {
        "model_type": "kimi_linear",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "torch_dtype": cfg.dtype,
        "hidden_act": cfg.hidden_act,
        "linear_attn_config": lin,
        "num_attention_heads": cfg.mla_num_heads,
        "num_key_value_heads": cfg.mla_num_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": cfg.mla_output_gate,
        "intermediate_size": cfg.intermediate_size,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "moe_layer_freq": cfg.moe_layer_freq,
        "num_experts": cfg.num_experts,
        "num_experts_per_token": cfg.num_experts_per_token,
        "num_shared_experts": cfg.num_shared_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "moe_renormalize": cfg.moe_renormalize,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True,
        "num_expert_group": cfg.num_expert_group,
        "topk_group": cfg.topk_group,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
    }
    if cfg.hidden_act == "situ":
        text["activation_situ_beta"] = cfg.situ_beta
        text["activation_situ_linear_beta"] = cfg.situ_linear_beta
    if cfg.routed_expert_hidden_size is not None:
        text["routed_expert_hidden_size"] = cfg.routed_expert_hidden_size
        text["latent_moe_use_norm"] = cfg.latent_moe_use_norm
    if cfg.attn_res_block_size:
        text["attn_res_block_size"] = cfg.attn_res_block_size
    if not k3_layout:
        text["architectures"] = ["KimiLinearForCausalLM"]
        return text
    out = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "media_placeholder_token_id": cfg.media_placeholder_token_id,
    }
    if cfg.vision is not None:
        out["vision_config"] = cfg.vision.to_hf()
    return out


# ---- presets -----------------------------------------------------------------------------

_K3_FULL = tuple(range(4, 89, 4)) + (92, 93)

_PRESETS: dict[str, ModelConfig] = {
    "k3": ModelConfig(
        name="k3",
        full_attn_layers=_K3_FULL,
        kda_a_log_size=128,
        vision=VisionConfig(),
    ),
    "kimi-linear-48b": ModelConfig(
        name="kimi-linear-48b",
        hidden_size=2304,
        num_layers=27,
        full_attn_layers=(4, 8, 12, 16, 20, 24, 27),
        kda_num_heads=32,
        kda_gate="softplus",
        kda_full_rank_output_gate=False,
        mla_num_heads=32,
        q_lora_rank=None,
        mla_output_gate=False,
        hidden_act="silu",
        intermediate_size=9216,
        num_experts=256,
        num_experts_per_token=8,
        num_shared_experts=1,
        moe_intermediate_size=1024,
        routed_scaling_factor=2.446,
        routed_expert_hidden_size=None,
        latent_moe_use_norm=False,
        attn_res_block_size=None,
    ),
    # One TP=8 rank of K3 (12 KDA / MLA heads of 128, real latent dims), 8 layers, 16 experts.
    "k3-mini": ModelConfig(
        name="k3-mini",
        vocab_size=32768,
        num_layers=8,
        full_attn_layers=(4, 8),
        kda_num_heads=12,
        mla_num_heads=12,
        intermediate_size=4224,
        num_experts=16,
        num_experts_per_token=4,
        attn_res_block_size=4,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    ),
    # A few million parameters with every K3 feature on; f32 so CPU tests compare tightly.
    "k3-tiny": ModelConfig(
        name="k3-tiny",
        vocab_size=512,
        hidden_size=256,
        num_layers=6,
        dtype="float32",
        max_position_embeddings=8192,
        full_attn_layers=(3, 6),
        kda_num_heads=4,
        kda_head_dim=32,
        mla_num_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=512,
        num_experts=8,
        num_experts_per_token=2,
        num_shared_experts=2,
        moe_intermediate_size=128,
        routed_expert_hidden_size=128,
        attn_res_block_size=2,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
        media_placeholder_token_id=259,
        # a two-block MoonViT3d (8 x 8 position table): every vision feature at test size
        vision=VisionConfig(init_pos_emb_height=8, init_pos_emb_width=8, num_attention_heads=2, num_hidden_layers=2,
                            hidden_size=64, intermediate_size=128, text_hidden_size=256, max_image_tokens=64),
    ),
}


def preset_names() -> list[str]:
    return list(_PRESETS)


def preset(name: str) -> ModelConfig:
    try:
        return _PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(_PRESETS)}") from None
