"""The MoonViT3d vision tower and its patch-merger projector (Kimi-K2.5's, which K3 keeps), as pure
functions over `VisionParams`.

Shapes (p patch size, D vision width, H heads, K = D/H head dim, I MLP width, kh x kw merge kernel,
A = kh*kw, Dt the LM's hidden size):

  preprocess_image(uint8[Hpx, Wpx, 3]) -> patches f32[h*w, 3*p*p], grid (1, h, w)
      each patch flattened in (channel, row, column) order, patches row-major over the h x w grid
  preprocess_video(uint8[T, Hpx, Wpx, 3]) -> [(patches f32[t*h*w, 3*p*p] frame-major, (t, h, w)), ...]
  encode(params, vcfg, patches f32[N, 3*p*p], grids) -> [sum_i (h_i/kh)*(w_i/kw), Dt]
      N = sum_i t_i*h_i*w_i: every image / video chunk of `grids` packed in order

The tower: patch embedding (Conv2d k=s=p == a linear over the flattened patch) + the learned
position table [H0, W0, D] resized to (h, w) with torch's bicubic (`F.interpolate(mode="bicubic",
align_corners=False)`: Keys a=-0.75, border clamped, no antialias; the table itself when (h, w) ==
(H0, W0)) + for t > 1 a fixed sin-cos time embedding of the frame -> L pre-LN blocks (2-D rotary
attention, bidirectional within each chunk; MLP fc0 -> gelu(tanh) -> fc1) -> final LayerNorm ->
temporal mean over the chunk's frames -> kh x kw patch groups, row-major over the (h/kh, w/kw) groups
-> projector: LayerNorm(D) per patch, concat the group [A*D], Linear -> GELU(erf) -> Linear to Dt.

2-D rotary: rotary pairs are interleaved (q[2i], q[2i+1]) as in the published checkpoint (HF
transformers permutes `wqkv` to its rotate-half layout on load; we keep the checkpoint's). Pair i
turns by x * f[i//2] for even i and y * f[i//2] for odd i, x the patch column, y its row,
f[j] = 10000^(-4j/K).

Numerics: products in the params' dtype with f32 accumulation; the residual stream, LayerNorms,
softmax, rotary and the temporal mean in f32; the output in the params' dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import VisionConfig

LN_EPS = 1e-5  # the tower's LayerNorms (torch's default); the projector's is `projector_ln_eps`
ROPE_THETA = 10000.0
TIME_THETA = 10000.0

Grid = tuple[int, int, int]  # (t, h, w): frames, patch rows, patch columns


# ---- parameters ---------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VisionBlocks:  # stacked over the tower's blocks (leading dim L)
    norm0_w: jax.Array  # [L, D] pre-attention LayerNorm
    norm0_b: jax.Array  # [L, D]
    wqkv: jax.Array  # [L, D, 3*D] q | k | v, each head-major [H, K] with rotary pairs interleaved
    wqkv_b: jax.Array  # [L, 3*D]
    wo: jax.Array  # [L, D, D]
    wo_b: jax.Array  # [L, D]
    norm1_w: jax.Array  # [L, D] pre-MLP LayerNorm
    norm1_b: jax.Array  # [L, D]
    fc0: jax.Array  # [L, D, I]
    fc0_b: jax.Array  # [L, I]
    fc1: jax.Array  # [L, I, D]
    fc1_b: jax.Array  # [L, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VisionParams:
    patch_w: jax.Array  # [3*p*p, D] the patch Conv2d as a linear over (channel, row, column)
    patch_b: jax.Array  # [D]
    pos_emb: jax.Array  # [H0, W0, D] learned position table
    blocks: VisionBlocks
    final_norm_w: jax.Array  # [D]
    final_norm_b: jax.Array  # [D]
    proj_norm_w: jax.Array  # [D] projector pre_norm (per patch)
    proj_norm_b: jax.Array  # [D]
    proj0: jax.Array  # [A*D, A*D]
    proj0_b: jax.Array  # [A*D]
    proj2: jax.Array  # [A*D, Dt]
    proj2_b: jax.Array  # [Dt]


def init_vision_params(vcfg: VisionConfig, key: jax.Array, dtype="float32") -> VisionParams:
    """Random parameters: projections ~ N(0, fan_in^-1), position table N(0, 0.25), LayerNorm weights
    near 1 and biases near 0 (all nonzero, so a layout mistake in any of them shows in a test);
    activations stay O(1) through the tower."""
    dt = jnp.dtype(dtype)
    D, I, L, p, A, Dt = (vcfg.hidden_size, vcfg.intermediate_size, vcfg.num_hidden_layers, vcfg.patch_size,
                         vcfg.merge_area, vcfg.text_hidden_size)
    keys = iter(jax.random.split(key, 32))

    def normal(*shape, std):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)

    def lin(*shape):  # [..., in, out]
        return normal(*shape, std=shape[-2] ** -0.5)

    def norm_w(*shape):
        return (1.0 + normal(*shape, std=0.1).astype(jnp.float32)).astype(dt)

    blocks = VisionBlocks(
        norm0_w=norm_w(L, D), norm0_b=normal(L, D, std=0.1),
        wqkv=lin(L, D, 3 * D), wqkv_b=normal(L, 3 * D, std=0.1),
        wo=lin(L, D, D), wo_b=normal(L, D, std=0.1),
        norm1_w=norm_w(L, D), norm1_b=normal(L, D, std=0.1),
        fc0=lin(L, D, I), fc0_b=normal(L, I, std=0.1),
        fc1=lin(L, I, D), fc1_b=normal(L, D, std=0.1),
    )
    return VisionParams(
        patch_w=lin(3 * p * p, D), patch_b=normal(D, std=0.1),
        pos_emb=normal(vcfg.init_pos_emb_height, vcfg.init_pos_emb_width, D, std=0.5),
        blocks=blocks,
        final_norm_w=norm_w(D), final_norm_b=normal(D, std=0.1),
        proj_norm_w=norm_w(D), proj_norm_b=normal(D, std=0.1),
        proj0=lin(A * D, A * D), proj0_b=normal(A * D, std=0.1),
        proj2=lin(A * D, Dt), proj2_b=normal(Dt, std=0.1),
    )


def vision_param_shapes(vcfg: VisionConfig, dtype="float32") -> VisionParams:
    """`VisionParams` of ShapeDtypeStructs (no allocation)."""
    return jax.eval_shape(lambda: init_vision_params(vcfg, jax.random.key(0), dtype))


# ---- grids and static tables (numpy, built while tracing) ------------------------------

def num_image_tokens(grid: Sequence[int], vcfg: VisionConfig) -> int:
    """LM tokens of one image or video chunk: (h/kh)*(w/kw) (frames are mean-pooled)."""
    _, h, w = grid
    kh, kw = vcfg.merge_kernel_size
    return (h // kh) * (w // kw)


def check_grids(grids, vcfg: VisionConfig) -> tuple[Grid, ...]:
    """`grids` as a tuple of (t, h, w) int tuples; ValueError naming the first bad one."""
    kh, kw = vcfg.merge_kernel_size
    out = []
    for i, g in enumerate(grids):
        try:
            t, h, w = (int(x) for x in g)
        except (TypeError, ValueError):
            raise ValueError(f"grid {i} is {g!r}; expected (t, h, w)") from None
        if min(t, h, w) < 1:
            raise ValueError(f"grid {i} {(t, h, w)}: t, h and w must be >= 1")
        if h % kh or w % kw:
            raise ValueError(f"grid {i} {(t, h, w)}: h and w must be multiples of the merge kernel {(kh, kw)}")
        if t > vcfg.init_pos_emb_time:
            raise ValueError(f"grid {i} {(t, h, w)}: a video chunk has at most {vcfg.init_pos_emb_time} frames")
        if max(h, w) > vcfg.rope_max_grid:
            raise ValueError(f"grid {i} {(t, h, w)}: h and w must be <= rope_max_grid {vcfg.rope_max_grid}")
        out.append((t, h, w))
    if not out:
        raise ValueError("no images: grids is empty")
    return tuple(out)


@functools.lru_cache(maxsize=256)
def bicubic_matrix(n_out: int, n_in: int) -> np.ndarray:
    """f32[n_out, n_in]: torch's 1-D bicubic resize (align_corners=False, a=-0.75, taps clamped to
    the border, no antialias) as a matrix; `M @ x` resizes x along its first axis."""
    a = -0.75
    src = (np.arange(n_out, dtype=np.float64) + 0.5) * (n_in / n_out) - 0.5
    base = np.floor(src)
    m = np.zeros((n_out, n_in), np.float64)
    for off in (-1, 0, 1, 2):
        d = np.abs(src - (base + off))
        near = ((a + 2) * d - (a + 3)) * d * d + 1
        far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
        wgt = np.where(d <= 1, near, far)
        idx = np.clip(base + off, 0, n_in - 1).astype(np.int64)
        np.add.at(m, (np.arange(n_out), idx), wgt)
    return m.astype(np.float32)


def resize_pos_table(table: jax.Array, h: int, w: int) -> jax.Array:
    """[H0, W0, D] -> f32[h, w, D] by torch-style bicubic (the table itself at its own size)."""
    H0, W0, _ = table.shape
    t = table.astype(jnp.float32)
    if (h, w) == (H0, W0):
        return t
    mh, mw = jnp.asarray(bicubic_matrix(h, H0)), jnp.asarray(bicubic_matrix(w, W0))
    return jnp.einsum("ha,abd,wb->hwd", mh, t, mw, precision=jax.lax.Precision.HIGHEST)


def time_embedding(num_frames: int, dim: int) -> np.ndarray:
    """f32[num_frames, dim]: frame f -> [sin(f * w_k), cos(f * w_k)], w_k = 10000^(-2k/dim)."""
    omega = 1.0 / TIME_THETA ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    ang = np.arange(num_frames, dtype=np.float32)[:, None] * omega[None, :].astype(np.float32)
    return np.concatenate([np.sin(ang), np.cos(ang)], axis=1).astype(np.float32)


def rotary_angles(grids: tuple[Grid, ...], head_dim: int) -> np.ndarray:
    """f32[N, head_dim/2]: the angle of every rotary pair of every packed patch (frames repeat the
    spatial positions)."""
    inv = (1.0 / ROPE_THETA ** (np.arange(0, head_dim // 2, 2, dtype=np.float32) / np.float32(head_dim // 2)))
    inv = inv.astype(np.float32)  # [K/4]
    parts = []
    for t, h, w in grids:
        rows = np.repeat(np.arange(h, dtype=np.float32), w)
        cols = np.tile(np.arange(w, dtype=np.float32), h)
        xy = np.stack([cols[:, None] * inv, rows[:, None] * inv], axis=-1)  # [h*w, K/4, 2]: x then y
        parts.append(np.tile(xy.reshape(h * w, head_dim // 2), (t, 1)))
    return np.concatenate(parts).astype(np.float32)


def _offsets(grids: tuple[Grid, ...]) -> list[tuple[int, int]]:
    """(start, length) of every chunk in the packed patch sequence."""
    out, s = [], 0
    for t, h, w in grids:
        out.append((s, t * h * w))
        s += t * h * w
    return out


# ---- the tower ----------------------------------------------------------------------------

def _linear(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] + b in w's dtype with f32 accumulation -> f32."""
    y = jnp.einsum("...i,io->...o", x.astype(w.dtype), w, preferred_element_type=jnp.float32)
    return y + b.astype(jnp.float32)


def _layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis in f32 -> f32."""
    x = x.astype(jnp.float32)
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Interleaved-pair rotary: x f32[T, H, K], cos/sin f32[T, K/2]."""
    T, H, K = x.shape
    x = x.reshape(T, H, K // 2, 2)
    a, b = x[..., 0], x[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(T, H, K)


def _chunk_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, attn: str = "xla",
                     n_valid=None) -> jax.Array:
    """Bidirectional attention within one chunk: q, k, v [n, H, K] -> f32[n, H, K] (f32 softmax). n_valid (a
    traced scalar): keys at or past it are padding, masked out. attn "cudnn": `jax.nn.dot_product_attention`'s
    fused GPU kernel (bf16 / f16; no [H, n, n] scores)."""
    if attn != "xla":
        lengths = None if n_valid is None else jnp.reshape(n_valid, (1,)).astype(jnp.int32)
        o = jax.nn.dot_product_attention(q[None], k[None], v[None], scale=scale, implementation=attn,
                                         key_value_seq_lengths=lengths)
        return o[0].astype(jnp.float32)
    s = jnp.einsum("thk,shk->hts", q, k, preferred_element_type=jnp.float32) * scale
    if n_valid is not None:
        s = jnp.where(jnp.arange(k.shape[0])[None, None, :] < n_valid, s, -jnp.inf)
    pr = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("hts,shk->thk", pr.astype(v.dtype), v, preferred_element_type=jnp.float32)


def _attention(x: jax.Array, blk: VisionBlocks, vcfg: VisionConfig, cos, sin, grids, attn: str = "xla",
               n_valid=None) -> jax.Array:
    """x f32[N, D] (normed) -> f32[N, D]: each chunk of `grids` attends to itself only (static slices:
    O(sum n_i^2)); with `n_valid` (grids None), x is one image padded to N rows, keys past n_valid masked."""
    N = x.shape[0]
    H, K = vcfg.num_attention_heads, vcfg.head_dim
    dt = blk.wqkv.dtype
    qkv = _linear(x, blk.wqkv, blk.wqkv_b).reshape(N, 3, H, K)
    q = _rotate(qkv[:, 0], cos, sin).astype(dt)
    k = _rotate(qkv[:, 1], cos, sin).astype(dt)
    v = qkv[:, 2].astype(dt)
    if n_valid is not None:
        return _linear(_chunk_attention(q, k, v, K ** -0.5, attn, n_valid).reshape(N, H * K), blk.wo, blk.wo_b)
    outs = [_chunk_attention(q[s:s + n], k[s:s + n], v[s:s + n], K ** -0.5, attn) for s, n in _offsets(grids)]
    o = jnp.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
    return _linear(o.reshape(N, H * K), blk.wo, blk.wo_b)


def _block(x: jax.Array, blk: VisionBlocks, vcfg: VisionConfig, cos, sin, grids, attn: str = "xla",
           n_valid=None) -> jax.Array:
    h = _layer_norm(x, blk.norm0_w, blk.norm0_b, LN_EPS)
    x = x + _attention(h, blk, vcfg, cos, sin, grids, attn, n_valid)
    h = _layer_norm(x, blk.norm1_w, blk.norm1_b, LN_EPS)
    h = jax.nn.gelu(_linear(h, blk.fc0, blk.fc0_b), approximate=True)
    return x + _linear(h, blk.fc1, blk.fc1_b)


def _embed(params: VisionParams, vcfg: VisionConfig, patches: jax.Array, grids) -> jax.Array:
    """Patch embedding + resized position table (+ time embedding for t > 1) -> f32[N, D]."""
    x = _linear(patches, params.patch_w, params.patch_b)
    D = vcfg.hidden_size
    time = time_embedding(vcfg.init_pos_emb_time, D)
    pos = []
    for t, h, w in grids:
        p2 = resize_pos_table(params.pos_emb, h, w).reshape(1, h * w, D)
        if t > 1:
            p2 = p2 + jnp.asarray(time[:t])[:, None, :]
        pos.append(jnp.broadcast_to(p2, (t, h * w, D)).reshape(t * h * w, D))
    return x + (jnp.concatenate(pos, axis=0) if len(pos) > 1 else pos[0])


def _merge(x: jax.Array, vcfg: VisionConfig, grids) -> jax.Array:
    """f32[N, D] -> f32[M, A, D]: mean over each chunk's frames, then kh x kw groups, row-major."""
    kh, kw = vcfg.merge_kernel_size
    D = x.shape[-1]
    out = []
    for (t, h, w), (s, n) in zip(grids, _offsets(grids)):
        y = x[s:s + n].reshape(t, h // kh, kh, w // kw, kw, D).mean(axis=0)
        out.append(y.transpose(0, 2, 1, 3, 4).reshape(-1, kh * kw, D))
    return jnp.concatenate(out, axis=0) if len(out) > 1 else out[0]


def _project(params: VisionParams, vcfg: VisionConfig, x: jax.Array) -> jax.Array:
    """f32[M, A, D] -> f32[M, Dt]: the patch-merger projector."""
    h = _layer_norm(x, params.proj_norm_w, params.proj_norm_b, vcfg.projector_ln_eps)
    h = h.reshape(h.shape[0], -1)
    h = jax.nn.gelu(_linear(h, params.proj0, params.proj0_b), approximate=False)
    return _linear(h, params.proj2, params.proj2_b)


@functools.partial(jax.jit, static_argnames=("vcfg", "grids", "attn"))
def _encode(params: VisionParams, patches: jax.Array, vcfg: VisionConfig, grids: tuple[Grid, ...],
            attn: str = "xla") -> jax.Array:
    with jax.named_scope("vision_embed"):
        x = _embed(params, vcfg, patches, grids)
    ang = jnp.asarray(rotary_angles(grids, vcfg.head_dim))
    cos, sin = jnp.cos(ang), jnp.sin(ang)

    def body(x, blk):
        with jax.named_scope("vision_block"):
            return _block(x, blk, vcfg, cos, sin, grids, attn), None

    x, _ = jax.lax.scan(body, x, params.blocks)
    x = _layer_norm(x, params.final_norm_w, params.final_norm_b, LN_EPS)
    with jax.named_scope("vision_projector"):
        y = _project(params, vcfg, _merge(x, vcfg, grids))
    return y.astype(params.proj2.dtype)


def encode(params: VisionParams, vcfg: VisionConfig, patches, grids, attn: str = "auto") -> jax.Array:
    """Images / video chunks -> LM input embeddings [sum_i num_image_tokens(grid_i), Dt] in the
    params' dtype; rows in `grids` order, each chunk's tokens row-major over its merge groups.

    `patches` [sum_i t_i*h_i*w_i, 3*p*p] (the `preprocess_*` outputs concatenated, `pack`), `grids`
    a sequence of (t, h, w). Compiles once per distinct `grids` tuple. Every chunk's attention is
    computed on its own slice (no cross-chunk work, no mask), materialising an f32 [H, n, n] score
    matrix per chunk of n patches: O(n^2) memory, fine for the tiny and moderate images used so far;
    a flash-style kernel is the next step for 4096-token images (n = 16384). attn="cudnn" (GPU, bf16)
    runs each chunk through `jax.nn.dot_product_attention`'s fused kernel instead: on an H100 3.5x
    faster at 9,216 patches (55 against 191 ms for K3's tower) and within one bf16 ulp of the XLA form's
    output (bench/results/session31/vision.json). "auto" (the default): cuDNN for bf16 / f16 params on a
    GPU, XLA otherwise."""
    grids = check_grids(grids, vcfg)
    n = sum(t * h * w for t, h, w in grids)
    width = 3 * vcfg.patch_size ** 2
    shape = tuple(np.shape(patches))
    if shape != (n, width):
        raise ValueError(f"patches have shape {shape}; grids {grids} need ({n}, {width})")
    return _encode(params, jnp.asarray(patches), vcfg, grids, _resolve_attn(params, attn))


# ---- one image padded to a patch bucket: one compile per bucket, not per grid ----------------

MIN_PATCH_BUCKET = 256
PATCH_BUCKET_STEP = 1024


def patch_bucket(n: int) -> int:
    """The padded patch count an image of n patches runs at: the next power of two >= max(n, 256) up to 1024,
    then the next multiple of 1024 (at most 1023 padding patches; 16 buckets up to a 4096-token image)."""
    if n > PATCH_BUCKET_STEP:
        return -(-n // PATCH_BUCKET_STEP) * PATCH_BUCKET_STEP
    return max(MIN_PATCH_BUCKET, 1 << (max(n, 1) - 1).bit_length())


@functools.lru_cache(maxsize=64)
def bucket_tables(grid: Grid, vcfg: VisionConfig) -> tuple[np.ndarray, ...]:
    """Host tables of one image (t = 1) at its patch bucket Nb (n = h*w real patches, M = n / A merged rows,
    Mb = Nb / A): the position table's bicubic taps (i32[Nb, 16] flat indices into [H0*W0], f32[Nb, 16]
    weights; zeros for padding), rotary angles f32[Nb, K/2] and the merge gather i32[Mb, A] (row-major
    groups; padding rows read patch 0). The taps reproduce `resize_pos_table`: each output row of torch's
    bicubic reads 4 source rows and 4 source columns."""
    t, h, w = grid
    if t != 1:
        raise ValueError(f"grid {grid}: the bucketed tower takes single images (t = 1)")
    n = h * w
    Nb = patch_bucket(n)
    H0, W0 = vcfg.init_pos_emb_height, vcfg.init_pos_emb_width

    def taps(n_out, n_in):  # the (<= 4) nonzero source indices and weights of each output position
        m = bicubic_matrix(n_out, n_in) if n_out != n_in else np.eye(n_in, dtype=np.float32)
        idx = np.argsort(-np.abs(m), axis=1, kind="stable")[:, :4]
        return idx, np.take_along_axis(m, idx, axis=1)

    ri, rw = taps(h, H0)
    ci, cw = taps(w, W0)
    rows, cols = np.repeat(np.arange(h), w), np.tile(np.arange(w), h)
    pos_idx = np.zeros((Nb, 16), np.int32)
    pos_w = np.zeros((Nb, 16), np.float32)
    pos_idx[:n] = (ri[rows][:, :, None] * W0 + ci[cols][:, None, :]).reshape(n, 16)
    pos_w[:n] = (rw[rows][:, :, None] * cw[cols][:, None, :]).reshape(n, 16)
    ang = np.zeros((Nb, vcfg.head_dim // 2), np.float32)
    ang[:n] = rotary_angles((grid,), vcfg.head_dim)
    kh, kw = vcfg.merge_kernel_size
    A = kh * kw
    merge = np.zeros((Nb // A, A), np.int32)
    merge[: n // A] = np.arange(n).reshape(h // kh, kh, w // kw, kw).transpose(0, 2, 1, 3).reshape(-1, A)
    return pos_idx, pos_w, ang, merge


@functools.partial(jax.jit, static_argnames=("vcfg", "attn"))
def _encode_bucket(params: VisionParams, patches, pos_idx, pos_w, ang, merge, n_valid, vcfg: VisionConfig,
                   attn: str = "xla") -> jax.Array:
    """One image padded to Nb patches -> [Mb, Dt] (rows past the image's M are padding)."""
    D = vcfg.hidden_size
    table = params.pos_emb.astype(jnp.float32).reshape(-1, D)
    with jax.named_scope("vision_embed"):
        pos = sum(table[pos_idx[:, j]] * pos_w[:, j, None] for j in range(pos_idx.shape[1]))
        x = _linear(patches, params.patch_w, params.patch_b) + pos
    cos, sin = jnp.cos(ang), jnp.sin(ang)

    def body(x, blk):
        with jax.named_scope("vision_block"):
            return _block(x, blk, vcfg, cos, sin, None, attn, n_valid), None

    x, _ = jax.lax.scan(body, x, params.blocks)
    x = _layer_norm(x, params.final_norm_w, params.final_norm_b, LN_EPS)
    with jax.named_scope("vision_projector"):
        y = _project(params, vcfg, x[merge])
    return y.astype(params.proj2.dtype)


def _resolve_attn(params: VisionParams, attn: str) -> str:
    if attn not in ("auto", "xla", "cudnn"):
        raise ValueError(f"attn must be 'auto', 'xla' or 'cudnn', got {attn!r}")
    if attn == "auto":
        half = jnp.dtype(params.blocks.wo.dtype) in (jnp.bfloat16, jnp.float16)
        return "cudnn" if half and jax.default_backend() == "gpu" else "xla"
    return attn


def encode_image(params: VisionParams, vcfg: VisionConfig, patches, grid, attn: str = "auto") -> jax.Array:
    """One image (grid (1, h, w)) -> [num_image_tokens, Dt], with its patches padded to `patch_bucket`: one
    compiled program per bucket (`patch_bucket`) rather than per grid, so a server meeting
    many image sizes compiles a handful of times. Same function as `encode` (padding keys masked out)."""
    (grid,) = check_grids((grid,), vcfg)
    t, h, w = grid
    if t != 1:
        raise ValueError(f"grid {grid}: encode_image takes single images (t = 1); use encode for video chunks")
    n = h * w
    width = 3 * vcfg.patch_size ** 2
    if tuple(np.shape(patches)) != (n, width):
        raise ValueError(f"patches have shape {tuple(np.shape(patches))}; grid {grid} needs ({n}, {width})")
    pos_idx, pos_w, ang, merge = bucket_tables(grid, vcfg)
    padded = np.zeros((pos_idx.shape[0], width), np.float32)
    padded[:n] = patches
    out = _encode_bucket(params, padded, pos_idx, pos_w, ang, merge, np.int32(n), vcfg, _resolve_attn(params, attn))
    return out[: num_image_tokens(grid, vcfg)]


def pack(items: Sequence[tuple[np.ndarray, Sequence[int]]]) -> tuple[np.ndarray, tuple[Grid, ...]]:
    """[(patches, grid), ...] (the `preprocess_*` outputs) -> (patches concatenated, grids) for `encode`."""
    if not items:
        raise ValueError("no images to pack")
    return (np.concatenate([np.asarray(p, np.float32) for p, _ in items], axis=0),
            tuple(tuple(int(x) for x in g) for _, g in items))


# ---- preprocessing (numpy) ----------------------------------------------------------------

def _pixels(image, what: str = "image", rank: int = 3) -> np.ndarray:
    """A PIL image (if Pillow is installed), uint8 array or float array in [0, 1], checked:
    [H, W, 3] (rank 3) or [T, H, W, 3] (rank 4); ValueError saying what is wrong."""
    try:
        from PIL import Image
    except ImportError:  # Pillow is optional
        Image = None
    if Image is not None and isinstance(image, Image.Image):
        image = np.asarray(image.convert("RGB"))
    arr = np.asarray(image)
    if arr.ndim != rank:
        want = "[H, W, 3]" if rank == 3 else "[T, H, W, 3]"
        raise ValueError(f"{what} must be an array {want} (RGB, channels last); got shape {arr.shape}")
    if arr.shape[-1] != 3:
        raise ValueError(f"{what} must have 3 channels (RGB, channels last); got shape {arr.shape}")
    if 0 in arr.shape:
        raise ValueError(f"{what} is empty: shape {arr.shape}")
    if np.issubdtype(arr.dtype, np.floating):
        lo, hi = float(arr.min()), float(arr.max())
        if not (np.isfinite(lo) and np.isfinite(hi)) or lo < 0.0 or hi > 1.0:
            raise ValueError(f"a float {what} must hold values in [0, 1]; got [{lo}, {hi}]")
    elif arr.dtype != np.uint8:
        raise ValueError(f"{what} must be uint8 (0-255) or float (0-1); got dtype {arr.dtype}")
    return arr


def _unit(arr: np.ndarray) -> np.ndarray:
    """Checked pixels -> f32 in [0, 1]."""
    if arr.dtype == np.uint8:
        return arr.astype(np.float32) / np.float32(255.0)
    return arr.astype(np.float32)


def fit_image(height: int, width: int, vcfg: VisionConfig, max_tokens: int | None = None
              ) -> tuple[tuple[int, int], tuple[int, int]]:
    """-> ((new_height, new_width), (h, w)): the size an image is resized to (never up, aspect kept)
    and its patch grid (the resized image padded at the bottom / right to whole merge groups).

    Same rule as HF transformers' Kimi-K2.5 processor (`navit_resize`, with max_patches =
    max_tokens * kh * kw and max_size_per_side = rope_max_grid), plus a guarantee: where its padding
    would exceed `max_tokens` (default `vcfg.max_image_tokens`) LM tokens, the scale shrinks until
    the grid fits. At least one merge group."""
    p = vcfg.patch_size
    kh, kw = vcfg.merge_kernel_size
    side = vcfg.rope_max_grid
    budget = int(vcfg.max_image_tokens if max_tokens is None else max_tokens)
    if budget < 1:
        raise ValueError(f"max_tokens must be >= 1, got {budget}")
    if side < max(kh, kw):
        raise ValueError(f"rope_max_grid {side} is smaller than the merge kernel {(kh, kw)}")
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height} x {width}")

    def at(scale):
        nh = min(max(1, int(height * scale)), side * p)
        nw = min(max(1, int(width * scale)), side * p)
        return (nh, nw), (-(-nh // (p * kh)) * kh, -(-nw // (p * kw)) * kw)

    patches = max(1, height // p) * max(1, width // p)
    scale = min(1.0, math.sqrt(budget * kh * kw / patches), side * p / height, side * p / width)
    size, (gh, gw) = at(scale)
    while (gh // kh) * (gw // kw) > budget or gh > side or gw > side:
        tokens = (gh // kh) * (gw // kw)
        scale *= min(0.99, math.sqrt(budget / tokens))
        size, (gh, gw) = at(scale)
    return size, (gh, gw)


def _cubic_pil(x: np.ndarray) -> np.ndarray:
    """The bicubic kernel with a = -0.5 (PIL's / torchvision's antialiased BICUBIC)."""
    a = -0.5
    x = np.abs(x)
    return np.where(x < 1, ((a + 2) * x - (a + 3)) * x * x + 1,
                    np.where(x < 2, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, 0.0))


def _resize_axis(img: np.ndarray, n_out: int, axis: int) -> np.ndarray:
    """Antialiased bicubic resize of `img` along `axis` (the kernel widened by the downscale factor,
    weights normalised per output; taps outside the image dropped), as PIL's `resize(BICUBIC)`."""
    n_in = img.shape[axis]
    if n_in == n_out:
        return img
    scale = n_in / n_out
    support = 2.0 * max(scale, 1.0)
    centers = (np.arange(n_out) + 0.5) * scale
    lo = np.maximum(np.floor(centers - support + 0.5).astype(np.int64), 0)
    hi = np.minimum(np.floor(centers + support + 0.5).astype(np.int64), n_in)
    taps = int((hi - lo).max())
    idx = lo[:, None] + np.arange(taps)[None, :]  # [n_out, taps]
    valid = idx < hi[:, None]
    wgt = _cubic_pil((idx + 0.5 - centers[:, None]) / max(scale, 1.0)) * valid
    wgt = wgt / wgt.sum(axis=1, keepdims=True)
    idx = np.minimum(idx, n_in - 1)
    moved = np.moveaxis(img, axis, 0)  # [n_in, ...]
    wgt = wgt.astype(np.float32).reshape(n_out, taps, *([1] * (moved.ndim - 1)))
    out = wgt[:, 0] * moved[idx[:, 0]]
    for k in range(1, taps):  # one tap at a time: memory stays one output
        out += wgt[:, k] * moved[idx[:, k]]
    return np.moveaxis(out, 0, axis)


def resize_bicubic(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """f32 [..., H, W, C] -> [..., height, width, C], antialiased bicubic (`_resize_axis`)."""
    img = _resize_axis(img, height, img.ndim - 3)
    return _resize_axis(img, width, img.ndim - 2).astype(np.float32)


def _patchify(frames: np.ndarray, vcfg: VisionConfig, grid_hw: tuple[int, int]) -> np.ndarray:
    """f32 [T, h', w', 3] in [0, 1] -> normalised patches f32[T*h*w, 3*p*p] (pad bottom / right with
    black, then (x - mean) / std, each patch in (channel, row, column) order)."""
    p = vcfg.patch_size
    gh, gw = grid_hw
    T, nh, nw, _ = frames.shape
    canvas = np.zeros((T, gh * p, gw * p, 3), np.float32)
    canvas[:, :nh, :nw] = frames
    canvas = (canvas - np.asarray(vcfg.image_mean, np.float32)) / np.asarray(vcfg.image_std, np.float32)
    x = canvas.reshape(T, gh, p, gw, p, 3).transpose(0, 1, 3, 5, 2, 4)  # [T, gh, gw, c, row, col]
    return np.ascontiguousarray(x.reshape(T * gh * gw, 3 * p * p))


def preprocess_image(image, vcfg: VisionConfig, *, max_tokens: int | None = None
                     ) -> tuple[np.ndarray, Grid]:
    """One RGB image -> (patches f32[h*w, 3*p*p], grid (1, h, w)).

    `image`: uint8 [H, W, 3], float [H, W, 3] in [0, 1], or a PIL image (if Pillow is installed).
    Resized (only ever down, aspect kept) by `fit_image` to at most `max_tokens` (default
    `vcfg.max_image_tokens`) LM tokens with an antialiased bicubic (a = -0.5, PIL's BICUBIC, in f32 on
    the [0, 1] values: HF's processor rounds its resized image to uint8, so pixels can differ by
    about 1/255), padded with black at the bottom / right to whole merge groups (as HF's), rescaled to
    [0, 1] and normalised by `image_mean` / `image_std`."""
    arr = _pixels(image)
    (nh, nw), grid_hw = fit_image(arr.shape[0], arr.shape[1], vcfg, max_tokens)
    return _patchify(resize_bicubic(_unit(arr), nh, nw)[None], vcfg, grid_hw), (1, *grid_hw)


def preprocess_video(frames, vcfg: VisionConfig, *, max_tokens: int | None = None
                     ) -> list[tuple[np.ndarray, Grid]]:
    """Video frames uint8 / float [T, H, W, 3] -> one (patches f32[t*h*w, 3*p*p], (t, h, w)) per chunk
    of `init_pos_emb_time` consecutive frames (the last chunk may be shorter; a 1-frame chunk is
    encoded like an image, as HF's processor does). Every frame is resized like `preprocess_image`
    to at most `max_tokens` LM tokens per chunk (frames are mean-pooled). Frame sampling (fps) is the
    caller's."""
    arr = _pixels(frames, "video", rank=4)
    (nh, nw), grid_hw = fit_image(arr.shape[1], arr.shape[2], vcfg, max_tokens)
    n = vcfg.init_pos_emb_time
    out = []
    for s in range(0, len(arr), n):  # one chunk at a time in f32
        chunk = np.stack([resize_bicubic(_unit(f), nh, nw) for f in arr[s:s + n]])
        out.append((_patchify(chunk, vcfg, grid_hw), (len(chunk), *grid_hw)))
    return out
