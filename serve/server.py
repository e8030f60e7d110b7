"""`k3jax-serve`: the gRPC server (`k3jax.v1.Generation`, grpc.health.v1, reflection, Prometheus).

    k3jax-serve --model k3-tiny --port 50051 --metrics-port 9400

A grpc.aio server over the async `Engine` (the engine loop runs in its own thread). Startup: the
gRPC port opens at once with health NOT_SERVING; the model loads and every step bucket compiles
(warm-up) in the background; health turns SERVING. SIGTERM (or SIGINT): health turns NOT_SERVING,
new calls are refused (UNAVAILABLE), in-flight streams finish (at most --drain-timeout seconds, then
they are cancelled and their requests aborted), the process exits 0.

Bad input never reaches the engine: the request is checked here and refused with INVALID_ARGUMENT
and a message naming the field (ALREADY_EXISTS for a request id in use); a cancelled or
disconnected stream aborts its request, which frees its slots and pages.
User errors on the command line (bad flag values, unknown preset, an engine option not built yet)
print one line to stderr and exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import grpc

try:
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection
except ImportError as e:  # reported by main() in one line
    _MISSING = e
else:
    _MISSING = None

from k3jax.media import prepare as prepare_media
from serve.common import BIG_TEXT as _BIG_TEXT
from serve.common import MAX_IMAGE_PIXELS, ReplyStream, RequestError, api_key_matches, decode_image_bytes
from serve.common import hostport as _hostport
from serve.common import invalid as _invalid
from serve import pb
from serve.metrics import Metrics

log = logging.getLogger("k3jax.serve")

_EXIT_USAGE = 2
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_OPEN_METHODS = ("/grpc.health.v1.Health/",)  # callable without the API key
_KEEPALIVE = [("grpc.keepalive_time_ms", 30_000),  # ping clients with open calls: a vanished client's stream is
              ("grpc.keepalive_timeout_ms", 20_000),  # cancelled (and its request aborted) within ~50 s
              ("grpc.http2.min_ping_interval_without_data_ms", 10_000)]
_REASONS = {"length": pb.FINISH_REASON_LENGTH, "eos": pb.FINISH_REASON_EOS, "stop": pb.FINISH_REASON_STOP,
            "abort": pb.FINISH_REASON_ABORT}


class UserError(Exception):
    """A problem with the command line: reported in one line, exit status 2."""


# ---- command line ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from k3jax.config import preset_names

    p = argparse.ArgumentParser(
        prog="k3jax-serve",
        description="Serve a k3jax model over gRPC (service k3jax.v1.Generation, see serve/proto/k3jax/v1/"
                    "generation.proto) with standard health checking, server reflection and Prometheus metrics.",
        epilog="Logs go to stderr with timestamps. SIGTERM drains in-flight streams, then exits 0.")
    s = p.add_argument_group("server")
    s.add_argument("--model", required=True, metavar="PRESET_OR_DIR",
                   help=f"a preset with random weights ({', '.join(preset_names())}) or a checkpoint directory")
    s.add_argument("--model-seed", type=int, default=0, metavar="S",
                   help="seed of a preset's random weights (default: %(default)s)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to bind the gRPC and metrics ports; 0.0.0.0 or :: exposes them to the network "
                        "(default: %(default)s)")
    s.add_argument("--port", type=int, default=50051, help="gRPC port; 0 picks a free one (logged) (default: %(default)s)")
    s.add_argument("--metrics-port", type=int, default=None, metavar="N",
                   help="serve Prometheus metrics at http://HOST:N/metrics; 0 picks a free port (logged) "
                        "(default: off)")
    s.add_argument("--http-port", type=int, default=None, metavar="N",
                   help="also serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
                        "/health; docs/serving.md) on this port; 0 picks a free one (logged) (default: off)")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id the HTTP API reports and accepts in 'model' (default: --model)")
    s.add_argument("--api-key", default=os.environ.get("K3JAX_API_KEY"), metavar="KEY",
                   help="require metadata 'authorization: Bearer KEY' (or 'x-api-key: KEY') on every call except "
                        "health checks; calls without it get UNAUTHENTICATED (default: $K3JAX_API_KEY, else off)")
    s.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES, metavar="N",
                   help="largest gRPC message received or sent; larger requests get RESOURCE_EXHAUSTED "
                        "(default: %(default)s)")
    s.add_argument("--max-new-tokens-limit", type=int, default=None, metavar="N",
                   help="largest max_new_tokens a request may ask for (default: max_seq_len - 1)")
    s.add_argument("--default-max-new-tokens", type=int, default=16, metavar="N",
                   help="max_new_tokens of requests that leave it unset (default: %(default)s)")
    s.add_argument("--max-queued-requests", type=int, default=0, metavar="N",
                   help="refuse new Generate calls with RESOURCE_EXHAUSTED while max_running + N are open; "
                        "0: no limit (default: %(default)s)")
    s.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, wait at most S seconds for in-flight streams before cancelling them "
                        "(default: %(default)s)")
    s.add_argument("--debug-invariants", action="store_true",
                   help="testing/debugging: let GetModelInfo(check_invariants=true) run the engine's "
                        "page/slot ownership check (default: off; the request is refused)")
    s.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log verbosity; DEBUG logs every request (default: %(default)s)")

    e = p.add_argument_group("engine (see docs/engine.md)")
    e.add_argument("--page-size", type=int, default=16, metavar="N", help="tokens per MLA KV-cache page (default: %(default)s)")
    e.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV pages and recurrent-state checkpoints of shared prompt prefixes (default: on)")
    e.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule the next step on the host while the device runs this one (default: on)")
    e.add_argument("--enable-unified-memory", action="store_true",
                   help="one byte budget shared by KV pages and state slots; a build or setting that does "
                        "not support it is reported in one line, exit status 2 (default: off)")
    e.add_argument("--speculative", choices=["ngram", "dspark"], default=None,
                   help="speculative decoding method: 'ngram' (prompt lookup drafts, verified losslessly); a "
                        "method this build lacks is reported in one line, exit status 2 (default: off)")
    e.add_argument("--num-draft-tokens", type=int, default=4, metavar="N",
                   help="drafts per verify block with --speculative (default: %(default)s)")
    e.add_argument("--mesh", default=None, metavar="SPEC",
                   help="device mesh, e.g. tp=2 or tp=4,ep=2 (default: one device)")
    e.add_argument("--max-running", type=int, default=16, metavar="N",
                   help="requests decoded together (the largest decode batch) (default: %(default)s)")
    e.add_argument("--max-seq-len", type=int, default=2048, metavar="N",
                   help="prompt + generated tokens per request (default: %(default)s)")
    e.add_argument("--prefill-chunk", type=int, default=256, metavar="N",
                   help="prefill tokens per step, a multiple of 64 (default: %(default)s)")
    e.add_argument("--max-prefill-seqs", type=int, default=4, metavar="N",
                   help="prefill sequences per step (default: %(default)s)")
    e.add_argument("--state-slots", type=int, default=None, metavar="N",
                   help="recurrent-state slots incl. the sink (default: 3 x max-running + 8)")
    e.add_argument("--kv-pages", type=int, default=None, metavar="N",
                   help="KV-cache pages incl. the sink (default: 1.5 x max-running x pages per max-seq-len)")
    e.add_argument("--checkpoint-policy", choices=["marconi", "every_chunk", "leaf_only"], default="marconi",
                   help="which recurrent-state checkpoints the prefix cache keeps (default: %(default)s)")
    e.add_argument("--single-bucket", action="store_true",
                   help="compile only the largest step shapes (2 compiles, more padding): fast start-up, "
                        "for tests and CPUs (default: off)")
    e.add_argument("--decode-buckets", type=_int_list, default=None, metavar="N,N,...",
                   help="decode batch sizes to compile, increasing, ending with --max-running (as SGLang's "
                        "--cuda-graph-bs); fewer sizes: fewer compiles, more padding (default: powers of two up to "
                        "--max-running)")
    e.add_argument("--prefill-buckets", type=_int_list, default=None, metavar="N,N,...",
                   help="prefill token counts to compile, increasing multiples of 64 ending with --prefill-chunk "
                        "(default: 64 x powers of two up to --prefill-chunk)")
    e.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="compile every step bucket before reporting SERVING (default: on)")
    e.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant steps: a request's tokens are bit for bit independent of the other requests "
                        "in its steps and of --speculative (row-wise work in fixed blocks of 128 rows; slower; one "
                        "device only, not with --mesh) (default: off)")
    e.add_argument("--impl", choices=["auto", "xla", "pallas"], default="auto",
                   help="kernel implementation; auto picks Pallas on a Hopper GPU, XLA elsewhere (default: %(default)s)")
    return p


def _int_list(text: str) -> tuple[int, ...]:
    """'1,8,64' -> (1, 8, 64) (argparse type: a bad item is a usage error naming it)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 1,8,64; got {text!r}") from None


def engine_kwargs(args) -> dict:
    """`LLM(...)` keyword arguments from the command line."""
    return dict(page_size=args.page_size, prefix_cache=args.prefix_cache, overlap=args.overlap,
                enable_unified_memory=args.enable_unified_memory, speculative=args.speculative,
                num_draft_tokens=args.num_draft_tokens, mesh=args.mesh,
                state_slots=args.state_slots, kv_pages=args.kv_pages, max_running=args.max_running,
                max_seq_len=args.max_seq_len, prefill_chunk=args.prefill_chunk, max_prefill_seqs=args.max_prefill_seqs,
                checkpoint_policy=args.checkpoint_policy, single_bucket=args.single_bucket,
                decode_buckets=args.decode_buckets, prefill_buckets=args.prefill_buckets, warmup=args.warmup,
                impl=args.impl, batch_invariant=args.batch_invariant)


def check_args(args) -> None:
    """Everything that can be checked before loading the model; UserError names the flag."""
    from k3jax.config import preset_names
    from k3jax.engine.engine import EngineConfig

    for flag in ("port", "max_message_bytes", "default_max_new_tokens", "max_queued_requests"):
        v = getattr(args, flag)
        if v < (1 if flag in ("max_message_bytes", "default_max_new_tokens") else 0):
            raise UserError(f"--{flag.replace('_', '-')} must be {'>= 1' if v < 1 else '>= 0'}, got {v}")
    if args.port > 65535 or any(p is not None and not 0 <= p <= 65535 for p in (args.metrics_port, args.http_port)):
        raise UserError("--port, --metrics-port and --http-port must be in [0, 65535]")
    if args.served_model_name is not None and not args.served_model_name:
        raise UserError("--served-model-name is empty")
    if not (args.drain_timeout >= 0 and math.isfinite(args.drain_timeout)):
        raise UserError(f"--drain-timeout must be a finite number >= 0, got {args.drain_timeout}")
    if args.max_new_tokens_limit is not None and not 1 <= args.max_new_tokens_limit < args.max_seq_len:
        raise UserError(f"--max-new-tokens-limit must be in [1, --max-seq-len), got {args.max_new_tokens_limit}")
    if args.api_key is not None and not args.api_key:
        raise UserError("--api-key is empty")
    for flag in ("state_slots", "kv_pages"):
        v = getattr(args, flag)
        if v is not None and v < 2:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 2, got {v}")
    if not os.path.isdir(args.model) and args.model not in preset_names():
        raise UserError(f"--model {args.model!r}: not a directory and not a preset ({', '.join(preset_names())})")
    try:
        EngineConfig(**engine_kwargs(args)).validate()
    except NotImplementedError as e:
        msg = str(e)
        which = "--enable-unified-memory" if "unified" in msg else "--speculative" if "specul" in msg else \
            "--batch-invariant" if "batch_invariant" in msg else "an engine option"
        raise UserError(f"{which}: not supported here ({msg})") from None
    except ValueError as e:
        raise UserError(str(e)) from None


# ---- the service -----------------------------------------------------------------------------



def _decode_images(msgs) -> list:
    """GenerateRequest.images as uint8 [H, W, 3] arrays; INVALID_ARGUMENT naming the image otherwise."""
    return [_decode_image(m, f"images[{i}]") for i, m in enumerate(msgs)]


def _decode_image(m, where: str):
    """One Image message as a uint8 [H, W, 3] array; INVALID_ARGUMENT naming `where` otherwise."""
    import numpy as np

    kind = m.WhichOneof("data")
    if kind == "raw":
        h, w, n = m.raw.height, m.raw.width, len(m.raw.rgb)
        if h <= 0 or w <= 0:
            raise _invalid(f"{where}.raw: height and width must be >= 1, got {h} x {w}")
        if h * w > MAX_IMAGE_PIXELS:
            raise _invalid(f"{where}.raw: {h} x {w} pixels is above the limit {MAX_IMAGE_PIXELS}")
        if n != h * w * 3:
            raise _invalid(f"{where}.raw.rgb has {n} bytes; height * width * 3 = {h * w * 3}")
        return np.frombuffer(m.raw.rgb, np.uint8).reshape(h, w, 3)
    if kind == "encoded":
        return decode_image_bytes(m.encoded, f"{where}.encoded")
    raise _invalid(f"{where} is empty: set encoded or raw")


def _chat_request(chat) -> tuple[list[dict], list | None]:
    """GenerateRequest.chat as (messages in `k3jax.xtml`'s form, tools), its images decoded; INVALID_ARGUMENT naming
    the field otherwise (the chat format checks the rest when it renders)."""
    if not chat.messages:
        raise _invalid("chat.messages is empty")
    msgs = []
    for i, m in enumerate(chat.messages):
        where = f"chat.messages[{i}]"
        d: dict = {"role": m.role}
        if m.parts:
            if m.content:
                raise _invalid(f"{where}: set content or parts, not both")
            parts = []
            for j, part in enumerate(m.parts):
                kind = part.WhichOneof("part")
                if kind == "text":
                    parts.append({"type": "text", "text": part.text})
                elif kind == "image":
                    parts.append({"type": "image", "image": _decode_image(part.image, f"{where}.parts[{j}].image")})
                else:
                    raise _invalid(f"{where}.parts[{j}] is empty: set text or image")
            d["content"] = parts
        else:
            d["content"] = m.content if m.content or not m.tool_calls else None
        if m.name:
            d["name"] = m.name
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id or None, "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments or "{}"}} for c in m.tool_calls]
        if m.HasField("reasoning_content"):
            d["reasoning_content"] = m.reasoning_content
        msgs.append(d)
    tools = None
    if chat.tools_json:
        try:
            tools = json.loads(chat.tools_json)
        except ValueError as e:
            raise _invalid(f"chat.tools_json is not JSON: {e}") from None
        if not isinstance(tools, list):
            raise _invalid("chat.tools_json must be a JSON array of tool definitions")
    return msgs, tools


class GenerationServicer:
    """The `k3jax.v1.Generation` methods. The engine is attached by `start_engine` (after warm-up)."""

    def __init__(self, args, metrics: Metrics):
        self.args = args
        self.metrics = metrics
        self.llm = None
        self.engine = None
        self.ready = False
        self.draining = False
        self.active: dict[str, float] = {}  # request id -> arrival time, for every open stream
        self.unfinished_in_drain: list[str] = []  # streams that ended unfinished while draining

    # ---- limits -------------------------------------------------------------------------------
    @property
    def max_new_tokens_limit(self) -> int:
        return self.args.max_new_tokens_limit or self.args.max_seq_len - 1

    def attach(self, llm) -> None:
        from k3jax.engine.engine import Engine

        self.llm = llm
        self.engine = Engine(llm.core)
        self.metrics.bind_engine(llm.core, lambda: len(self.active))
        self.ready = True
        self.metrics.ready.set(1)

    @property
    def vision_ok(self) -> bool:
        """Whether GenerateRequest.images is served: a vision model in one process."""
        return self.llm.model.config.vision is not None and getattr(self.llm.core, "channel", None) is None

    @functools.cached_property
    def chat_error(self) -> str | None:
        """Why GenerateRequest.chat is not served (None: it is): the tokenizer lacks the chat format."""
        try:
            self.llm.model.chat_format
        except ValueError as e:
            return str(e)
        return None

    def check_admission(self, rid: str) -> None:
        """RequestError if a new request cannot start now: draining, the engine failed or still warming up, its id
        in use, or the queue limit reached."""
        if self.draining:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if self.engine is not None and self.engine.error is not None:
            raise RequestError(grpc.StatusCode.INTERNAL, f"the engine failed: {self.engine.error!r}")
        if not self.ready:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, "the engine is warming up; retry when health reports SERVING")
        if rid in self.active:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is already in use")
        limit = self.args.max_queued_requests
        if limit and len(self.active) >= self.args.max_running + limit:
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"too many requests: {len(self.active)} open (max_running {self.args.max_running} "
                               f"+ max_queued_requests {limit}); retry later")

    # ---- request parsing ----------------------------------------------------------------------
    def parse(self, req, text_ids: list[int] | None = None):
        """(prompt ids, SamplingParams) of a GenerateRequest; RequestError names the field.
        `text_ids`: the text prompt, already tokenized (a chat prompt: rendered)."""
        from k3jax.sampling import MAX_PENALTY, SamplingParams

        cfg, tok = self.llm.model.config, self.llm.model.tokenizer
        vocab = cfg.vocab_size
        kind = req.WhichOneof("prompt")
        if kind is None:
            raise _invalid("prompt is empty: set prompt.text, prompt.token_ids or prompt.chat")
        if kind == "chat":
            ids = list(text_ids)
        elif kind == "text":
            if not req.text:
                raise _invalid("prompt.text is empty")
            if tok is None:
                raise _invalid("prompt.text: this model has no tokenizer; send prompt.token_ids")
            ids = text_ids if text_ids is not None else tok.encode(req.text, add_bos=req.add_bos)
        else:
            ids = list(req.token_ids.ids)
            if not ids:
                raise _invalid("prompt.token_ids is empty")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise _invalid(f"prompt.token_ids: unknown token ids {bad[:5]} (ids lie in [0, {vocab}))")
        mnt = req.max_new_tokens if req.HasField("max_new_tokens") else self.args.default_max_new_tokens
        if mnt <= 0:
            raise _invalid(f"max_new_tokens must be >= 1, got {mnt}")
        if mnt > self.max_new_tokens_limit:
            raise _invalid(f"max_new_tokens={mnt} is above the server limit {self.max_new_tokens_limit}")
        max_len = self.args.max_seq_len
        if len(ids) >= max_len:
            raise _invalid(f"prompt is {len(ids)} tokens: longer than the context (max_seq_len {max_len} "
                           f"including at least one generated token)")
        if len(ids) + mnt > max_len:
            raise _invalid(f"prompt ({len(ids)} tokens) + max_new_tokens ({mnt}) exceeds the context "
                           f"(max_seq_len {max_len}); lower max_new_tokens to at most {max_len - len(ids)}")
        s = req.sampling
        temperature = s.temperature if s.HasField("temperature") else 0.0
        top_p = s.top_p if s.HasField("top_p") else 1.0
        top_k = s.top_k if s.HasField("top_k") else 0
        min_p = s.min_p if s.HasField("min_p") else 0.0
        rep = s.repetition_penalty if s.HasField("repetition_penalty") else 1.0
        pres = s.presence_penalty if s.HasField("presence_penalty") else 0.0
        freq = s.frequency_penalty if s.HasField("frequency_penalty") else 0.0
        if not (math.isfinite(temperature) and temperature >= 0):
            raise _invalid(f"sampling.temperature must be a finite number >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:  # NaN fails too
            raise _invalid(f"sampling.top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise _invalid(f"sampling.top_k must be >= 0 (0 disables it), got {top_k}")
        if not 0.0 <= min_p <= 1.0:  # NaN fails too
            raise _invalid(f"sampling.min_p must be in [0, 1] (0 disables it), got {min_p}")
        if top_k > vocab:
            raise _invalid(f"sampling.top_k={top_k} exceeds the vocabulary size {vocab}")
        if not (math.isfinite(rep) and rep > 0):
            raise _invalid(f"sampling.repetition_penalty must be a finite number > 0 (1 disables it), got {rep}")
        for name, v in (("presence_penalty", pres), ("frequency_penalty", freq)):
            if not -MAX_PENALTY <= v <= MAX_PENALTY:  # NaN fails too
                raise _invalid(f"sampling.{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 disables it), "
                               f"got {v}")
        stop = list(req.stop)
        if any(not x for x in stop):
            raise _invalid("stop: stop strings must not be empty")
        bias = dict(s.logit_bias) or None
        sampling = SamplingParams(max_new_tokens=mnt, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                  repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq,
                                  logit_bias=bias,
                                  seed=s.seed if s.HasField("seed") else None, stop=stop or None,
                                  stop_token_ids=sorted(set(req.stop_token_ids)) or None, ignore_eos=req.ignore_eos,
                                  logprobs=req.logprobs if req.HasField("logprobs") else None)
        try:
            sampling.validate(vocab)  # stop_token_ids, logit_bias; the fields above are checked with their proto names
        except ValueError as e:
            raise _invalid(("sampling." if str(e).startswith("logit_bias") else "") + str(e)) from None
        return ids, sampling

    # ---- RPCs ---------------------------------------------------------------------------------
    async def _refuse(self, context, err: RequestError, rid: str = ""):
        self.metrics.error(err.code.name)
        log.info("refused %s: %s: %s", rid or "a request", err.code.name, err)
        await context.abort(err.code, str(err))

    async def Generate(self, request, context):
        t0 = time.perf_counter()
        rid = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        try:
            self.check_admission(rid)
            text_ids = None
            tok = self.llm.model.tokenizer
            if request.WhichOneof("prompt") == "text" and len(request.text) > _BIG_TEXT and tok is not None:
                text_ids = await asyncio.to_thread(tok.encode, request.text, add_bos=request.add_bos)  # off the loop
            chat = None
            if request.WhichOneof("prompt") == "chat":
                chat = await self._render_chat(request)
                text_ids = chat.token_ids
            ids, sampling = self.parse(request, text_ids)
            images, field = None, "images"
            if chat is not None:
                sampling = chat.sampling(sampling)  # the reply ends with its turn
                images, field = chat.images or None, "chat: images"
            elif request.images:
                if not self.vision_ok:  # before decoding them
                    raise _invalid(f"images: {self.vision_refusal}")
                images = _decode_images(request.images)
            ids = await self.submit(ids, sampling, rid, images, field)
        except RequestError as err:
            await self._refuse(context, err, rid)
            return
        log.debug("request %s: %d prompt tokens, max_new_tokens %d", rid, len(ids), sampling.max_new_tokens)
        await self._stream(rid, ids, t0, context, sampling.logprobs or 0, chat is not None)

    @property
    def vision_refusal(self) -> str:
        return ("the model has no vision tower" if self.llm.model.config.vision is None
                else "not supported by a multi-process server yet")

    async def submit(self, ids: list[int], sampling, rid: str, images=None, field: str = "images") -> list[int]:
        """Queue a parsed request on the engine (the vision tower first, off the event loop, for `images`); the
        prompt ids usage counts (images expanded). RequestError naming the problem (`field`: the images' name)."""
        media = None
        if images:
            if not self.vision_ok:
                raise _invalid(f"{field}: {self.vision_refusal}")
            try:
                media = await asyncio.to_thread(prepare_media, self.llm.model, ids, images)
            except ValueError as e:
                raise _invalid(f"{field}: {e}") from None
        try:
            self.engine.add_request(ids, sampling, rid, images=media)
        except ValueError as e:
            dup = "duplicate request id" in str(e)
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS if dup else grpc.StatusCode.INVALID_ARGUMENT,
                               f"request_id {rid!r} is already in use" if dup else str(e)) from None
        except RuntimeError as e:
            raise RequestError(grpc.StatusCode.INTERNAL, str(e)) from None
        return media.token_ids if media is not None else ids

    async def _render_chat(self, request):
        """The chat prompt of a GenerateRequest (`k3jax.xtml.ChatPrompt`), rendered off the event loop."""
        if self.chat_error is not None:
            raise _invalid(f"chat: {self.chat_error}")
        if request.images:
            raise _invalid("images: a chat request carries its images in chat.messages[].parts")
        if request.add_bos:
            raise _invalid("add_bos: not with chat (the chat format decides the prompt's opening tokens)")
        msgs, tools = _chat_request(request.chat)
        try:
            return await asyncio.to_thread(self.llm.model.chat_format.render, msgs, tools=tools)
        except ValueError as e:
            raise _invalid(f"chat.{e}" if str(e).startswith("messages") else f"chat: {e}") from None

    async def _stream(self, rid, ids, t0, context, n_logprobs=0, chat=False):
        rs = ReplyStream(self, rid, len(ids), t0, chat)
        try:
            async with contextlib.aclosing(rs.deltas()) as deltas:
                async for delta, text in deltas:
                    toks = list(delta.token_ids)
                    resp = pb.GenerateResponse(request_id=rid, token_ids=toks, text=text)
                    for t, entry in zip(toks, delta.logprobs or ()):
                        top = sorted(entry.items(), key=lambda kv: -kv[1])[:n_logprobs]
                        resp.logprobs.add(logprob=entry[t], top_ids=[k for k, _ in top], top_logprobs=[v for _, v in top])
                    if delta.finished:
                        if rs.reply is not None:
                            resp.reply.content = rs.reply.content
                            if rs.reply.reasoning_content is not None:
                                resp.reply.reasoning_content = rs.reply.reasoning_content
                            for c in rs.reply.tool_calls:
                                resp.reply.tool_calls.add(id=c.id, name=c.name, arguments=c.arguments)
                        resp.finish_reason = _REASONS.get(delta.finish_reason, pb.FINISH_REASON_UNSPECIFIED)
                        resp.usage.prompt_tokens = len(ids)
                        resp.usage.cached_tokens = rs.cached
                        resp.usage.completion_tokens = rs.n_out
                        await context.write(resp)
                        return
                    if toks:
                        await context.write(resp)
        except RuntimeError as e:  # the engine loop failed or stopped
            self.metrics.error(grpc.StatusCode.INTERNAL.name)
            log.error("request %s failed: %s", rid, e)
            await context.abort(grpc.StatusCode.INTERNAL, str(e))

    async def Abort(self, request, context):
        if not request.request_id:
            await self._refuse(context, _invalid("request_id is empty"))
        found = self.ready and request.request_id in self.active
        if found:
            self.engine.abort(request.request_id)
            log.info("abort %s", request.request_id)
        return pb.AbortResponse(found=found)

    async def GetModelInfo(self, request, context):
        import k3jax

        a = self.args
        info = pb.ModelInfo(model=a.model, ready=self.ready, server_version=k3jax.__version__)
        lim = info.limits
        lim.max_seq_len, lim.max_new_tokens = a.max_seq_len, self.max_new_tokens_limit
        lim.default_max_new_tokens, lim.max_running = a.default_max_new_tokens, a.max_running
        lim.max_queued_requests, lim.max_message_bytes = a.max_queued_requests, a.max_message_bytes
        lim.prefill_chunk, lim.page_size = a.prefill_chunk, a.page_size
        f = info.features
        f.token_prompts = f.stop_strings = f.stop_token_ids = f.seeded_sampling = f.top_k = f.top_p = f.ignore_eos = f.min_p = True
        f.logprobs = f.penalties = f.logit_bias = not a.speculative
        f.chat = self.ready and self.chat_error is None
        f.prefix_cache, f.overlap, f.unified_memory = a.prefix_cache, a.overlap, a.enable_unified_memory
        f.speculative, f.mesh = a.speculative or "", a.mesh or ""
        if request.check_invariants and not a.debug_invariants:
            await self._refuse(context, RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                                     "check_invariants needs a server started with --debug-invariants"))
        if not self.ready:
            if request.check_invariants:
                await self._refuse(context, RequestError(grpc.StatusCode.UNAVAILABLE, "the engine is warming up"))
            return info
        cfg = self.llm.model.config
        f.text_prompts = self.llm.model.tokenizer is not None
        f.vision = self.vision_ok
        c = info.config
        c.name, c.vocab_size, c.hidden_size, c.num_layers = cfg.name, cfg.vocab_size, cfg.hidden_size, cfg.num_layers
        c.dtype, c.max_position_embeddings = cfg.dtype, cfg.max_position_embeddings
        if cfg.bos_token_id is not None:
            c.bos_token_id = cfg.bos_token_id
        if cfg.eos_token_id is not None:
            c.eos_token_id = cfg.eos_token_id
        c.config_json = json.dumps({k.name: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
                                    for k in dataclasses.fields(cfg) if k.name != "extra"
                                    for v in (getattr(cfg, k.name),)}, default=str)
        if cfg.vision is not None:
            c.media_placeholder_token_id = cfg.media_placeholder_token_id
        sched = self.llm.core.scheduler
        lim.kv_pages, lim.state_slots = sched.pages.capacity, sched.slots.capacity
        llm = self.llm
        check = bool(request.check_invariants)

        def snapshot(core):  # on the engine thread: a consistent view
            mem, counters = llm.memory_usage(), dict(core.scheduler.stats)
            err = None
            if check:
                try:
                    core.check_invariants()
                except AssertionError as e:
                    err = str(e) or "AssertionError"
            return mem, counters, err

        try:
            mem, counters, err = await asyncio.wait_for(asyncio.wrap_future(self.engine.call(snapshot)), 30.0)
        except (asyncio.TimeoutError, RuntimeError) as e:
            await self._refuse(context, RequestError(grpc.StatusCode.UNAVAILABLE, f"the engine did not answer: {e!r}"))
        st = info.stats
        for k, v in mem.items():
            setattr(st, k, int(v))
        for k, v in counters.items():
            st.counters[k] = int(v)
        st.streams = len(self.active)
        if check:
            info.invariants.ok = err is None
            info.invariants.error = err or ""
        return info


# ---- API key ---------------------------------------------------------------------------------
class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Every method except health needs `authorization: Bearer KEY` or `x-api-key: KEY` metadata."""

    def __init__(self, key: str, metrics: Metrics | None = None):
        self._key = key.encode()
        self._metrics = metrics

    def _authorized(self, metadata) -> bool:
        return api_key_matches(metadata or (), self._key)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_METHODS) or self._authorized(details.invocation_metadata):
            return handler
        if self._metrics is not None:
            self._metrics.error(grpc.StatusCode.UNAUTHENTICATED.name)

        async def deny(_request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong API key: send metadata 'authorization: Bearer KEY' or 'x-api-key: KEY'")

        kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
        make = kind[(bool(handler.request_streaming), bool(handler.response_streaming))]
        return make(deny, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


# ---- the process -----------------------------------------------------------------------------
def wait_listening(log_text, proc, timeout: float = 120.0) -> tuple[str, str]:
    """For a server started as a subprocess with its log in a file: poll `log_text()` until the
    server has logged its gRPC and metrics addresses -> ("HOST:PORT", "http://HOST:PORT/metrics").
    Raises RuntimeError if the process exits or the timeout passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_text()
        g = re.search(r"gRPC listening on (\S+) \(", text)
        m = re.search(r"metrics on (http://\S+/metrics)", text)
        if g and m:
            return g.group(1), m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"the server did not start (rc={proc.poll()})")


def stop_process(proc, grace: float = 60.0) -> int:
    """SIGTERM a server subprocess (it drains), kill it if it has not exited after `grace` seconds;
    its exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


async def serve(args, make_llm=None) -> int:
    """Run the server until SIGTERM/SIGINT; the exit status. `make_llm()` (optional; called on a
    background thread) builds the engine's `LLM` instead of `LLM(args.model, ...)`: the hook
    `k3jax-launch ... serve` uses to run rank 0 of a multi-process engine."""
    metrics = Metrics()
    servicer = GenerationServicer(args, metrics)
    interceptors = [ApiKeyInterceptor(args.api_key, metrics)] if args.api_key else []
    options = [("grpc.max_receive_message_length", args.max_message_bytes),
               ("grpc.max_send_message_length", args.max_message_bytes),
               ("grpc.so_reuseport", 0), *_KEEPALIVE]  # so_reuseport 0: a port in use is an error, not a 2nd listener
    server = grpc.aio.server(interceptors=interceptors, options=options)
    server.add_generic_rpc_handlers((pb.generic_handler(servicer),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (pb.SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
    for name in ("", pb.SERVICE_NAME):
        await health_servicer.set(name, NOT_SERVING)
    try:
        port = server.add_insecure_port(_hostport(args.host, args.port))
    except RuntimeError as e:
        raise UserError(f"cannot bind {_hostport(args.host, args.port)}: {e}") from None
    await server.start()
    log.info("gRPC listening on %s (health NOT_SERVING until warm-up ends)", _hostport(args.host, port))
    if args.metrics_port is not None:
        try:
            mport = metrics.serve(args.host, args.metrics_port)
        except OSError as e:
            await server.stop(None)
            raise UserError(f"cannot bind the metrics port {_hostport(args.host, args.metrics_port)}: {e}") from None
        log.info("metrics on http://%s/metrics", _hostport(args.host, mport))
    http = None
    if args.http_port is not None:
        from serve import openai

        try:
            http, _ = await openai.start(servicer, args)
        except OSError as e:
            await server.stop(None)
            metrics.close()
            raise UserError(f"cannot bind the HTTP port {_hostport(args.host, args.http_port)}: {e}") from None

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: (log.info("%s received", signal.Signals(s).name), stop.set()))

    # load + warm up off the event loop (a daemon thread: a SIGTERM during warm-up need not wait for it)
    built: asyncio.Future = loop.create_future()

    def build():
        try:
            from k3jax.engine.engine import LLM

            t = time.perf_counter()
            llm = make_llm() if make_llm is not None else LLM(args.model, seed=args.model_seed, **engine_kwargs(args))
            loop.call_soon_threadsafe(lambda: built.done() or built.set_result((llm, time.perf_counter() - t)))
        except BaseException as e:  # noqa: BLE001 (reported by the main task)
            loop.call_soon_threadsafe(lambda err=e: built.done() or built.set_exception(err))

    log.info("loading %s and compiling the engine (warmup=%s)", args.model, args.warmup)
    threading.Thread(target=build, name="k3jax-build", daemon=True).start()
    stop_task = asyncio.ensure_future(stop.wait())
    await asyncio.wait([built, stop_task], return_when=asyncio.FIRST_COMPLETED)
    if not built.done():
        log.info("stopping during warm-up")
        await health_servicer.enter_graceful_shutdown()
        await asyncio.gather(server.stop(0), http.stop(0) if http is not None else asyncio.sleep(0))
        metrics.close()
        return 0
    if built.exception() is not None:
        e = built.exception()
        log.error("engine start-up failed: %s: %s", type(e).__name__, e)
        await asyncio.gather(server.stop(0), http.stop(0) if http is not None else asyncio.sleep(0))
        metrics.close()
        return _EXIT_USAGE if isinstance(e, (ValueError, NotImplementedError, FileNotFoundError)) else 1
    llm, dt = built.result()
    servicer.attach(llm)
    for name in ("", pb.SERVICE_NAME):
        await health_servicer.set(name, SERVING)
    log.info("ready: %s loaded and warmed up in %.1f s; health SERVING", args.model, dt)

    async def housekeeping():
        while True:
            await asyncio.sleep(1.0)
            metrics.sample_throughput()
            if servicer.engine.error is not None and servicer.ready:
                servicer.ready = False
                metrics.ready.set(0)
                for name in ("", pb.SERVICE_NAME):
                    await health_servicer.set(name, NOT_SERVING)
                log.error("engine failed (%r): health NOT_SERVING", servicer.engine.error)

    hk = asyncio.ensure_future(housekeeping())
    await stop_task
    n = len(servicer.active)
    log.info("draining: %d open stream(s), timeout %g s; new calls get UNAVAILABLE", n, args.drain_timeout)
    servicer.draining = True
    metrics.ready.set(0)
    await health_servicer.enter_graceful_shutdown()
    t = time.perf_counter()
    await asyncio.gather(server.stop(args.drain_timeout),
                         http.stop(args.drain_timeout) if http is not None else asyncio.sleep(0))
    hk.cancel()
    # still open, or already cancelled by server.stop (their handlers may finish before it returns)
    left = list(dict.fromkeys(servicer.unfinished_in_drain + list(servicer.active)))
    log.info("drained in %.2f s%s", time.perf_counter() - t, f" ({len(left)} stream(s) cancelled)" if left else "")
    if left:  # the cancelled handlers' aborts may not reach the engine loop before it stops: abort them here
        def abort(core):
            for rid in left:
                core.abort(rid)
            core.scheduler.drain_finished()

        try:
            await asyncio.wait_for(asyncio.wrap_future(servicer.engine.call(abort)), 10.0)
        except (asyncio.TimeoutError, RuntimeError) as e:  # the engine loop failed or is stuck
            log.warning("could not abort the cancelled requests: %r", e)
    servicer.engine.shutdown(timeout=10.0)
    metrics.close()
    log.info("stopped")
    return 0


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level), stream=sys.stderr,
                        format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", force=True)


def main(argv: list[str] | None = None) -> int:
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")  # no progress bars in server logs (read when tqdm loads)
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    try:
        if _MISSING is not None:
            raise UserError(f"{_MISSING}: install grpcio-health-checking and grpcio-reflection (pip install -e .)")
        check_args(args)
        code = asyncio.run(serve(args))
    except UserError as e:
        print(f"k3jax-serve: error: {e}", file=sys.stderr)
        return _EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    if any(t.name == "k3jax-build" and t.is_alive() for t in threading.enumerate()):
        # stopped during warm-up: do not finalize the interpreter under a thread inside XLA
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
