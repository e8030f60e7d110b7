"""User-facing engines: `LLM` (blocking, for notebooks and scripts), `Engine` (asyncio, for servers),
both over `EngineCore` = scheduler (host decisions) + model runner (device steps)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import math
import queue
import threading
import time
from typing import AsyncIterator, Iterator, Sequence

from tqdm import tqdm

from k3jax.config import BATCH_INVARIANT_ROWS
from k3jax.engine.request import Request, RequestOutput, Status
from k3jax.engine.runner import Buckets, InFlight, ModelRunner
from k3jax.cache.unified import UnifiedMemory
from k3jax.engine.scheduler import Scheduler, SchedulerConfig
from k3jax.media import MediaPrompt, expand_placeholders
from k3jax.media import prepare as prepare_media
from k3jax.state import UnifiedGeometry
from k3jax.sampling import SamplingParams, resolve_seed
from k3jax.spec.drafter import NgramDrafter
from k3jax.tokenizer import IncrementalDecoder

log = logging.getLogger("k3jax.engine")


SPECULATIVE = (None, "ngram")  # [dspark] adds the model drafter


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    page_size: int = 16
    prefix_cache: bool = True
    overlap: bool = True
    enable_unified_memory: bool = False
    speculative: object = None  # "ngram" (prompt lookup), or a `k3jax.spec.Drafter`; None: off
    num_draft_tokens: int = 4  # gamma: drafts per verify block (the block is gamma + 1 tokens)
    mesh: str | None = None  # "tp=2", "tp=4,ep=2", "dp=2,tp=2" (or a Mesh); None: the model's mesh, if any
    state_slots: int | None = None  # recurrent slots incl. the sink (default: 3 per running request + 8)
    kv_pages: int | None = None  # KV pages incl. the sink (default: every running request at max_seq_len, x1.5)
    max_running: int = 16  # concurrent requests (the largest decode bucket)
    max_seq_len: int = 2048  # prompt + generated tokens per request
    prefill_chunk: int = 256  # prefill tokens per step (the largest prefill bucket)
    max_prefill_seqs: int = 4  # prefill sequences per step
    checkpoint_policy: str = "marconi"  # "marconi" | "every_chunk" | "leaf_only"
    max_checkpoints_per_path: int = 4
    warmup: bool = False  # compile every bucket before serving (servers: True)
    single_bucket: bool = False  # only the largest buckets (decode-only and mixed): 2 compiles, more padding
    # the step shapes to compile (as SGLang's --cuda-graph-bs): decode batch sizes, increasing, the largest
    # max_running (None: powers of two up to it); prefill token counts, multiples of 64, the largest
    # prefill_chunk (None: 64 x powers of two up to it). Fewer buckets: fewer compiles, more padding.
    decode_buckets: tuple[int, ...] | None = None
    prefill_buckets: tuple[int, ...] | None = None
    impl: str = "auto"  # kernel choice: "auto" picks the Pallas kernels on a Hopper GPU, XLA elsewhere
    # a token's logits independent of the other tokens of its step (speculation, batch composition): the
    # steps run their row-wise work in fixed blocks (`ModelConfig.batch_invariant_rows`), one device only
    batch_invariant: bool = False

    def buckets(self) -> Buckets:
        """Decode batch buckets: `decode_buckets`, or powers of two up to max_running; prefill token buckets:
        `prefill_buckets`, or 64 x powers of two up to prefill_chunk."""
        dec = tuple(2**i for i in range(int(math.log2(self.max_running)) + 1))
        if dec[-1] != self.max_running:
            dec += (self.max_running,)
        tok = tuple(64 * 2**i for i in range(int(math.log2(self.prefill_chunk // 64)) + 1))
        if tok[-1] != self.prefill_chunk:
            tok += (self.prefill_chunk,)
        dec, tok = tuple(self.decode_buckets or dec), tuple(self.prefill_buckets or tok)
        return Buckets(decode=dec, tokens=tok, max_prefill_seqs=self.max_prefill_seqs,
                       pages_per_seq=-(-self.max_seq_len // self.page_size), single=self.single_bucket)

    def validate(self) -> None:
        if self.prefill_chunk < 64 or self.prefill_chunk % 64:
            raise ValueError(f"prefill_chunk must be a positive multiple of 64, got {self.prefill_chunk}")
        for name in ("page_size", "max_running", "max_seq_len", "max_prefill_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name, top, step in (("decode_buckets", "max_running", 1), ("prefill_buckets", "prefill_chunk", 64)):
            b = getattr(self, name)
            if b is None:
                continue
            if self.single_bucket:
                raise ValueError(f"{name} and single_bucket exclude each other (single_bucket compiles only the "
                                 f"largest shapes)")
            ok = isinstance(b, tuple) and b and all(isinstance(x, int) and x >= step and x % step == 0 for x in b)
            if not ok or list(b) != sorted(set(b)):
                raise ValueError(f"{name} must be a tuple of increasing integers, each a positive multiple of {step}, "
                                 f"got {b!r}")
            if b[-1] != getattr(self, top):
                raise ValueError(f"{name} must end with {top} ({getattr(self, top)}), the largest step; got {b!r}")
        if self.enable_unified_memory and self.mesh is not None:
            raise NotImplementedError("enable_unified_memory with a mesh is not supported yet")
        if isinstance(self.speculative, str) or self.speculative is None:
            if self.speculative not in SPECULATIVE:
                raise ValueError(f"speculative must be one of {SPECULATIVE[1:]}, a Drafter or None, "
                                 f"got {self.speculative!r}")
        elif not callable(getattr(self.speculative, "propose", None)):
            raise ValueError("speculative must be a method name or a Drafter (with propose/forget)")
        if self.speculative is not None and not 1 <= self.num_draft_tokens <= 16:
            raise ValueError(f"num_draft_tokens must be in [1, 16], got {self.num_draft_tokens}")
        if self.batch_invariant and self.mesh is not None:
            raise NotImplementedError("batch_invariant with a mesh is not supported yet (its collectives and "
                                      "expert-parallel MoE are not batch-invariant): run it on one device")
        if isinstance(self.mesh, str):
            from sharding.mesh import parse_mesh_spec

            parse_mesh_spec(self.mesh)  # ValueError naming the bad part


def _engine_mesh(spec, model_mesh):
    """The engine's Mesh: `spec` (EngineConfig.mesh) if given, else the mesh the model was loaded on."""
    if spec is None and model_mesh is None:
        return None
    from sharding.mesh import make_mesh

    return make_mesh(spec if spec is not None else model_mesh)


@dataclasses.dataclass
class StepTiming:
    """Cumulative wall time of `EngineCore.step` over the steps that ran or collected a device step: `wait_s`
    blocked on the device for sampled tokens, `host_s` everything else (scheduling, packing, launching,
    applying tokens, drafting). With overlap the host work of step N + 1 runs while step N is on the device,
    so `wait_s / steps` is the device time the host did not hide, and a host-bound loop shows wait ~0."""
    steps: int = 0
    host_s: float = 0.0  # seconds
    wait_s: float = 0.0  # seconds

    def as_dict(self) -> dict:
        return {"steps": self.steps, "step_host_s": self.host_s, "step_wait_s": self.wait_s}


class EngineCore:
    """One process's engine: `add` requests, call `step` until `has_work()` is false."""

    def __init__(self, model, cfg: EngineConfig):
        cfg.validate()
        if cfg.batch_invariant:
            if getattr(model, "mesh", None) is not None:
                raise NotImplementedError("batch_invariant with a model loaded on a mesh is not supported yet: "
                                          "load it on one device")
            if not model.config.batch_invariant_rows:
                model = dataclasses.replace(model, config=model.config.replace(batch_invariant_rows=BATCH_INVARIANT_ROWS))
        self.model, self.cfg = model, cfg
        mcfg = model.config
        self.buckets = cfg.buckets()
        pages_per_seq = self.buckets.pages_per_seq
        slots = cfg.state_slots or 3 * cfg.max_running + 8
        pages = cfg.kv_pages or int(1.5 * cfg.max_running * pages_per_seq) + 1
        self.gamma = cfg.num_draft_tokens if cfg.speculative else 0
        self.drafter = None
        if cfg.speculative == "ngram":
            self.drafter = NgramDrafter()
        elif cfg.speculative is not None:  # a Drafter object
            self.drafter = cfg.speculative
        memory = None
        if cfg.enable_unified_memory:  # the same bytes as the two pools, as one budget
            geom = UnifiedGeometry.build(mcfg, 0, cfg.page_size)
            memory = UnifiedMemory(slots * geom.block_bytes + pages * geom.page_bytes, geom.block_bytes,
                                   geom.page_bytes, cfg.page_size)
        self.scheduler = Scheduler(SchedulerConfig(
            page_size=cfg.page_size, num_pages=pages, num_slots=slots, max_running=cfg.max_running,
            prefill_budget=cfg.prefill_chunk, max_prefill_seqs=cfg.max_prefill_seqs, prefix_cache=cfg.prefix_cache,
            policy=cfg.checkpoint_policy, max_ckpt_per_path=cfg.max_checkpoints_per_path,
            eos_token_id=mcfg.eos_token_id, spec_gamma=self.gamma), memory=memory, drafter=self.drafter)
        self.mesh = _engine_mesh(cfg.mesh, getattr(model, "mesh", None))
        self.runner = ModelRunner(model, slots=slots, pages=pages, page_size=cfg.page_size, buckets=self.buckets,
                                  impl=cfg.impl, mesh=self.mesh, ids=(self.scheduler.slots, self.scheduler.pages), memory=memory,
                                  spec_block=self.gamma + 1)
        self.inflight: InFlight | None = None
        self._ids = itertools.count()
        self.step_count = 0
        self.timing = StepTiming()
        if cfg.warmup:
            self.warmup()

    def warmup(self) -> float:
        t = time.perf_counter()
        with tqdm(total=len(self.buckets.shapes()), desc="compiling step buckets", leave=False) as bar:
            self.runner.warmup(bar)
        dt = time.perf_counter() - t
        log.info("compiled %d step buckets in %.1f s", len(self.buckets.shapes()), dt)
        return dt

    # ---- requests -----------------------------------------------------------------------------
    def make_request(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
                     request_id: str | None = None, images: Sequence | None = None) -> Request:
        """Validate and build a request (raises ValueError naming the problem; nothing is queued).
        `images` (vision models): one per media placeholder of the prompt, in order (`k3jax.media`); the
        vision tower runs here, in the caller's thread, unless `images` is the prompt's `MediaPrompt`, prepared
        already (`k3jax.media.prepare`, e.g. off a server's event loop)."""
        mcfg, tok = self.model.config, self.model.tokenizer
        sampling = (sampling or SamplingParams()).validate(mcfg.vocab_size)
        if sampling.logprobs is not None and self.gamma:
            raise ValueError("logprobs: not supported with speculative decoding yet (the verify step returns no "
                             "log-probabilities); use an engine without speculative=")
        if sampling.needs_logit_row and self.gamma:
            raise ValueError("repetition_penalty / presence_penalty / frequency_penalty / logit_bias: not supported with "
                             "speculative decoding yet (a verify block's tokens would each need the counts of the ones "
                             "before); use an engine without speculative=")
        if isinstance(prompt, str):
            if tok is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            ids = tok.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < mcfg.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids must lie in [0, {mcfg.vocab_size}); got {bad[:5]}")
        if not ids:
            raise ValueError("prompt is empty")
        media = None
        if images:
            if isinstance(images, MediaPrompt):
                media = images
                if media.token_ids != expand_placeholders(ids, [e - s for s, e in media.spans],
                                                          mcfg.media_placeholder_token_id)[0]:
                    raise ValueError("the prepared media prompt was made for another prompt")
            else:
                media = prepare_media(self.model, ids, images)
            ids = media.keyed
        elif mcfg.vision is not None and mcfg.media_placeholder_token_id in ids:
            raise ValueError(f"the prompt holds media placeholder tokens (id {mcfg.media_placeholder_token_id}) but no "
                             "images were given")
        total = len(ids) + sampling.max_new_tokens
        if total > self.cfg.max_seq_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds "
                             f"max_seq_len {self.cfg.max_seq_len}")
        need = -(-total // self.cfg.page_size)
        if need > self.scheduler.pages.capacity:
            raise ValueError(f"the request needs {need} KV pages; the pool holds {self.scheduler.pages.capacity}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.scheduler.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        detok = IncrementalDecoder(tok) if tok is not None else None
        return Request(rid, ids, sampling, resolve_seed(sampling.seed), detok, media)

    def add(self, req: Request) -> None:
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self.inflight is not None

    # ---- one iteration ------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Schedule and launch one step; apply the results of the previous (overlap) or this one.
        Returns the requests that received tokens. `timing` splits the time into host work and the wait
        for the device's tokens."""
        t0 = time.perf_counter()
        wait = 0.0
        plan = self.scheduler.schedule()
        new = None
        if plan:
            new = self.runner.launch(plan)
            self.scheduler.commit(plan)
            self.step_count += 1
        done: list[Request] = []
        collect = self.inflight if self.cfg.overlap else new
        if collect is not None:
            tw = time.perf_counter()
            tokens = collect.host()  # blocks until the device has sampled them
            wait = time.perf_counter() - tw
            done = self.scheduler.process(collect.plan, tokens, collect.host_logprobs)
        if self.cfg.overlap:
            self.inflight = new
        if new is None and not done and self.inflight is None and self.scheduler.has_work():
            raise RuntimeError("scheduler stalled: requests wait but nothing can run (pool too small?)")
        finished = self.scheduler.drain_finished()
        if plan or collect is not None:
            t = self.timing
            t.steps += 1
            t.wait_s += wait
            t.host_s += time.perf_counter() - t0 - wait
        return done + [r for r in finished if r not in done]

    def check_invariants(self) -> None:
        self.scheduler.check_invariants()


class LLM:
    """Blocking engine for notebooks and scripts.

    >>> llm = LLM("k3-tiny")
    >>> out = llm.generate(["Hello"], SamplingParams(max_new_tokens=8))[0]
    >>> out.token_ids, out.text, out.cached_tokens
    """

    def __init__(self, model="k3-tiny", *, page_size: int = 16, prefix_cache: bool = True, overlap: bool = True,
                 enable_unified_memory: bool = False, speculative: str | None = None, mesh: str | None = None,
                 state_slots: int | None = None, kv_pages: int | None = None, seed: int = 0, **engine_kw):
        if isinstance(model, str):
            from k3jax.api import load_model

            model = load_model(model, seed=seed, mesh=mesh)
        self.model = model
        self.tokenizer = model.tokenizer
        self.config = EngineConfig(page_size=page_size, prefix_cache=prefix_cache, overlap=overlap,
                                   enable_unified_memory=enable_unified_memory, speculative=speculative, mesh=mesh,
                                   state_slots=state_slots, kv_pages=kv_pages, **engine_kw)
        self.core = EngineCore(model, self.config)

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]] | str,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: bool = False, images: Sequence | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (continuous batching) and return outputs in prompt order.
        `images` (vision models): for one prompt, its images (one per `<|media_pad|>` placeholder, in order);
        for a list of prompts, one such list (or None) per prompt."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        if single:
            prompts = [prompts]
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        if images is None:
            media = [None] * len(prompts)
        else:
            media = [images] if single else list(images)
            if len(media) != len(prompts):
                raise ValueError(f"{len(media)} image lists for {len(prompts)} prompts (one list, or None, per prompt)")
        reqs = [self.core.make_request(p, s, images=m) for p, s, m in zip(prompts, params, media)]
        for r in reqs:
            self.core.add(r)
        with tqdm(total=len(reqs), desc="generating", disable=not progress) as bar:
            while self.core.has_work():
                before = sum(r.status is Status.FINISHED for r in reqs)
                self.core.step()
                bar.update(sum(r.status is Status.FINISHED for r in reqs) - before)
        return [r.to_output() for r in reqs]

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]],
             sampling: SamplingParams | Sequence[SamplingParams] | None = None, *, tools: Sequence[dict] | None = None,
             add_generation_prompt: bool = True, progress: bool = False, **template_kwargs) -> list[RequestOutput]:
        """Reply to one conversation (a list of OpenAI-style messages) or to each of a list of them, rendered with
        the model's chat format (`k3jax.xtml`: the checkpoint's template, else Kimi's). Images go in the messages
        (`{"type": "image", "image": ...}` parts). A reply stops at its end-of-turn token; each output's `message`
        holds it parsed (`ChatReply`: content, reasoning_content, tool_calls; `.to_message()` continues the
        conversation). Raises ValueError naming a bad message before anything runs."""
        single = bool(messages) and isinstance(messages[0], dict)
        convs = [messages] if single else list(messages)
        params = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(convs)
        if len(params) != len(convs):
            raise ValueError(f"{len(params)} sampling params for {len(convs)} conversations")
        fmt = self.model.chat_format
        prompts = [fmt.render(c, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs)
                   for c in convs]
        outs = self.generate([p.token_ids for p in prompts], [p.sampling(s) for p, s in zip(prompts, params)],
                             progress=progress, images=[p.images or None for p in prompts])
        for o in outs:
            o.message = fmt.parse(o.token_ids)
        return outs

    def stream(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None,
               images: Sequence | None = None) -> Iterator["StreamDelta"]:
        """Yield new tokens/text of one request as they arrive; the last delta has `finished` set."""
        req = self.core.make_request(prompt, sampling, images=images)
        self.core.add(req)
        while True:
            delta = StreamDelta.take(req)
            if delta is not None:
                yield delta
                if delta.finished:
                    return
            if not self.core.has_work():
                return
            self.core.step()

    def abort(self, request_id: str) -> bool:
        return self.core.abort(request_id)

    def check_invariants(self) -> None:
        """Raise if any KV page or state slot is lost or owned twice."""
        self.core.check_invariants()

    @property
    def stats(self) -> dict:
        """Cumulative counters: computed / restored tokens, donated checkpoints, evictions, preemptions; engine
        steps and their time on the host and waiting for the device (`StepTiming`: steps, step_host_s,
        step_wait_s)."""
        return dict(self.core.scheduler.stats) | self.core.timing.as_dict()

    def memory_usage(self) -> dict:
        """Where the KV pages and state slots are now (one snapshot; see `check_invariants`)."""
        s = self.core.scheduler
        tree_pages = s.tree.num_pages if s.tree is not None else 0
        ckpts = len(s.tree.ckpt_nodes) if s.tree is not None else 0
        return {
            "pages_total": s.pages.capacity, "pages_free": s.pages.free_count, "pages_cached": tree_pages,
            "pages_running": s.pages.capacity - s.pages.free_count - tree_pages,
            "slots_total": s.slots.capacity, "slots_free": s.slots.free_count, "slots_checkpoints": ckpts,
            "slots_running": s.slots.capacity - s.slots.free_count - ckpts, "running": len(s.running),
            "waiting": len(s.waiting),
        }


@dataclasses.dataclass
class StreamDelta:
    request_id: str
    token_ids: list[int]  # new tokens since the previous delta
    text: str  # new text since the previous delta
    finished: bool
    finish_reason: str | None
    output: RequestOutput | None  # the whole output, on the last delta
    logprobs: list[dict[int, float]] | None = None  # with SamplingParams.logprobs: one entry per new token

    @staticmethod
    def take(req: Request) -> "StreamDelta | None":
        """The part of `req`'s output not handed out yet (None if nothing new)."""
        n, done = len(req.output), req.status is Status.FINISHED
        if n == req.stream_pos and not done:
            return None
        if getattr(req, "_stream_text", None) is None:
            req._stream_text = 0
        new_text = req.text[req._stream_text:]
        delta = StreamDelta(req.id, req.output[req.stream_pos:n], new_text, done, req.finish_reason,
                            req.to_output() if done else None,
                            req.logprobs[req.stream_pos:n] if req.sampling.logprobs is not None else None)
        req.stream_pos, req._stream_text = n, len(req.text)
        return delta


class Engine:
    """Asyncio front end: the engine loop runs in a background thread; requests stream back through
    per-request asyncio queues. Used by the gRPC server.

        engine = Engine(LLM("k3-tiny").core)
        rid = engine.add_request("Hello", SamplingParams(max_new_tokens=8))
        async for delta in engine.stream(rid): ...
    """

    def __init__(self, core: EngineCore):
        self.core = core
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="k3jax-engine", daemon=True)
        self._thread.start()

    def add_request(self, prompt, sampling: SamplingParams | None = None, request_id: str | None = None,
                    images: Sequence | None = None) -> str:
        """Validate (ValueError on bad input) and queue a request; call from the event loop."""
        if self.error is not None:
            raise RuntimeError(f"engine stopped: {self.error!r}")
        with self._lock:
            if request_id is not None and request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            req = self.core.make_request(prompt, sampling, request_id, images=images)
            self._streams[req.id] = (asyncio.get_running_loop(), asyncio.Queue())
        self._cmds.put(("add", req))
        return req.id

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    def call(self, fn) -> concurrent.futures.Future:
        """Run `fn(core)` on the engine thread between steps (a consistent view of the scheduler,
        e.g. `check_invariants` or memory stats); the future holds its result or exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("call", (fn, fut)))
        return fut

    async def stream(self, request_id: str) -> AsyncIterator[StreamDelta]:
        _, q = self._streams[request_id]
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)

    async def generate(self, prompt, sampling: SamplingParams | None = None, request_id: str | None = None):
        rid = self.add_request(prompt, sampling, request_id)
        try:
            async for d in self.stream(rid):
                yield d
        except (asyncio.CancelledError, GeneratorExit):
            self.abort(rid)
            raise

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._cmds.put(("wake", None))
        self._thread.join(timeout)

    def _publish(self, req: Request) -> None:
        with self._lock:
            target = self._streams.get(req.id)
        if target is None:
            return
        delta = StreamDelta.take(req)
        if delta is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, delta)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    cmd, arg = self._cmds.get(timeout=None if not self.core.has_work() else 0)
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    if cmd == "add":
                        self.core.add(arg)
                    elif cmd == "abort":
                        self.core.abort(arg)
                        for req in self.core.scheduler.drain_finished():
                            self._publish(req)
                    elif cmd == "call":
                        fn, fut = arg
                        if fut.set_running_or_notify_cancel():
                            try:
                                fut.set_result(fn(self.core))
                            except Exception as e:  # noqa: BLE001 (handed to the caller)
                                fut.set_exception(e)
                    try:
                        cmd, arg = self._cmds.get_nowait()
                    except queue.Empty:
                        cmd = None
                if self.core.has_work():
                    for req in self.core.step():
                        self._publish(req)
        except BaseException as e:  # surface to every waiting stream
            log.exception("engine loop failed")
            self.error = e
            with self._lock:
                streams = list(self._streams.values())
            for loop, q in streams:
                loop.call_soon_threadsafe(q.put_nowait, RuntimeError(f"engine failed: {e!r}"))
