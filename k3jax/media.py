"""Media (image) prompts on the host: placeholder expansion, image keys for the prefix cache, and the
embedding rows a step feeds in place of the token table's.

A prompt names each image with one media placeholder token (`ModelConfig.media_placeholder_token_id`,
`<|media_pad|>` in text), in the order of the images given; `prepare` expands each placeholder to the
image's LM token count (`k3jax.model.vision.num_image_tokens`). A prompt that is already expanded (as
HF's processor writes it: runs of exactly those counts) is taken as is.

The prefix cache and the scheduler see the *keyed* prompt: every token of an image is
`image_key(vocab, digest)`, an id >= vocab_size derived from the image's pixels, so two prompts share
cached KV and recurrent state across an image only when the image is the same (SGLang keys its radix
tree with image hashes the same way). A step that holds keyed tokens carries their embeddings
(`StepBatch.embeds`); the model reads the table for every other token (`forward.embed_tokens`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Sequence

import numpy as np

# keyed ids stay below the penalty counts' prompt bit (1 << 30) and inside int32
KEY_LIMIT = 1 << 30


def image_key(vocab_size: int, digest: bytes) -> int:
    """The id every token of an image takes in the keyed prompt: >= vocab_size, from its digest."""
    return vocab_size + int.from_bytes(digest[:8], "little") % (KEY_LIMIT - vocab_size)


@dataclasses.dataclass
class MediaPrompt:
    token_ids: list[int]  # the expanded prompt in the model's vocabulary (placeholder id at image tokens)
    keyed: list[int]  # the same with each image's tokens set to its key (what the engine schedules and caches)
    index: np.ndarray  # i32[len(keyed)]: row of `embeds` for image tokens, -1 for text
    embeds: np.ndarray  # [image tokens, hidden] the projector's output, in prompt order
    spans: list[tuple[int, int]]  # per image, its token range [start, end) in the prompt

    @functools.cached_property
    def key_ids(self) -> frozenset[int]:
        """The image keys in the prompt (ids >= vocab_size)."""
        return frozenset(self.keyed[s] for s, _ in self.spans)

    def rows(self, start: int, n: int) -> np.ndarray | None:
        """Input rows for fed tokens [start, start + n) (zeros at text tokens), or None if all are text."""
        idx = self.index[start: start + n]
        sel = np.nonzero(idx >= 0)[0]
        if sel.size == 0:
            return None
        out = np.zeros((n, self.embeds.shape[1]), self.embeds.dtype)
        out[sel] = self.embeds[idx[sel]]
        return out


def expand_placeholders(ids: Sequence[int], counts: Sequence[int], placeholder: int) -> tuple[list[int], list[tuple[int, int]]]:
    """-> (expanded ids, per image its [start, end)). One placeholder per image is expanded to `counts[i]`
    copies; a prompt whose placeholders already form runs of exactly `counts` is kept. Raises ValueError
    naming the mismatch otherwise."""
    ids = [int(t) for t in ids]
    pos = [i for i, t in enumerate(ids) if t == placeholder]
    if len(pos) == len(counts):
        out, spans, prev = [], [], 0
        for p, n in zip(pos, counts):
            out += ids[prev:p]
            spans.append((len(out), len(out) + n))
            out += [placeholder] * n
            prev = p + 1
        return out + ids[prev:], spans
    runs: list[tuple[int, int]] = []
    for p in pos:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    if [e - s for s, e in runs] == list(counts):
        return ids, runs
    raise ValueError(
        f"the prompt holds {len(pos)} media placeholder tokens (id {placeholder}) for {len(counts)} image(s): put one "
        f"placeholder per image (<|media_pad|> in text), or runs of exactly {list(counts)} (pre-expanded)")


def load_image(path: str) -> np.ndarray:
    """An image file as uint8 [H, W, 3]: a .npy array, or anything Pillow opens (PNG, JPEG, ...)."""
    if str(path).endswith(".npy"):
        return np.load(path)
    try:
        from PIL import Image
    except ImportError:
        raise ValueError(f"{path}: reading image files needs Pillow (pip install pillow); or pass a .npy uint8 "
                         "[H, W, 3] array") from None
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def expand(model, ids: Sequence[int], images: Sequence):
    """-> (preprocessed (patches, grid) per image, the expanded prompt ids, per image its token span): the
    host half of `prepare`, without the vision tower."""
    cfg = model.config
    if cfg.vision is None or getattr(model, "vision_params", None) is None:
        raise ValueError(f"images given, but model {cfg.name!r} has no vision tower")
    if not images:
        raise ValueError("no images given")
    from k3jax.model.vision import num_image_tokens, preprocess_image

    pre = []
    for i, im in enumerate(images):
        try:
            pre.append(preprocess_image(im, cfg.vision))
        except (TypeError, ValueError) as e:
            raise ValueError(f"image {i}: {e}") from None
    counts = [num_image_tokens(g, cfg.vision) for _, g in pre]
    token_ids, spans = expand_placeholders(ids, counts, cfg.media_placeholder_token_id)
    return pre, token_ids, spans


def prepare(model, ids: Sequence[int], images: Sequence) -> MediaPrompt:
    """The media prompt of `ids` with `images` (numpy uint8 [H, W, 3], floats in [0, 1], or PIL images):
    preprocess, expand the placeholders, run the vision tower (`Model.encode_images`), key the image tokens."""
    cfg = model.config
    pre, token_ids, spans = expand(model, ids, images)
    digests = []
    for patches, grid in pre:
        h = hashlib.sha256(np.ascontiguousarray(patches, np.float32).tobytes())
        h.update(np.asarray(grid, np.int64).tobytes())
        digests.append(h.digest())
    feats = model.encode_images(pre, keys=digests)  # a repeated image: its rows from the model's cache
    keyed = list(token_ids)
    index = np.full(len(token_ids), -1, np.int32)
    row = 0
    for digest, (s, e) in zip(digests, spans):
        keyed[s:e] = [image_key(cfg.vocab_size, digest)] * (e - s)
        index[s:e] = np.arange(row, row + e - s)
        row += e - s
    embeds = np.concatenate([np.asarray(f) for f in feats], axis=0)
    return MediaPrompt(token_ids=token_ids, keyed=keyed, index=index, embeds=embeds, spans=spans)
