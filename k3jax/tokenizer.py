"""Tokenizers: byte-level (random presets, tests) and tiktoken BPE (Kimi checkpoints).

Both expose one interface: `encode(text, add_bos=False, allow_special=True) -> list[int]`,
`decode(ids, skip_special=True) -> str`, `token_bytes(id, skip_special=True) -> bytes`,
`vocab_size`, `bos_token_id`, `eos_token_id`, `pad_token_id`, `id_is_valid(id)`, `is_special(id)`.
Decoding is defined on bytes: the tokens' bytes are joined and decoded as UTF-8 with invalid
sequences replaced by U+FFFD, so `IncrementalDecoder` can reproduce a full decode exactly.
"""

from __future__ import annotations

import base64
import codecs
import json
import logging
import numbers
import os
import re
from typing import Iterable, Sequence

from k3jax.config import ModelConfig

log = logging.getLogger(__name__)

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# Kimi's pre-tokenizer split: runs of Han characters stand alone; other letter runs follow the
# cl100k / o200k case-aware word rule (Han excluded by class intersection); up to 3 digits; runs of
# punctuation; newlines; whitespace.
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PAT_STR = "|".join([
    r"[\p{Han}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+{_CONTRACTION}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*{_CONTRACTION}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

# tiktoken's Rust core can overflow on huge inputs: encode in pieces of bounded size.
_MAX_ENCODE_CHARS = 400_000
_MAX_RUN_CHARS = 25_000
_NUM_RESERVED_SPECIALS = 256  # Kimi: the special-token block after the BPE ranks


def _special_names(cfg: ModelConfig | None) -> dict[int, str]:
    names: dict[int, str] = {}
    if cfg is not None:
        for tid, name in ((cfg.bos_token_id, "<|bos|>"), (cfg.eos_token_id, "<|eos|>"), (cfg.pad_token_id, "<|pad|>"),
                          (cfg.media_placeholder_token_id if cfg.vision is not None else None, "<|media_pad|>")):
            if tid is not None:
                names.setdefault(int(tid), name)
    return names


def _chat_names(names: dict[int, str], vocab_size: int) -> dict[int, str]:
    """The chat format's special tokens (`k3jax.xtml.CHAT_TOKENS`) on the lowest free ids from 256, if they all
    fit the vocabulary (a byte-level model then chats like a Kimi checkpoint)."""
    from k3jax.xtml import CHAT_TOKENS

    todo = [t for t in CHAT_TOKENS if t not in names.values()]
    free = (i for i in range(256, vocab_size) if i not in names)
    ids = [i for i, _ in zip(free, todo)]
    return dict(zip(ids, todo)) if len(ids) == len(todo) else {}


class _Tokenizer:
    """Shared decoding and bookkeeping; subclasses implement `_encode` and `_piece`."""

    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    special_tokens: dict[str, int]  # text -> id, every special id (named and reserved)

    def id_is_valid(self, token_id: int) -> bool:
        return isinstance(token_id, numbers.Integral) and not isinstance(token_id, bool) and 0 <= token_id < self.vocab_size

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def _check(self, token_id: int) -> int:
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        return token_id

    def token_bytes(self, token_id: int, skip_special: bool = True) -> bytes:
        """The bytes a token contributes to decoded text (b"" for a skipped special token)."""
        token_id = self._check(token_id)
        if token_id in self._special_ids:
            return b"" if skip_special else self._special_text[token_id].encode()
        return self._piece(token_id)

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        data = b"".join(self.token_bytes(i, skip_special) for i in ids)
        return data.decode("utf-8", errors="replace")

    def encode(self, text: str, add_bos: bool = False, allow_special: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids if `allow_special`."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self._encode(text, allow_special)
        if add_bos:
            if self.bos_token_id is None:
                raise ValueError("this tokenizer has no BOS token")
            ids = [self.bos_token_id] + ids
        return ids

    def _set_specials(self, specials: dict[int, str]):
        self._special_text = dict(specials)
        self._special_ids = frozenset(specials)
        self.special_tokens = {t: i for i, t in sorted(specials.items(), reverse=True)}


class ByteTokenizer(_Tokenizer):
    """Ids 0..255 are raw bytes; bos/eos/pad (and a vision model's media placeholder) come from the config;
    the chat format's tokens (`<|im_user|>`, ...) take the lowest free ids from 256; every other id is a
    reserved special token (`<|reserved_N|>`). Special tokens show in decode only when `skip_special=False`.

    A special id below 256 (some presets use bos=1, eos=2) shadows that byte: it decodes as the
    special token, and the byte itself still encodes to that id.
    """

    def __init__(self, cfg: ModelConfig):
        names = _special_names(cfg)
        names.update(_chat_names(names, cfg.vocab_size))
        if cfg.vocab_size < 256 + len([i for i in names if i >= 256]):
            raise ValueError(
                f"a byte-level tokenizer needs a vocabulary of at least 256 bytes plus the special tokens; "
                f"the model has {cfg.vocab_size}"
            )
        for tid in names:
            if tid >= cfg.vocab_size:
                raise ValueError(f"special token id {tid} is outside the vocabulary [0, {cfg.vocab_size})")
        self.vocab_size = cfg.vocab_size
        self.bos_token_id, self.eos_token_id, self.pad_token_id = cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id
        self._names = names
        self._set_specials(names)  # reserved ids are resolved lazily (the vocabulary may be large)
        self._special_re = re.compile("|".join(re.escape(t) for t in sorted(self.special_tokens, key=len, reverse=True)))

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids or 256 <= token_id < self.vocab_size

    def token_bytes(self, token_id: int, skip_special: bool = True) -> bytes:
        token_id = self._check(token_id)
        if token_id in self._special_ids or token_id >= 256:
            return b"" if skip_special else self._names.get(token_id, f"<|reserved_{token_id}|>").encode()
        return bytes((token_id,))

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        if not allow_special or not self.special_tokens:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            ids += text[pos : m.start()].encode("utf-8")
            ids.append(self.special_tokens[m.group()])
            pos = m.end()
        ids += text[pos:].encode("utf-8")
        return ids


class TiktokenTokenizer(_Tokenizer):
    """A Kimi-style tiktoken BPE: `tiktoken.model` (`<base64 bytes> <rank>` per line) plus special
    tokens from `tokenizer_config.json` (`added_tokens_decoder`). Ids from the end of the ranks up to
    the model's vocabulary (or 256 past the ranks) that are not named are `<|reserved_token_N|>`."""

    def __init__(self, directory: str | os.PathLike, cfg: ModelConfig | None = None):
        import tiktoken

        directory = os.fspath(directory)
        ranks = _read_ranks(os.path.join(directory, TIKTOKEN_FILE))
        n_base = max(ranks.values()) + 1
        tok_cfg = _read_json(os.path.join(directory, TOKENIZER_CONFIG_FILE))
        named: dict[int, str] = {}
        for key, attrs in (tok_cfg.get("added_tokens_decoder") or {}).items():
            content = attrs.get("content") if isinstance(attrs, dict) else None
            if isinstance(content, str):
                named[int(key)] = content
        clash = [i for i in named if i < n_base]
        if clash:
            raise ValueError(f"{TOKENIZER_CONFIG_FILE}: special token ids {clash[:5]} collide with BPE ranks")
        upper = cfg.vocab_size if cfg is not None else n_base + _NUM_RESERVED_SPECIALS
        specials = {i: f"<|reserved_token_{i}|>" for i in range(n_base, max(upper, n_base))}
        specials.update(named)
        self._set_specials(specials)
        self._enc = tiktoken.Encoding(
            name=os.path.basename(os.path.abspath(directory)) or "kimi",
            pat_str=KIMI_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.vocab_size = max(specials, default=n_base - 1) + 1
        if cfg is not None and self.vocab_size > cfg.vocab_size:
            log.warning("tokenizer has %d ids but the model only %d", self.vocab_size, cfg.vocab_size)

        def pick(attr: str, key: str) -> int | None:
            if cfg is not None and getattr(cfg, attr) is not None:
                return int(getattr(cfg, attr))
            val = tok_cfg.get(key)
            val = val.get("content") if isinstance(val, dict) else val
            return self.special_tokens.get(val) if isinstance(val, str) else None

        self.bos_token_id = pick("bos_token_id", "bos_token")
        self.eos_token_id = pick("eos_token_id", "eos_token")
        self.pad_token_id = pick("pad_token_id", "pad_token")

    def _piece(self, token_id: int) -> bytes:
        try:
            return self._enc.decode_single_token_bytes(token_id)
        except KeyError:
            raise ValueError(f"token id {token_id} is not in the vocabulary (a gap in the ranks)") from None

    def _encode(self, text: str, allow_special: bool) -> list[int]:
        kw = dict(allowed_special="all") if allow_special else dict(disallowed_special=())
        ids: list[int] = []
        for piece in _bounded_pieces(text):
            ids += self._enc.encode(piece, **kw)
        return ids


def _bounded_pieces(text: str) -> Iterable[str]:
    if len(text) <= _MAX_ENCODE_CHARS and not re.search(rf"\S{{{_MAX_RUN_CHARS + 1}}}|\s{{{_MAX_RUN_CHARS + 1}}}", text):
        yield text
        return
    buf: list[str] = []
    size = 0
    for m in re.finditer(rf"\s{{1,{_MAX_RUN_CHARS}}}|\S{{1,{_MAX_RUN_CHARS}}}", text):
        run = m.group()
        if buf and size + len(run) > _MAX_ENCODE_CHARS:
            yield "".join(buf)
            buf, size = [], 0
        buf.append(run)
        size += len(run)
        if len(run) == _MAX_RUN_CHARS:  # a capped run: its continuation must go in a new piece
            yield "".join(buf)
            buf, size = [], 0
    if buf:
        yield "".join(buf)


def _read_ranks(path: str) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (ValueError, IndexError):
                raise ValueError(f"{path}:{n}: expected '<base64 token> <rank>'") from None
            ranks[token] = rank
    if not ranks:
        raise ValueError(f"{path} holds no tokens")
    return ranks


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


class IncrementalDecoder:
    """Streaming detokenizer: `push(id)` returns only newly completed text; an incomplete UTF-8
    sequence is held back until later tokens complete it. The concatenation of every `push` and the
    final `flush()` equals `tokenizer.decode(all_ids, skip_special)`."""

    def __init__(self, tokenizer: _Tokenizer, skip_special: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.token_bytes(token_id, self.skip_special))

    def push_many(self, ids: Sequence[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        """Text of any held-back bytes (replacement characters for an unfinished sequence)."""
        return self._utf8.decode(b"", final=True)


def load_tokenizer(directory: str | os.PathLike | None, cfg: ModelConfig) -> _Tokenizer:
    """None: `ByteTokenizer(cfg)`. A directory with `tiktoken.model`: `TiktokenTokenizer`. A directory
    without a vocabulary: `ByteTokenizer` when the model's vocabulary can hold bytes plus specials."""
    if directory is None:
        return ByteTokenizer(cfg)
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"no tokenizer directory at {directory!r}")
    if os.path.isfile(os.path.join(directory, TIKTOKEN_FILE)):
        return TiktokenTokenizer(directory, cfg)
    try:
        tok = ByteTokenizer(cfg)
    except ValueError as e:
        raise FileNotFoundError(
            f"{directory!r} has no {TIKTOKEN_FILE} and a byte-level tokenizer does not fit the model ({e})"
        ) from None
    log.warning("%s has no %s: using the byte-level tokenizer", directory, TIKTOKEN_FILE)
    return tok
