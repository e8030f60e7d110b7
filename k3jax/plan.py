"""`k3jax plan`: the deployment planner. Every figure comes from `k3jax.sizing` (which reads the
model's own shapes and the sharding rules); this module parses the flags and prints the report."""

from __future__ import annotations

import os
import re

from k3jax.config import ModelConfig, preset, preset_names

EXPERT_BITS = {"mxfp4": 4.25, "fp8": 8.0, "bf16": 16.0, "model": None}
KV_BYTES = {"bf16": 2, "fp8": 1}
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_TOKEN_UNITS = {"": 1, "k": 2**10, "m": 2**20}


def parse_bytes(text: str) -> int:
    """"141GB" -> 141e9 (decimal GB / TB; GiB / TiB binary)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 141GB, 80GiB or 1.5TB")
    return int(float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()])


def parse_tokens(text: str) -> int:
    """"1M" -> 1,048,576; "128K" -> 131,072; "5000" -> 5000."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmM]?)\s*", text)
    if not m:
        raise ValueError(f"cannot read {text!r} as a token count; write e.g. 1M, 128K or 32000")
    n = int(float(m.group(1)) * _TOKEN_UNITS[m.group(2).lower()])
    if n < 1:
        raise ValueError(f"context must be at least one token, got {text!r}")
    return n


def model_config(name_or_dir: str) -> ModelConfig:
    """A preset, or the config of a checkpoint directory (no weights are read)."""
    if os.path.isdir(name_or_dir):
        from k3jax.weights.orbax_io import ORBAX_CONFIG, _cfg_from_json

        orbax = os.path.join(name_or_dir, ORBAX_CONFIG)
        if os.path.isfile(orbax):
            import json

            with open(orbax) as f:
                return _cfg_from_json(json.load(f))
        return ModelConfig.from_hf(name_or_dir)
    return preset(name_or_dir)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="memory plan of a model on a device mesh, and the smallest node count that fits it",
        description="Print weight bytes per device, KDA state per request, MLA KV per token, the number of "
                    "concurrent requests of the given context that fit, whether the mesh fits at all, the smallest "
                    "number of nodes that fits (tp within a node, ep across nodes) and the collective traffic of one "
                    "decode token per layer. Sizes are decimal (1 GB = 1e9 bytes). Nothing is allocated.",
    )
    p.add_argument("--model", default="k3", metavar="PRESET_OR_DIR",
                   help=f"a preset ({', '.join(preset_names())}) or a checkpoint directory (its config only) "
                        "(default: %(default)s)")
    p.add_argument("--mesh", default="tp=8", metavar="SPEC",
                   help="mesh axis sizes, e.g. 'tp=8', 'tp=8,ep=8' or 'dp=2,tp=4'; the device count is their product "
                        "(default: %(default)s)")
    p.add_argument("--hbm", default="141GB", metavar="SIZE",
                   help="memory per device (units B, KB, MB, GB, TB, or KiB .. TiB) (default: %(default)s, one H200)")
    p.add_argument("--context", default=None, metavar="TOKENS",
                   help="tokens per request (K = 1024, M = 1048576); default: the model's maximum context")
    p.add_argument("--experts", choices=list(EXPERT_BITS), default="mxfp4",
                   help="storage of routed-expert weights (mxfp4 = 4.25 bits per weight incl. scales; "
                        "'model' = the config dtype); all other weights use the config dtype (default: %(default)s)")
    p.add_argument("--kv-dtype", choices=list(KV_BYTES), default="bf16",
                   help="storage of MLA KV pages and the KDA conv state (the KDA recurrent state is always f32) "
                        "(default: %(default)s)")
    p.add_argument("--reserve", type=float, default=0.1, metavar="FRAC",
                   help="fraction of HBM kept free for activations, workspace and fragmentation (default: %(default)s)")
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="N",
                   help="devices per node, for the node-count search (tp stays within a node) (default: %(default)s)")
    p.add_argument("--requests", type=int, default=1, metavar="N",
                   help="concurrent requests at --context that the node-count search must fit (default: %(default)s)")
    p.add_argument("--dp-attention", action="store_true",
                   help="DP-attention: MLA KV pages shard over dp, each dp group holding its own requests' KV "
                        "(default: off, KV replicated)")


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def run(args, error) -> int:
    """Print the report; `error(msg)` raises the CLI's one-line user error."""
    from k3jax.sizing import decode_traffic, memory_plan, smallest_deployment
    from sharding.mesh import format_mesh_spec, parse_mesh_spec
    from sharding.rules import Rules

    try:
        cfg = model_config(args.model)
        sizes = parse_mesh_spec(args.mesh)
        hbm = parse_bytes(args.hbm)
        context = parse_tokens(args.context) if args.context else cfg.max_position_embeddings
    except (ValueError, FileNotFoundError) as e:
        error(str(e))
    for flag, v in (("--gpus-per-node", args.gpus_per_node), ("--requests", args.requests)):
        if v < 1:
            error(f"{flag} must be a positive integer, got {v}")
    if not 0 <= args.reserve < 1:
        error(f"--reserve must lie in [0, 1), got {args.reserve}")
    rules = Rules.dp_attention() if args.dp_attention else Rules()
    kw = dict(expert_bits=EXPERT_BITS[args.experts], kv_dtype_bytes=KV_BYTES[args.kv_dtype], rules=rules)
    try:
        plan = memory_plan(cfg, sizes["tp"], ep=sizes["ep"], dp=sizes["dp"], **kw)
    except ValueError as e:
        error(str(e))
    n_dev, gpn = plan.devices, args.gpus_per_node
    nodes = f"{n_dev // gpn} node(s) x {gpn}" if n_dev % gpn == 0 and n_dev >= gpn else "part of a node"
    bits = EXPERT_BITS[args.experts]
    exp = f"{args.experts} ({bits} bits)" if bits else cfg.dtype
    free = hbm * (1 - args.reserve) - plan.weight_bytes_per_device
    per_req = plan.request_bytes_per_device(context)
    n_req = plan.max_requests(hbm, context, args.reserve)
    mesh = format_mesh_spec(sizes)
    out = [
        f"model {cfg.name} on mesh {mesh}: {n_dev} devices ({nodes}), {_gb(hbm)} HBM each",
        f"  parameters               {plan.param_count / 1e12:.3f} T ({plan.expert_param_count / 1e12:.3f} T routed-expert "
        f"weights in {exp}; the rest {cfg.dtype})",
        f"  weights per device       {_gb(plan.weight_bytes_per_device)} (routed experts "
        f"{_gb(plan.expert_weight_bytes_per_device)})",
        *([f"    note: k3jax dequantizes MXFP4 experts to {cfg.dtype} when loading today, which holds "
           f"{_gb(memory_plan(cfg, sizes['tp'], ep=sizes['ep'], dp=sizes['dp'], rules=rules).weight_bytes_per_device)}"
           " per device"] if args.experts == "mxfp4" else []),
        f"  KDA state per request    {plan.kda_state_bytes_per_request / 1e6:,.2f} MB per device (recurrent "
        f"{plan.kda_recurrent_bytes_per_request:,} B f32 + conv {plan.kda_conv_bytes_per_request:,} B)",
        f"  MLA KV per token         {plan.mla_kv_bytes_per_token:,} B per device (latent replicated over tp"
        + (f"; pages spread over dp={sizes['dp']})" if plan.kv_shards > 1 else ")"),
        f"  one request at {context:,} tokens: {_gb(per_req)} per device",
        f"  free for requests        {_gb(max(free, 0))} (HBM x {1 - args.reserve:.2f} - weights)",
        f"  max concurrent requests  {n_req} at {context:,} tokens",
        f"  fits                     {'yes' if n_req >= 1 else 'no'}",
    ]
    best = smallest_deployment(cfg, hbm, context, gpus_per_node=gpn, requests=args.requests,
                               reserve_frac=args.reserve, **kw)
    if best is None:
        out.append(f"  smallest deployment      none up to 64 nodes of {gpn} holds {args.requests} request(s) "
                   f"of {context:,} tokens")
    else:
        bp = best.plan
        out.append(f"  smallest deployment      {best.nodes} node(s) of {gpn} x {_gb(hbm)}: mesh "
                   f"{format_mesh_spec({'dp': 1, 'tp': bp.tp, 'ep': bp.ep})}, weights {_gb(bp.weight_bytes_per_device)} "
                   f"per device, {best.max_requests} request(s) of {context:,} tokens")
    t = decode_traffic(cfg, sizes["tp"], sizes["ep"])
    tp, ep = sizes["tp"], sizes["ep"]
    out += [
        "collective traffic per decode token per layer (bf16 activations; per device on a ring):",
        f"  attention out (KDA, MLA) reduce-scatter + all-gather of [D={cfg.hidden_size}] over tp={tp}: payload "
        f"{t.attn_allreduce_payload:,} B, {t.attn_allreduce_per_device:,.0f} B per device",
        f"  FFN out (dense / shared + latent up) the same: {t.ffn_allreduce_per_device:,.0f} B per device",
    ]
    if cfg.num_moe_layers:
        out += [
            f"  latent all-gather of [Din={cfg.moe_expert_dim}] over tp={tp}: {t.latent_allgather_per_device:,.0f} B per device",
            f"  expert all-to-all: dispatch {cfg.num_experts_per_token} x [Din] = {t.expert_dispatch_payload:,} B, combine "
            f"the same; {t.expert_alltoall_per_device:,.0f} B per token cross ep={ep} ranks",
            f"  expert combine as implemented (replicated tokens, psum of f32 [Din] over ep x tp = {ep * tp}): "
            f"{t.expert_allreduce_per_device:,.0f} B per device",
        ]
    out.append(f"  once per token: logits all-gather over tp: {t.logits_allgather_per_device:,.0f} B per device")
    print("\n".join(out))
    return 0
