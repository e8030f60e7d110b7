"""What the gRPC service (`serve/server.py`) and the HTTP API (`serve/openai.py`) share: request errors, image
decoding, and `ReplyStream` (one request's stream from the engine, with the server's metrics and bookkeeping).
Its own module so both front ends see the same classes whether the server runs as `k3jax-serve` or as
`python -m serve.server` (where serve.server is `__main__`)."""

from __future__ import annotations

import hmac
import logging
import time

import grpc

from k3jax.xtml import TOOLS_BEGIN

log = logging.getLogger("k3jax.serve")

BIG_TEXT = 16384  # text prompts longer than this (chars) are tokenized off the event loop


class RequestError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def api_key_matches(pairs, key: bytes) -> bool:
    """Whether (lower-case name, value) pairs (gRPC metadata, HTTP headers) carry the API key, as
    `authorization: Bearer KEY` or `x-api-key: KEY` (compared in constant time)."""
    for k, v in pairs:
        v = v.encode() if isinstance(v, str) else v
        if k == "authorization" and v[:7].lower() == b"bearer ":
            v = v[7:].strip()
        elif k != "x-api-key":
            continue
        if hmac.compare_digest(v, key):
            return True
    return False


def invalid(msg: str) -> RequestError:
    return RequestError(grpc.StatusCode.INVALID_ARGUMENT, msg)


MAX_IMAGE_PIXELS = 64 * 1024 * 1024  # a decoded image larger than this is refused (decompression bombs)


def decode_image_bytes(data: bytes, where: str):
    """An image file's bytes (PNG, JPEG, ...) as uint8 [H, W, 3]; INVALID_ARGUMENT naming `where` if it does not
    decode or is larger than MAX_IMAGE_PIXELS (checked before the pixels are decoded)."""
    import numpy as np

    try:
        import io

        from PIL import Image
    except ImportError:
        raise invalid(f"{where}: this server cannot decode image files (no Pillow); send raw images") from None
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.width * im.height > MAX_IMAGE_PIXELS:
                raise invalid(f"{where}: {im.width} x {im.height} pixels is above the limit {MAX_IMAGE_PIXELS}")
            return np.asarray(im.convert("RGB"))
    except RequestError:
        raise
    except Exception as e:  # PIL raises many types for bad data
        raise invalid(f"{where}: cannot decode the image ({type(e).__name__}: {e})") from None


class ReplyStream:
    """One request's stream from the engine as a front end (gRPC, HTTP) sends it: `deltas()` yields (delta, text)
    with text in whole UTF-8 characters; a chat reply's text stops where its tool-call section starts (the calls
    come parsed in `reply` when it finishes). It keeps the server's metrics (TTFT, inter-token gaps, e2e, finish
    reasons) and its bookkeeping: the request is in `servicer.active` until the stream closes, and a stream closed
    before the request finished (cancelled, disconnected, drained, failed) aborts it. Raises RuntimeError if the
    engine stops. Close the generator (`contextlib.aclosing`) so that happens at once."""

    def __init__(self, servicer, rid: str, n_prompt: int, t0: float, chat: bool = False):
        from k3jax.tokenizer import IncrementalDecoder

        self.servicer, self.rid, self.n_prompt, self.t0 = servicer, rid, n_prompt, t0
        model = servicer.llm.model
        tok = model.tokenizer
        self.detok = IncrementalDecoder(tok) if tok is not None else None
        self.chat_format = model.chat_format if chat else None
        self.tools_begin = tok.special_tokens.get(TOOLS_BEGIN) if chat else None
        self.n_out, self.cached, self.last = 0, 0, None
        self.done = False
        self.reply = None  # chat: the finished reply, parsed (`k3jax.xtml.ChatReply`)
        servicer.active[rid] = t0

    def _text(self, toks: list[int], final: bool) -> str:
        if self.detok is None:
            return ""
        if self.tools_begin in toks:  # the text ends here
            text = "".join(self.detok.push(t) for t in toks[: toks.index(self.tools_begin)]) + self.detok.flush()
            self.detok = None
            return text
        return "".join(self.detok.push(t) for t in toks) + (self.detok.flush() if final else "")

    def _observe(self, n: int) -> None:
        m = self.servicer.metrics
        if n:
            now = time.perf_counter()
            if self.last is None:  # tokens that arrive together after the first: 0 s apart
                m.ttft.observe(now - self.t0)
                k, gap = n - 1, 0.0
            else:
                k, gap = n, (now - self.last) / n
            for _ in range(k):
                m.itl.observe(gap)
            self.last = now
            m.tokens(n)
        self.n_out += n

    async def deltas(self):
        servicer = self.servicer
        stream = servicer.engine.stream(self.rid)
        try:
            async for delta in stream:
                toks = list(delta.token_ids)
                text = self._text(toks, delta.finished)
                self._observe(len(toks))
                if delta.finished:
                    out = delta.output
                    self.cached = out.cached_tokens if out is not None else 0
                    if self.chat_format is not None and out is not None:
                        self.reply = self.chat_format.parse(out.token_ids)
                    self.done = True
                    servicer.metrics.e2e.observe(time.perf_counter() - self.t0)
                    servicer.metrics.finished(delta.finish_reason, self.n_prompt, self.cached)
                    log.debug("request %s finished (%s): %d tokens, %d cached prompt tokens, %.3f s", self.rid,
                              delta.finish_reason, self.n_out, self.cached, time.perf_counter() - self.t0)
                yield delta, text
                if delta.finished:
                    return
            # the engine stream ended without a final delta: cannot happen unless the engine stopped
            raise RuntimeError("the engine stopped")
        finally:
            if not self.done:  # cancelled, disconnected, deadline exceeded, drained past the timeout, or failed
                servicer.engine.abort(self.rid)
                servicer.metrics.requests.labels(finish_reason="cancelled").inc()
                log.debug("request %s cancelled after %d tokens", self.rid, self.n_out)
                if servicer.draining:
                    servicer.unfinished_in_drain.append(self.rid)
            await stream.aclose()
            servicer.active.pop(self.rid, None)


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
