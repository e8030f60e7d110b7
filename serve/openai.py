"""OpenAI-compatible HTTP API beside the gRPC service (`k3jax-serve --http-port N`, aiohttp on the server's event
loop, sharing its engine, limits, API key, metrics and drain).

Routes: `GET /health` (200 once warmed up, else 503), `GET /v1/models`, `POST /v1/completions`,
`POST /v1/chat/completions`, both with `"stream": true` as server-sent events ending in `data: [DONE]`.
Chat renders the messages with the model's chat format (`k3jax.xtml`; images as `image_url` data: URLs), stops at
the end of the turn and returns content, `reasoning_content` and `tool_calls` (finish reason `tool_calls`).
Sampling follows OpenAI's fields and defaults (temperature 1; `max_tokens` / `max_completion_tokens`, `stop`,
`seed`, `presence_penalty`, `frequency_penalty`, `logit_bias`, `logprobs` / `top_logprobs`), plus vLLM's
extensions `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`. Bad input gets 400 with
`{"error": {"message", "type": "invalid_request_error", "param", "code"}}` naming the field; a client that
disconnects aborts its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

import grpc
from aiohttp import web

from k3jax.xtml import data_url_bytes
from serve.common import BIG_TEXT, ReplyStream, RequestError, api_key_matches, decode_image_bytes, hostport

log = logging.getLogger("k3jax.serve")

_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.ALREADY_EXISTS: 409,
           grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.INTERNAL: 500,
           grpc.StatusCode.UNAUTHENTICATED: 401}
_FINISH = {"length": "length", "eos": "stop", "stop": "stop", "abort": "abort"}
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.kind = status, param, kind

    @classmethod
    def of(cls, err: RequestError) -> "ApiError":
        status = _STATUS.get(err.code, 500)
        return cls(status, str(err), kind="invalid_request_error" if status < 500 else "server_error")

    def response(self) -> web.Response:
        body = {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}
        return web.json_response(body, status=self.status)


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


class OpenAIFrontEnd:
    """The HTTP routes over a `GenerationServicer` (attached to its engine once warm)."""

    def __init__(self, servicer, model_name: str):
        self.s = servicer
        self.model_name = model_name
        self.runner: web.AppRunner | None = None

    # ---- plumbing -------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.s.args.max_message_bytes, middlewares=[self._errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    async def start(self, host: str, port: int) -> int:
        # handler_cancellation: a client that disconnects cancels its handler, which aborts its request
        self.runner = web.AppRunner(self.app(), access_log=None, handle_signals=False, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, reuse_port=False)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def stop(self, timeout: float) -> None:
        """Stop listening and wait up to `timeout` seconds for open requests; then cancel them (their requests are
        aborted)."""
        if self.runner is None:
            return
        deadline = time.monotonic() + timeout
        for site in list(self.runner.sites):
            await site.stop()
        while any(r.startswith(("cmpl-", "chatcmpl-")) for r in self.s.active) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.runner.cleanup()

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        key = self.s.args.api_key
        if key and request.path != "/health" and not api_key_matches(
                ((k.lower(), v) for k, v in request.headers.items()), key.encode()):
            self.s.metrics.error(grpc.StatusCode.UNAUTHENTICATED.name)
            return ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                            kind="authentication_error").response()
        try:
            return await handler(request)
        except ApiError as e:
            if e.status >= 400:
                self.s.metrics.error({400: "INVALID_ARGUMENT", 409: "ALREADY_EXISTS", 429: "RESOURCE_EXHAUSTED",
                                      503: "UNAVAILABLE"}.get(e.status, "INTERNAL"))
            log.info("refused %s %s: %d: %s", request.method, request.path, e.status, e)
            return e.response()

    async def _body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} is not served here (this server serves {self.model_name!r})", "model",
                           "not_found_error")
        return body

    def _admit(self, rid: str) -> None:
        try:
            self.s.check_admission(rid)
        except RequestError as e:
            raise ApiError.of(e) from None

    # ---- simple routes --------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        ok = self.s.ready and not self.s.draining
        return web.json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0, "owned_by": "k3jax",
            "max_model_len": self.s.args.max_seq_len}]})

    # ---- sampling -------------------------------------------------------------------------------
    def _sampling(self, body: dict, chat: bool):
        from k3jax.sampling import SamplingParams

        for k in ("n", "best_of"):
            if body.get(k, 1) != 1:
                raise _bad(f"{k}={body[k]!r}: only 1 is supported (send separate requests)", k)
        if body.get("echo"):
            raise _bad("echo is not supported", "echo")
        if body.get("suffix"):
            raise _bad("suffix is not supported", "suffix")
        mnt_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        mnt = body.get(mnt_key)
        if mnt is None:
            mnt = self.s.args.default_max_new_tokens
        if not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 1:
            raise _bad(f"{mnt_key} must be an integer >= 1, got {mnt!r}", mnt_key)
        if mnt > self.s.max_new_tokens_limit:
            raise _bad(f"{mnt_key}={mnt} is above the server limit {self.s.max_new_tokens_limit}", mnt_key)
        kw = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
        kw.setdefault("temperature", 1.0)  # OpenAI's default
        if kw.get("top_k") == -1:  # vLLM's "off"
            kw["top_k"] = 0
        if "logit_bias" in kw:
            bias = kw["logit_bias"]
            if not isinstance(bias, dict):
                raise _bad("logit_bias must be an object {token id: bias}", "logit_bias")
            try:
                kw["logit_bias"] = {int(k): v for k, v in bias.items()}
            except ValueError:
                raise _bad("logit_bias keys must be token ids (integers)", "logit_bias") from None
        if chat:
            lp = body.get("logprobs")
            if lp:
                kw["logprobs"] = body.get("top_logprobs") or 0
            elif body.get("top_logprobs"):
                raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
        elif body.get("logprobs") is not None:
            kw["logprobs"] = body["logprobs"]
        try:
            sp = SamplingParams(max_new_tokens=mnt, **kw).validate(self.s.llm.model.config.vocab_size)
        except (TypeError, ValueError) as e:
            field = next((f for f in (*_SAMPLING_FIELDS, "logprobs") if str(e).startswith(f)), None)
            raise _bad(str(e), "top_logprobs" if chat and field == "logprobs" else field) from None
        return sp

    # ---- completions ----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        body = await self._body(request)
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        self._admit(rid)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        tok = self.s.llm.model.tokenizer
        if isinstance(prompt, str) and prompt:
            if tok is None:
                raise _bad("this model has no tokenizer: send the prompt as token ids", "prompt")
            ids = await asyncio.to_thread(tok.encode, prompt) if len(prompt) > BIG_TEXT else tok.encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = prompt
        elif isinstance(prompt, list) and len(prompt) > 1:
            raise _bad("one prompt per request (send a batch as separate requests)", "prompt")
        else:
            raise _bad("prompt must be a non-empty string or a list of token ids", "prompt")
        sampling = self._sampling(body, chat=False)
        n_prompt = await self._submit(ids, sampling, rid)
        rs = ReplyStream(self.s, rid, n_prompt, t0)
        created = int(time.time())

        def chunk(text, lp, finish):
            return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}]}

        if body.get("stream"):
            return await self._sse(request, rs, body, lambda d, text: chunk(
                text, self._completion_logprobs(d, sampling), _FINISH.get(d.finish_reason) if d.finished else None))
        text, lps, last = await self._collect(rs)
        lp = None
        if sampling.logprobs is not None:
            lp = self._completion_logprobs_of(lps, sampling)
        out = chunk(text, lp, _FINISH.get(last.finish_reason))
        out["usage"] = self._usage(rs)
        return web.json_response(out)

    def _token_text(self, t: int) -> str:
        return self.s.llm.model.tokenizer.decode([t], skip_special=False)

    def _completion_logprobs(self, delta, sampling):
        if sampling.logprobs is None or not delta.token_ids:
            return None
        return self._completion_logprobs_of(list(zip(delta.token_ids, delta.logprobs or ())), sampling)

    def _completion_logprobs_of(self, pairs, sampling) -> dict:
        n = sampling.logprobs
        def top(e):
            return dict(sorted(((self._token_text(k), v) for k, v in e.items()), key=lambda kv: -kv[1])[:n])

        return {"tokens": [self._token_text(t) for t, _ in pairs], "token_logprobs": [e[t] for t, e in pairs],
                "top_logprobs": [top(e) for _, e in pairs]}

    def _chat_logprobs_of(self, pairs, sampling) -> dict:
        n = sampling.logprobs

        def entry(t, lp):
            s = self._token_text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        def top(e):
            return [entry(k, v) for k, v in sorted(e.items(), key=lambda kv: -kv[1])[:n]]

        return {"content": [entry(t, e[t]) | {"top_logprobs": top(e)} for t, e in pairs]}

    # ---- chat -----------------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        body = await self._body(request)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self._admit(rid)
        if self.s.chat_error is not None:
            raise _bad(f"this model cannot chat: {self.s.chat_error}", "messages")
        messages = _messages(body.get("messages"))
        tools = body.get("tools")
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise _bad("tool_choice: only 'auto' and 'none' are supported", "tool_choice")
        if choice == "none":
            tools = None
        sampling = self._sampling(body, chat=True)
        try:  # off the event loop (a long conversation encodes for a while)
            prompt = await asyncio.to_thread(self.s.llm.model.chat_format.render, messages, tools=tools)
        except ValueError as e:
            raise _bad(str(e), "tools" if str(e).startswith("tools") else "messages") from None
        sampling = prompt.sampling(sampling)
        n_prompt = await self._submit(prompt.token_ids, sampling, rid, prompt.images or None)
        rs = ReplyStream(self.s, rid, n_prompt, t0, chat=True)
        created = int(time.time())

        def chunk(delta: dict, finish, lp=None):
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}]}

        if body.get("stream"):
            from k3jax.xtml import ReasoningSplitter

            split = ReasoningSplitter()
            first = [True]

            def event(d, text):
                reasoning, content = split.push(text, final=d.finished)
                delta = {"role": "assistant"} if first[0] else {}
                first[0] = False
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if content:
                    delta["content"] = content
                finish = None
                if d.finished:
                    calls = rs.reply.tool_calls if rs.reply is not None else []
                    if calls:
                        delta["tool_calls"] = [c.to_dict() | {"index": i} for i, c in enumerate(calls)]
                    finish = "tool_calls" if calls else _FINISH.get(d.finish_reason)
                lp = None
                if sampling.logprobs is not None and d.token_ids:
                    lp = self._chat_logprobs_of(list(zip(d.token_ids, d.logprobs or ())), sampling)
                return chunk(delta, finish, lp)

            return await self._sse(request, rs, body, event)
        _, lps, last = await self._collect(rs)
        reply = rs.reply
        message = {"role": "assistant", "content": reply.content}
        if reply.reasoning_content is not None:
            message["reasoning_content"] = reply.reasoning_content
        if reply.tool_calls:
            message["tool_calls"] = [c.to_dict() for c in reply.tool_calls]
        out = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
               "choices": [{"index": 0, "message": message,
                            "logprobs": self._chat_logprobs_of(lps, sampling) if sampling.logprobs is not None else None,
                            "finish_reason": "tool_calls" if reply.tool_calls else _FINISH.get(last.finish_reason)}],
               "usage": self._usage(rs)}
        return web.json_response(out)

    # ---- shared ---------------------------------------------------------------------------------
    async def _submit(self, ids, sampling, rid, images=None) -> int:
        try:
            return len(await self.s.submit(list(ids), sampling, rid, images, "messages: images"))
        except RequestError as e:
            raise ApiError.of(e) from None

    @staticmethod
    def _usage(rs: ReplyStream) -> dict:
        return {"prompt_tokens": rs.n_prompt, "completion_tokens": rs.n_out, "total_tokens": rs.n_prompt + rs.n_out,
                "prompt_tokens_details": {"cached_tokens": rs.cached}}

    async def _collect(self, rs: ReplyStream):
        """The whole reply: (text, [(token, logprob entry)], the last delta)."""
        text, lps, last = [], [], None
        try:
            async with contextlib.aclosing(rs.deltas()) as deltas:
                async for d, t in deltas:
                    text.append(t)
                    lps += list(zip(d.token_ids, d.logprobs or ()))
                    last = d
        except RuntimeError as e:
            raise ApiError(500, str(e), kind="server_error") from None
        return "".join(text), lps, last

    async def _sse(self, request, rs: ReplyStream, body: dict, event) -> web.StreamResponse:
        """Server-sent events: one chunk per engine step with tokens (`event(delta, text)`), the usage chunk with
        `stream_options.include_usage`, then `data: [DONE]`. A disconnect cancels the handler: the request aborts."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        send = lambda obj: resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")  # noqa: E731
        try:
            async with contextlib.aclosing(rs.deltas()) as deltas:
                async for d, text in deltas:
                    if d.token_ids or d.finished:
                        await send(event(d, text))
        except ConnectionResetError:  # the client went away: the request was aborted when the stream closed
            log.debug("request %s: the client disconnected", rs.rid)
            return resp
        except RuntimeError as e:  # the engine stopped: an error event, then the stream ends
            await send({"error": {"message": str(e), "type": "server_error", "param": None, "code": 500}})
            return resp
        opts = body.get("stream_options") or {}
        if isinstance(opts, dict) and opts.get("include_usage"):
            await send({"id": rs.rid, "object": "chat.completion.chunk" if rs.chat_format else "text_completion",
                        "created": int(time.time()), "model": self.model_name, "choices": [], "usage": self._usage(rs)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _messages(messages) -> list:
    """OpenAI messages with their image_url parts decoded (data: URLs only: the server reads no files or URLs)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            parts = []
            for j, p in enumerate(m["content"]):
                if isinstance(p, dict) and p.get("type") == "image_url":
                    url = p.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    where = f"messages[{i}].content[{j}].image_url"
                    if not isinstance(url, str) or not url.startswith("data:"):
                        raise _bad(f"{where}: send images as data: URLs (data:image/png;base64,...); this server "
                                   "fetches nothing", "messages")
                    try:
                        raw = data_url_bytes(url)
                    except ValueError as e:
                        raise _bad(f"{where}: {e}", "messages") from None
                    try:
                        p = {"type": "image", "image": decode_image_bytes(raw, where)}
                    except RequestError as e:
                        raise _bad(str(e), "messages") from None
                elif isinstance(p, dict) and p.get("type") == "image":
                    raise _bad(f"messages[{i}].content[{j}]: send images as image_url parts with data: URLs", "messages")
                parts.append(p)
            m = m | {"content": parts}
        out.append(m)
    return out


async def start(servicer, args) -> tuple[OpenAIFrontEnd, int]:
    front = OpenAIFrontEnd(servicer, args.served_model_name or args.model)
    port = await front.start(args.host, args.http_port)
    log.info("OpenAI API on http://%s/v1", hostport(args.host, port))
    return front, port
