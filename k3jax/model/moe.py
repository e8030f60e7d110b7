"""FFNs: dense GLU FFN and the (Latent)MoE.

MoE: sigmoid router in f32 on the full hidden, `e_score_correction_bias` for selection only,
optional group limit, top-k, renormalise (k > 1), `routed_scaling_factor`. LatentMoE runs the
routed experts in a latent space: `z = x @ down`, `y = sum_j w_j E_j(z)` (f32 accumulate),
RMSNorm on y, `y @ up`; shared experts read the original x at full width. Routed experts are a
grouped matmul (`jax.lax.ragged_dot` over expert-sorted token copies), never dense over all experts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.model.common import glu, proj, rms_norm, rowwise
import pallas_kernels.moe as gmm
from pallas_kernels.dispatch import batch_invariant_rows, block_loop, resolve_impl


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DenseParams:  # stacked over dense-FFN layers (leading dim L)
    gate: jax.Array  # [L, D, I]
    up: jax.Array  # [L, D, I]
    down: jax.Array  # [L, I, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MoEParams:  # stacked over MoE layers (leading dim L); Din = latent width or D
    router: jax.Array  # f32[L, D, E]
    router_bias: jax.Array  # f32[L, E] selection-only bias (noaux_tc)
    w1: jax.Array  # [L, E, Din, I] gate
    w3: jax.Array  # [L, E, Din, I] up
    w2: jax.Array  # [L, E, I, Din] down
    latent_down: jax.Array | None = None  # [L, D, Din]
    latent_norm: jax.Array | None = None  # [L, Din]
    latent_up: jax.Array | None = None  # [L, Din, D]
    shared: DenseParams | None = None  # [L, D, I_shared] ...


def dense_ffn(p: DenseParams, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    return proj(glu(proj(x, p.gate), proj(x, p.up), cfg), p.down)


def route(p: MoEParams, x: jax.Array, cfg: ModelConfig):
    """-> (expert ids i32[T, k], weights f32[T, k])."""
    scores = jax.nn.sigmoid(proj(x.astype(jnp.float32), p.router.astype(jnp.float32)))  # [T, E]
    choice = scores + p.router_bias.astype(jnp.float32)
    E, G, k = cfg.num_experts, cfg.num_expert_group, cfg.num_experts_per_token
    if G > 1 and cfg.topk_group < G:
        grouped = choice.reshape(-1, G, E // G)
        gscore = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
        keep = jax.lax.top_k(gscore, cfg.topk_group)[1]
        gmask = jnp.zeros_like(gscore, dtype=bool).at[jnp.arange(gscore.shape[0])[:, None], keep].set(True)
        choice = jnp.where(jnp.repeat(gmask, E // G, axis=1), choice, -jnp.inf)
    idx = jax.lax.top_k(choice, k)[1]
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.moe_renormalize and k > 1:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return idx, w * cfg.routed_scaling_factor


def routed_experts(p: MoEParams, z: jax.Array, idx: jax.Array, w: jax.Array, cfg: ModelConfig,
                   first_expert: jax.Array | None = None) -> jax.Array:
    """Grouped matmul over expert-sorted copies of z [T, Din]. Returns f32 [T, Din].

    `p.w1/w3/w2` hold all experts, or (with `first_expert`, under expert parallelism) the local ones
    `[first_expert, first_expert + E_local)`: assignments to other experts sort last, fall outside the
    groups and add nothing, so summing the results of all expert shards gives the full output.
    """
    T, k = idx.shape
    E = p.w1.shape[0]
    flat = idx.reshape(-1)
    R = batch_invariant_rows()
    if R and first_expert is None:
        if INVARIANT_EXPERTS not in INVARIANT_FORMS:
            raise ValueError(f"moe.INVARIANT_EXPERTS must be one of {INVARIANT_FORMS}, got {INVARIANT_EXPERTS!r}")
        # "kernel" where the kernel runs: the grouped matmul below, each output row its own row's products in a
        # fixed order over K (no block loop), with an N tile fixed by the weight's width (`_expert_kernel`)
        if INVARIANT_EXPERTS != "kernel" or grouped_matmul_form(p) not in ("pallas", "pallas_interpret"):
            form = _expert_rounds if INVARIANT_EXPERTS == "rounds" else _expert_blocks
            order = jnp.argsort(flat, stable=True)
            return _combine(form(p, z, flat, order, k, cfg, R), w, order, None, T, k)
    local = None
    if first_expert is not None:
        flat = flat - first_expert
        local = (flat >= 0) & (flat < E)
        flat = jnp.where(local, flat, E)
    order = jnp.argsort(flat, stable=True)
    tok = order // k
    sizes = jnp.bincount(flat, length=E if local is None else E + 1)[:E].astype(jnp.int32)
    form = grouped_matmul_form(p, first_expert)
    if form == "slabs":
        return _combine(_expert_slabs(p, z, flat, order, sizes, k, cfg), w, order, local, T, k)
    if form in ("pallas", "pallas_interpret"):
        bn = gmm.fixed_tile_cols if R else None  # in the mode the N tile must not follow the block count
        return _combine(_expert_kernel(p, z, flat, order, sizes, k, cfg, form, bn=bn), w, order, local, T, k)
    rd = lambda a, b: jax.lax.ragged_dot(a, b, sizes, preferred_element_type=jnp.float32)
    return _combine(_glu_products(rd, z[tok].astype(p.w1.dtype), p.w1, p.w3, p.w2, cfg), w, order, local, T, k)


def _glu_products(mm, x, w1, w3, w2, cfg: ModelConfig) -> jax.Array:
    """The experts' GLU through a product `mm(a, b)` (f32 out) of every form: mm(glu(x w1, x w3), w2), the
    gate and up products rounded to the weights' dtype first."""
    return mm(glu(mm(x, w1).astype(w1.dtype), mm(x, w3).astype(w3.dtype), cfg), w2)


def _expert_ranks(flat: jax.Array, order: jax.Array, sizes: jax.Array, E: int):
    """-> (e_sorted: each expert-sorted copy's expert, E for a copy routed to no local expert; rank: its
    index within its expert's group)."""
    e_sorted = flat[order]
    rank = jnp.arange(flat.shape[0], dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[jnp.minimum(e_sorted, E - 1)]
    return e_sorted, rank


# The grouped matmul of the routed experts outside the batch-invariant mode, read while tracing:
# "ragged" = `jax.lax.ragged_dot` (TPU: a grouped kernel; XLA's GPU backend lowers it as a zero-padded
# product of every copy with every expert, unless --xla_gpu_experimental_use_ragged_dot_fusion=true
# hands it to cuDNN); "slabs" = `_expert_slabs`; "pallas" = `_expert_kernel` (the Mosaic GPU grouped matmul
# of pallas_kernels/moe.py; "pallas_interpret": the same in interpret mode, CPU tests); "auto" (the
# default) = "pallas" where `grouped_matmul_form` says the kernel applies, else "ragged".
# bench/k3_mini_h200.py --moe-impl times them (session 19, H100, k3-mini decode step: ragged 5.27 / 7.08 /
# 17.6 ms at batch 1 / 64 / 256, slabs 5.08 / 6.68 / 11.7, pallas 3.79 / 5.96 / 10.7).
GROUPED_MATMULS = ("auto", "ragged", "slabs", "pallas", "pallas_interpret")
GROUPED_MATMUL = "auto"


def grouped_matmul_form(p: MoEParams, first_expert=None) -> str:
    """The form `routed_experts` runs (`GROUPED_MATMUL`, with "auto" resolved): "auto" takes the Mosaic GPU
    kernel on a Hopper GPU (`dispatch.resolve_impl`, `GPU_KERNELS`) for bf16 weights whose widths it tiles,
    on one device (expert-parallel shards keep `ragged_dot`: the kernel has not run under a mesh yet)."""
    if GROUPED_MATMUL not in GROUPED_MATMULS:
        raise ValueError(f"moe.GROUPED_MATMUL must be one of {GROUPED_MATMULS}, got {GROUPED_MATMUL!r}")
    if GROUPED_MATMUL != "auto":
        return GROUPED_MATMUL
    fits = (first_expert is None and all(a.dtype == jnp.bfloat16 for a in (p.w1, p.w3, p.w2))
            and gmm.tiles(*p.w1.shape[1:]) and gmm.tiles(*p.w2.shape[1:]))
    return "pallas" if fits and resolve_impl("auto", "moe_grouped_matmul") == "pallas" else "ragged"


def _block_layout(flat: jax.Array, order: jax.Array, sizes: jax.Array, E: int, R: int, NB: int):
    """Expert-aligned blocks of R rows: each expert's group of copies starts on a block, its last block
    padded with zero rows. -> (dest [n]: each expert-sorted copy's row, NB * R for a copy routed to no
    local expert (flat == E); block_e [NB]: each block's expert (E - 1 past the last group); used [1]:
    the blocks that hold copies)."""
    e_sorted, rank = _expert_ranks(flat, order, sizes, E)
    padded = -(-sizes // R) * R
    pend = jnp.cumsum(padded)
    dest = jnp.where(e_sorted < E, (pend - padded)[jnp.minimum(e_sorted, E - 1)] + rank, NB * R)
    block_e = jnp.minimum(jnp.searchsorted(pend, jnp.arange(NB, dtype=jnp.int32) * R, side="right"), E - 1)
    return dest, block_e.astype(jnp.int32), pend[-1:] // R


def _expert_kernel(p: MoEParams, z: jax.Array, flat: jax.Array, order: jax.Array, sizes: jax.Array, k: int,
                   cfg: ModelConfig, impl: str, bn=None) -> jax.Array:
    """The grouped matmul on the Pallas kernel (`pallas_kernels.moe.grouped_matmul`): the copies in
    expert-aligned blocks of its `BLOCK_ROWS`, at most n / BLOCK_ROWS + min(E, n) blocks (static), of which
    the kernel computes the used ones: three launches a layer, each expert's weights read once per block.
    bn: the kernel's N tile (None: its rule by block count), or a function of the weight's width N.
    -> f32 [T*k, Din] of the copies in `order` (expert-sorted), as the ragged form returns."""
    n, E = flat.shape[0], p.w1.shape[0]
    R = gmm.BLOCK_ROWS
    NB = -(-n // R) + min(E, n)
    dest, block_e, used = _block_layout(flat, order, sizes, E, R, NB)
    xs = jnp.zeros((NB * R, z.shape[-1]), p.w1.dtype).at[dest].set(z[order // k].astype(p.w1.dtype), mode="drop")
    tile = (lambda N: None) if bn is None else bn
    mm = lambda a, b: gmm.grouped_matmul(a, b, block_e, used, impl=impl, bn=tile(b.shape[-1]))
    y = _glu_products(mm, xs, p.w1, p.w3, p.w2, cfg)
    return jnp.concatenate([y, jnp.zeros_like(y[:1])])[dest]


def _expert_slabs(p: MoEParams, z: jax.Array, flat: jax.Array, order: jax.Array, sizes: jax.Array, k: int,
                  cfg: ModelConfig) -> jax.Array:
    """The grouped matmul as three batched products over all experts: expert e's copies fill slab e of
    T rows (a token picks an expert at most once, so T rows always suffice), zero rows after them. Each
    expert's weights are read once, as in a grouped kernel; the products cost E / k times the routed rows
    (the zero-padded form that XLA's GPU backend makes of `ragged_dot` costs E times). Copies routed to
    no local expert (`flat` == E under expert parallelism) go to a spare row and come back as zeros.
    -> f32 [T*k, Din] of the copies in `order` (expert-sorted), as the ragged form returns."""
    n, E = flat.shape[0], p.w1.shape[0]
    T = n // k
    e_sorted, rank = _expert_ranks(flat, order, sizes, E)
    slot = jnp.where(e_sorted < E, e_sorted * T + rank, E * T)
    xs = jnp.zeros((E * T + 1, z.shape[-1]), p.w1.dtype).at[slot].set(z[order // k].astype(p.w1.dtype))
    mm = lambda a, b: jnp.einsum("etd,edx->etx", a, b, preferred_element_type=jnp.float32)
    y = _glu_products(mm, xs[: E * T].reshape(E, T, -1), p.w1, p.w3, p.w2, cfg).reshape(E * T, -1)
    return jnp.concatenate([y, jnp.zeros_like(y[:1])])[slot]


def _combine(y, w, order, local, T: int, k: int):
    """The expert outputs y [T*k, Din] of the expert-sorted copies (`order`) weighted and summed per token."""
    y = y * w.reshape(-1)[order][:, None]
    if local is not None:
        y = jnp.where(local[order][:, None], y, 0.0)
    # back to (token, choice) order and summed over the k choices in that order: a gather and k - 1 adds,
    # not a scatter-add, whose atomics (GPU) sum a token's copies in whatever order they land, so a
    # token's row would depend on the run and on the other tokens of the step
    unsort = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    y = y[unsort].reshape(T, k, -1)
    out = y[:, 0]
    for j in range(1, k):
        out = out + y[:, j]
    return out


# The batch-invariant mode's routed experts, read while tracing: "kernel" (the default: the grouped-matmul
# kernel where `grouped_matmul_form` gives it, with its N tile fixed by the weight's width: a row's output is
# its own row's products in a fixed order over K, so it needs no loop; elsewhere "blocks"), "blocks"
# (`_expert_blocks`: one used expert's block of R rows a loop step, its weights sliced out of the stacked
# ones) or "rounds" (`_expert_rounds`: every expert's next block of R rows a loop step, as one batched
# product over all the experts' weights, no slicing; ceil(T / R) steps). k3-mini decode in the mode on an
# H100 (session 21, device call 20), ms at batch 1 / 64: kernel 12.9 / 13.1 (moe 1.5 / 2.3), blocks 14.7 /
# 25.2 (moe 5.2 / 15.3); session 20: rounds 17.5 / 18.4. The kernel passed the mode's tests/gpu test on
# both paths.
INVARIANT_FORMS = ("blocks", "rounds", "kernel")
INVARIANT_EXPERTS = "kernel"


# Expert blocks per loop step in the batch-invariant mode (`_expert_blocks`), read while tracing: 1 runs
# one [R, Din] product per weight a step; G > 1 runs G blocks' products as one batched product over their
# G experts' weights (G times fewer steps, each launch-bound at decode; the weights of G experts are
# gathered per step). A fixed G keeps every shape fixed, so either is batch-invariant; bench flag
# `bench/k3_mini_h200.py --expert-group` measures them on a GPU.
EXPERT_GROUP = 1


def _expert_blocks(p: MoEParams, z: jax.Array, flat: jax.Array, order: jax.Array, k: int, cfg: ModelConfig,
                   R: int) -> jax.Array:
    """The batch-invariant grouped matmul: the expert-sorted copies of z laid out so that each expert's
    group starts on a block of R rows (its last block padded with zero rows), then every block through
    its expert's GLU as one [R, Din] product per weight, `EXPERT_GROUP` blocks per step of `block_loop`: the same shapes
    whatever the step, so a copy's output row cannot depend on how many tokens the step routes where
    (`jax.lax.ragged_dot`'s algorithm and splits follow the group sizes). The blocks past the last group
    (at most min(E, T*k) of them) run too, on zero rows through the last expert, and are discarded: a
    `cond` to skip them would read its predicate back to the host on a GPU, each block, where running one
    costs an expert's weight read. -> f32 [T*k, Din] of the copies in `order` (expert-sorted), as the
    ragged form returns."""
    n, E = flat.shape[0], p.w1.shape[0]
    G = EXPERT_GROUP
    if G < 1:
        raise ValueError(f"moe.EXPERT_GROUP must be >= 1, got {G}")
    bound = -(-n // R) + min(E, n)  # on the blocks: sum_e ceil(n_e / R) < n / R + (experts used)
    NB = -(-bound // G) * G  # rounded up to whole groups
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    dest, block_e, _ = _block_layout(flat, order, sizes, E, R, NB)
    xs = jnp.zeros((NB * R, z.shape[-1]), p.w1.dtype).at[dest].set(z[order // k].astype(p.w1.dtype))
    # one block a step, or G blocks as one batched product per weight over their G experts' weights
    sub = "rd,dx->rx" if G == 1 else "grd,gdx->grx"
    mm = lambda a, b: jnp.einsum(sub, a, b, preferred_element_type=jnp.float32)

    def block(e, xb):
        return _glu_products(mm, xb, p.w1[e], p.w3[e], p.w2[e], cfg)

    lead = (NB,) if G == 1 else (NB // G, G)
    y = block_loop(block, block_e.reshape(lead), xs.reshape(*lead, R, -1))
    return y.reshape(NB * R, -1)[dest]


def _expert_rounds(p: MoEParams, z: jax.Array, flat: jax.Array, order: jax.Array, k: int, cfg: ModelConfig,
                   R: int) -> jax.Array:
    """The batch-invariant grouped matmul by rounds: an expert's copies, in order, fill its blocks of R rows
    (copy j of expert e sits in round j // R, row j % R), and each step of `block_loop` runs one round
    through every expert's GLU as one batched product [E, R, Din] x [E, Din, X] per weight. A token picks
    an expert at most once, so ceil(T / R) rounds always suffice (one for a decode step of up to R
    tokens). Every round has the same shapes whatever the step, and a batched product computes each
    expert's block on its own, so a copy's row cannot depend on the other tokens. The weights are used
    whole (no per-expert slice); the cost is E blocks of R rows a round, used or not: E / k times the
    routed rows when T >> R, fine for few experts (k3-mini: 16), not for K3's 384.
    -> f32 [T*k, Din] of the copies in `order` (expert-sorted), as the ragged form returns."""
    n, E = flat.shape[0], p.w1.shape[0]
    T = n // k
    NR = -(-T // R)
    e_sorted, rank = _expert_ranks(flat, order, jnp.bincount(flat, length=E).astype(jnp.int32), E)  # rank < T
    dest = ((rank // R) * E + e_sorted) * R + rank % R  # [round, expert, row]
    xs = jnp.zeros((NR * E * R, z.shape[-1]), p.w1.dtype).at[dest].set(z[order // k].astype(p.w1.dtype))
    mm = lambda a, b: jnp.einsum("erd,edx->erx", a, b, preferred_element_type=jnp.float32)

    y = block_loop(lambda xb: _glu_products(mm, xb, p.w1, p.w3, p.w2, cfg), xs.reshape(NR, E, R, -1))
    return y.reshape(NR * E * R, -1)[dest]


def moe_ffn(p: MoEParams, x: jax.Array, cfg: ModelConfig, shard=None) -> jax.Array:
    with jax.named_scope("moe_route"):
        idx, w = rowwise(lambda x: route(p, x, cfg), x)
    with jax.named_scope("moe_experts"):
        z = proj(x, p.latent_down) if p.latent_down is not None else x
        if shard is not None and p.latent_down is not None:  # computed sharded, then gathered for the experts
            z = shard.constrain(z, (None, "latent"))
        if shard is None:
            y = routed_experts(p, z, idx, w, cfg)
        else:  # expert parallel: each shard runs its experts, the shards' outputs are summed
            y = shard.experts(routed_experts, p, z, idx, w, cfg)
        if p.latent_up is not None:
            if p.latent_norm is not None:
                y = rms_norm(y, p.latent_norm, cfg.rms_norm_eps)
            y = proj(y.astype(x.dtype), p.latent_up)
        y = y.astype(x.dtype)
    if p.shared is not None:
        with jax.named_scope("moe_shared"):
            y = y + dense_ffn(p.shared, x, cfg)
    return y
