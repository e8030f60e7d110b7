"""`k3jax-launch` for real: 2 processes on localhost with 4 CPU devices each (gloo collectives), one
engine on the mesh tp=4 x ep=2 over all 8 devices, in lockstep. Same greedy tokens as one process, on
both ranks; rank 0 serves gRPC and a follower's SIGTERM stops both cleanly; a killed peer makes the
other exit with a clear error within a bounded time. Plus the process-group detection from flags and
environment variables."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from sharding.launch import Cluster, UserError, detect_cluster, first_host
from tests.test_engine import ENGINE_KW, workload

_STARTED: list = []  # launcher processes, killed after each test if still running
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_FLAGS = ["--model", "k3-tiny", "--mesh", "tp=4,ep=2", "--max-running", str(ENGINE_KW["max_running"]),
                "--max-seq-len", str(ENGINE_KW["max_seq_len"]), "--prefill-chunk", str(ENGINE_KW["prefill_chunk"]),
                "--max-prefill-seqs", str(ENGINE_KW["max_prefill_seqs"]), "--single-bucket"]


# ---- the process group ---------------------------------------------------------------------------

def test_cluster_from_flags_and_environment():
    assert detect_cluster(env={}) == Cluster(None, 1, 0, "single process")
    c = detect_cluster("10.0.0.1", 2, 1, env={})
    assert (c.coordinator, c.num_processes, c.process_id) == ("10.0.0.1:8476", 2, 1)
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "gpu[007-010],cpu1"}
    c = detect_cluster(port=9000, env=slurm)
    assert (c.coordinator, c.num_processes, c.process_id) == ("gpu007:9000", 4, 3)
    assert detect_cluster(process_id=0, env=slurm).process_id == 0  # a flag wins
    tpu = {"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "t0,t1", "MEGASCALE_NUM_SLICES": "2",
           "MEGASCALE_SLICE_ID": "1", "MEGASCALE_COORDINATOR_ADDRESS": "t0:7777"}
    c = detect_cluster(env=tpu)
    assert (c.coordinator, c.num_processes, c.process_id) == ("t0:7777", 4, 3)
    c = detect_cluster(env={"JOB_COMPLETION_INDEX": "2", "K3JAX_NUM_PROCESSES": "4", "K3JAX_COORDINATOR": "job-0.svc"})
    assert (c.coordinator, c.num_processes, c.process_id) == ("job-0.svc:8476", 4, 2)
    assert first_host("node1") == "node1" and first_host("a[1-3]-ib,b") == "a1-ib"
    with pytest.raises(UserError, match="no coordinator"):
        detect_cluster(num_processes=2, process_id=0, env={})
    with pytest.raises(UserError, match="not in"):
        detect_cluster("h:1", 2, 2, env={})


# ---- 2 processes on localhost ---------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cache_dir):
    # PJRT_NPROC: more client pool threads than the 4 devices (tests/conftest.py says why), and not many
    # more intra-op threads than cores: this module took 191 s with 32, 137 s with 8 (2 cores, 2 processes)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PJRT_NPROC="8", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _launch(tmp_path, prompts=None, *, peer_timeout=15, max_new_tokens=10, n=2, extra=(), serve=None):
    """Start n processes (`run` over `prompts`, or `serve` with these k3jax-serve flags)."""
    out = tmp_path / "out.jsonl"
    if serve is None:
        path = tmp_path / "prompts.jsonl"
        path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
        mode = ["run", "--prompts", str(path), "--output", str(out), "--max-new-tokens", str(max_new_tokens),
                *ENGINE_FLAGS, *extra]
    else:
        mode = ["serve", *ENGINE_FLAGS, *serve]
    port = _free_port()
    procs, logs = [], []
    for i in range(n):
        log = tmp_path / f"rank{i}.log"
        cmd = [sys.executable, "-m", "sharding.launch", "--coordinator", f"127.0.0.1:{port}", "--num-processes",
               str(n), "--process-id", str(i), "--peer-timeout", str(peer_timeout), *mode]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                                      env=_env(tmp_path.parent / "jaxcache"), cwd=ROOT))
        logs.append(log)
    _STARTED.extend(procs)
    return procs, out, logs


def _wait(procs, logs, timeout):
    try:
        return [p.wait(timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError("launcher hung:\n" + "\n".join(log.read_text()[-3000:] for log in logs)) from None


def _wait_for(log, text, procs, timeout=240):
    t = time.time()
    while time.time() - t < timeout:
        if text in log.read_text():
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {log}:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("launch")


@pytest.fixture(autouse=True)
def _no_leftover_processes():
    yield
    while _STARTED:
        p = _STARTED.pop()
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def want():
    """Greedy tokens of one process (unsharded engine) for the phase-1 prompts of tests/test_engine.py."""
    from k3jax import LLM, SamplingParams
    from k3jax.api import load_model

    llm = LLM(load_model("k3-tiny"), **ENGINE_KW)
    return [o.token_ids for o in llm.generate(workload()[0], SamplingParams(max_new_tokens=10))]


def test_request_messages_rebuild_the_sampling_exactly():
    """A request sent to the other processes (`encode_request` -> the JSON wire form -> `decode_request`) comes back
    with the same sampling, logit_bias's integer token ids included (JSON object keys are strings)."""
    from k3jax import LLM, SamplingParams
    from sharding.lockstep import decode, decode_request, encode, encode_request

    core = LLM("k3-tiny", **ENGINE_KW).core  # make_request validates only: nothing compiles
    sp = SamplingParams(max_new_tokens=5, temperature=0.5, top_k=3, seed=9, stop=["x"], repetition_penalty=1.2,
                        logit_bias={7: -100.0, 300: 2.5})
    req = core.make_request([1, 2, 3], sp, request_id="a")
    got = decode_request(core, decode(encode({"add": encode_request(req)}))["add"])
    assert got.sampling == sp and got.prompt == [1, 2, 3] and got.id == "a"


def test_two_processes_give_the_tokens_of_one(tmp_root, want):
    tmp = tmp_root / "tokens"
    tmp.mkdir()
    procs, out, logs = _launch(tmp, workload()[0])
    codes = _wait(procs, logs, 600)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    rank0 = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["token_ids"] for r in rank0] == want
    rank1 = {r["request_id"]: r["token_ids"] for r in map(json.loads, open(f"{out}.rank1"))}
    assert rank1 == {r["request_id"]: r["token_ids"] for r in rank0}  # every process saw the same tokens
    assert "following rank 0" in logs[1].read_text()


def test_serve_on_two_processes_then_sigterm_stops_both(tmp_root, want):
    """Rank 0 serves gRPC over the lockstep engine; a follower's SIGTERM stops the whole group cleanly."""
    pytest.importorskip("grpc")
    from serve import pb
    from serve.client import connect

    tmp = tmp_root / "serve"
    tmp.mkdir()
    port = _free_port()
    procs, _, logs = _launch(tmp, serve=["--port", str(port)])
    try:
        _wait_for(logs[0], "health SERVING", procs, timeout=400)
        stub = pb.GenerationStub(connect(f"127.0.0.1:{port}"))
        for prompt, tokens in list(zip(workload()[0], want))[:2]:
            req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), max_new_tokens=10)
            assert [t for r in stub.Generate(req, timeout=300) for t in r.token_ids] == tokens
    finally:
        procs[1].send_signal(signal.SIGTERM)  # a follower's SIGTERM stops the group through rank 0
    codes = _wait(procs, logs, 120)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    assert "received SIGTERM: stopping all" in logs[0].read_text()


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_peer_makes_the_other_exit_with_a_clear_error(tmp_root, victim):
    tmp = tmp_root / f"kill{victim}"
    tmp.mkdir()
    procs, _, logs = _launch(tmp, workload()[0][:2], max_new_tokens=280, peer_timeout=10, extra=["--no-warmup"])
    # rank 1 dies between steps (rank 0 then waits in a collective); rank 0 dies while rank 1 compiles
    _wait_for(logs[1], "replaying rank 0's steps" if victim == 1 else "following rank 0", procs)
    procs[victim].kill()
    t = time.time()
    survivor = 1 - victim
    # bounded: the peer timeout (10 s) plus slack for a 2-core machine shared with another test worker
    code = _wait([procs[survivor]], [logs[survivor]], 120)[0]
    took = time.time() - t
    text = logs[survivor].read_text()
    assert code != 0 and took < 120, text[-3000:]
    if victim == 1:  # rank 0 notices the silent follower: its heartbeats stop, or (stuck in a collective) the dead
        # peer's connection resets first and the collective fails
        assert code == 3 and ("process 1 sent no heartbeat" in text or "a collective failed: a peer process probably "
                                                                        "died" in text), text[-3000:]
    else:  # the coordination service lived in rank 0: ours or JAX's error says the peer is gone
        assert "lost the coordination service" in text or "another task died" in text or "process 0" in text, \
            text[-3000:]
