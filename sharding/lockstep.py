"""Lockstep serving over several processes: rank 0 decides, every process runs the same engine steps.

A sharded step is one SPMD program over the global mesh, so every process must call the same jitted
functions with the same inputs in the same order. Every process holds a whole host engine (scheduler,
radix tree, id pools: host memory only) next to its shards of the device state. The host engine is
deterministic given its inputs (requests, aborts, sampled tokens), so rank 0 sends only the inputs.
Per `EngineCore.step()`, message n:

    rank 0     apply adds / aborts as they come (queued for message n); schedule; publish
               {n, adds (request id, prompt ids, sampling, resolved seed), aborts, run,
                digest of this step's device inputs, digest of every sampled token so far}; launch
    follower   receive n; compare the token digest; apply the adds / aborts; step; the runner's
               `on_launch` hook compares the device-input digest before the launch

A divergence (a bug, or a host decision that depends on the process) therefore stops every process
with an error naming the step before a mismatched collective could hang. Sampled tokens come from the
step's replicated output (every process reads its own replica), and the token digest checks at every
step that they agree.

Transport: the `jax.distributed` key-value store (`KVChannel`), which works the same on CPU (gloo) and
GPU, with any message size and no compile. Liveness: `PeerMonitor` (a thread per process) writes a
heartbeat every second and exits the process with a clear error when a peer's heartbeat is older than
`timeout`, when a peer posts an error, or when the coordination service is gone, even while the main
thread waits inside a collective that will never complete.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import os
import sys
import threading
import time

import numpy as np

from k3jax.sampling import SamplingParams

log = logging.getLogger("k3jax.launch")

EXIT_PEER = 3  # a peer died, hung or failed, or the processes diverged
EPOCH = 1024  # step messages per key directory (deleted as a whole once every follower read it)


class LockstepError(RuntimeError):
    """The processes can no longer run in lockstep (a peer failed, or they diverged)."""


# ---- digests ------------------------------------------------------------------------------------

def inputs_digest(*trees) -> str:
    """Digest of a step's device inputs (StepBatch, StateOps, SamplingBatch of host arrays)."""
    import jax

    h = hashlib.blake2b(digest_size=16)
    for leaf in jax.tree_util.tree_leaves(trees):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{a.dtype}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


class TokenDigest:
    """Running digest of every (request id, new tokens) a step hands out, in step order."""

    def __init__(self):
        self._h = hashlib.blake2b(digest_size=16)
        self._seen: dict[str, int] = {}

    def update(self, reqs) -> None:
        for r in reqs:
            new = r.output[self._seen.get(r.id, 0):]
            if new:
                self._h.update(r.id.encode() + b":" + np.asarray(new, np.int64).tobytes())
                self._seen[r.id] = len(r.output)
            if r.finish_reason is not None:
                self._seen.pop(r.id, None)

    def hex(self) -> str:
        return self._h.copy().hexdigest()


# ---- messages -----------------------------------------------------------------------------------

def encode_request(req) -> list:
    sp = dataclasses.asdict(req.sampling)
    sp["seed"] = req.seed  # resolved on rank 0 (a request without a seed draws one)
    ids = base64.b64encode(np.asarray(req.prompt, np.int32).tobytes()).decode()
    return [req.id, ids, sp]


def decode_request(core, item):
    rid, ids, sp = item
    prompt = np.frombuffer(base64.b64decode(ids), np.int32).tolist()
    if sp.get("logit_bias"):  # JSON made the token ids strings
        sp["logit_bias"] = {int(k): v for k, v in sp["logit_bias"].items()}
    return core.make_request(prompt, SamplingParams(**sp), request_id=rid)


def encode(msg: dict) -> bytes:
    return json.dumps(msg, separators=(",", ":")).encode()


def decode(data: bytes) -> dict:
    return json.loads(data.decode())


# ---- transport ----------------------------------------------------------------------------------

def _is_timeout(e: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(e)


class KVChannel:
    """Step messages from rank 0 to every process through the `jax.distributed` key-value store."""

    PART = 1 << 20  # larger messages go in parts (the store's RPCs have a size limit)

    def __init__(self, client, prefix: str = "k3jax", poll_s: float = 1.0):
        self.client, self.prefix, self.poll_ms = client, prefix, max(1, int(poll_s * 1000))
        self.forgotten = 0  # epochs below this are deleted

    def _key(self, n: int) -> str:
        return f"{self.prefix}/step/{n // EPOCH}/{n}"

    def publish(self, n: int, data: bytes) -> None:
        key = self._key(n)
        if len(data) > self.PART:
            parts = [data[i:i + self.PART] for i in range(0, len(data), self.PART)]
            for i, p in enumerate(parts):
                self.client.key_value_set_bytes(f"{key}/{i}", p)
            data = b"P%d" % len(parts)
        else:
            data = b"M" + data
        self.client.key_value_set_bytes(key, data)

    def receive(self, n: int) -> bytes:
        """Wait for message n (as long as it takes: `PeerMonitor` bounds the wait if rank 0 dies)."""
        key = self._key(n)
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, self.poll_ms)
                break
            except Exception as e:  # noqa: BLE001 (jax raises its own runtime error type)
                if not _is_timeout(e):
                    raise LockstepError(f"lost the coordination service while waiting for step {n}: {e}") from None
        if data[:1] == b"P":
            return b"".join(self.client.blocking_key_value_get_bytes(f"{key}/{i}", 60_000)
                            for i in range(int(data[1:])))
        return data[1:]

    def forget_before(self, n: int) -> None:
        """Delete the messages of whole epochs below step n (every process has read them)."""
        for e in range(self.forgotten, n // EPOCH):
            self.client.key_value_delete(f"{self.prefix}/step/{e}")
            self.forgotten = e + 1


class NullChannel:
    """No followers (one process): nothing to send."""

    def publish(self, n: int, data: bytes) -> None:
        pass


class LocalChannel:
    """In-process stand-in for `KVChannel` (tests: a leader and followers in threads of one process)."""

    def __init__(self):
        self._msgs: dict[int, bytes] = {}
        self._cv = threading.Condition()

    def publish(self, n: int, data: bytes) -> None:
        with self._cv:
            self._msgs[n] = data
            self._cv.notify_all()

    def receive(self, n: int) -> bytes:
        with self._cv:
            self._cv.wait_for(lambda: n in self._msgs)
            return self._msgs[n]

    def forget_before(self, n: int) -> None:
        pass


# ---- rank 0 -------------------------------------------------------------------------------------

class LockstepCore:
    """Rank 0's engine core: an `EngineCore` whose every step is first published to the followers.

    Drop-in for `EngineCore` (`LLM.core = LockstepCore(...)`, `Engine(LockstepCore(...))`): adds and
    aborts apply at once, as on one process, and go out with the next step's message. `stop` (an Event,
    e.g. set on SIGTERM) aborts every request at the next step. `close()` tells the followers to exit.
    """

    def __init__(self, core, channel, stop: threading.Event | None = None):
        self.core, self.channel = core, channel
        self.stop = stop or threading.Event()
        self.n = 0  # next message
        self.tokens = TokenDigest()
        self._ops: list = []  # ("add", encoded request) | ("abort", id), in order
        self._msg: dict | None = None
        self._lock = threading.RLock()
        self.closed = False
        core.runner.on_launch = self._on_launch

    def __getattr__(self, name):  # scheduler, runner, cfg, model, make_request, check_invariants, ...
        return getattr(self.core, name)

    def make_request(self, prompt, sampling=None, request_id=None, images=None):
        if images:  # the other processes would need the images, not the keyed prompt
            raise ValueError("images: not supported by a multi-process engine yet (requests travel as token ids)")
        return self.core.make_request(prompt, sampling, request_id)

    def add(self, req) -> None:
        with self._lock:
            self.core.add(req)
            self._ops.append(["add", encode_request(req)])

    def abort(self, request_id: str) -> bool:
        with self._lock:
            self._ops.append(["abort", request_id])
            return self.core.abort(request_id)

    def has_work(self) -> bool:
        return bool(self._ops) or self.core.has_work()

    def _publish(self, launch: str | None) -> None:
        msg, self._msg = self._msg, None
        msg["launch"] = launch
        self.channel.publish(msg["n"], encode(msg))

    def _on_launch(self, packed, ops, samp) -> None:
        if self._msg is not None:
            self._publish(None if isinstance(self.channel, NullChannel) else inputs_digest(packed.batch, ops, samp))

    def step(self) -> list:
        with self._lock:
            if self.closed:
                raise LockstepError("the lockstep engine is closed")
            if self.stop.is_set():  # shutting down: abort whatever is queued or running
                for rid in list(self.core.scheduler.requests):
                    self.abort(rid)
            ops, self._ops = self._ops, []
            run = self.core.has_work()
            self._msg = {"n": self.n, "ops": ops, "run": run, "tokens": self.tokens.hex()}
            try:
                out = self.core.step() if run else []
            except BaseException:
                if self._msg is None:  # message n went out: close() sends n + 1
                    self.n += 1
                self._msg = None
                raise
            if self._msg is not None:  # nothing was launched (the hook did not publish)
                self._publish(None)
            out += [r for r in self.core.scheduler.drain_finished() if r not in out]
            self.tokens.update(out)
            self.n += 1
            return out

    def close(self, error: str | None = None) -> None:
        """Tell the followers to stop (after a clean end, or with rank 0's `error`)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            publish_stop(self.channel, self.n, self.tokens.hex(), error)


def publish_stop(channel, n: int, tokens: str | None = None, error: str | None = None) -> None:
    """Message n: stop (every follower checks `tokens` first, then exits, or raises rank 0's `error`)."""
    tokens = TokenDigest().hex() if tokens is None else tokens
    channel.publish(n, encode({"n": n, "stop": True, "tokens": tokens, "error": error}))


# ---- followers ----------------------------------------------------------------------------------

class Follower:
    """A follower's loop: replay rank 0's messages on this process's `EngineCore` until told to stop."""

    def __init__(self, core, channel, on_finished=None):
        self.core, self.channel, self.on_finished = core, channel, on_finished
        self.n = 0
        self.tokens = TokenDigest()
        self._expect: str | None = None
        self._launched = self._logged = False
        core.runner.on_launch = self._on_launch

    def _on_launch(self, packed, ops, samp) -> None:
        self._launched = True
        got = inputs_digest(packed.batch, ops, samp)
        if got != self._expect:
            raise LockstepError(f"step {self.n}: this process scheduled different device inputs than rank 0 "
                                f"({got} vs {self._expect}); the host engines diverged")

    def run(self) -> int:
        """Returns the number of steps replayed when rank 0 says stop; raises LockstepError on divergence."""
        core = self.core
        while True:
            msg = decode(self.channel.receive(self.n))
            if msg.get("error"):
                raise LockstepError(f"rank 0 failed: {msg['error']}")
            if msg["tokens"] != self.tokens.hex():
                raise LockstepError(f"step {self.n}: the sampled tokens differ from rank 0's (the replicated step "
                                    "output is not the same on every process)")
            if msg.get("stop"):
                return self.n
            for kind, arg in msg["ops"]:
                if kind == "add":
                    core.add(decode_request(core, arg))
                else:
                    core.abort(arg)
            run = core.has_work()
            if run != msg["run"]:
                raise LockstepError(f"step {self.n}: rank 0 {'has' if msg['run'] else 'has no'} work, this process "
                                    f"{'has' if run else 'has none'}")
            self._expect, self._launched = msg["launch"], False
            out = core.step() if run else []
            if self._launched and not self._logged:
                self._logged = True
                log.info("replaying rank 0's steps (step %d launched)", self.n)
            if msg["launch"] is not None and not self._launched:
                raise LockstepError(f"step {self.n}: rank 0 launched a step, this process did not")
            out += [r for r in core.scheduler.drain_finished() if r not in out]
            self.tokens.update(out)
            if self.on_finished is not None:
                for r in out:
                    if r.finish_reason is not None:
                        self.on_finished(r)
            self.n += 1


# ---- liveness -----------------------------------------------------------------------------------

class PeerMonitor(threading.Thread):
    """Heartbeats through the key-value store; exits this process loudly when the group cannot go on.

    Every `interval` seconds: write this process's heartbeat (a counter and its step), read everyone's,
    read posted errors (and, on rank 0, followers' stop requests). A peer whose heartbeat has not
    changed for `timeout` seconds is dead or hung; a posted error is a peer's failure; a failing store
    means rank 0 (which hosts the coordination service) is gone. Any of these: one line on stderr,
    then `os._exit(EXIT_PEER)`, because the main thread may be blocked in a collective for good.
    """

    def __init__(self, client, rank: int, nprocs: int, *, timeout: float = 30.0, interval: float = 1.0,
                 prefix: str = "k3jax", progress=lambda: 0, channel: KVChannel | None = None, on_stop_request=None,
                 stop_requested: threading.Event | None = None):
        super().__init__(name="k3jax-peer-monitor", daemon=True)
        self.client, self.rank, self.nprocs = client, rank, nprocs
        self.timeout, self.interval, self.prefix = timeout, interval, prefix
        self.progress, self.channel, self.on_stop_request = progress, channel, on_stop_request
        self.stop_requested = stop_requested  # a follower's SIGTERM: ask rank 0 to stop everyone
        self._closed = threading.Event()
        self._asked = False

    def close(self) -> None:
        self._closed.set()
        if self.is_alive():
            self.join(5.0)

    def fail(self, reason: str, publish: bool = True, code: int = EXIT_PEER):
        print(f"k3jax-launch[{self.rank}/{self.nprocs}]: error: {reason}; exiting", file=sys.stderr, flush=True)
        if publish:
            try:
                self.client.key_value_set(f"{self.prefix}/error/{self.rank}", reason[:2000], allow_overwrite=True)
                if self.rank == 0:  # the store lives in this process: let the followers read the reason
                    time.sleep(2 * self.interval + 0.5)
            except Exception:  # noqa: BLE001
                pass
        logging.shutdown()
        os._exit(code)

    def run(self) -> None:
        start = time.monotonic()
        last_ok = start
        seen: dict[str, tuple[str, float]] = {}
        beat = 0
        p = self.prefix
        while not self._closed.is_set():
            beat += 1
            now = time.monotonic()
            try:
                self.client.key_value_set(f"{p}/hb/{self.rank}", f"{beat}:{self.progress()}", allow_overwrite=True)
                hb = dict(self.client.key_value_dir_get(f"{p}/hb/"))
                errors = self.client.key_value_dir_get(f"{p}/error/")
                stops = self.client.key_value_dir_get(f"{p}/stop/") if self.rank == 0 else []
                if self.stop_requested is not None and self.stop_requested.is_set() and not self._asked:
                    self.client.key_value_set(f"{p}/stop/{self.rank}", "SIGTERM", allow_overwrite=True)
                    self._asked = True
                last_ok = now
            except Exception as e:  # noqa: BLE001
                if self._closed.is_set():
                    return
                if now - last_ok > min(self.timeout, 3 * self.interval + 1):
                    self.fail(f"lost the coordination service (it runs in process 0): {e}", publish=False)
                self._closed.wait(self.interval)
                continue
            for key, reason in errors:
                r = key.rsplit("/", 1)[-1]
                if r != str(self.rank):
                    self.fail(f"process {r} failed: {reason}", publish=False)
            for r in range(self.nprocs):
                if r == self.rank:
                    continue
                v = hb.get(f"{p}/hb/{r}")
                old = seen.get(str(r))
                if old is None or old[0] != v:
                    seen[str(r)] = (v, now)
                elif now - old[1] > self.timeout:
                    self.fail(f"process {r} sent no heartbeat for {now - old[1]:.0f} s (dead, hung or cut off); "
                              "the lockstep steps cannot go on without it")
            if stops and self.on_stop_request is not None:
                self.on_stop_request([k.rsplit("/", 1)[-1] for k, _ in stops])
            if self.rank == 0 and self.channel is not None and len(hb) == self.nprocs:
                try:  # every follower has read the messages below its step
                    done = min(int(v.split(":")[1]) for k, v in hb.items() if not k.endswith("/0"))
                    self.channel.forget_before(done)
                except Exception:  # noqa: BLE001 (cleanup only)
                    pass
            self._closed.wait(self.interval)
