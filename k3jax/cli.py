"""`k3jax` command line. Subcommands: `generate` (stream a completion for one prompt), `chat` (a multi-turn
conversation in the model's chat format, `k3jax/xtml.py`), `plan` (memory plan and node count of a model on a
mesh, `k3jax/plan.py`).

User errors (unknown preset, missing directory, empty prompt, bad sampling values) print one line
to stderr and exit with status 2; progress goes through `logging` to stderr, generated text to stdout.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import os
import sys
import time

from k3jax.config import BATCH_INVARIANT_ROWS, preset_names
from k3jax.sampling import SamplingParams

log = logging.getLogger("k3jax")

_EXIT_USAGE = 2


class UserError(Exception):
    """A problem with the command line input: reported in one line, no traceback."""


def _bias_pair(text: str) -> tuple[int, float]:
    """`--logit-bias ID=BIAS` -> (ID, BIAS); argparse reports a bad one as a usage error naming the flag."""
    tid, sep, val = text.partition("=")
    try:
        if sep:
            return int(tid), float(val)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"expected ID=BIAS (an integer token id, a number), got {text!r}")


def _add_common_args(p: argparse.ArgumentParser, max_new_tokens: int = SamplingParams.max_new_tokens):
    """The flags `generate` and `chat` share: model, sampling, memory layout, mesh, output."""
    p.add_argument("--model", default="k3-tiny", metavar="PRESET_OR_DIR",
                   help=f"a preset with random weights ({', '.join(preset_names())}) or a checkpoint directory "
                        "(default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N",
                   help="stop after generating N tokens (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=SamplingParams.temperature, metavar="T",
                   help="softmax temperature; 0 means greedy (always the most likely token) (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=SamplingParams.top_p, metavar="P",
                   help="nucleus sampling: sample only from the most likely tokens whose probability "
                        "reaches P, in (0, 1]; 1 disables it (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=SamplingParams.top_k, metavar="K",
                   help="sample only from the K most likely tokens; 0 disables it (default: %(default)s)")
    p.add_argument("--min-p", type=float, default=SamplingParams.min_p, metavar="P",
                   help="sample only from tokens at least P times as likely as the most likely one, in [0, 1]; "
                        "0 disables it (default: %(default)s)")
    p.add_argument("--repetition-penalty", type=float, default=SamplingParams.repetition_penalty, metavar="R",
                   help="divide the positive logits (multiply the negative ones) of tokens already in the prompt or "
                        "the output by R > 0; 1 disables it (default: %(default)s)")
    p.add_argument("--presence-penalty", type=float, default=SamplingParams.presence_penalty, metavar="P",
                   help="subtract P from the logits of tokens already generated, in [-2, 2]; 0 disables it "
                        "(default: %(default)s)")
    p.add_argument("--frequency-penalty", type=float, default=SamplingParams.frequency_penalty, metavar="F",
                   help="subtract F times a token's count in the output so far from its logit, in [-2, 2]; 0 "
                        "disables it (default: %(default)s)")
    p.add_argument("--logit-bias", action="append", default=None, metavar="ID=BIAS", type=_bias_pair,
                   help="add BIAS in [-100, 100] to token ID's logit before sampling (greedy too; repeatable): -100 all "
                        "but bans the token, 100 all but forces it (default: none)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="sampling seed for reproducible output (default: a fresh random seed per run)")
    p.add_argument("--stop", action="append", default=None, metavar="STR",
                   help="stop after the token that completes STR (repeatable; the stop string is printed; default: none)")
    p.add_argument("--stop-token-id", type=int, action="append", default=None, metavar="ID",
                   help="stop after token ID (repeatable; the token is printed; default: none)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the model's EOS token, up to --max-new-tokens (default: stop at EOS)")
    p.add_argument("--page-size", type=int, default=16, metavar="N", help="tokens per MLA KV-cache page (default: %(default)s)")
    p.add_argument("--prefill-chunk", type=int, default=256, metavar="N",
                   help="prompt tokens processed per prefill step (default: %(default)s)")
    p.add_argument("--mesh", default=None, metavar="SPEC",
                   help="run sharded on a device mesh, e.g. tp=2, tp=4,ep=2 or dp=2,tp=2 (axes dp, tp, ep; on CPU "
                        "set XLA_FLAGS=--xla_force_host_platform_device_count=N for N host devices; default: one device)")
    p.add_argument("--show-special", action="store_true",
                   help="print special tokens (e.g. <|eos|>) instead of skipping them (default: off)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress messages and no summary on stderr (default: off)")


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3jax", description="JAX inference for Kimi-K3-class hybrid models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    g = sub.add_parser(
        "generate",
        help="stream a completion of one prompt to stdout",
        description="Generate a completion for one prompt and stream its text to stdout as tokens arrive. "
                    "Progress and a timing summary go to stderr.",
    )
    _add_common_args(g)
    g.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt text (required, not empty)")
    g.add_argument("--speculative", choices=["ngram"], default=None,
                   help="speculative decoding: 'ngram' drafts from earlier occurrences of the context's last "
                        "tokens (prompt lookup), verified in blocks by the model; greedy output is unchanged "
                        "(runs through the engine; default: off)")
    g.add_argument("--num-draft-tokens", type=int, default=4, metavar="N",
                   help="drafts per verify block with --speculative (default: %(default)s)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant steps: every token's logits come out bit for bit the same whatever the "
                        "step it runs in (a prefill, a decode, a --speculative verify block), so --speculative "
                        "never changes greedy output on any backend; row-wise work runs in fixed blocks of "
                        "128 rows (slower; one device only; default: off)")
    g.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image for a vision model (repeatable, in prompt order): a PNG/JPEG (needs Pillow) or a .npy "
                        "uint8 [H, W, 3] array; the prompt names each with <|media_pad|>, or, with none there, the "
                        "images go before the prompt text (runs through the engine; default: none)")
    g.add_argument("--add-bos", action="store_true", help="prepend the BOS token to the prompt (default: off)")
    c = sub.add_parser(
        "chat",
        help="talk with the model in its chat format",
        description="A multi-turn conversation in the model's chat format (the checkpoint's template, else Kimi's): "
                    "each line read from stdin (or each --message) is a user turn, and the reply streams to stdout. "
                    "Later turns reuse the conversation so far from the prefix cache. Tool calls the model makes are "
                    "printed as JSON lines. An empty line, /exit or end of input ends the chat.",
    )
    _add_common_args(c, max_new_tokens=256)
    c.add_argument("--system", default=None, metavar="TEXT", help="a system message opening the conversation (default: none)")
    c.add_argument("--message", action="append", default=None, metavar="TEXT",
                   help="a user turn to send instead of reading stdin (repeatable, in order; default: read stdin)")
    c.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image for a vision model, shown before the first user turn's text (repeatable): a PNG/JPEG "
                        "(needs Pillow) or a .npy uint8 [H, W, 3] array (default: none)")
    c.add_argument("--max-seq-len", type=int, default=4096, metavar="N",
                   help="the conversation's token budget: every prompt plus its reply must fit (default: %(default)s)")
    from k3jax import plan

    plan.add_parser(sub)
    return parser


def _sampling(args) -> SamplingParams:
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                              seed=args.seed, stop=args.stop, stop_token_ids=args.stop_token_id, ignore_eos=args.ignore_eos,
                              logit_bias=dict(args.logit_bias) if args.logit_bias else None)
    try:
        sampling.validate()
    except ValueError as e:
        raise UserError(str(e)) from None
    for flag, v in (("--page-size", args.page_size), ("--prefill-chunk", args.prefill_chunk)):
        if v < 1:
            raise UserError(f"{flag} must be a positive integer, got {v}")
    return sampling


def _load_images(args) -> list | None:
    """--image files, read before the model loads: a missing file fails fast."""
    if not args.image:
        return None
    from k3jax.media import load_image

    try:
        return [load_image(p) for p in args.image]
    except (ValueError, OSError) as e:
        raise UserError(f"--image: {e}") from None


def _load_model(args, sampling: SamplingParams, images):
    """--model loaded (on --mesh); UserError naming the problem (a missing directory, sampling values the
    vocabulary rules out, images for a model without a vision tower)."""
    import k3jax.api

    log.info("loading model %s%s", args.model, f" on mesh {args.mesh}" if args.mesh else "")
    try:
        model = k3jax.api.load_model(args.model, mesh=args.mesh)
        sampling.validate(model.config.vocab_size)
    except (ValueError, FileNotFoundError, NotADirectoryError, OSError) as e:
        raise UserError(str(e)) from None
    if images and model.config.vision is None:
        raise UserError(f"--image: model {model.config.name!r} has no vision tower")
    return model


def _generate(args) -> int:
    sampling = _sampling(args)
    if not args.prompt:
        raise UserError("--prompt is empty")
    if not 1 <= args.num_draft_tokens <= 16:
        raise UserError(f"--num-draft-tokens must be in [1, 16], got {args.num_draft_tokens}")
    if args.batch_invariant and args.mesh:
        raise UserError("--batch-invariant runs on one device: drop --mesh")

    from k3jax.tokenizer import IncrementalDecoder

    images = _load_images(args)
    t0 = time.perf_counter()
    model = _load_model(args, sampling, images)
    try:
        prompt_ids = model.tokenizer.encode(args.prompt, add_bos=args.add_bos)
    except ValueError as e:
        raise UserError(str(e)) from None
    ph = model.config.media_placeholder_token_id
    if images and ph not in prompt_ids:  # no placeholders: the images come first
        prompt_ids = [ph] * len(images) + prompt_ids
    args.images = images
    load_s = time.perf_counter() - t0
    if args.batch_invariant:
        model = dataclasses.replace(model, config=model.config.replace(batch_invariant_rows=BATCH_INVARIANT_ROWS))
    kind = "checkpoint" if os.path.isdir(args.model) else "preset with random weights"
    log.info("loaded %s (%s) in %.2f s; prompt is %d tokens", model.config.name, kind, load_s, len(prompt_ids))

    detok = IncrementalDecoder(model.tokenizer, skip_special=not args.show_special)
    stats: dict = {}
    out = sys.stdout
    t_start = time.perf_counter()
    times: list[float] = []
    try:
        for tok in _token_stream(args, model, prompt_ids, sampling, stats):
            times.append(time.perf_counter())
            out.write(detok.push(tok))
            out.flush()
    except ValueError as e:  # e.g. a prompt longer than the model's context
        raise UserError(str(e)) from None
    out.write(detok.flush() + "\n")
    out.flush()
    if not args.quiet:
        _summary(stats, times, t_start, load_s)
    return 0


def _chat(args) -> int:
    sampling = _sampling(args)
    if args.max_seq_len < 2:
        raise UserError(f"--max-seq-len must be at least 2, got {args.max_seq_len}")
    if args.message is not None and not all(m.strip() for m in args.message):
        raise UserError("--message is empty")
    images = _load_images(args)
    import json

    from k3jax import LLM
    from k3jax.tokenizer import IncrementalDecoder
    from k3jax.xtml import TOOLS_BEGIN

    t0 = time.perf_counter()
    model = _load_model(args, sampling, images)
    try:
        fmt = model.chat_format
    except ValueError as e:
        raise UserError(str(e)) from None
    llm = LLM(model, mesh=args.mesh, page_size=args.page_size, prefill_chunk=args.prefill_chunk, max_running=1,
              single_bucket=True, warmup=True, max_seq_len=args.max_seq_len)
    log.info("loaded %s and warmed up in %.2f s (chat format: %s)", model.config.name, time.perf_counter() - t0,
             "the checkpoint's template" if fmt.template is not None else "Kimi's built-in")
    tools_begin = fmt.tokenizer.special_tokens.get(TOOLS_BEGIN)
    conv: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    turns = iter(args.message) if args.message is not None else _stdin_turns()
    out = sys.stdout
    for text in turns:
        if images:  # the first turn shows the images
            conv.append({"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                                     {"type": "text", "text": text}]})
            images = None
        else:
            conv.append({"role": "user", "content": text})
        try:
            prompt = fmt.render(conv)
            detok = IncrementalDecoder(model.tokenizer, skip_special=not args.show_special)
            t, shown, final = time.perf_counter(), True, None
            for delta in llm.stream(prompt.token_ids, prompt.sampling(sampling), images=prompt.images or None):
                for tok in delta.token_ids:
                    shown = shown and (tok != tools_begin or args.show_special)  # tool calls print parsed, below
                    if shown:
                        out.write(detok.push(tok))
                out.flush()
                final = delta.output if delta.finished else final
        except ValueError as e:  # e.g. the conversation outgrew --max-seq-len
            raise UserError(str(e)) from None
        out.write(detok.flush() + "\n")
        reply = fmt.parse(final.token_ids)
        for call in reply.tool_calls:
            out.write(json.dumps({"tool_call": call.to_dict()}, ensure_ascii=False) + "\n")
        out.flush()
        conv.append(reply.to_message())
        log.info("turn %d: prompt %d tokens (%d from the prefix cache), reply %d tokens (%s) in %.2f s",
                 sum(m["role"] == "user" for m in conv), len(prompt.token_ids), final.cached_tokens,
                 len(final.token_ids), final.finish_reason, time.perf_counter() - t)
    return 0


def _stdin_turns():
    while True:
        if sys.stdin.isatty():
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip() or line.strip() == "/exit":
            return
        yield line.rstrip("\n")


def _token_stream(args, model, prompt_ids, sampling, stats):
    """Generated token ids: the single-request loop, or the engine with speculative decoding."""
    from k3jax.engine.simple import generate_stream

    if args.speculative is None and not args.images:
        yield from generate_stream(model, prompt_ids, sampling, page_size=args.page_size,
                                   prefill_chunk=args.prefill_chunk, warmup=True, stats=stats)
        return
    from k3jax import LLM

    t = time.perf_counter()
    if args.images:
        from k3jax.media import expand

        n_prompt = len(expand(model, prompt_ids, args.images)[1])  # the expanded prompt's length, for the pool
    else:
        n_prompt = len(prompt_ids)
    llm = LLM(model, mesh=args.mesh, page_size=args.page_size, prefill_chunk=args.prefill_chunk, speculative=args.speculative,
              num_draft_tokens=args.num_draft_tokens, max_running=1, single_bucket=True, warmup=True,
              max_seq_len=n_prompt + sampling.max_new_tokens)
    stats["warmup_s"], stats["prompt_tokens"] = time.perf_counter() - t, n_prompt
    for delta in llm.stream(prompt_ids, sampling, images=args.images):
        yield from delta.token_ids
        if delta.finished:
            stats["finish_reason"] = delta.output.finish_reason
    st = collections.Counter(llm.stats)
    if st["steps"]:
        log.info("engine: %d steps, %.2f ms a step on the host, %.2f ms waiting for the device", st["steps"],
                 st["step_host_s"] * 1e3 / st["steps"], st["step_wait_s"] * 1e3 / st["steps"])
    if st["spec_blocks"]:
        log.info("speculative: %d verify steps, %d of %d drafts accepted (%.2f tokens per step)", st["spec_blocks"],
                 st["spec_accepted"], st["spec_drafted"], (st["spec_blocks"] + st["spec_accepted"]) / st["spec_blocks"])


def _raise_user_error(msg: str):
    raise UserError(msg)


def _summary(stats: dict, times: list[float], t_start: float, load_s: float):
    n = len(times)
    warm = stats.get("warmup_s", 0.0)
    parts = [f"prompt {stats.get('prompt_tokens', 0)} tokens", f"generated {n} ({stats.get('finish_reason')})"]
    parts.append(f"model load {load_s:.2f} s")
    parts.append(f"compile + padded warm-up steps {warm:.2f} s")
    if n:
        parts.append(f"time to first token {times[0] - t_start - warm:.3f} s (prefill + sampling, compile excluded)")
    if n > 1:
        dt = times[-1] - times[0]
        parts.append(f"decode {n - 1} tokens in {dt:.3f} s = {(n - 1) / dt:.1f} tokens/s (compile excluded)")
    if n:
        parts.append(f"end-to-end {times[-1] - t_start:.2f} s incl. compile")
    print("; ".join(parts), file=sys.stderr)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at emit time (main() may run in-process, e.g. in tests)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _setup_logging(level: int):
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("[k3jax] %(message)s"))
        log.addHandler(handler)
    log.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    _setup_logging(logging.WARNING if getattr(args, "quiet", False) else logging.INFO)
    try:
        sys.stdout.reconfigure(errors="replace")  # model text may not fit a non-UTF-8 terminal
    except (AttributeError, ValueError):
        pass
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "chat":
            return _chat(args)
        if args.command == "plan":
            from k3jax import plan

            return plan.run(args, _raise_user_error)
        parser.error(f"unknown command {args.command!r}")
    except UserError as e:
        print(f"k3jax {args.command}: error: {e}", file=sys.stderr)
        return _EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
