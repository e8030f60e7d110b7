"""`k3jax-client`: a command-line client of `k3jax-serve`, and `connect()` for Python callers.

    k3jax-client generate --prompt "Hello" --max-new-tokens 16
    k3jax-client health --wait 120
    k3jax-client info

Generated text streams to stdout as it arrives; a summary (finish reason, token usage, time to first
token) goes to stderr. Errors (bad flags, an unreachable server, a refused request) print one line
to stderr and exit 2. `health` exits 0 when the server reports SERVING, 1 otherwise.

    from serve.client import connect
    from serve import pb
    stub = pb.GenerationStub(connect("127.0.0.1:50051", api_key="..."))
    for r in stub.Generate(pb.GenerateRequest(text="Hello", max_new_tokens=8)): print(r.text, end="")
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import sys
import time

import grpc

_EXIT_USAGE = 2
DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


class UserError(Exception):
    """Reported in one line, exit status 2."""


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")), grpc.ClientCallDetails):
    pass


class ApiKeyClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `authorization: Bearer KEY` to every call of a (sync) channel."""

    def __init__(self, key: str):
        self._md = ("authorization", f"Bearer {key}")

    def _details(self, d):
        md = list(d.metadata or []) + [self._md]
        return _Details(d.method, d.timeout, md, d.credentials, getattr(d, "wait_for_ready", None),
                        getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


def connect(target: str = DEFAULT_TARGET, api_key: str | None = None,
            max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.Channel:
    """An insecure (plaintext) channel to `target` that sends `api_key` with every call."""
    ch = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", max_message_bytes),
                                                ("grpc.max_send_message_length", max_message_bytes)])
    return grpc.intercept_channel(ch, ApiKeyClientInterceptor(api_key)) if api_key else ch


# ---- command line ----------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3jax-client", description="Talk to a k3jax-serve gRPC server.")
    p.add_argument("--target", default=os.environ.get("K3JAX_TARGET", DEFAULT_TARGET), metavar="HOST:PORT",
                   help="server address (default: $K3JAX_TARGET, else %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("K3JAX_API_KEY"), metavar="KEY",
                   help="API key sent as 'authorization: Bearer KEY' (default: $K3JAX_API_KEY, else none)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="deadline of each call in seconds (default: %(default)s)")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES, metavar="N",
                   help="largest message sent or received (default: %(default)s)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    g = sub.add_parser("generate", help="stream a completion to stdout",
                       description="Stream the completion of one prompt to stdout; a summary goes to stderr.")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (tokenized by the server)")
    src.add_argument("--token-ids", metavar="IDS", help="prompt token ids, comma- or space-separated")
    src.add_argument("--messages", metavar="FILE",
                     help="a conversation to reply to: a JSON file with a list of OpenAI-style messages (role, content "
                          "as text or parts; image parts {'type': 'image_url', 'image_url': {'url': PATH or data: "
                          "URL}} are read here and sent as image bytes), rendered by the server's chat format")
    g.add_argument("--chat", action="store_true",
                   help="send --prompt as a user message in the model's chat format (with --system, --image) instead "
                        "of raw text; the reply stops at the end of its turn and its tool calls print as JSON lines "
                        "(default: off)")
    g.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message first (default: none)")
    g.add_argument("--tools", default=None, metavar="FILE",
                   help="with --chat or --messages: a JSON file with the OpenAI tool definitions the model may call "
                        "(default: none)")
    g.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                   help="tokens to generate (default: the server's default)")
    g.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="softmax temperature, 0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=None, metavar="P", help="nucleus mass in (0, 1] (default: 1, off)")
    g.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens (default: 0, off)")
    g.add_argument("--min-p", type=float, default=None, metavar="P",
                   help="sample among the tokens at least P times as likely as the most likely one, in [0, 1] "
                        "(default: 0, off)")
    g.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                   help="divide the positive logits (multiply the negative ones) of tokens already in the prompt or "
                        "the output by R > 0 (default: 1, off)")
    g.add_argument("--presence-penalty", type=float, default=None, metavar="P",
                   help="subtract P from the logits of tokens already generated, in [-2, 2] (default: 0, off)")
    g.add_argument("--frequency-penalty", type=float, default=None, metavar="F",
                   help="subtract F times a token's count in the output so far from its logit, in [-2, 2] "
                        "(default: 0, off)")
    g.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed (default: random)")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID=BIAS",
                   help="add BIAS in [-100, 100] to token ID's logit before sampling (repeatable; default: none)")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="finish after the token that completes STR (repeatable)")
    g.add_argument("--stop-token-id", type=int, action="append", default=[], metavar="ID",
                   help="finish after token ID (repeatable)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate past the model's EOS token, up to --max-new-tokens (default: stop at EOS)")
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="ask for each token's log-probability and the N most likely alternatives, in [0, 20]; shown "
                        "with --json (default: none)")
    g.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="an image for a vision model (repeatable, in prompt order; the prompt names each with "
                        "<|media_pad|>): a .npy uint8 [H, W, 3] array is sent raw, any other file as encoded bytes "
                        "that the server decodes (PNG, JPEG, ...)")
    g.add_argument("--request-id", default="", metavar="ID", help="request id (default: assigned by the server)")
    g.add_argument("--add-bos", action="store_true", help="prepend the BOS token to a text prompt (default: off)")
    out = g.add_mutually_exclusive_group()
    out.add_argument("--ids", action="store_true", help="print token ids instead of text (default: text)")
    out.add_argument("--json", action="store_true", help="print every response as one JSON line (default: text)")
    g.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr (default: off)")

    h = sub.add_parser("health", help="print the server's health status (exit 0 if SERVING)",
                       description="Query grpc.health.v1.Health/Check; print SERVING / NOT_SERVING / ...; exit 0 "
                                   "when SERVING, 1 otherwise.")
    h.add_argument("--service", default="", metavar="NAME",
                   help="service to check, e.g. k3jax.v1.Generation (default: '' = the whole server)")
    h.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="poll until SERVING for at most S seconds (default: %(default)s, one check)")

    i = sub.add_parser("info", help="print the model config, limits, features and engine load as JSON",
                       description="Call GetModelInfo and print the answer as JSON.")
    i.add_argument("--check-invariants", action="store_true",
                   help="also run the engine's resource check (servers started with --debug-invariants only)")

    a = sub.add_parser("abort", help="abort a running request by id", description="Call Abort; print found / not found.")
    a.add_argument("request_id", metavar="REQUEST_ID", help="the id of the request to abort")
    return p


def _rpc_error(e: grpc.RpcError) -> UserError:
    code = e.code().name if hasattr(e, "code") and e.code() is not None else "UNKNOWN"
    details = (e.details() if hasattr(e, "details") else str(e)) or ""
    return UserError(f"{code}: {' '.join(details.split())}")


def _read_json(path: str, flag: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{flag} {path}: {e}") from None


def _read_image(img, src: str, where: str):
    """Fill an Image message from a path (a .npy uint8 [H, W, 3] array goes raw, other files as their bytes), a
    file:// URL or a base64 data: URL."""
    try:
        if src.startswith("data:"):
            from k3jax.xtml import data_url_bytes

            img.encoded = data_url_bytes(src)
            return
        path = src.removeprefix("file://")
        if "://" in path:
            raise UserError(f"{where}: {src[:64]!r}: only paths, file:// and data: URLs are read")
        if path.endswith(".npy"):
            import numpy as np

            a = np.load(path)
            if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] != 3:
                raise UserError(f"{where} {path}: a .npy image must be uint8 [H, W, 3], got {a.dtype} {a.shape}")
            img.raw.height, img.raw.width, img.raw.rgb = a.shape[0], a.shape[1], a.tobytes()
        else:
            with open(path, "rb") as f:
                img.encoded = f.read()
    except (OSError, ValueError) as e:
        raise UserError(f"{where} {src[:64]}: {e}") from None


def _add_messages(chat, messages):
    """OpenAI-style messages (parsed JSON) into a Chat message; UserError naming a malformed one."""
    if not isinstance(messages, list) or not messages:
        raise UserError("--messages: expected a non-empty JSON list of messages")
    for i, m in enumerate(messages):
        where = f"--messages [{i}]"
        if not isinstance(m, dict):
            raise UserError(f"{where}: a message is an object with role and content")
        msg = chat.messages.add(role=str(m.get("role", "")), name=m.get("name") or "",
                                tool_call_id=m.get("tool_call_id") or "")
        content = m.get("content")
        if isinstance(content, str):
            msg.content = content
        elif isinstance(content, list):
            for j, p in enumerate(content):
                kind = p.get("type") if isinstance(p, dict) else None
                if kind == "text":
                    msg.parts.add(text=str(p.get("text", "")))
                elif kind in ("image", "image_url"):
                    src = p.get("image") if kind == "image" else p.get("image_url")
                    src = src.get("url") if isinstance(src, dict) else src
                    if not isinstance(src, str):
                        raise UserError(f"{where}.content[{j}]: an image part needs a path or URL")
                    _read_image(msg.parts.add().image, src, f"{where}.content[{j}]")
                else:
                    raise UserError(f"{where}.content[{j}]: a part has type text, image or image_url")
        elif content is not None:
            raise UserError(f"{where}.content must be a string or a list of parts")
        for c in m.get("tool_calls") or ():
            fn = (c or {}).get("function") or {}
            args = fn.get("arguments", "{}")
            msg.tool_calls.add(id=c.get("id") or "", name=str(fn.get("name", "")),
                               arguments=args if isinstance(args, str) else json.dumps(args))
        if m.get("reasoning_content") is not None:
            msg.reasoning_content = str(m["reasoning_content"])


def _generate(args, channel) -> int:
    from serve import pb

    req = pb.GenerateRequest(request_id=args.request_id, add_bos=args.add_bos)
    chat = args.chat or args.messages is not None
    if (args.system or args.tools) and not chat:
        raise UserError("--system and --tools need --chat or --messages")
    if args.chat and args.prompt is None:
        raise UserError("--chat sends --prompt as the user's message: give --prompt")
    if args.messages is not None:
        _add_messages(req.chat, _read_json(args.messages, "--messages"))
    elif args.chat:
        if args.system:
            req.chat.messages.add(role="system", content=args.system)
        user = req.chat.messages.add(role="user")
        for path in args.image:
            _read_image(user.parts.add().image, path, "--image")
        if args.image:
            user.parts.add(text=args.prompt)
        else:
            user.content = args.prompt
    elif args.prompt is not None:
        req.text = args.prompt
    else:
        try:
            ids = [int(x) for x in args.token_ids.replace(",", " ").split()]
        except ValueError:
            raise UserError(f"--token-ids must be integers, got {args.token_ids!r}") from None
        req.token_ids.ids.extend(ids)
        if not ids:
            req.token_ids.SetInParent()
    if args.tools is not None:
        req.chat.tools_json = json.dumps(_read_json(args.tools, "--tools"))
    if args.max_new_tokens is not None:
        req.max_new_tokens = args.max_new_tokens
    for f in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
              "seed"):
        v = getattr(args, f)
        if v is not None:
            if f == "seed" and v < 0:
                raise UserError(f"--seed must be >= 0, got {v}")
            setattr(req.sampling, f, v)
    for path in args.image if not chat else ():
        _read_image(req.images.add(), path, "--image")
    for item in args.logit_bias:
        tid, sep, val = item.partition("=")
        try:
            req.sampling.logit_bias[int(tid)] = float(val)
            if not sep:
                raise ValueError
        except ValueError:
            raise UserError(f"--logit-bias must be ID=BIAS (an integer token id, a number), got {item!r}") from None
    req.stop.extend(args.stop)
    req.stop_token_ids.extend(args.stop_token_id)
    req.ignore_eos = args.ignore_eos
    if args.logprobs is not None:
        req.logprobs = args.logprobs

    from google.protobuf import json_format

    stub = pb.GenerationStub(channel)
    t0 = time.perf_counter()
    first = None
    last = None
    out = sys.stdout
    for r in stub.Generate(req, timeout=args.timeout):
        if first is None and r.token_ids:
            first = time.perf_counter()
        if args.json:
            out.write(json.dumps(json_format.MessageToDict(r, preserving_proto_field_name=True)) + "\n")
        elif args.ids:
            if r.token_ids:
                out.write(" ".join(map(str, r.token_ids)) + " ")
        else:
            out.write(r.text)
        out.flush()
        last = r
    if not args.json:
        out.write("\n")
        if last is not None and last.HasField("reply"):
            for c in last.reply.tool_calls:
                call = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                out.write(json.dumps({"tool_call": call}, ensure_ascii=False) + "\n")
        out.flush()
    if last is not None and not args.quiet:
        u = last.usage
        ttft = f"{first - t0:.3f} s" if first is not None else "-"
        print(f"request {last.request_id}: {pb.FinishReason.Name(last.finish_reason).removeprefix('FINISH_REASON_').lower()}; "
              f"prompt {u.prompt_tokens} tokens ({u.cached_tokens} cached), generated {u.completion_tokens}; "
              f"first token {ttft}, total {time.perf_counter() - t0:.3f} s", file=sys.stderr)
    return 0


def _health(args, channel) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + args.wait
    while True:
        try:
            status = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=min(args.timeout, 10.0)).status
            name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
        except grpc.RpcError as e:
            if time.monotonic() >= deadline:
                raise
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise
            name = None
        if name == "SERVING" or time.monotonic() >= deadline:
            if name is not None:
                print(name)
            return 0 if name == "SERVING" else 1
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def _info(args, channel) -> int:
    from google.protobuf import json_format

    from serve import pb

    info = pb.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(check_invariants=args.check_invariants),
                                                   timeout=args.timeout)
    d = json_format.MessageToDict(info, preserving_proto_field_name=True)
    if d.get("config", {}).get("config_json"):
        d["config"]["config_json"] = json.loads(d["config"]["config_json"])
    print(json.dumps(d, indent=2))
    return 0


def _abort(args, channel) -> int:
    from serve import pb

    found = pb.GenerationStub(channel).Abort(pb.AbortRequest(request_id=args.request_id), timeout=args.timeout).found
    print("aborted" if found else "not found (unknown or already finished)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sys.stdout.reconfigure(errors="replace")
    except (AttributeError, ValueError):
        pass
    try:
        if not (args.timeout > 0 and math.isfinite(args.timeout)):
            raise UserError(f"--timeout must be a positive number, got {args.timeout}")
        if args.max_message_bytes < 1:
            raise UserError(f"--max-message-bytes must be >= 1, got {args.max_message_bytes}")
        channel = connect(args.target, args.api_key, args.max_message_bytes)
        try:
            return {"generate": _generate, "health": _health, "info": _info, "abort": _abort}[args.command](args, channel)
        finally:
            channel.close()
    except grpc.RpcError as e:
        print(f"k3jax-client {args.command}: error: {_rpc_error(e)}", file=sys.stderr)
        return _EXIT_USAGE
    except UserError as e:
        print(f"k3jax-client {args.command}: error: {e}", file=sys.stderr)
        return _EXIT_USAGE
    except ImportError as e:  # e.g. grpcio-health-checking missing
        print(f"k3jax-client {args.command}: error: {e}", file=sys.stderr)
        return _EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
