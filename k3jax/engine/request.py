"""A request's host-side record and the output users see."""

from __future__ import annotations

import dataclasses
import enum
import time

from k3jax.media import MediaPrompt
from k3jax.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued (new, or preempted and waiting to resume)
    RUNNING = "running"  # holds a working slot; prefilling or decoding
    FINISHED = "finished"


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens (including the EOS or stop-completing token)
    text: str
    finish_reason: str | None  # "length" | "eos" | "stop" | "abort" | None while running
    cached_tokens: int  # prompt tokens restored from the prefix cache (not recomputed) at admission
    recomputed_tokens: int  # tokens the model processed for this request (prefill, replay, resume)
    num_preemptions: int
    metrics: dict  # arrival, first_token, finish (perf_counter seconds), ttft_s, e2e_s
    # with SamplingParams.logprobs: per generated token {token id: log-probability} (the sampled token and the
    # most likely ones); None otherwise
    logprobs: list[dict[int, float]] | None = None
    # `LLM.chat`: the reply parsed into content, reasoning and tool calls (`k3jax.xtml.ChatReply`); None otherwise
    message: object = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Request:
    """Everything the scheduler tracks for one request. `fed` is the token sequence the model
    has processed or will process next (prompt, then generated tokens as they are fed back)."""

    def __init__(self, request_id: str, prompt: list[int], sampling: SamplingParams, seed: int, detok=None,
                 media: MediaPrompt | None = None):
        self.id = request_id
        self.prompt = list(prompt)  # with media: image tokens keyed by image (`k3jax.media`), ids >= vocab
        self.media = media
        self.sampling = sampling
        self.seed = seed
        self.detok = detok
        self.status = Status.WAITING
        self.output: list[int] = []
        self.logprobs: list[dict[int, float]] = []  # per output token, with SamplingParams.logprobs
        self.text = ""
        self.finish_reason: str | None = None
        # device resources
        self.slot: int | None = None  # working slot
        self.extra: int | None = None  # extra-buffer slot (snapshot target), lazily allocated
        self.pen_row: int | None = None  # with penalties, while running: its row of the runner's penalty counts
        self.snap_depth = 0  # depth of the snapshot held in `extra`
        self.snap_inflight = False  # a dispatched verify block may still write `extra`
        self.pages: list[int] = []  # page table: page ids for positions [0, len(pages) * page_size)
        self.owned: set[int] = set()  # pages of `pages` this request owns (the rest belong to the tree)
        self.lock_node = None  # deepest radix node this request keeps locked
        self.restore = None  # (slot, node) to copy into the working slot in the first step, if any
        self.plant_at = 0  # chunk-aligned depth where this request should leave a checkpoint
        # progress
        self.computed = 0  # tokens whose KV/state a scheduled step writes (host view, at schedule time)
        self.prefill_target = 0  # set at admission: prompt plus the outputs known then (resume)
        self.pending_row: tuple[int, int] | None = None  # (plan id, row) of the step sampling its next token
        self.scheduled_samples = 0  # sampled tokens already scheduled (they become outputs)
        self.inflight = 0  # dispatched steps whose results are not processed yet
        self.cached_tokens = 0
        self.recomputed = 0
        self.preemptions = 0
        self.aborted = False
        self.metrics = {"arrival": time.perf_counter()}
        self.stream_pos = 0  # tokens already handed to a streaming consumer

    @property
    def fed(self) -> list[int]:
        return self.prompt + self.output

    def media_embeds(self, start: int, n: int):
        """The input rows of fed tokens [start, start + n) for a step (None: all text)."""
        return None if self.media is None else self.media.rows(start, n)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt as the model's vocabulary spells it (image tokens as the media placeholder id)."""
        return self.prompt if self.media is None else self.media.token_ids

    @property
    def in_prefill(self) -> bool:
        return self.computed < self.prefill_target

    def to_output(self) -> RequestOutput:
        m = dict(self.metrics)
        if "first_token" in m:
            m["ttft_s"] = m["first_token"] - m["arrival"]
        if "finish" in m:
            m["e2e_s"] = m["finish"] - m["arrival"]
        return RequestOutput(
            request_id=self.id, prompt_token_ids=list(self.prompt_token_ids), token_ids=list(self.output), text=self.text,
            finish_reason=self.finish_reason, cached_tokens=self.cached_tokens, recomputed_tokens=self.recomputed,
            num_preemptions=self.preemptions, metrics=m,
            logprobs=list(self.logprobs) if self.sampling.logprobs is not None else None,
        )
