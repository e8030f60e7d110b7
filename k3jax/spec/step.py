"""The speculative engine step: verify -> accept -> fold (ReplaySSM), one jitted function.

The decode segment holds one block per decoding request: its last sampled token and up to
gamma drafts (`StepContext.block` = gamma + 1 token slots). Verify runs the blocks through the
model from the committed state: KDA layers read the recurrent and conv state and never write it,
recording each step's inputs (`VerifyCapture`); MLA layers write KV for every block token.
Acceptance (`k3jax.sampling.spec_accept`) picks how many block tokens each request keeps; the fold
replays exactly those captured steps for all KDA layers and heads in one op (`kda_fold`, same step
function and stored gates as verify) and advances the conv state from the captured inputs. A
checkpoint boundary inside a block is snapshotted from the same replay (`snap_at`), and written only
where the block reached it. Rejected tokens cost nothing: their KV sits beyond the request's
length and the next block overwrites it. Prefill sequences in the same step run as in the plain step.

Everything is ordered on the stream by data dependence; nothing syncs with the host, which reads
the accepted tokens when it processes the step (one step late with overlap).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from k3jax.model.forward import forward_verify, step_numerics
from k3jax.sampling import sample, spec_accept
from k3jax.state import restore_checkpoints, snapshot_slots
from pallas_kernels.kda.spec import Capture, kernel_impl, kda_fold
from pallas_kernels.kda.spec_kernels import fold_pool


def _stack(xs, axis=1):
    return jnp.stack(xs, axis=axis)


def fold_blocks(state, captures, slots, n_keep, snap_at, snap_dst, impl="xla", shard=None):
    """Apply the kept prefix of every verified block to the recurrent pool.

    captures: one `VerifyCapture` per KDA layer ([D, B, ...]); slots / n_keep / snap_at / snap_dst
    i32[D]. Writes the state after n_keep steps into each working slot and, where 0 < snap_at <=
    n_keep, the state after snap_at steps into snap_dst (else into the sink). With the Pallas fold
    (`impl` resolving to a kernel for "kda_fold", one device, a pool kernels may write in place)
    the replay runs on the pool itself in one launch (`spec_kernels.fold_pool`: only the touched
    rows are read and written); otherwise the states are gathered, folded (`kda_fold`) and
    scattered back. The conv state is a window of the captured inputs either way."""
    rec = state.recurrent
    L = len(captures)
    if not L:
        return state
    dst = jnp.where((snap_at > 0) & (snap_at <= n_keep), snap_dst, 0)
    fields = ("k", "v", "g", "beta")
    # "auto" takes the kernel only for the shapes it runs (K and V multiples of 64), as verify does
    kern = kernel_impl(impl, "kda_fold", captures[0].core.k.shape[-1], captures[0].core.v.shape[-1])
    if kern != "xla" and shard is None and rec.in_place:
        cap = Capture(*(_stack([getattr(c.core, f) for c in captures]) for f in fields))  # [D, L, B, H, X]
        rec = dataclasses.replace(rec, ssm=fold_pool(rec.ssm, slots, cap, n_keep, snap_at, dst, impl=kern))
        S = S_snap = None
    else:
        S0 = _stack([rec.read_ssm(slots, l) for l in range(L)])  # [D, L, H, K, V]
        cap = Capture(*(_stack([getattr(c.core, f) for c in captures]).astype(jnp.float32) for f in fields))
        S, S_snap = kda_fold(S0, cap, n_keep, snap_at)
    conv_old = _stack([rec.read_conv(slots, l) for l in range(L)])  # [D, L, W-1, C]
    W1 = conv_old.shape[2]
    hist = jnp.concatenate([conv_old, _stack([c.conv_x for c in captures]).astype(conv_old.dtype)], axis=2)
    window = lambda n: jnp.take_along_axis(hist, (n[:, None] + jnp.arange(W1))[:, None, :, None], axis=2)
    conv_new, conv_snap = window(n_keep), window(snap_at)
    for l in range(L):
        if S is not None:
            rec = rec.write_ssm(slots, l, S[:, l])
        rec = rec.write_conv(slots, l, conv_new[:, l])
    for l in range(L):  # after the working slots: a padded row's sink write never lands on a real slot
        if S_snap is not None:
            rec = rec.write_ssm(dst, l, S_snap[:, l])
        rec = rec.write_conv(dst, l, conv_snap[:, l])
    return state.with_recurrent(rec)


def _spec_step(params, state, batch, ops, snap_at, samp, cfg, impl, block, shard=None):
    """-> (out i32[N, block + 1]: per sequence the number of new tokens then the tokens, state).

    Decode sequences (the first D) are verify blocks; `ops.snap_dst` of a decode sequence is its
    in-block snapshot target at `snap_at` steps. `samp` holds one row per logit row: block rows
    of each decode sequence (its token positions), then one per prefill sequence.

    The whole step runs at the model's matmul precision, the fold included: on the XLA path the fold
    replays the recurrence with einsums, which outside `matmul_precision` ran an f32 model's state
    products in TF32 on a GPU while plain decoding's ran in f32 (until session 15)."""
    with step_numerics(cfg):
        return _spec_step_body(params, state, batch, ops, snap_at, samp, cfg, impl, block, shard)


def _spec_step_body(params, state, batch, ops, snap_at, samp, cfg, impl, block, shard):
    N, NP = batch.seq_slot.shape[0], batch.prefill_cu.shape[0] - 1
    D = N - NP
    ndt = D * block
    is_dec = jnp.arange(N) < D
    state = restore_checkpoints(state, ops, batch.seq_slot)
    logits, state, captures = forward_verify(params, state, batch, cfg, block, impl, shard)
    out = jnp.zeros((0, block + 1), jnp.int32)
    if D:
        X = logits.shape[-1]
        first = lambda a: a[:ndt].reshape(D, block, *a.shape[1:])[:, 0]
        n_draft = jnp.maximum(batch.seq_len[:D] - 1, 0)
        n_emit, toks = spec_accept(logits[:ndt].reshape(D, block, X), batch.tokens[:ndt].reshape(D, block), n_draft,
                                   first(samp.temperature), first(samp.top_k), first(samp.top_p),
                                   samp.keys[:ndt].reshape(D, block, 2), first(samp.min_p))
        n_keep = jnp.where(batch.seq_len[:D] > 0, n_emit, 0)
        state = fold_blocks(state, captures, batch.seq_slot[:D], n_keep, snap_at, ops.snap_dst[:D], impl, shard)
        out = jnp.concatenate([n_keep[:, None], toks], axis=1)
    state = snapshot_slots(state, type(ops)(ops.restore_src, jnp.where(is_dec, 0, ops.snap_dst)), batch.seq_slot)
    if NP:
        tp = sample(logits[ndt:], samp.temperature[ndt:], samp.top_k[ndt:], samp.top_p[ndt:], samp.keys[ndt:],
                    samp.min_p[ndt:])
        rows_p = jnp.zeros((NP, block + 1), jnp.int32).at[:, 0].set(1).at[:, 1].set(tp)
        out = jnp.concatenate([out, rows_p], axis=0)
    return out, state


spec_step = jax.jit(_spec_step, static_argnames=("cfg", "impl", "block"), donate_argnames=("state",))


@functools.lru_cache(maxsize=None)
def mesh_step_fn(block: int):
    """`_spec_step` for `sharding.step.make_sharded_step` (one function object per block size, so the
    sharded step's compile cache keys on it). Under the mesh the verify scan and the fold are plain
    jnp over head-sharded operands: GSPMD keeps them per head shard, like the state they write."""
    return functools.partial(_spec_step, block=block)
