"""`load_model` and `Model`: config + parameters + tokenizer, with a plain full forward."""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from typing import Sequence

import numpy as np

from k3jax.config import ModelConfig, preset, preset_names
from k3jax.engine.runner import SeqWork, pack_step
from k3jax.model.forward import Params, is_split, split_layers, step
from k3jax.state import init_state

LOGITS_PAGE_SIZE = 64
VISION_CACHE_BYTES = 512 << 20  # the vision tower's outputs a model keeps for repeated images


@dataclasses.dataclass
class Model:
    config: ModelConfig
    params: Params
    tokenizer: object
    impl: str = "auto"  # kernel choice: "auto" picks the Pallas kernels on a Hopper GPU, XLA elsewhere
    mesh: object = None  # a jax.sharding.Mesh: params laid out by sharding.rules, steps sharded on it
    vision_params: object = None  # `k3jax.model.vision.VisionParams` of a vision model (replicated on a mesh)
    vision_cache_bytes: int = VISION_CACHE_BYTES  # the tower's outputs kept by image digest (LRU); 0: none
    chat_template: str | None = None  # a checkpoint's Jinja chat template; None: the built-in Kimi format (`k3jax.xtml`)

    def __post_init__(self):
        self._vision_cache: collections.OrderedDict = collections.OrderedDict()  # digest -> rows (a fresh one per
        self._vision_lock = threading.Lock()  # model, `dataclasses.replace` included: rows belong to these params)
        self.vision_cache_hits = 0
        self._chat_format = None

    @property
    def chat_format(self):
        """`k3jax.xtml.ChatFormat` of this model: messages -> prompt ids and images; reply ids -> content,
        reasoning and tool calls (raises ValueError if the tokenizer cannot chat)."""
        if self._chat_format is None:
            from k3jax.xtml import ChatFormat

            self._chat_format = ChatFormat.for_model(self)
        return self._chat_format

    def encode_images(self, images, keys=None) -> list[np.ndarray]:
        """The projector's output rows of each preprocessed image (`k3jax.model.vision.preprocess_image`:
        (patches, grid) pairs): host arrays [tokens, hidden] in the model's dtype. One jitted program per
        patch bucket (`k3jax.model.vision.encode_image`). `keys` (one digest per image, `k3jax.media`): rows
        already computed for a digest are reused (an LRU of at most `vision_cache_bytes`), so a repeated image
        skips the tower."""
        if self.config.vision is None or self.vision_params is None:
            raise ValueError(f"model {self.config.name!r} has no vision tower")
        import jax.numpy as jnp

        from k3jax.model.vision import encode, encode_image

        dt = jnp.dtype(self.config.dtype)  # the step's `embeds` dtype (one compiled variant: `ModelRunner.warmup`)
        keys = list(keys) if keys is not None else [None] * len(images)
        out = []
        for (patches, grid), key in zip(images, keys):
            with self._vision_lock:
                rows = self._vision_cache.get(key) if key is not None else None
                if rows is not None:
                    self._vision_cache.move_to_end(key)
                    self.vision_cache_hits += 1
            if rows is None:  # an image: padded to its patch bucket (one compile per bucket); a video chunk: its grid
                fn = encode_image if grid[0] == 1 else lambda p, v, x, g: encode(p, v, x, (g,))
                rows = np.asarray(fn(self.vision_params, self.config.vision, patches, tuple(grid)).astype(dt))
                if key is not None and rows.nbytes <= self.vision_cache_bytes:
                    with self._vision_lock:
                        self._vision_cache[key] = rows
                        while sum(r.nbytes for r in self._vision_cache.values()) > self.vision_cache_bytes:
                            self._vision_cache.popitem(last=False)
            out.append(rows)
        return out

    def step_fn(self):
        """`(params, state, batch) -> (logits, state)`, state donated: the jitted forward, or on a mesh
        the sharded one (`sharding.step.make_sharded_step`)."""
        if self.mesh is None:
            return lambda params, state, batch: step(params, state, batch, self.config, self.impl)
        from sharding.step import make_sharded_step

        return make_sharded_step(self.config, self.mesh, impl=self.impl, split=is_split(self.params))

    def init_state(self, slots: int, pages: int, page_size: int):
        """A zeroed device state for `step_fn` (sharded on the mesh, if any)."""
        if self.mesh is None:
            return init_state(self.config, slots, pages, page_size)
        from sharding.step import make_sharded_step

        return make_sharded_step(self.config, self.mesh, impl=self.impl, split=is_split(self.params)).init_state(
            slots, pages, page_size)

    def logits(self, token_ids: Sequence[int], images=None) -> np.ndarray:
        """One plain forward over `token_ids` from an empty context: f32 logits `[T, vocab]`. `images`: a
        vision model's images for the prompt's media placeholders (`k3jax.media.prepare`); T then counts the
        expanded prompt."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise ValueError("token_ids is empty")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        embeds = None
        if images:
            from k3jax.media import prepare

            media = prepare(self, ids.tolist(), images)
            ids, embeds = np.asarray(media.keyed, np.int64), media.rows(0, len(media.keyed))
        T = int(ids.size)
        P = -(-T // 64) * 64
        n_pages = -(-T // LOGITS_PAGE_SIZE)
        state = self.init_state(slots=2, pages=n_pages + 1, page_size=LOGITS_PAGE_SIZE)
        work = SeqWork(tokens=ids.tolist(), start=0, slot=1, pages=list(range(1, n_pages + 1)), all_logits=True,
                       embeds=embeds)
        packed = pack_step([], [work], D=0, P=P, NP=1, pages_per_seq=n_pages, R=P)
        out, _ = self.step_fn()(self.params, state, packed.batch)
        return np.asarray(out)[packed.rows[0]]


def load_model(name_or_dir: str, *, seed: int = 0, mesh=None, dtype: str | None = None) -> Model:
    """A preset name (random weights, seeded) or a checkpoint directory (safetensors or orbax).

    `mesh` ("tp=2", "tp=4,ep=2", "dp=2,tp=2", or a Mesh): every weight is placed directly into its
    shards (`sharding.rules.param_shardings`; no full host copy of a checkpoint), and `Model.logits`
    and engines built on the model run sharded on that mesh. The parameters come back in the
    per-layer layout (`k3jax.model.forward.split_layers`; the stacked arrays are freed field by field);
    `stack_layers` gives the stacked layout back (what the checkpoint writers take)."""
    from k3jax.model.init import init_params
    from k3jax.tokenizer import load_tokenizer
    from k3jax.xtml import load_template

    shardings = None
    if mesh is not None:
        from sharding.mesh import make_mesh
        from sharding.rules import param_shardings

        mesh = make_mesh(mesh)
        shardings = lambda cfg: param_shardings(cfg, mesh)
    if os.path.isdir(name_or_dir):
        from k3jax.weights import load_checkpoint

        cfg, params = load_checkpoint(name_or_dir, dtype=dtype, shardings=shardings)
        tok = load_tokenizer(name_or_dir, cfg)
        template = load_template(name_or_dir)
    else:
        if os.sep in name_or_dir or name_or_dir.startswith("."):
            raise FileNotFoundError(f"no checkpoint directory at {name_or_dir!r}")
        if name_or_dir not in preset_names():
            raise ValueError(
                f"unknown model {name_or_dir!r}: not a directory and not a preset ({', '.join(preset_names())})"
            )
        cfg = preset(name_or_dir)
        if dtype:
            cfg = cfg.replace(dtype=dtype)
        params = init_params(cfg, seed, shardings=shardings(cfg) if shardings else None)
        tok = load_tokenizer(None, cfg)
        template = None
    # per-layer arrays: the forward never slices stacked weights (`split_layers`)
    split_sh = None
    if mesh is not None:
        from sharding.rules import split_shardings

        split_sh = split_shardings(shardings(cfg), cfg)
    params = split_layers(params, split_sh, consume=True)
    vision = None
    if cfg.vision is not None:
        vision = _load_vision(name_or_dir, cfg, seed, dtype)
        if mesh is not None:  # small: every device keeps the whole tower
            import jax
            from jax.sharding import NamedSharding, PartitionSpec

            vision = jax.device_put(vision, NamedSharding(mesh, PartitionSpec()))
    return Model(config=cfg, params=params, tokenizer=tok, mesh=mesh, vision_params=vision, chat_template=template)


def _load_vision(name_or_dir: str, cfg: ModelConfig, seed: int, dtype: str | None):
    """The vision tower's parameters: from the checkpoint directory, or random (seeded apart from the text
    weights, which do not change with it) for a preset."""
    if os.path.isdir(name_or_dir):
        from k3jax.weights import load_vision

        return load_vision(name_or_dir, cfg, dtype=dtype)
    import jax

    from k3jax.model.vision import init_vision_params

    return init_vision_params(cfg.vision, jax.random.fold_in(jax.random.PRNGKey(seed), 0x56495331), cfg.dtype)
