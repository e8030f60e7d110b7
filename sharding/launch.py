"""`k3jax-launch`: run one engine over the devices of several processes (hosts), in lockstep.

    k3jax-launch --coordinator HOST:PORT --num-processes N --process-id I run --model k3 --mesh tp=8,ep=8 \
        --prompts prompts.jsonl --output out.jsonl
    k3jax-launch ... serve --model k3 --mesh tp=8,ep=8 --port 50051      # rank 0 serves gRPC

Start the same command on every process (only the process id differs, or comes from the
environment). Each process: `jax.distributed.initialize` on the pinned coordinator address, the mesh
over every device of every process (`sharding.mesh`: tp within a process, processes along dp then
ep), the model placed into its shards, the engine warmed up; then rank 0 owns the request queue and
every process runs the same steps (`sharding.lockstep`). Rank 0 reads prompts (`run`) or serves gRPC
(`serve`); the followers only replay. With one process nothing is initialised and no lockstep runs.

Where the process group comes from, per field, first match wins (see docs/sharding.md):
  flags        --coordinator HOST[:PORT], --num-processes N, --process-id I
  k3jax        K3JAX_COORDINATOR, K3JAX_NUM_PROCESSES, K3JAX_PROCESS_ID
  jax          JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID
  SLURM        SLURM_PROCID, SLURM_NTASKS, coordinator = first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST
  Cloud TPU    TPU_WORKER_ID, TPU_WORKER_HOSTNAMES (coordinator = the first); multislice adds
               MEGASCALE_SLICE_ID, MEGASCALE_NUM_SLICES, MEGASCALE_COORDINATOR_ADDRESS
  indexed Job  JOB_COMPLETION_INDEX (Kubernetes / GKE indexed Jobs: the process id only)
The port is pinned: the coordinator's own, else --port (K3JAX_COORDINATOR_PORT, default 8476).

Exit status: 0 done or stopped by SIGTERM (requests still running are aborted), 2 usage error,
3 a peer died / hung / failed or the processes diverged (one line on stderr says which), 1 other errors.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import os
import re
import signal
import sys
import threading
import time

log = logging.getLogger("k3jax.launch")

DEFAULT_PORT = 8476
_EXIT_USAGE = 2


class UserError(Exception):
    """Bad command line or environment: one line on stderr, exit 2."""


# ---- the process group ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Cluster:
    coordinator: str | None  # HOST:PORT
    num_processes: int
    process_id: int
    source: str  # where the values came from (for the log)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu[003-005,9],cpu1" -> "gpu003"."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", nodelist.strip())
    if not m:
        raise UserError(f"cannot read the SLURM node list {nodelist!r}")
    prefix, ranges, suffix = m.groups()
    if not ranges:
        return prefix + suffix
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


def _int(v, what: str) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        raise UserError(f"{what} must be an integer, got {v!r}") from None


def detect_cluster(coordinator=None, num_processes=None, process_id=None, port=None, env=None) -> Cluster:
    """The process group from the flags, else the environment (module docstring); one process if none."""
    env = os.environ if env is None else env
    sources = []

    def pick(flag, *names):
        if flag is not None:
            return flag, "flag"
        for n in names:
            if env.get(n):
                return env[n], n
        return None, None

    coord, c_src = pick(coordinator, "K3JAX_COORDINATOR", "JAX_COORDINATOR_ADDRESS")
    nproc, n_src = pick(num_processes, "K3JAX_NUM_PROCESSES", "JAX_NUM_PROCESSES", "SLURM_NTASKS", "SLURM_NPROCS")
    pid, p_src = pick(process_id, "K3JAX_PROCESS_ID", "JAX_PROCESS_ID", "SLURM_PROCID")
    if coord is None and (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")):
        coord, c_src = first_host(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]), "SLURM nodelist"
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if hosts and env.get("TPU_WORKER_ID") is not None:  # Cloud TPU VMs / GKE TPU node pools
        worker = _int(env["TPU_WORKER_ID"], "TPU_WORKER_ID")
        slices = _int(env.get("MEGASCALE_NUM_SLICES", 1), "MEGASCALE_NUM_SLICES")
        slice_id = _int(env.get("MEGASCALE_SLICE_ID", 0), "MEGASCALE_SLICE_ID")
        if pid is None:
            pid, p_src = slice_id * len(hosts) + worker, "TPU_WORKER_ID"
        if nproc is None:
            nproc, n_src = slices * len(hosts), "TPU_WORKER_HOSTNAMES"
        if coord is None:
            coord, c_src = env.get("MEGASCALE_COORDINATOR_ADDRESS") or hosts[0], "TPU env"
    if pid is None and env.get("JOB_COMPLETION_INDEX") is not None:
        pid, p_src = env["JOB_COMPLETION_INDEX"], "JOB_COMPLETION_INDEX"
    n = _int(nproc, f"the number of processes ({n_src})") if nproc is not None else 1
    i = _int(pid, f"the process id ({p_src})") if pid is not None else 0
    if n < 1 or not 0 <= i < n:
        raise UserError(f"process id {i} ({p_src}) is not in [0, {n}) ({n_src})")
    if n > 1 and coord is None:
        raise UserError(f"{n} processes but no coordinator: pass --coordinator HOST:PORT or set K3JAX_COORDINATOR")
    if coord is not None:
        coord = str(coord)
        if not re.search(r":\d+$", coord) or coord.endswith("]"):
            coord = f"{coord}:{port or env.get('K3JAX_COORDINATOR_PORT') or DEFAULT_PORT}"
    sources = sorted({s for s in (c_src, n_src, p_src) if s})
    return Cluster(coord, n, i, ", ".join(sources) or "single process")


# ---- command line ----------------------------------------------------------------------------------

def _engine_args(p: argparse.ArgumentParser) -> None:
    from k3jax.engine.engine import EngineConfig

    d = EngineConfig()
    g = p.add_argument_group("engine (every process must pass the same values)")
    g.add_argument("--model", default="k3-tiny", help="preset (random weights) or checkpoint dir (default: %(default)s)")
    g.add_argument("--model-seed", type=int, default=0, help="seed of a preset's random weights (default: 0)")
    g.add_argument("--mesh", default=None, help="device mesh over all processes' devices, e.g. tp=4,ep=2")
    g.add_argument("--page-size", type=int, default=d.page_size)
    g.add_argument("--max-running", type=int, default=d.max_running)
    g.add_argument("--max-seq-len", type=int, default=d.max_seq_len)
    g.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk)
    g.add_argument("--max-prefill-seqs", type=int, default=d.max_prefill_seqs)
    g.add_argument("--state-slots", type=int, default=None)
    g.add_argument("--kv-pages", type=int, default=None)
    g.add_argument("--single-bucket", action="store_true", help="two compiled step shapes only")
    on = dict(action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--prefix-cache", **on)
    g.add_argument("--overlap", **on)
    g.add_argument("--warmup", **on, help="compile every step bucket before the first request (default: on)")
    g.add_argument("--impl", choices=["auto", "xla", "pallas"], default="auto")


def engine_kwargs(a) -> dict:
    """`LLM(...)` keyword arguments of the `run` subcommand."""
    return dict(page_size=a.page_size, prefix_cache=a.prefix_cache, overlap=a.overlap, mesh=a.mesh,
                state_slots=a.state_slots, kv_pages=a.kv_pages, max_running=a.max_running, max_seq_len=a.max_seq_len,
                prefill_chunk=a.prefill_chunk, max_prefill_seqs=a.max_prefill_seqs, single_bucket=a.single_bucket,
                warmup=a.warmup, impl=a.impl)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3jax-launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coordinator", metavar="HOST:PORT", help="rank 0's address (pinned port; all processes alike)")
    p.add_argument("--num-processes", type=int, metavar="N")
    p.add_argument("--process-id", type=int, metavar="I")
    p.add_argument("--port", type=int, default=None, help=f"coordinator port when the address has none ({DEFAULT_PORT})")
    p.add_argument("--local-device-ids", default=None, metavar="0,1,..", help="this process's devices (default: all)")
    p.add_argument("--init-timeout", type=int, default=300, metavar="S", help="wait for all processes (default: 300)")
    p.add_argument("--peer-timeout", type=float, default=30.0, metavar="S",
                   help="a peer silent this long is dead: every process exits with status 3 (default: 30)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = p.add_subparsers(dest="mode", required=True, metavar="MODE")
    r = sub.add_parser("run", help="generate for a prompts file (JSONL) and exit")
    r.add_argument("--prompts", required=True, metavar="FILE",
                   help="JSONL, one prompt a line: a string, a list of token ids, or {\"prompt\": ..., plus any "
                        "SamplingParams field}; '-' reads stdin (rank 0 only reads it)")
    r.add_argument("--output", default=None, metavar="FILE",
                   help="rank 0 writes one JSON result a line here (default: stdout); followers write FILE.rankI")
    r.add_argument("--max-new-tokens", type=int, default=16)
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--top-k", type=int, default=0)
    r.add_argument("--seed", type=int, default=None, help="sampling seed (default: one per request)")
    _engine_args(r)
    sub.add_parser("serve", help="rank 0 serves gRPC; the k3jax-serve flags follow (k3jax-serve --help)",
                   add_help=False)
    return p


# ---- front ends ------------------------------------------------------------------------------------

def read_prompts(path: str, defaults: dict) -> tuple[list, list]:
    """(prompts, SamplingParams list) from a JSONL file."""
    from k3jax.sampling import SamplingParams

    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    f = sys.stdin if path == "-" else open(path, encoding="utf-8")
    prompts, params = [], []
    with f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{i}: not JSON ({e})") from None
            sp = dict(defaults)
            if isinstance(item, dict):
                extra = set(item) - fields - {"prompt"}
                if extra or "prompt" not in item:
                    raise UserError(f"{path}:{i}: needs \"prompt\"; unknown keys {sorted(extra)}")
                sp.update({k: v for k, v in item.items() if k != "prompt"})
                item = item["prompt"]
            if not isinstance(item, (str, list)):
                raise UserError(f"{path}:{i}: a prompt is a string or a list of token ids")
            prompts.append(item)
            params.append(SamplingParams(**sp))
    return prompts, params


def _result(o, index=None) -> dict:
    out = {"request_id": o.request_id, "token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason,
           "cached_tokens": o.cached_tokens}
    return out if index is None else {"index": index, **out}


def _write(path, rows) -> None:
    f = sys.stdout if path is None else open(path, "w", encoding="utf-8")
    try:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    finally:
        if path is not None:
            f.close()
        else:
            f.flush()


# ---- one process of the group ------------------------------------------------------------------------

class Group:
    """This process's place in the group: distributed runtime, peer monitor, control channel."""

    def __init__(self, cluster: Cluster, args):
        self.cluster, self.rank, self.n = cluster, cluster.process_id, cluster.num_processes
        self.stop = threading.Event()  # SIGTERM on rank 0 (or forwarded from a follower)
        self.stop_requested = threading.Event()  # SIGTERM on a follower
        self.monitor = self.channel = self.client = None
        self._forwarded = False
        if self.n == 1:
            return
        import jax

        if not os.environ.get("JAX_CPU_COLLECTIVES_IMPLEMENTATION"):
            try:  # CPU collectives across processes (already the default on JAX 0.10)
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
            except (AttributeError, ValueError):  # pragma: no cover - a JAX without the option
                pass
        ids = [int(x) for x in args.local_device_ids.split(",")] if args.local_device_ids else None
        log.info("joining %d processes as %d via %s (%s)", self.n, self.rank, cluster.coordinator, cluster.source)
        kw = dict(local_device_ids=ids, initialization_timeout=args.init_timeout)
        if "heartbeat_timeout_seconds" in inspect.signature(jax.distributed.initialize).parameters:
            kw["heartbeat_timeout_seconds"] = int(args.peer_timeout) + 30  # JAX's backstop; ours fires first
        jax.distributed.initialize(cluster.coordinator, self.n, self.rank, **kw)
        from jax._src import distributed  # the runtime client: key-value store and barriers

        from sharding.lockstep import KVChannel, PeerMonitor

        self.client = distributed.global_state.client
        self.channel = KVChannel(self.client)
        self.progress = lambda: 0
        self.monitor = PeerMonitor(self.client, self.rank, self.n, timeout=args.peer_timeout,
                                   progress=lambda: self.progress(), channel=self.channel if self.rank == 0 else None,
                                   on_stop_request=self._forwarded_stop, stop_requested=self.stop_requested)
        self.monitor.start()

    def _forwarded_stop(self, ranks) -> None:
        if not self._forwarded:
            self._forwarded = True
            log.info("process(es) %s received SIGTERM: stopping all", ", ".join(ranks))
            os.kill(os.getpid(), signal.SIGTERM)  # the same path as a SIGTERM on rank 0 (serve's handler too)

    def install_signals(self) -> None:
        def on_term(signum, frame):
            if self.rank == 0 or self.n == 1:
                if self.stop.is_set():  # asked twice: go now
                    if self.monitor is None:
                        raise KeyboardInterrupt
                    self.monitor.fail(f"stopped by a second {signal.Signals(signum).name}")
                log.info("%s: aborting running requests and stopping", signal.Signals(signum).name)
                self.stop.set()
            elif self.stop_requested.is_set():
                os._exit(128 + signum)  # asked twice: go now (the others see a dead peer)
            else:
                log.info("%s: asking rank 0 to stop the group", signal.Signals(signum).name)
                self.stop_requested.set()

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)

    def check_same_config(self, config: dict) -> None:
        """Every process must build the same engine: rank 0 posts its config, the others compare."""
        if self.n == 1:
            return
        import jax

        config = dict(config, jax=jax.__version__, local_devices=jax.local_device_count())
        mine = json.dumps(config, sort_keys=True)
        if self.rank == 0:
            self.client.key_value_set("k3jax/config", mine)
            return
        theirs = self.client.blocking_key_value_get("k3jax/config", 60_000)
        if theirs != mine:
            a, b = json.loads(theirs), json.loads(mine)
            diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
            raise UserError(f"this process's engine config differs from rank 0's (rank 0, this): {diff}")

    def fail(self, reason: str):
        if self.monitor is not None:
            self.monitor.fail(reason)  # posts the reason for the others, exits 3
        print(f"k3jax-launch: error: {reason}", file=sys.stderr, flush=True)
        sys.exit(1)

    def finish(self) -> None:
        """A clean end on every process: meet, stop heartbeats, leave the distributed runtime."""
        if self.n == 1:
            return
        import jax

        self.client.wait_at_barrier("k3jax/exit", int(max(60.0, 2 * self.monitor.timeout) * 1000))
        self.monitor.close()
        jax.distributed.shutdown()


def _build_llm(model_name: str, seed: int, kw: dict):
    from k3jax.api import load_model
    from k3jax.engine.engine import LLM

    t = time.perf_counter()
    model = load_model(model_name, seed=seed, mesh=kw.get("mesh"))
    llm = LLM(model, **kw)
    log.info("engine ready in %.1f s (mesh %s, %d devices)", time.perf_counter() - t, kw.get("mesh") or "none",
             llm.core.mesh.devices.size if llm.core.mesh is not None else 1)
    return llm


def _lead(group: Group, llm):
    """Rank 0: wrap the core so each step is published first (one process: only SIGTERM handling)."""
    from sharding.lockstep import LockstepCore, NullChannel

    llm.core = LockstepCore(llm.core, group.channel or NullChannel(), stop=group.stop)
    return llm


def _follow(group: Group, llm, on_finished=None) -> int:
    from sharding.lockstep import Follower

    f = Follower(llm.core, group.channel, on_finished)
    group.progress = lambda: f.n  # heartbeats carry the step: rank 0 deletes the messages all have read
    log.info("following rank 0")
    n = f.run()
    log.info("rank 0 stopped the group after %d steps", n)
    return n


def _run(group: Group, args) -> int:
    defaults = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed)
    kw = engine_kwargs(args)
    prompts = params = None
    if group.rank == 0:
        prompts, params = read_prompts(args.prompts, defaults)
        for sp in params:
            try:
                sp.validate()
            except ValueError as e:
                raise UserError(str(e)) from None
    group.check_same_config(dict(mode="run", model=args.model, model_seed=args.model_seed, **kw))
    llm = _build_llm(args.model, args.model_seed, kw)
    if group.rank != 0:
        rows = []
        _follow(group, llm, lambda r: rows.append(_result(r.to_output())))
        if args.output:
            _write(f"{args.output}.rank{group.rank}", rows)
        return 0
    llm = _lead(group, llm)
    error = None
    try:
        t = time.perf_counter()
        outs = llm.generate(prompts, params)
        log.info("%d requests done in %.1f s", len(outs), time.perf_counter() - t)
        _write(args.output, [_result(o, i) for i, o in enumerate(outs)])
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"
        raise
    finally:
        llm.core.close(error)  # stop the followers (with rank 0's error, if any)
    return 0


def _serve(group: Group, args) -> int:
    try:
        from serve import server
    except ImportError as e:
        raise UserError(f"serve mode needs the gRPC server (serve/): {e}") from None
    sargs = server.build_parser().parse_args(args.serve_args)
    try:
        server.check_args(sargs)
    except server.UserError as e:
        raise UserError(str(e)) from None
    kw = server.engine_kwargs(sargs)
    group.check_same_config(dict(mode="serve", model=sargs.model, model_seed=sargs.model_seed, **kw))
    if group.rank != 0:
        _follow(group, _build_llm(sargs.model, sargs.model_seed, kw))
        return 0
    import asyncio

    if "make_llm" not in inspect.signature(server.serve).parameters:
        # TODO(grpc-serve): serve.server.serve(args, make_llm=None) builds its LLM with make_llm() when given
        raise UserError("this serve/ has no multi-process hook yet: serve.server.serve(args, make_llm=...)")
    llm_box = []

    def make_llm():
        llm_box.append(_lead(group, _build_llm(sargs.model, sargs.model_seed, kw)))
        return llm_box[0]

    try:
        code = asyncio.run(server.serve(sargs, make_llm=make_llm))
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    if group.n > 1:
        from sharding.lockstep import publish_stop

        error = None if code == 0 else f"the gRPC server stopped with {code}"
        if llm_box:
            llm_box[0].core.close(error)
        else:  # stopped during warm-up: the followers stop once theirs ends
            publish_stop(group.channel, 0, error=error)
    if code != 0:
        raise RuntimeError(f"the gRPC server stopped with {code}")
    return 0


def main(argv: list[str] | None = None) -> int:
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars in logs (set before tqdm is imported)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.mode == "serve":
        args.serve_args = rest  # k3jax-serve's own flags
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        cluster = detect_cluster(args.coordinator, args.num_processes, args.process_id, args.port)
    except UserError as e:
        print(f"k3jax-launch: error: {e}", file=sys.stderr)
        return _EXIT_USAGE
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr, force=True,
                        format=f"%(asctime)s [k3jax-launch {cluster.process_id}/{cluster.num_processes}] %(message)s",
                        datefmt="%H:%M:%S")
    group = None
    try:
        group = Group(cluster, args)
        group.install_signals()
        code = _run(group, args) if args.mode == "run" else _serve(group, args)
        group.finish()
        return code
    except UserError as e:
        if group is not None and group.monitor is not None:
            group.monitor.fail(f"usage: {e}", code=_EXIT_USAGE)
        print(f"k3jax-launch: error: {e}", file=sys.stderr)
        return _EXIT_USAGE
    except Exception as e:  # noqa: BLE001
        from sharding.lockstep import LockstepError

        if group is None:
            raise
        if not isinstance(e, LockstepError):
            log.exception("failed")
        reason = f"{type(e).__name__}: {e}"
        if re.search(r"gloo|nccl|connection (closed|reset)|socket closed", str(e), re.IGNORECASE):
            reason = f"a collective failed: a peer process probably died ({reason})"
        group.fail(reason)
        return 1


if __name__ == "__main__":
    sys.exit(main())
