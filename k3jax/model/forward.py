"""The whole model over one packed ragged step: embedding -> layers (KDA / MLA attention, dense /
MoE FFN, plain or Block-AttnRes residuals) -> final norm -> LM head for the requested rows.

`forward(params, state, batch, cfg, impl)` is a pure function; `step` is its jitted form with the
state donated and `cfg` / `impl` static. `shard` (a `sharding.step.MeshContext`, static) runs the
kernels per shard and the MoE expert-parallel; `sharding.step.make_sharded_step` passes it.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.model.attn_res import AttnResParams, mix
from k3jax.model.common import layer_slice, rms_norm, rowwise
from k3jax.model.context import StepBatch, make_context
from k3jax.model.kda import KDAParams, kda_layer
from k3jax.model.mla import MLAParams, mla_layer
from k3jax.model.moe import DenseParams, MoEParams, dense_ffn, moe_ffn
from k3jax.state import DeviceState
from pallas_kernels.dispatch import batch_invariant


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    embed: jax.Array  # [X, D]
    lm_head: jax.Array  # [D, X]
    final_norm: jax.Array  # [D]
    input_norm: jax.Array  # [L, D] pre-attention RMSNorm of every layer
    post_norm: jax.Array  # [L, D] pre-FFN RMSNorm of every layer
    kda: KDAParams | None  # stacked over KDA layers
    mla: MLAParams | None  # stacked over MLA layers
    dense: DenseParams | None  # stacked over dense-FFN layers
    moe: MoEParams | None  # stacked over MoE layers
    attn_res: AttnResParams | None  # Block AttnRes query sites (None: plain residual)


# `Params` fields stacked over layers -> the config property counting their layers (None: all layers)
_LAYER_FIELDS = {"input_norm": None, "post_norm": None, "kda": "num_kda_layers", "mla": "num_mla_layers",
                 "dense": "num_dense_layers", "moe": "num_moe_layers"}
_RES_FIELDS = ("attn", "mlp")  # the Block AttnRes sites before each sublayer (one per layer)


def layer_fields(cfg: ModelConfig) -> dict[str, int]:
    """The `Params` fields stacked over layers ("attn_res.attn" for a nested one) -> layer count."""
    out = {k: cfg.num_layers if a is None else getattr(cfg, a) for k, a in _LAYER_FIELDS.items()}
    return out | {f"attn_res.{k}": cfg.num_layers for k in _RES_FIELDS}


def map_layer_fields(params, fn):
    """`params` (a `Params`, or any tree of its structure such as its shardings) with every stacked
    field `t` replaced by `fn(t, name)` (None fields stay None)."""
    f = lambda name, t: None if t is None else fn(t, name)
    kw = {k: f(k, getattr(params, k)) for k in _LAYER_FIELDS}
    ar = params.attn_res
    if ar is not None:
        kw["attn_res"] = dataclasses.replace(ar, **{k: f(f"attn_res.{k}", getattr(ar, k)) for k in _RES_FIELDS})
    return dataclasses.replace(params, **kw)


def is_split(params) -> bool:
    """Whether `params` holds its layers as tuples of per-layer arrays (`split_layers`)."""
    return isinstance(params.input_norm, tuple)


def split_layers(params: Params, shardings=None, consume: bool = False) -> Params:
    """The same parameters with every stacked (leading layer dim) field as a tuple of per-layer
    arrays / pytrees, which the forward indexes instead of slicing. XLA materialises the per-layer
    slices of stacked weights that feed small-batch products (a copy of every weight, every
    step: on the H200 4.5 of k3-mini's 9.8 ms per decode step at batch 1; on the CPU k3-tiny's
    step halves), and per-layer arrays have nothing to slice; `load_model` splits every model.

    shardings: the split layout's shardings (`sharding.rules.split_shardings`) to slice into (one jit
    per field); consume: delete each stacked field once it is split, so the peak is the stacked
    parameters plus one field. Split params pass through unchanged."""
    if is_split(params):
        return params

    def one(tree, name):
        leaves = jax.tree_util.tree_leaves(tree)
        n = leaves[0].shape[0]
        cut = lambda t: tuple(layer_slice(t, i) for i in range(n))
        if shardings is not None:
            sh = shardings
            for part in name.split("."):
                sh = getattr(sh, part)
            out = jax.jit(cut, out_shardings=sh)(tree)
        else:
            out = cut(tree)
        if consume:
            jax.block_until_ready(out)
            for leaf in leaves:
                leaf.delete()
        return out

    return map_layer_fields(params, one)


def stack_layers(params: Params) -> Params:
    """The inverse of `split_layers`: every per-layer tuple stacked back into one array per leaf
    (stacked params pass through unchanged)."""
    if not is_split(params):
        return params
    return map_layer_fields(params, lambda t, name: jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *t))


def _attention(params: Params, h, ctx, state: DeviceState, i: int, cfg: ModelConfig, impl: str, shard=None,
               captures=None):
    j = cfg.kind_index[i]
    if cfg.layer_kinds[i] == "kda":
        with jax.named_scope(f"layer{i}_kda"):
            y, rec = kda_layer(layer_slice(params.kda, j), h, ctx, state.recurrent, j, cfg, impl, shard, captures)
        return y, state.with_recurrent(rec)
    with jax.named_scope(f"layer{i}_mla"):
        y, kv = mla_layer(layer_slice(params.mla, j), h, ctx, state.kv, j, cfg, impl, shard)
    return y, state.with_kv(kv)


def _ffn(params: Params, h, i: int, cfg: ModelConfig, shard=None):
    j = cfg.ffn_index[i]
    if cfg.ffn_kinds[i] == "moe":
        with jax.named_scope(f"layer{i}_moe"):
            return moe_ffn(layer_slice(params.moe, j), h, cfg, shard)
    with jax.named_scope(f"layer{i}_dense"):
        return dense_ffn(layer_slice(params.dense, j), h, cfg)


def embed_tokens(params: Params, batch: StepBatch, cfg: ModelConfig):
    """The step's input rows: the embedding table's, or for media tokens (ids >= vocab_size, only in a step
    that carries `batch.embeds`) the given embeddings."""
    tok = batch.tokens
    if batch.embeds is None:
        return params.embed[tok]
    media = tok >= cfg.vocab_size
    x = params.embed[jnp.where(media, 0, tok)]
    return jnp.where(media[:, None], batch.embeds.astype(x.dtype), x)


def forward_hidden(params: Params, state: DeviceState, batch: StepBatch, cfg: ModelConfig, impl: str = "xla",
                   shard=None, block: int = 1, captures: list | None = None):
    """-> (final normed hidden of the `logit_idx` rows [R, D], state). `block` > 1: a speculative
    verify step (see `StepContext`); each KDA layer appends its `VerifyCapture` to `captures`."""
    ctx = make_context(batch, cfg.kda_conv_size, block)
    eps = cfg.rms_norm_eps
    x = embed_tokens(params, batch, cfg)
    B = cfg.attn_res_block_size
    ar = params.attn_res
    if not B:
        for i in range(cfg.num_layers):
            a, state = _attention(params, rms_norm(x, params.input_norm[i], eps), ctx, state, i, cfg, impl, shard,
                                  captures)
            x = x + a
            x = x + _ffn(params, rms_norm(x, params.post_norm[i], eps), i, cfg, shard)
        out = x[batch.logit_idx]
    else:
        bank: list[jax.Array] = []
        p = x
        for i in range(cfg.num_layers):
            h = mix(bank, p, layer_slice(ar.attn, i), eps)
            if i % B == 0:
                bank.append(p)
                p = None
            a, state = _attention(params, rms_norm(h, params.input_norm[i], eps), ctx, state, i, cfg, impl, shard,
                                  captures)
            p = a if p is None else p + a
            h = mix(bank, p, layer_slice(ar.mlp, i), eps)
            p = p + _ffn(params, rms_norm(h, params.post_norm[i], eps), i, cfg, shard)
        rows = batch.logit_idx
        out = mix([b[rows] for b in bank], p[rows], ar.out, eps)
    return rms_norm(out, params.final_norm, eps), state


def lm_head(params: Params, h):
    with jax.named_scope("lm_head"):
        return rowwise(lambda h: jnp.einsum("rd,dx->rx", h.astype(params.lm_head.dtype), params.lm_head,
                                            preferred_element_type=jnp.float32), h)


def matmul_precision(cfg: ModelConfig):
    """The step's matmul precision: an f32 model multiplies in f32 (`jax.default_matmul_precision`
    "highest"). Left at XLA's default, an f32 matmul runs with TF32 (GPU) or bf16 passes (TPU)
    inputs for some shapes and in full f32 for others: on the H200 the rows of a weight product at M = 1
    (decode) and M >= 4 (verify blocks) differed by ~1e-3 (bench/results/batch_invariance_h200.json), so
    speculative and plain decoding of an f32 model parted. bf16 models (what is served) are untouched:
    their products take bf16 inputs at any precision. CPU results do not change."""
    if jnp.dtype(cfg.dtype) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


@contextlib.contextmanager
def step_numerics(cfg: ModelConfig):
    """What a step is traced in: `matmul_precision(cfg)` and, with `cfg.batch_invariant_rows`, the
    batch-invariant mode (`pallas_kernels.dispatch.batch_invariant`: a token's logits do not depend on
    the other tokens of its step, DESIGN.md section 4)."""
    with matmul_precision(cfg), batch_invariant(cfg.batch_invariant_rows):
        yield


def forward(params: Params, state: DeviceState, batch: StepBatch, cfg: ModelConfig, impl: str = "auto", shard=None):
    """-> (f32 logits [R, X] of the `logit_idx` rows, new state)."""
    with step_numerics(cfg):
        h, state = forward_hidden(params, state, batch, cfg, impl, shard)
        return lm_head(params, h), state


def forward_verify(params: Params, state: DeviceState, batch: StepBatch, cfg: ModelConfig, block: int,
                   impl: str = "auto", shard=None):
    """A speculative verify step: blocks of `block` tokens per decode sequence read the committed
    recurrent state (never writing it) and write MLA KV for every block token; prefill sequences
    run as usual. -> (logits [R, X], state, [VerifyCapture per KDA layer])."""
    captures: list = []
    with step_numerics(cfg):
        h, state = forward_hidden(params, state, batch, cfg, impl, shard, block, captures)
        return lm_head(params, h), state, captures


step = jax.jit(forward, static_argnames=("cfg", "impl", "shard"), donate_argnames=("state",))
