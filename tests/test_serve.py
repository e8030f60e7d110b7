"""k3jax-serve end to end: a real server subprocess on loopback, real gRPC clients.

One server for the whole module (k3-tiny, single-bucket step shapes: 2 compiles), started first
so that it warms up while this process builds the `LLM.generate` reference with the same engine
settings and weights seed. The server runs without this suite's PJRT_NPROC / 8-host-device
settings (`tests.one_device_env`: it needs one device; 32 XLA:CPU threads on 2 cores made its steps ~8x slower).
The SIGTERM test stops the shared server, so it runs last.
"""

import asyncio
import base64
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
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serve import pb
from serve.metrics import NAMES as METRIC_NAMES
from serve.server import stop_process, wait_listening
from tests import one_device_env

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-123"
MD = (("authorization", f"Bearer {KEY}"),)
ENGINE = dict(max_running=8, max_seq_len=256, prefill_chunk=128, max_prefill_seqs=4, single_bucket=True)
MNT = 5  # max_new_tokens of the reference requests
MAX_MSG = 65536
SERVER_FLAGS = ["--model", "k3-tiny", "--model-seed", "0", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
                "--api-key", KEY, "--debug-invariants", "--max-message-bytes", str(MAX_MSG), "--drain-timeout", "60",
                "--single-bucket", "--max-running", "8", "--max-seq-len", "256", "--prefill-chunk", "128",
                "--max-prefill-seqs", "4", "--http-port", "0"]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _prompts():
    """8 distinct prompts: short ones, one text prompt, and long ones sharing a 70-token prefix
    (past the 64-token checkpoint alignment, so repeats restore from the prefix cache)."""
    rng = np.random.default_rng(7)
    r = lambda n: rng.integers(0, 256, n).tolist()
    system = r(70)
    return [r(5), r(17), r(31), "Hello, k3jax server!", system + r(9), system + r(20), system + r(33), r(66)]


PROMPTS = _prompts()


def _server_env():
    env = one_device_env(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


class Server:
    """A `python -m serve.server` subprocess; records health statuses and a Generate attempt while it warms up."""

    def __init__(self, tmp: Path, flags=SERVER_FLAGS):
        self.flags = flags
        self.log_path = tmp / "server.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "serve.server", *flags], cwd=ROOT, env=_server_env(),
                                     stdout=self._log, stderr=subprocess.STDOUT)
        self.port = self.metrics_port = None
        self.statuses: list[int] = []
        self.warmup_generate_code = None
        self.t0 = time.perf_counter()
        self._watch = threading.Thread(target=self._watch_health, daemon=True)
        self._ports()
        self._watch.start()

    def log(self) -> str:
        return self.log_path.read_text()

    def _ports(self, timeout=120):
        try:
            self.target, metrics = wait_listening(self.log, self.proc, timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{e}:\n{self.log()}") from None
        self.port, self.metrics_port = int(self.target.rsplit(":", 1)[1]), int(metrics.rsplit(":", 1)[1].split("/")[0])
        self.http = None
        if "--http-port" in self.flags:  # logged right after the metrics address, before the model loads
            deadline = time.monotonic() + timeout
            while (m := re.search(r"OpenAI API on (http://\S+)/v1", self.log())) is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert m, self.log()
            self.http = m.group(1)

    def _watch_health(self):
        with grpc.insecure_channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            gen = pb.GenerationStub(ch)
            while self.proc.poll() is None:
                try:
                    st = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                except grpc.RpcError:
                    time.sleep(0.2)
                    continue
                if not self.statuses or self.statuses[-1] != st:
                    self.statuses.append(st)
                if st == SERVING:
                    return
                if self.warmup_generate_code is None:
                    try:
                        list(gen.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])), metadata=MD, timeout=5))
                    except grpc.RpcError as e:
                        self.warmup_generate_code = e.code()
                time.sleep(0.2)

    def wait_ready(self, timeout=400):
        self._watch.join(timeout)
        if not self.statuses or self.statuses[-1] != SERVING:
            raise RuntimeError(f"server not SERVING after {timeout} s (rc={self.proc.poll()}):\n{self.log()}")
        self.ready_s = time.perf_counter() - self.t0

    def stop(self):
        stop_process(self.proc)
        self._log.close()


@pytest.fixture(scope="module")
def server_proc(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference_llm(server_proc):
    """The reference `LLM` (same engine settings and weights seed as the server), built while it warms up."""
    from k3jax import LLM

    return LLM("k3-tiny", seed=0, **ENGINE)


@pytest.fixture(scope="module")
def reference(reference_llm):
    """`LLM.generate` outputs for PROMPTS (greedy)."""
    from k3jax import SamplingParams

    return reference_llm.generate(PROMPTS, SamplingParams(max_new_tokens=MNT))


@pytest.fixture(scope="module")
def server(server_proc, reference):
    server_proc.wait_ready()
    return server_proc


def request(prompt, max_new_tokens=MNT, **kw) -> "pb.GenerateRequest":
    req = pb.GenerateRequest(max_new_tokens=max_new_tokens, **kw)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def collect(responses):
    toks, text, last = [], "", None
    for r in responses:
        toks += r.token_ids
        text += r.text
        last = r
    return toks, text, last


async def read_rest(call) -> list:
    """The remaining responses of an aio call read with `call.read()` (the two APIs may not be mixed)."""
    out = []
    while (r := await call.read()) is not grpc.aio.EOF:
        out.append(r)
    return out


def info(target, check=True):
    with grpc.insecure_channel(target) as ch:
        return pb.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(check_invariants=check), metadata=MD, timeout=60)


def wait_idle(target, timeout=60):
    """GetModelInfo (with the invariant check) once no request runs or waits and no stream is open."""
    deadline = time.monotonic() + timeout
    while True:
        i = info(target)
        s = i.stats
        if (s.running == 0 and s.waiting == 0 and s.streams == 0) or time.monotonic() > deadline:
            return i
        time.sleep(0.2)


def assert_clean(target):
    i = wait_idle(target)
    assert i.invariants.ok, i.invariants.error
    s = i.stats
    assert (s.running, s.waiting, s.streams, s.pages_running, s.slots_running) == (0, 0, 0, 0, 0), s
    assert s.pages_free + s.pages_cached == s.pages_total
    return i


def test_checked_in_descriptor_matches_the_proto():
    """serve/_descriptor.py is what `python -m serve.protogen` writes from the .proto today."""
    pytest.importorskip("grpc_tools")
    from serve import protogen

    with open(protogen.DESCRIPTOR_MODULE) as f:
        assert f.read() == protogen.descriptor_module_source(protogen.compile_descriptor()), \
            "serve/_descriptor.py is stale: run python -m serve.protogen"
    assert {m.name for m in pb.SERVICE.methods} == {"Generate", "Abort", "GetModelInfo"}


# ---- start-up ----------------------------------------------------------------------------------
def test_health_not_serving_until_warm_then_serving(server):
    assert server.statuses[0] == NOT_SERVING and server.statuses[-1] == SERVING, server.statuses
    assert server.warmup_generate_code in (grpc.StatusCode.UNAVAILABLE, None)  # None: warmed up before the try
    with grpc.insecure_channel(server.target) as ch:  # health needs no API key
        stub = health_pb2_grpc.HealthStub(ch)
        assert stub.Check(health_pb2.HealthCheckRequest(service="k3jax.v1.Generation"), timeout=10).status == SERVING
    log = server.log()
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} INFO k3jax\.serve: ready", log, re.M), log


def test_model_info(server):
    i = info(server.target, check=False)
    assert i.ready and i.model == "k3-tiny" and i.config.name == "k3-tiny" and i.config.vocab_size == 512
    assert json.loads(i.config.config_json)["num_layers"] == i.config.num_layers
    assert (i.limits.max_seq_len, i.limits.max_new_tokens, i.limits.max_running) == (256, 255, 8)
    assert i.limits.max_message_bytes == MAX_MSG and i.limits.kv_pages > 0 and i.limits.state_slots > 0
    assert i.features.text_prompts and i.features.stop_token_ids and i.features.prefix_cache and i.features.overlap
    assert i.features.ignore_eos and i.features.min_p and i.features.logprobs and i.features.penalties
    assert not i.HasField("invariants")


# ---- correctness -------------------------------------------------------------------------------
def test_streamed_tokens_equal_llm_generate(server, reference):
    with grpc.insecure_channel(server.target) as ch:
        stub = pb.GenerationStub(ch)
        for i, (prompt, ref) in enumerate(zip(PROMPTS, reference)):
            toks, text, last = collect(stub.Generate(request(prompt, request_id=f"seq-{i}"), metadata=MD, timeout=120))
            assert toks == ref.token_ids, i
            assert text == ref.text, i
            assert last.request_id == f"seq-{i}"
            assert last.finish_reason == {"length": pb.FINISH_REASON_LENGTH, "eos": pb.FINISH_REASON_EOS}[ref.finish_reason]
            assert last.usage.prompt_tokens == len(ref.prompt_token_ids)
            assert last.usage.completion_tokens == len(ref.token_ids)
    assert_clean(server.target)


def test_64_concurrent_streams(server, reference):
    async def main():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = pb.GenerationStub(ch)

            async def one(i):
                toks, last = [], None
                async for r in stub.Generate(request(PROMPTS[i % 8], request_id=f"c-{i}"), metadata=MD, timeout=300):
                    toks += r.token_ids
                    last = r
                return toks, last
            return await asyncio.gather(*(one(i) for i in range(64)))

    t = time.perf_counter()
    outs = asyncio.run(main())
    dt = time.perf_counter() - t
    for i, (toks, last) in enumerate(outs):
        assert toks == reference[i % 8].token_ids, i
        assert last.request_id == f"c-{i}" and last.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert sum(last.usage.cached_tokens for _, last in outs) > 0  # repeats of the long prompts hit the cache
    assert_clean(server.target)
    print(f"64 streams in {dt:.1f} s")


def test_stop_token_ids(server, reference):
    """A stop token id ends the stream at its first occurrence (the engine stops the request there), with
    ignore_eos set or not (the server's model never reaches its EOS in these prompts)."""
    assert reference[1].finish_reason == "length"  # no EOS in the reference: ignore_eos changes nothing here
    ref = reference[1].token_ids
    stop = ref[2]
    want = ref[: ref.index(stop) + 1]
    with grpc.insecure_channel(server.target) as ch:
        for ignore_eos in (False, True):
            req = request(PROMPTS[1], stop_token_ids=[stop, stop], ignore_eos=ignore_eos)
            toks, _, last = collect(pb.GenerationStub(ch).Generate(req, metadata=MD, timeout=120))
            assert toks == want
            assert last.finish_reason == pb.FINISH_REASON_STOP and last.usage.completion_tokens == len(want)
    assert_clean(server.target)


def test_min_p(server, reference):
    """sampling.min_p reaches the engine: at min_p 1 only the top token is kept, so temperature 50 gives the
    greedy stream."""
    req = request(PROMPTS[2], sampling=pb.SamplingParams(temperature=50.0, min_p=1.0, seed=9))
    with grpc.insecure_channel(server.target) as ch:
        toks, _, last = collect(pb.GenerationStub(ch).Generate(req, metadata=MD, timeout=120))
    assert toks == reference[2].token_ids and last.finish_reason == pb.FINISH_REASON_LENGTH
    assert_clean(server.target)


def test_logprobs(server, reference_llm):
    """GenerateRequest.logprobs: one TokenLogprobs per streamed token, the token's log-probability and the N most
    likely (most likely first), as `LLM.generate` gives them."""
    from k3jax import SamplingParams

    want = reference_llm.generate([PROMPTS[3]], SamplingParams(max_new_tokens=MNT, logprobs=3))[0]
    with grpc.insecure_channel(server.target) as ch:
        resps = list(pb.GenerationStub(ch).Generate(request(PROMPTS[3], logprobs=3), metadata=MD, timeout=120))
    toks = [t for r in resps for t in r.token_ids]
    lps = [lp for r in resps for lp in r.logprobs]
    assert toks == want.token_ids and len(lps) == len(toks)
    for t, lp, entry in zip(toks, lps, want.logprobs):
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:3]
        assert list(lp.top_ids) == [k for k, _ in top] and lp.logprob == pytest.approx(entry[t], abs=1e-4)
        assert list(lp.top_logprobs) == pytest.approx([v for _, v in top], abs=1e-4)
        assert lp.top_logprobs[0] >= lp.top_logprobs[-1]
    assert_clean(server.target)


def test_penalties(server, reference, reference_llm):
    """sampling.repetition_penalty / presence_penalty / frequency_penalty and logit_bias reach the engine: the stream
    is `LLM.generate`'s with the same penalties and bias, and differs from the greedy one."""
    from k3jax import SamplingParams

    kw = dict(repetition_penalty=0.4, presence_penalty=-2.0, frequency_penalty=-1.5)
    bias = {reference[1].token_ids[0]: -100.0, 65: 3.0}  # ban the greedy first token
    with grpc.insecure_channel(server.target) as ch:
        for k, b in ((kw, None), ({}, bias), (kw, bias)):
            want = reference_llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=MNT, logit_bias=b, **k))[0]
            toks, _, _ = collect(pb.GenerationStub(ch).Generate(request(PROMPTS[1], sampling=pb.SamplingParams(
                logit_bias=b, **k)), metadata=MD, timeout=120))
            assert toks == want.token_ids and toks != reference[1].token_ids
    assert info(server.target, check=False).features.logit_bias
    assert_clean(server.target)


PH = 259  # k3-tiny's media placeholder token
IMAGE = np.random.default_rng(11).integers(0, 256, (70, 98, 3), dtype=np.uint8)  # 5 x 7 patches -> 2 x 3 tokens


def _raw(a):
    return pb.Image(raw=pb.RawImage(height=a.shape[0], width=a.shape[1], rgb=a.tobytes()))


def test_images(server, reference_llm):
    """GenerateRequest.images (raw RGB and a PNG file's bytes, the same pixels) give `LLM.generate`'s tokens for
    the image prompt; ModelInfo announces vision and the placeholder id."""
    import io

    from PIL import Image

    from k3jax import SamplingParams

    buf = io.BytesIO()
    Image.fromarray(IMAGE).save(buf, format="PNG")
    prompt = PROMPTS[1][:9] + [PH] + PROMPTS[1][9:]
    want = reference_llm.generate(prompt, SamplingParams(max_new_tokens=MNT), images=[IMAGE])[0]
    assert want.token_ids != reference_llm.generate(prompt, SamplingParams(max_new_tokens=MNT),
                                                    images=[IMAGE[::-1].copy()])[0].token_ids
    i = info(server.target, check=False)
    assert i.features.vision and i.config.media_placeholder_token_id == PH
    with grpc.insecure_channel(server.target) as ch:
        stub = pb.GenerationStub(ch)
        for img in (_raw(IMAGE), pb.Image(encoded=buf.getvalue())):
            toks, _, last = collect(stub.Generate(request(prompt, images=[img]), metadata=MD, timeout=120))
            assert toks == want.token_ids
            assert last.usage.prompt_tokens == len(want.prompt_token_ids)
    assert_clean(server.target)


TOOLS = [{"type": "function", "function": {"name": "f"}}]  # short: the conversation fits max_seq_len 256


def _conversation():
    """A conversation with every message kind, and its GenerateRequest.chat form (the image as raw RGB)."""
    conv = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image", "image": IMAGE}, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": None, "reasoning_content": "look it up", "tool_calls": [
                {"id": "functions.f:0", "type": "function", "function": {"name": "f", "arguments": '{"q": 1}'}}]},
            {"role": "tool", "tool_call_id": "functions.f:0", "content": "a cat"}]
    chat = pb.Chat(tools_json=json.dumps(TOOLS))
    chat.messages.add(role="system", content="Be brief.")
    user = chat.messages.add(role="user")
    user.parts.add(image=_raw(IMAGE))
    user.parts.add(text="What is it?")
    chat.messages.add(role="assistant", reasoning_content="look it up").tool_calls.add(
        id="functions.f:0", name="f", arguments='{"q": 1}')
    chat.messages.add(role="tool", tool_call_id="functions.f:0", content="a cat")
    return conv, chat


def test_chat(server, reference_llm):
    """GenerateRequest.chat gives `LLM.chat`'s greedy reply for the same conversation (images, tool calls, tool
    results, declared tools), and the last response carries it parsed."""
    from k3jax import SamplingParams
    from k3jax.xtml import TOOLS_BEGIN

    conv, chat = _conversation()
    cases = [(conv, chat), ([{"role": "user", "content": "Hi there"}], pb.Chat(messages=[pb.ChatMessage(
        role="user", content="Hi there")]))]
    assert info(server.target, check=False).features.chat
    with grpc.insecure_channel(server.target) as ch:
        stub = pb.GenerationStub(ch)
        for i, (msgs, c) in enumerate(cases):
            want = reference_llm.chat(msgs, SamplingParams(max_new_tokens=MNT), tools=TOOLS if i == 0 else None)[0]
            toks, text, last = collect(stub.Generate(pb.GenerateRequest(chat=c, max_new_tokens=MNT), metadata=MD,
                                                     timeout=120))
            assert toks == want.token_ids
            assert last.usage.prompt_tokens == len(want.prompt_token_ids)
            r = want.message
            assert (last.reply.content, last.reply.HasField("reasoning_content")) == (r.content,
                                                                                      r.reasoning_content is not None)
            assert [(t.id, t.name, t.arguments) for t in last.reply.tool_calls] == [
                (t.id, t.name, t.arguments) for t in r.tool_calls]
            tb = reference_llm.tokenizer.special_tokens[TOOLS_BEGIN]  # the streamed text stops at a tool-call section
            assert text == reference_llm.tokenizer.decode(toks[: toks.index(tb)] if tb in toks else toks)
    assert_clean(server.target)


# ---- bad input ---------------------------------------------------------------------------------
def _bad_cases():
    empty_ids = pb.GenerateRequest(max_new_tokens=4)
    empty_ids.token_ids.SetInParent()
    return [
        ("no prompt", pb.GenerateRequest(max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        ("empty text", pb.GenerateRequest(text="", max_new_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "prompt.text"),
        ("empty ids", empty_ids, grpc.StatusCode.INVALID_ARGUMENT, "prompt.token_ids"),
        ("id >= vocab", request([1, 512, 3]), grpc.StatusCode.INVALID_ARGUMENT, "prompt.token_ids"),
        ("negative id", request([-1]), grpc.StatusCode.INVALID_ARGUMENT, "prompt.token_ids"),
        ("prompt > context", request([1] * 256), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        ("prompt + new > context", request([1] * 250, max_new_tokens=10), grpc.StatusCode.INVALID_ARGUMENT,
         "max_new_tokens"),
        ("max_new_tokens 0", request([1], max_new_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        ("max_new_tokens < 0", request([1], max_new_tokens=-3), grpc.StatusCode.INVALID_ARGUMENT, "max_new_tokens"),
        ("max_new_tokens > limit", request([1], max_new_tokens=1000), grpc.StatusCode.INVALID_ARGUMENT,
         "max_new_tokens"),
        ("temperature < 0", request([1], sampling=pb.SamplingParams(temperature=-0.5)),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
        ("temperature NaN", request([1], sampling=pb.SamplingParams(temperature=math.nan)),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
        ("top_p 0", request([1], sampling=pb.SamplingParams(top_p=0.0)), grpc.StatusCode.INVALID_ARGUMENT,
         "sampling.top_p"),
        ("top_p > 1", request([1], sampling=pb.SamplingParams(top_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT,
         "sampling.top_p"),
        ("top_p NaN", request([1], sampling=pb.SamplingParams(top_p=math.nan)), grpc.StatusCode.INVALID_ARGUMENT,
         "sampling.top_p"),
        ("top_k < 0", request([1], sampling=pb.SamplingParams(top_k=-1)), grpc.StatusCode.INVALID_ARGUMENT,
         "sampling.top_k"),
        ("min_p < 0", request([1], sampling=pb.SamplingParams(min_p=-0.1)), grpc.StatusCode.INVALID_ARGUMENT,
         "sampling.min_p"),
        ("min_p > 1", request([1], sampling=pb.SamplingParams(min_p=1.5)), grpc.StatusCode.INVALID_ARGUMENT,
         "sampling.min_p"),
        ("min_p NaN", request([1], sampling=pb.SamplingParams(min_p=math.nan)), grpc.StatusCode.INVALID_ARGUMENT,
         "sampling.min_p"),
        ("logprobs > 20", request([1], logprobs=21), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
        ("repetition_penalty 0", request([1], sampling=pb.SamplingParams(repetition_penalty=0.0)),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.repetition_penalty"),
        ("repetition_penalty inf", request([1], sampling=pb.SamplingParams(repetition_penalty=math.inf)),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.repetition_penalty"),
        ("presence_penalty > 2", request([1], sampling=pb.SamplingParams(presence_penalty=2.5)),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.presence_penalty"),
        ("frequency_penalty NaN", request([1], sampling=pb.SamplingParams(frequency_penalty=math.nan)),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.frequency_penalty"),
        ("empty stop string", request([1], stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
        ("logit_bias id", request([1], sampling=pb.SamplingParams(logit_bias={512: 1.0})),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.logit_bias: unknown token ids [512]"),
        ("logit_bias value", request([1], sampling=pb.SamplingParams(logit_bias={5: 150.0})),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.logit_bias[5]"),
        ("unknown stop id", request([1], stop_token_ids=[9999]), grpc.StatusCode.INVALID_ARGUMENT, "stop_token_ids"),
        ("oversized message", request("x" * (MAX_MSG + 1000)), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
        ("long text prompt (tokenized off the event loop)", request("y" * 20000), grpc.StatusCode.INVALID_ARGUMENT,
         "prompt"),
        ("placeholder without image", request([1, PH, 2]), grpc.StatusCode.INVALID_ARGUMENT, "media placeholder"),
        ("image without placeholder", request([1, 2], images=[_raw(IMAGE)]), grpc.StatusCode.INVALID_ARGUMENT,
         "images: the prompt holds 0 media placeholder"),
        ("raw image size", request([PH], images=[pb.Image(raw=pb.RawImage(height=4, width=4, rgb=b"x" * 47))]),
         grpc.StatusCode.INVALID_ARGUMENT, "images[0].raw.rgb"),
        ("undecodable image", request([PH], images=[pb.Image(encoded=b"not an image")]), grpc.StatusCode.INVALID_ARGUMENT,
         "images[0].encoded"),
        ("empty image", request([PH], images=[pb.Image()]), grpc.StatusCode.INVALID_ARGUMENT, "images[0] is empty"),
        ("chat without messages", chat_request(), grpc.StatusCode.INVALID_ARGUMENT, "chat.messages is empty"),
        ("chat role", chat_request(pb.ChatMessage(role="robot", content="x")), grpc.StatusCode.INVALID_ARGUMENT,
         "chat.messages[0].role"),
        ("chat tool without id", chat_request(pb.ChatMessage(role="user", content="x"), pb.ChatMessage(role="tool",
                                              content="r")), grpc.StatusCode.INVALID_ARGUMENT, "tool_call_id"),
        ("chat tools_json", chat_request(pb.ChatMessage(role="user", content="x"), tools_json="[{"),
         grpc.StatusCode.INVALID_ARGUMENT, "chat.tools_json"),
        ("chat empty part", chat_request(pb.ChatMessage(role="user", parts=[pb.ContentPart()])),
         grpc.StatusCode.INVALID_ARGUMENT, "chat.messages[0].parts[0] is empty"),
        ("chat bad image", chat_request(pb.ChatMessage(role="user", parts=[pb.ContentPart(image=pb.Image(
            encoded=b"??"))])), grpc.StatusCode.INVALID_ARGUMENT, "chat.messages[0].parts[0].image.encoded"),
        ("chat + images", chat_request(pb.ChatMessage(role="user", content="x"), images=[_raw(IMAGE)]),
         grpc.StatusCode.INVALID_ARGUMENT, "chat.messages[].parts"),
        ("chat too long", chat_request(pb.ChatMessage(role="user", content="z" * 300)), grpc.StatusCode.INVALID_ARGUMENT,
         "prompt"),
    ]


def chat_request(*messages, tools_json="", **kw):
    return pb.GenerateRequest(chat=pb.Chat(messages=messages, tools_json=tools_json), max_new_tokens=4, **kw)


def test_bad_input_refused_and_others_unaffected(server, reference):
    async def main():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = pb.GenerationStub(ch)

            async def good():
                toks = []
                async for r in stub.Generate(request(PROMPTS[6], request_id="good"), metadata=MD, timeout=120):
                    toks += r.token_ids
                return toks

            good_task = asyncio.ensure_future(good())
            results = []
            for name, req, code, field in _bad_cases():
                try:
                    async for _ in stub.Generate(req, metadata=MD, timeout=60):
                        pass
                    results.append((name, None, ""))
                except grpc.aio.AioRpcError as e:
                    results.append((name, e.code(), e.details() or ""))
            # duplicate id: a live request holds "dup"
            live = stub.Generate(request(PROMPTS[0], max_new_tokens=200, request_id="dup"), metadata=MD, timeout=120)
            await live.read()
            try:
                async for _ in stub.Generate(request(PROMPTS[1], request_id="dup"), metadata=MD, timeout=60):
                    pass
                results.append(("duplicate id", None, ""))
            except grpc.aio.AioRpcError as e:
                results.append(("duplicate id", e.code(), e.details() or ""))
            live.cancel()
            return results, await good_task

    results, good = asyncio.run(main())
    cases = {name: (code, field) for name, _, code, field in _bad_cases()}
    cases["duplicate id"] = (grpc.StatusCode.ALREADY_EXISTS, "request_id")
    for name, code, details in results:
        want, field = cases[name]
        assert code == want, (name, code, details)
        assert field in details, (name, details)
    assert good == reference[6].token_ids
    with grpc.insecure_channel(server.target) as ch:
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING
        toks, _, _ = collect(pb.GenerationStub(ch).Generate(request(PROMPTS[2]), metadata=MD, timeout=60))
    assert toks == reference[2].token_ids
    assert_clean(server.target)


# ---- the OpenAI-compatible HTTP API ------------------------------------------------------------
def http(server, path, body=None, key=KEY, raw=False, timeout=120):
    """(status, parsed JSON body) of one HTTP call; raw: (status, the body text) (server-sent events)."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(server.http + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    return status, (text if raw else json.loads(text))


def events(text):
    """The JSON chunks of a server-sent event stream, which must end with `data: [DONE]`."""
    blocks = [b for b in text.split("\n\n") if b]
    assert blocks[-1] == "data: [DONE]", text[-300:]
    return [json.loads(b.removeprefix("data: ")) for b in blocks[:-1]]


def test_openai_completions(server, reference, reference_llm):
    """/v1/completions (token-id and text prompts, greedy) gives `LLM.generate`'s text and usage, streamed or not;
    logprobs are the engine's; /health and /v1/models answer."""
    from k3jax import SamplingParams

    assert http(server, "/health", key=None) == (200, {"status": "ok"})
    st, models = http(server, "/v1/models")
    assert st == 200 and [m["id"] for m in models["data"]] == ["k3-tiny"]
    for i in (0, 3):
        want = reference[i]
        body = {"model": "k3-tiny", "prompt": PROMPTS[i], "max_tokens": MNT, "temperature": 0}
        st, out = http(server, "/v1/completions", body)
        assert st == 200, out
        c = out["choices"][0]
        assert c["text"] == want.text and c["finish_reason"] == {"length": "length", "eos": "stop"}[want.finish_reason]
        assert out["usage"]["prompt_tokens"] == len(PROMPTS[i]) if i == 0 else out["usage"]["prompt_tokens"] > 0
        assert out["usage"]["completion_tokens"] == len(want.token_ids) and out["object"] == "text_completion"
        st, text = http(server, "/v1/completions", body | {"stream": True, "stream_options": {"include_usage": True}},
                        raw=True)
        chunks = events(text)
        assert st == 200 and "".join(ch["choices"][0]["text"] for ch in chunks[:-1]) == want.text
        usage = chunks[-1]["usage"]  # (its cached_tokens may grow: the first call left the prompt in the cache)
        assert chunks[-2]["choices"][0]["finish_reason"] == c["finish_reason"] and chunks[-1]["choices"] == []
        assert [usage[k] for k in ("prompt_tokens", "completion_tokens")] == [out["usage"][k] for k in
                                                                               ("prompt_tokens", "completion_tokens")]
    ref = reference_llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=MNT, logprobs=2))[0]
    st, out = http(server, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": MNT, "temperature": 0, "logprobs": 2})
    lp = out["choices"][0]["logprobs"]
    np.testing.assert_allclose(lp["token_logprobs"], [e[t] for t, e in zip(ref.token_ids, ref.logprobs)], rtol=1e-5)
    assert all(len(t) == 2 for t in lp["top_logprobs"]) and len(lp["tokens"]) == len(ref.token_ids)
    assert_clean(server.target)


def test_openai_chat(server, reference_llm):
    """/v1/chat/completions with an image (a data: URL), a tool call, its result and declared tools gives
    `LLM.chat`'s reply (content, tool calls, finish reason, usage); streamed, the role comes first and the deltas add
    up to the same reply."""
    import io

    from PIL import Image

    from k3jax import SamplingParams

    conv, _ = _conversation()
    buf = io.BytesIO()
    Image.fromarray(IMAGE).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    sent = [dict(m) for m in conv]
    sent[1] = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                           {"type": "text", "text": "What is it?"}]}
    want = reference_llm.chat(conv, SamplingParams(max_new_tokens=MNT), tools=TOOLS)[0]
    body = {"messages": sent, "tools": TOOLS, "max_tokens": MNT, "temperature": 0}
    st, out = http(server, "/v1/chat/completions", body)
    assert st == 200, out
    msg, r = out["choices"][0]["message"], want.message
    assert msg["role"] == "assistant" and msg["content"] == r.content
    assert msg.get("tool_calls", []) == [c.to_dict() for c in r.tool_calls]
    assert out["choices"][0]["finish_reason"] == ("tool_calls" if r.tool_calls else
                                                  {"length": "length", "eos": "stop", "stop": "stop"}[want.finish_reason])
    assert out["usage"]["completion_tokens"] == len(want.token_ids)
    assert out["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    st, text = http(server, "/v1/chat/completions", body | {"stream": True}, raw=True)
    chunks = events(text)
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert deltas[0]["role"] == "assistant" and chunks[-1]["choices"][0]["finish_reason"] == \
        out["choices"][0]["finish_reason"]
    assert "".join(d.get("content", "") for d in deltas) == r.content
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (r.reasoning_content or "")
    assert_clean(server.target)


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/v1/completions", b"{not json", 400, None, "not JSON"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "n", "only 1"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, 400, "max_tokens", "server limit"),
    ("/v1/completions", {"prompt": [1, 2], "logit_bias": {"x": 1}}, 400, "logit_bias", "token ids"),
    ("/v1/completions", {"prompt": [1, 2], "logit_bias": {"5": 300}}, 400, "logit_bias", "logit_bias[5]"),
    ("/v1/completions", {"prompt": [1] * 300}, 400, None, "max_seq_len"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model", "not served here"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "non-empty"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages", "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}, 400, "messages", "data: URLs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "tool_choice", "auto"),
])
def test_openai_bad_input(server, path, body, status, param, words):
    st, out = http(server, path, body)
    assert st == status and out["error"]["param"] == param and words in out["error"]["message"], out


def test_openai_auth_and_disconnect(server):
    """Without the API key: 401 (health stays open). A client that disconnects mid-stream aborts its request: no
    running request, page or slot is left."""
    import socket

    st, out = http(server, "/v1/models", key=None)
    assert st == 401 and out["error"]["type"] == "authentication_error"
    host, port = server.http.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"prompt": PROMPTS[4], "max_tokens": 150, "stream": True, "ignore_eos": True}).encode()
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while b"data: {" not in got:  # until the first chunk arrived
            got += sock.recv(65536)
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
    assert_clean(server.target)


# ---- cancellation and abort --------------------------------------------------------------------
def test_cancel_and_disconnect_free_resources(server):
    # cancel: the client cancels the call after a few tokens
    with grpc.insecure_channel(server.target) as ch:
        call = pb.GenerationStub(ch).Generate(request(PROMPTS[4], max_new_tokens=150, request_id="cancel-me"),
                                              metadata=MD, timeout=120)
        got = [next(call) for _ in range(3)]
        assert all(r.request_id == "cancel-me" for r in got)
        call.cancel()
    # disconnect: the client's connection goes away mid-stream
    ch = grpc.insecure_channel(server.target)
    it = pb.GenerationStub(ch).Generate(request(PROMPTS[7], max_new_tokens=150), metadata=MD, timeout=120)
    next(it), next(it)
    ch.close()
    i = assert_clean(server.target)
    assert i.stats.counters["computed_tokens"] > 0


def test_abort_rpc(server):
    async def main():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = pb.GenerationStub(ch)
            call = stub.Generate(request(PROMPTS[3], max_new_tokens=150, request_id="abort-me"), metadata=MD, timeout=120)
            await call.read()
            found = (await stub.Abort(pb.AbortRequest(request_id="abort-me"), metadata=MD, timeout=30)).found
            missing = (await stub.Abort(pb.AbortRequest(request_id="no-such-id"), metadata=MD, timeout=30)).found
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Abort(pb.AbortRequest(), metadata=MD, timeout=30)
            rest = await read_rest(call)
            return found, missing, rest, e.value

    found, missing, rest, empty = asyncio.run(main())
    assert found and not missing
    assert empty.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in empty.details()
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT and rest[-1].usage.completion_tokens < 150
    assert_clean(server.target)


# ---- api key, reflection, metrics --------------------------------------------------------------
def test_api_key_required(server):
    with grpc.insecure_channel(server.target) as ch:
        stub = pb.GenerationStub(ch)
        for md in ((), (("authorization", "Bearer wrong"),), (("x-api-key", "nope"),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request(PROMPTS[0]), metadata=md, timeout=30))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md, timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        toks, _, _ = collect(stub.Generate(request(PROMPTS[0]), metadata=(("x-api-key", KEY),), timeout=60))
        assert len(toks) == MNT
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == SERVING


def test_reflection_lists_the_service(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    from serve.client import connect

    ch = connect(server.target, api_key=KEY)
    try:
        db = ProtoReflectionDescriptorDatabase(ch)
        services = set(db.get_services())
        assert {"k3jax.v1.Generation", "grpc.health.v1.Health"} <= services
        fdp = db.FindFileContainingSymbol("k3jax.v1.Generation")
        assert fdp.package == "k3jax.v1"
        assert {m.name for m in fdp.service[0].method} == {"Generate", "Abort", "GetModelInfo"}
    finally:
        ch.close()


def test_metrics_endpoint(server):
    with grpc.insecure_channel(server.target) as ch:  # a prefix-cache hit: the second run restores the first's prefix
        for _ in range(2):
            collect(pb.GenerationStub(ch).Generate(request(PROMPTS[4]), metadata=MD, timeout=60))
        with pytest.raises(grpc.RpcError):  # and a refused call, counted by code (whether or not other tests ran)
            collect(pb.GenerationStub(ch).Generate(request([1], sampling=pb.SamplingParams(top_k=-1)), metadata=MD,
                                                   timeout=60))
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).read().decode()
    for name in METRIC_NAMES:
        assert re.search(rf"^{name}(_bucket|_count|_sum)?({{.*}})? ", text, re.M), name

    def value(name):
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))

    assert value("k3jax_time_to_first_token_seconds_count") >= 2
    assert value("k3jax_generation_tokens_total") >= 2 * MNT
    assert 0 < value("k3jax_cache_hit_rate") < 1
    assert value("k3jax_ready") == 1 and value("k3jax_num_running_reqs") == 0
    assert value("k3jax_engine_steps_total") >= 2 * MNT  # each streamed token took a step
    assert value("k3jax_engine_step_host_seconds_total") > 0 and value("k3jax_engine_step_wait_seconds_total") > 0
    assert re.search(r'^k3jax_request_errors_total\{code="INVALID_ARGUMENT"\} [1-9]', text, re.M)


# ---- command lines -----------------------------------------------------------------------------
def test_client_cli(server, reference, reference_llm, capsys, tmp_path):
    from k3jax import SamplingParams
    from serve.client import main

    base = ["--target", server.target, "--api-key", KEY]
    assert main(["--target", server.target, "health"]) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    ids = ",".join(map(str, PROMPTS[0]))
    assert main(base + ["generate", "--token-ids", ids, "--max-new-tokens", str(MNT), "--ids", "--ignore-eos"]) == 0
    out = capsys.readouterr()
    assert [int(t) for t in out.out.split()] == reference[0].token_ids
    assert "length" in out.err and f"generated {MNT}" in out.err
    assert main(base + ["generate", "--prompt", PROMPTS[3], "--max-new-tokens", str(MNT)]) == 0
    assert capsys.readouterr().out == reference[3].text + "\n"
    pen = ["--repetition-penalty", "0.4", "--presence-penalty", "-2", "--frequency-penalty", "-1.5"]
    assert main(base + ["generate", "--token-ids", ids, "--max-new-tokens", str(MNT), "--ids", *pen]) == 0
    want = reference_llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=MNT, repetition_penalty=0.4,
                                                                presence_penalty=-2.0, frequency_penalty=-1.5))[0]
    assert [int(t) for t in capsys.readouterr().out.split()] == want.token_ids
    want = reference_llm.chat([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
                              SamplingParams(max_new_tokens=MNT))[0]
    assert main(base + ["generate", "--chat", "--system", "S", "--prompt", "Hi", "--max-new-tokens", str(MNT), "--ids"]) == 0
    assert [int(t) for t in capsys.readouterr().out.split()] == want.token_ids
    conv, _ = _conversation()
    np.save(tmp_path / "img.npy", IMAGE)
    conv[1]["content"][0] = {"type": "image_url", "image_url": {"url": str(tmp_path / "img.npy")}}
    (tmp_path / "conv.json").write_text(json.dumps(conv))
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    conv[1]["content"][0] = {"type": "image", "image": IMAGE}
    want = reference_llm.chat(conv, SamplingParams(max_new_tokens=MNT), tools=TOOLS)[0]
    assert main(base + ["generate", "--messages", str(tmp_path / "conv.json"), "--tools", str(tmp_path / "tools.json"),
                        "--max-new-tokens", str(MNT), "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [int(t) for x in lines for t in x.get("token_ids", [])] == want.token_ids
    assert lines[-1]["reply"].get("content", "") == want.message.content
    assert main(base + ["generate", "--system", "S", "--prompt", "Hi"]) == 2
    assert "--system and --tools need --chat" in capsys.readouterr().err
    assert main(base + ["info"]) == 0
    assert json.loads(capsys.readouterr().out)["limits"]["max_seq_len"] == 256
    for argv in (base + ["generate", "--prompt", "hi", "--temperature", "-1"],  # refused by the server
                 ["--target", server.target, "generate", "--prompt", "hi"],  # no API key
                 ["--target", "127.0.0.1:1", "--timeout", "3", "info"]):  # nothing listens there
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err, err


def test_cli_help_explains_every_flag():
    import argparse

    from serve import client, server

    def actions(parser):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    yield from actions(sub)
            elif not isinstance(a, argparse._HelpAction):
                yield a

    for parser in (server.build_parser(), client.build_parser()):
        missing = [a.dest for a in actions(parser) if not a.help]
        assert not missing, missing


def test_serve_cli_user_errors(capsys, monkeypatch):
    from k3jax.engine.engine import EngineConfig
    from serve.server import main

    def not_built(self):  # what EngineConfig.validate raises for an engine option that has not landed
        if self.speculative or self.enable_unified_memory:
            raise NotImplementedError(f"{'speculative decoding' if self.speculative else 'enable_unified_memory'} "
                                      "lands with a later issue")

    monkeypatch.setattr(EngineConfig, "validate", not_built)
    for argv, word in ((["--model", "k3-tiny", "--speculative", "ngram"], "--speculative"),
                       (["--model", "k3-tiny", "--enable-unified-memory"], "--enable-unified-memory"),
                       (["--model", "no-such-preset"], "--model"),
                       (["--model", "k3-tiny", "--max-new-tokens-limit", "5000"], "--max-new-tokens-limit")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("k3jax-serve: error:") and err.count("\n") == 1 and word in err, err
    monkeypatch.undo()
    assert main(["--model", "k3-tiny", "--prefill-chunk", "100"]) == 2  # EngineConfig.validate's ValueError
    err = capsys.readouterr().err
    assert err.startswith("k3jax-serve: error:") and err.count("\n") == 1 and "prefill_chunk" in err, err
    assert main(["--model", "k3-tiny", "--batch-invariant", "--mesh", "tp=2"]) == 2  # one device only
    err = capsys.readouterr().err
    assert err.startswith("k3jax-serve: error:") and err.count("\n") == 1 and "--batch-invariant" in err, err
    assert main(["--model", "k3-tiny", "--max-running", "16", "--decode-buckets", "1,8"]) == 2  # must end at 16
    err = capsys.readouterr().err
    assert err.startswith("k3jax-serve: error:") and "decode_buckets must end with max_running (16)" in err, err
    with pytest.raises(SystemExit):  # argparse: not integers
        main(["--model", "k3-tiny", "--prefill-buckets", "64,x"])
    assert "comma-separated integers" in capsys.readouterr().err


def test_queue_limit_refuses_with_resource_exhausted():
    from types import SimpleNamespace

    from serve.metrics import Metrics
    from serve.server import GenerationServicer, build_parser

    class Refused(Exception):
        pass

    class Context:
        async def abort(self, code, details):
            raise Refused(code, details)

    args = build_parser().parse_args(["--model", "k3-tiny", "--max-running", "2", "--max-queued-requests", "1"])
    s = GenerationServicer(args, Metrics())
    s.ready, s.engine, s.active = True, SimpleNamespace(error=None), {"a": 0.0, "b": 0.0, "c": 0.0}
    with pytest.raises(Refused) as e:
        asyncio.run(s.Generate(request([1, 2]), Context()))
    assert e.value.args[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queued_requests" in e.value.args[1]


def test_sigterm_drain_timeout_cancels_open_streams(reference, reference_llm, caplog):
    """A stream still open when --drain-timeout runs out is cancelled (its request aborted) and the
    server exits 0. In this process, over the already compiled reference LLM (serve()'s make_llm hook)."""
    from serve.server import build_parser, serve

    # The drain timeout is far shorter than the stream's remaining ~149 tokens take on any machine (the
    # CPU decodes k3-tiny at a few ms a token; with 0.5 s a fast CI run once finished the stream inside it).
    args = build_parser().parse_args(["--model", "k3-tiny", "--port", "0", "--drain-timeout", "0.05",
                                      *SERVER_FLAGS[SERVER_FLAGS.index("--single-bucket"):]])
    caplog.set_level(logging.INFO, logger="k3jax.serve")

    async def main():
        task = asyncio.ensure_future(serve(args, make_llm=lambda: reference_llm))
        try:
            deadline = time.monotonic() + 120
            while not (port := re.search(r"gRPC listening on 127\.0\.0\.1:(\d+)", caplog.text)) or "ready:" not in caplog.text:
                assert not task.done() and time.monotonic() < deadline, caplog.text
                await asyncio.sleep(0.05)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port.group(1)}") as ch:
                call = pb.GenerationStub(ch).Generate(request(PROMPTS[4], max_new_tokens=150, request_id="slow"),
                                                      timeout=120)
                first = await call.read()
                os.kill(os.getpid(), signal.SIGTERM)
                t = time.perf_counter()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await read_rest(call)
                rc = await asyncio.wait_for(task, 60)
            return first, e.value.code(), rc, time.perf_counter() - t
        finally:  # a failure above: stop the server (its SIGTERM handler is installed before "loading")
            if not task.done() and "loading" in caplog.text:
                os.kill(os.getpid(), signal.SIGTERM)
                await asyncio.wait_for(task, 60)

    first, code, rc, dt = asyncio.run(main())
    assert first.request_id == "slow" and len(first.token_ids) >= 1
    assert code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE), code
    assert rc == 0 and dt < 30
    log = caplog.text
    assert "SIGTERM received" in log and "draining: 1 open stream(s)" in log and "stopped" in log, log
    assert "1 stream(s) cancelled" in log, log
    reference_llm.check_invariants()
    assert "slow" not in reference_llm.core.scheduler.requests  # the cancelled stream's request was aborted


# ---- shutdown (stops the shared server: keep last) ---------------------------------------------
def test_sigterm_drains_streams_then_exits_0(server):
    n = 30

    async def main():
        async with grpc.aio.insecure_channel(server.target) as ch:
            stub = pb.GenerationStub(ch)
            call = stub.Generate(request(PROMPTS[5], max_new_tokens=n, request_id="drain"), metadata=MD, timeout=120)
            first = await call.read()
            server.proc.send_signal(signal.SIGTERM)
            rest = await read_rest(call)
            return [first] + rest

    responses = asyncio.run(main())
    last = responses[-1]
    assert last.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)  # completed, not cancelled
    assert sum(len(r.token_ids) for r in responses) == last.usage.completion_tokens
    assert last.finish_reason == pb.FINISH_REASON_EOS or last.usage.completion_tokens == n
    assert server.proc.wait(60) == 0
    log = server.log()
    assert "SIGTERM received" in log and "draining: 1 open stream(s)" in log and "stopped" in log, log
