"""Kimi's chat prompt format (XTML): OpenAI-style messages -> prompt token ids, and a reply's tokens ->
content, reasoning and tool calls.

A turn is `<|im_ROLE|>NAME<|im_middle|>CONTENT<|im_end|>` (ROLE: system, user, assistant; NAME: the
message's `name`, else its role). Tools are declared in a first system turn named `tool_declare` whose
content is the tools' compact JSON; a tool result is a system turn named `tool` holding
`## Return of ID` and the result. An assistant's tool calls follow its content:
`<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS
<|tool_call_end|>`, then `<|tool_calls_section_end|>` (ID: `functions.NAME:N`, N counting the
conversation's calls). An image is `<|media_start|>image<|media_content|><|media_pad|><|media_end|>`;
its one `<|media_pad|>` placeholder becomes the image's tokens in the engine (`k3jax.media`). Reasoning
is `<think>...</think>` text before an assistant's content; it is kept only for the messages after the
last user message (the turn in progress), as the thinking models expect. The generation prompt opens an
assistant turn.

`ChatFormat` renders with that built-in form, straight to token ids: message text is encoded with
special tokens off, so a user cannot forge a turn by typing `<|im_end|>`. A checkpoint that ships a
Jinja chat template (`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`) is rendered
with it instead, the way `transformers`' `apply_chat_template` does (sandboxed, special tokens on).
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import io
import json
import os
from typing import Sequence

IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM = "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>"
IM_MIDDLE = "<|im_middle|>"
MEDIA_START, MEDIA_CONTENT, MEDIA_END = "<|media_start|>", "<|media_content|>", "<|media_end|>"
MEDIA_PAD = "<|media_pad|>"
TOOLS_BEGIN, TOOLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# the special tokens the format needs (`<|media_pad|>` is the model's media placeholder); the byte-level
# tokenizer names them on free reserved ids (`k3jax.tokenizer.ByteTokenizer`)
CHAT_TOKENS = (IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE, MEDIA_START, MEDIA_CONTENT, MEDIA_END,
               TOOLS_BEGIN, TOOLS_END, CALL_BEGIN, CALL_ARGS, CALL_END)
TEMPLATE_FILE = "chat_template.jinja"
ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str  # e.g. "functions.get_weather:0"
    name: str
    arguments: str  # JSON text, as the model wrote it (`json.loads` it; it may be malformed)

    def to_dict(self) -> dict:
        """The OpenAI form (what an assistant message's `tool_calls` holds)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class ChatReply:
    """A reply parsed from the model's tokens (`ChatFormat.parse`)."""

    content: str
    reasoning_content: str | None = None  # the `<think>` text, if the model wrote one
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)

    def to_message(self) -> dict:
        """The assistant message to append to the conversation for the next turn."""
        msg: dict = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            msg["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            msg["tool_calls"] = [c.to_dict() for c in self.tool_calls]
        return msg


@dataclasses.dataclass
class ChatPrompt:
    token_ids: list[int]  # the prompt, one media placeholder per image
    images: list  # one per placeholder, in order (arrays, PIL images; paths and data URLs already loaded)
    stop_token_ids: list[int]  # the end-of-turn token: a reply stops there
    eos_token_id: int | None = None

    def sampling(self, sampling=None):
        """`sampling` (default: `SamplingParams()`) with the end-of-turn token added to its stop tokens, so a
        reply ends with its turn (unless it is the EOS token already, or `ignore_eos` asks for fixed lengths)."""
        from k3jax.sampling import SamplingParams

        sampling = sampling or SamplingParams()
        extra = [t for t in self.stop_token_ids if t != self.eos_token_id and t not in (sampling.stop_token_ids or ())]
        if not extra or sampling.ignore_eos:
            return sampling
        return dataclasses.replace(sampling, stop_token_ids=[*(sampling.stop_token_ids or ()), *extra])


class ChatFormat:
    """Messages -> `ChatPrompt`, and a reply's token ids -> `ChatReply`, for one tokenizer.

    `template`: a Jinja chat template (a checkpoint's); None: the built-in Kimi format."""

    def __init__(self, tokenizer, template: str | None = None, media_placeholder_token_id: int | None = None):
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer: this model has none")
        self.tokenizer = tokenizer
        self.template = template
        specials = tokenizer.special_tokens
        missing = [t for t in CHAT_TOKENS if t not in specials]
        if missing and template is None:
            raise ValueError(f"the tokenizer lacks the chat format's special tokens {missing[:4]}; a checkpoint whose "
                             f"tokenizer has other ones needs its own chat template ({TEMPLATE_FILE})")
        self._id = {t: specials[t] for t in CHAT_TOKENS if t in specials}
        self.media_placeholder_token_id = media_placeholder_token_id
        if media_placeholder_token_id is None and MEDIA_PAD in specials:
            self.media_placeholder_token_id = specials[MEDIA_PAD]
        self.end_of_turn_id = self._id.get(IM_END, tokenizer.eos_token_id)
        self._jinja = _compile_template(template) if template is not None else None

    @classmethod
    def for_model(cls, model) -> "ChatFormat":
        cfg = model.config
        return cls(model.tokenizer, getattr(model, "chat_template", None),
                   cfg.media_placeholder_token_id if cfg.vision is not None else None)

    # ---- rendering

    def render(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
               add_generation_prompt: bool = True, **template_kwargs) -> ChatPrompt:
        """The prompt of a conversation. `messages`: dicts with `role` (system, user, assistant, tool) and
        `content` (a string, or a list of parts: `{"type": "text", "text": ...}`, `{"type": "image", "image":
        array | PIL image | path}`, `{"type": "image_url", "image_url": {"url": path | file:// | data: URL}}`);
        optional `name`; an assistant's `tool_calls` (OpenAI form) and `reasoning_content`; a tool result's
        `tool_call_id`. `tools`: OpenAI tool definitions. Raises ValueError naming the bad message and field."""
        messages = _check_messages(messages)
        if tools is not None:
            if not isinstance(tools, (list, tuple)) or not all(isinstance(t, dict) for t in tools):
                raise ValueError("tools must be a list of tool definitions (dicts)")
            tools = list(tools)
        images = [_load_part_image(p, i) for i, m in enumerate(messages) for p in _parts(m) if _is_image(p)]
        if self._jinja is not None:
            ids = self._render_jinja(messages, tools, add_generation_prompt, template_kwargs)
        else:
            if template_kwargs:
                raise ValueError(f"unknown chat options {sorted(template_kwargs)} (the built-in format takes none)")
            ids = self._render_builtin(messages, tools, add_generation_prompt)
        if images:
            if self.media_placeholder_token_id is None:
                raise ValueError("the conversation holds images but the model has no vision tower")
            n = ids.count(self.media_placeholder_token_id)
            if n != len(images):
                raise ValueError(f"the chat template wrote {n} media placeholders for {len(images)} images")
        stop = [] if self.end_of_turn_id is None else [self.end_of_turn_id]
        return ChatPrompt(ids, images, stop, self.tokenizer.eos_token_id)

    def render_text(self, messages: Sequence[dict], **kw) -> str:
        """The rendered prompt as text, special tokens shown (for reading, not for encoding again)."""
        return self.tokenizer.decode(self.render(messages, **kw).token_ids, skip_special=False)

    def _render_builtin(self, messages: list[dict], tools, add_generation_prompt: bool) -> list[int]:
        ids: list[int] = []
        sp, enc = self._id, self._text

        def turn(tag: str, name: str, body: list[int]):
            ids.extend([sp[tag], *enc(name), sp[IM_MIDDLE], *body, sp[IM_END]])

        if tools:
            turn(IM_SYSTEM, "tool_declare", enc(json.dumps(tools, separators=(",", ":"), ensure_ascii=False)))
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        n_calls = 0
        for i, m in enumerate(messages):
            role = m["role"]
            if role == "tool":
                turn(IM_SYSTEM, "tool", enc(f"## Return of {m['tool_call_id']}\n") + self._content(m))
                continue
            tag = {"system": IM_SYSTEM, "user": IM_USER, "assistant": IM_ASSISTANT}[role]
            body: list[int] = []
            if role == "assistant" and i > last_user and m.get("reasoning_content") is not None:
                body += enc(f"{THINK_OPEN}{m['reasoning_content']}{THINK_CLOSE}")
            body += self._content(m)
            if role == "assistant" and m.get("tool_calls"):
                body.append(sp[TOOLS_BEGIN])
                for call in m["tool_calls"]:
                    fn = call["function"]
                    cid = call.get("id") or f"functions.{fn['name']}:{n_calls}"
                    n_calls += 1
                    args = fn.get("arguments", "{}")
                    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                    body += [sp[CALL_BEGIN], *enc(cid), sp[CALL_ARGS], *enc(args), sp[CALL_END]]
                body.append(sp[TOOLS_END])
            turn(tag, m.get("name") or role, body)
        if add_generation_prompt:
            ids.extend([sp[IM_ASSISTANT], *enc("assistant"), sp[IM_MIDDLE]])
        return ids

    def _text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, allow_special=False)

    def _content(self, m: dict) -> list[int]:
        out: list[int] = []
        for p in _parts(m):
            if _is_image(p):
                if self.media_placeholder_token_id is None:
                    raise ValueError("the conversation holds images but the model has no vision tower")
                sp = self._id
                out += [sp[MEDIA_START], *self._text("image"), sp[MEDIA_CONTENT], self.media_placeholder_token_id,
                        sp[MEDIA_END]]
            else:
                out += self._text(p["text"])
        return out

    def _render_jinja(self, messages, tools, add_generation_prompt, kwargs) -> list[int]:
        tok = self.tokenizer
        name = lambda i: tok.decode([i], skip_special=False) if i is not None else None  # noqa: E731
        import jinja2

        try:
            text = self._jinja.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                      bos_token=name(tok.bos_token_id), eos_token=name(tok.eos_token_id), **kwargs)
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"the chat template failed: {e}") from None
        return tok.encode(text, allow_special=True)

    # ---- parsing

    def parse(self, token_ids: Sequence[int]) -> ChatReply:
        """A reply's parts from its generated tokens (the end-of-turn token and any text after it are dropped;
        a tool-call section cut short by the token limit keeps its complete calls)."""
        ids = list(token_ids)
        if self.end_of_turn_id is not None and self.end_of_turn_id in ids:
            ids = ids[: ids.index(self.end_of_turn_id)]
        marks = {self._id.get(t): t for t in (TOOLS_BEGIN, TOOLS_END, CALL_BEGIN, CALL_ARGS, CALL_END)}
        marks.pop(None, None)
        # split into text runs and marks
        pieces: list[str | tuple[str]] = []
        run: list[int] = []
        for t in ids:
            if t in marks:
                pieces.append(self.tokenizer.decode(run))
                run = []
                pieces.append((marks[t],))
            else:
                run.append(t)
        pieces.append(self.tokenizer.decode(run))
        content, calls, in_section, call = [], [], False, None
        for p in pieces:
            if isinstance(p, tuple):
                mark = p[0]
                if mark == TOOLS_BEGIN:
                    in_section = True
                elif mark == TOOLS_END:
                    in_section = False
                elif mark == CALL_BEGIN and in_section:
                    call = ["", None]
                elif mark == CALL_ARGS and call is not None:
                    call[1] = ""
                elif mark == CALL_END and call is not None:
                    if call[1] is not None:
                        calls.append(_tool_call(call[0].strip(), call[1]))
                    call = None
            elif in_section:
                if call is not None:
                    if call[1] is None:
                        call[0] += p
                    else:
                        call[1] += p
            else:
                content.append(p)
        split = ReasoningSplitter()
        reasoning, text = split.push("".join(content), final=True)
        return ChatReply(text, reasoning if split.thinking else None, calls)


class ReasoningSplitter:
    """A reply's text -> (reasoning, content), piece by piece as it streams (`push` returns the new parts). A reply
    that opens with `<think>` (after any whitespace) is reasoning up to `</think>`, then content (the newlines right
    after the tag dropped); a reply that does not is all content. Text that could still turn out to be a tag is held
    back until it cannot, or until `final`; `thinking` tells whether the reply opened with `<think>`."""

    def __init__(self):
        self.buf, self.state, self.thinking = "", "start", False

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning = content = ""
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(THINK_OPEN):
                    self.buf, self.state, self.thinking = head[len(THINK_OPEN):], "reasoning", True
                elif THINK_OPEN.startswith(head) and not final:  # may still become <think>
                    return reasoning, content
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                i = self.buf.find(THINK_CLOSE)
                if i >= 0:
                    reasoning += self.buf[:i]
                    self.buf, self.state = self.buf[i + len(THINK_CLOSE):], "after"
                    continue
                keep = 0 if final else next((k for k in range(len(THINK_CLOSE) - 1, 0, -1)
                                             if self.buf.endswith(THINK_CLOSE[:k])), 0)
                reasoning += self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return reasoning, content
            elif self.state == "after":
                self.buf = self.buf.lstrip("\n")
                if not self.buf and not final:
                    return reasoning, content
                self.state = "content"
            else:
                content, self.buf = content + self.buf, ""
                return reasoning, content


def _tool_call(call_id: str, arguments: str) -> ToolCall:
    name = call_id
    if name.startswith("functions."):
        name = name[len("functions."):]
    head, sep, tail = name.rpartition(":")
    if sep and tail.isdigit():
        name = head
    return ToolCall(call_id, name, arguments.strip())


# ---- messages


def _check_messages(messages) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}")
        content = m.get("content")
        if content is None:
            if not (role == "assistant" and m.get("tool_calls")):
                raise ValueError(f"{where}.content is missing (only an assistant message with tool_calls may omit it)")
        elif isinstance(content, list):
            for j, p in enumerate(content):
                _check_part(p, f"{where}.content[{j}]")
        elif not isinstance(content, str):
            raise ValueError(f"{where}.content must be a string or a list of parts, got {type(content).__name__}")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise ValueError(f"{where}.name must be a string")
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise ValueError(f"{where}: a tool message needs tool_call_id (the id of the call it answers)")
        if m.get("tool_calls"):
            if role != "assistant":
                raise ValueError(f"{where}: only assistant messages carry tool_calls")
            for j, c in enumerate(m["tool_calls"]):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                    raise ValueError(f"{where}.tool_calls[{j}] must be {{'function': {{'name': ..., 'arguments': ...}}}}")
        if m.get("reasoning_content") is not None and not isinstance(m["reasoning_content"], str):
            raise ValueError(f"{where}.reasoning_content must be a string")
        out.append(m)
    return out


def _check_part(p, where: str):
    if not isinstance(p, dict) or p.get("type") not in ("text", "image", "image_url"):
        raise ValueError(f"{where} must be a dict with type 'text', 'image' or 'image_url'")
    if p["type"] == "text" and not isinstance(p.get("text"), str):
        raise ValueError(f"{where}.text must be a string")
    if p["type"] == "image" and p.get("image") is None:
        raise ValueError(f"{where}.image is missing")
    if p["type"] == "image_url":
        url = p.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str):
            raise ValueError(f"{where}.image_url must be {{'url': ...}} (a path, file:// or data: URL)")


def _parts(m: dict) -> list[dict]:
    c = m.get("content")
    if c is None:
        return []
    return [{"type": "text", "text": c}] if isinstance(c, str) else c


def _is_image(p: dict) -> bool:
    return p["type"] in ("image", "image_url")


def _load_part_image(p: dict, i: int):
    if p["type"] == "image":
        src = p["image"]
        if not isinstance(src, (str, os.PathLike)):
            return src  # an array or a PIL image: checked by the vision preprocessing
    else:
        src = p["image_url"]["url"] if isinstance(p["image_url"], dict) else p["image_url"]
    try:
        return load_image_source(os.fspath(src))
    except (OSError, ValueError) as e:
        raise ValueError(f"messages[{i}]: image {str(src)[:64]!r}: {e}") from None


def data_url_bytes(url: str) -> bytes:
    """The bytes a `data:...;base64,` URL carries (ValueError naming what is wrong)."""
    head, sep, data = url.partition(",")
    if not url.startswith("data:") or not sep or not head.endswith(";base64"):
        raise ValueError("a data URL must be base64 (data:image/png;base64,...)")
    try:
        return base64.b64decode(data, validate=True)
    except ValueError:
        raise ValueError("the data URL's base64 does not decode") from None


def load_image_source(src: str):
    """An image from a path, a `file://` URL or a `data:image/...;base64,` URL (no network fetches)."""
    from k3jax.media import load_image

    if src.startswith("data:"):
        return load_image(io.BytesIO(data_url_bytes(src)))
    if src.startswith("file://"):
        src = src[len("file://"):]
    elif "://" in src:
        raise ValueError("only paths, file:// and data: URLs are read (the server fetches nothing)")
    return load_image(src)


# ---- Jinja templates


def _compile_template(source: str):
    try:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ValueError("this checkpoint's chat template needs jinja2 (pip install jinja2)") from None
    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template does not parse: {e}") from None


def load_template(directory: str | os.PathLike) -> str | None:
    """A checkpoint's chat template: `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`
    (a string, or a list of named templates: the one named "default"); None if it has neither."""
    directory = os.fspath(directory)
    path = os.path.join(directory, TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(cfg_path):
        return None
    with open(cfg_path, encoding="utf-8") as f:
        tmpl = json.load(f).get("chat_template")
    if isinstance(tmpl, list):
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default")
    return tmpl if isinstance(tmpl, str) else None

