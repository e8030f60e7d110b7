"""Continuous-batching scheduler over the hybrid prefix cache (host side, no jax).

Every step it (1) gives each decoding request one token, (2) fills the prefill token budget with
chunks of prefilling requests and newly admitted ones, (3) plans the state transitions that run
inside the step: restore of a cached checkpoint into the working slot, snapshot of the working slot
into the extra buffer at chunk-aligned depths, and donation of snapshots to the radix tree (at
Marconi branch points, and at the end of a request). Results are applied by `process`, one step
late in overlap mode: a decoding request's next token then comes from the in-flight step through a
placeholder resolved on device.

Memory never runs out by crashing: a step that needs pages or slots first skips caching, then
evicts cached KV / checkpoints, then preempts the newest running request (its computed prefix goes
into the tree; it resumes later with identical greedy output).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time

from k3jax.cache.pool import PagePool, SlotPool
from k3jax.cache.radix import RadixTree
from k3jax.engine.request import Request, Status
from k3jax.sampling import logprob_entry

POLICIES = ("marconi", "every_chunk", "leaf_only")


@dataclasses.dataclass
class SeqPlan:
    req: Request
    tokens: list[int]  # token ids; a negative entry -(1+row) is the in-flight step's sample of that row
    start: int  # context length before this chunk
    restore_src: int = 0  # checkpoint slot to copy into the working slot first (0: none)
    snap_dst: int = 0  # extra-buffer slot that receives the state after this chunk (0: none)
    sample: bool = False  # this row's sampled token becomes an output token
    snap_at: int = 0  # verify block: snap_dst gets the state after this many block tokens, if accepted


@dataclasses.dataclass
class StepPlan:
    decode: list[SeqPlan]
    prefill: list[SeqPlan]
    id: int = 0  # set when dispatched
    # requests admitted by this plan that have penalties: the runner writes their penalty-count rows (`pen_row`,
    # from the prompt and the outputs so far) before the step
    pen_init: list[Request] = dataclasses.field(default_factory=list)

    def __bool__(self):
        return bool(self.decode or self.prefill)

    def rows(self):
        return list(enumerate(self.decode + self.prefill))


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = 16
    num_pages: int = 1024
    num_slots: int = 64
    max_running: int = 64
    prefill_budget: int = 256  # prefill tokens per step (the largest prefill bucket)
    max_prefill_seqs: int = 4
    prefix_cache: bool = True
    policy: str = "marconi"
    max_ckpt_per_path: int = 4
    max_checkpoints: int | None = None  # total checkpoint budget (LRU beyond it); None: slot pool bound
    eos_token_id: int | None = None
    spec_gamma: int = 0  # > 0: speculative decoding, blocks of up to spec_gamma drafts per decode step

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"checkpoint policy must be one of {POLICIES}, got {self.policy!r}")


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, memory=None, drafter=None):
        """`memory`: a `UnifiedMemory` whose facades replace the separate page and slot pools.
        `drafter` (with cfg.spec_gamma > 0): a `k3jax.spec.Drafter` proposing each verify block."""
        self.cfg = cfg
        self.memory = memory
        self.drafter = drafter
        if cfg.spec_gamma and drafter is None:
            raise ValueError("spec_gamma > 0 needs a drafter")
        self.pages = memory.pages if memory is not None else PagePool(cfg.num_pages, cfg.page_size)
        self.slots = memory.slots if memory is not None else SlotPool(cfg.num_slots)
        # baselines for the benchmark: every_chunk keeps every chunk-end checkpoint (no superseding)
        self.tree = RadixTree(cfg.page_size, cfg.max_ckpt_per_path, supersede=cfg.policy != "every_chunk",
                              max_checkpoints=cfg.max_checkpoints) if cfg.prefix_cache else None
        self.align = RadixTree(cfg.page_size).align
        if cfg.prefill_budget < self.align:
            raise ValueError(f"prefill budget {cfg.prefill_budget} is below the chunk alignment {self.align}")
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # not finished
        self.finished: list[Request] = []  # finished since the last drain_finished()
        self.stats = collections.Counter()
        self._fresh_ckpts: set[int] = set()  # checkpoints planted by the step being built
        # rows of the runner's penalty counts (row 0 is nobody's): one per running request with penalties
        self._pen_free = list(range(cfg.max_running, 0, -1))
        self._pen_new: list[Request] = []  # admitted by the plan being built, with penalties
        self._plan_id = 0

    # ---- requests -----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.id in self.requests:
            raise ValueError(f"duplicate request id {req.id!r}")
        self.requests[req.id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        req.aborted = True
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        self._finish(req, "abort")
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- memory -------------------------------------------------------------------------------
    def _alloc_slot(self) -> int | None:
        s = self.slots.alloc_one()
        if s is None and self.tree is not None:
            self.slots.free(self.tree.evict_checkpoints(1))
            s = self.slots.alloc_one()
        return s

    def _alloc_pages(self, n: int, protect: set, preempt: bool, req: Request) -> list[int] | None:
        got = self.pages.alloc(n)
        if got is None and self.tree is not None:
            pages, slots = self.tree.evict_kv(n - self.pages.free_count)
            self.pages.free(pages)
            self.slots.free(slots)
            self.stats["evicted_pages"] += len(pages)
            got = self.pages.alloc(n)
        while got is None and preempt:
            victims = [r for r in self.running if r not in protect and r is not req]
            if not victims:
                return None
            self._preempt(victims[-1])
            got = self.pages.alloc(n)
            if got is None and self.tree is not None:
                pages, slots = self.tree.evict_kv(n - self.pages.free_count)
                self.pages.free(pages)
                self.slots.free(slots)
                got = self.pages.alloc(n)
        return got

    def _grow(self, req: Request, n_tokens: int, protect: set, preempt: bool) -> bool:
        """Pages for req's first n_tokens; may evict cached KV and (preempt=True) preempt running
        requests other than req and those in `protect`."""
        need = self.pages.pages_for(n_tokens) - len(req.pages)
        if need <= 0:
            return True
        got = self._alloc_pages(need, protect, preempt, req)
        if got is None:
            return False
        req.pages.extend(got)
        req.owned.update(got)
        return True

    def _snapshot_slot(self, req: Request) -> int:
        """The extra-buffer slot for a snapshot now (0: skip caching, no slot free)."""
        if self.tree is None:
            return 0
        if req.extra is None:
            req.extra = self._alloc_slot()
            if req.extra is None:
                self.stats["skipped_snapshots"] += 1
                return 0
        return req.extra

    def _publish(self, req: Request, depth: int):
        """Put req's first `depth` tokens (whole pages; KV written by dispatched or this step's
        work) into the tree, so later requests can match them and detect branch points. The
        request then locks the deeper node, which protects the pages the tree took from it."""
        ps = self.cfg.page_size
        depth = (depth // ps) * ps
        if req.lock_node is not None and req.lock_node.depth >= depth:
            return req.lock_node
        node, taken = self.tree.insert(req.fed[:depth], req.pages[: depth // ps])
        req.owned.difference_update(taken)
        self.tree.lock(node)
        if req.lock_node is not None:
            self.tree.unlock(req.lock_node)
        req.lock_node = node
        self.tree.touch(node)
        return node

    def _donate(self, req: Request, depth: int) -> None:
        """Give the extra buffer (holding the state at `depth`) to the tree node at `depth`."""
        node = self._publish(req, depth)
        self._fresh_ckpts.add(req.extra)
        self.slots.free(self.tree.set_checkpoint(node, req.extra, branch=depth == req.plant_at))
        req.extra = None
        self.stats["donated_checkpoints"] += 1

    # ---- admission ----------------------------------------------------------------------------
    def _admit(self, req: Request) -> bool:
        req.prefill_target = len(req.fed)
        start, node, plant = 0, None, 0
        if self.tree is not None:
            m = self.tree.match(req.fed[: req.prefill_target])
            node = m.ckpt_node
            # restore from the deepest usable checkpoint: one that leaves a token to compute and
            # was not planted by the step being built (its snapshot is not written yet)
            while node is not None and (node.ckpt is None or node.depth > req.prefill_target - 1
                                        or node.ckpt in self._fresh_ckpts):
                node = node.parent if node.parent is not self.tree.root else None
            start = node.depth if node is not None else 0
            if self.cfg.policy == "marconi":
                a = (min(m.kv_len, req.prefill_target - 1) // self.align) * self.align
                plant = a if a > start else 0
            if node is not None:
                self.tree.lock(node)
                self.tree.pin_ckpt(node)
        slot = self._alloc_slot()
        if slot is None:
            if node is not None:
                self.tree.unpin_ckpt(node)
                self.tree.unlock(node)
            return False
        req.slot, req.status, req.plant_at = slot, Status.RUNNING, plant
        if req.sampling.needs_logit_row:  # (running requests <= max_running: a row is always free)
            req.pen_row = self._pen_free.pop()
            self._pen_new.append(req)
        req.pages, req.owned = [], set()
        if node is not None:
            self.tree.touch(node)
            req.lock_node, req.restore = node, (node.ckpt, node)
            req.pages = self.tree.path_pages(node)
        req.computed = start
        if not req.preemptions:
            req.cached_tokens = start
        self.running.append(req)
        return True

    def _release(self, req: Request, cache: bool) -> None:
        """Return a running request's slots and pages; put its computed prefix into the tree."""
        ps = self.cfg.page_size
        if req.restore is not None:
            self.tree.unpin_ckpt(req.restore[1])
            req.restore = None
        # tokens whose KV is written (a verify block that hit a stop condition keeps fewer tokens
        # than it computed)
        done = min(req.computed, len(req.fed))
        if self.tree is not None and cache and done >= ps:
            n = (done // ps) * ps
            node, taken = self.tree.insert(req.fed[:n], req.pages[: n // ps])
            req.owned.difference_update(taken)
            self.tree.touch(node)
            # (a verify block in flight may still overwrite the extra buffer: then it is not donated)
            if req.extra is not None and 0 < req.snap_depth <= n and not req.snap_inflight:
                snode, _ = self.tree.insert(req.fed[: req.snap_depth], req.pages[: req.snap_depth // ps])
                self.slots.free(self.tree.set_checkpoint(snode, req.extra))
                req.extra = None
        self.pages.free(sorted(req.owned))
        self.slots.free([s for s in (req.slot, req.extra) if s is not None])
        if req.pen_row is not None:  # a step still in flight may count into it: the next owner's init comes later
            self._pen_free.append(req.pen_row)
            req.pen_row = None
        if req.lock_node is not None:
            self.tree.unlock(req.lock_node)
        req.slot = req.extra = req.lock_node = None
        req.pages, req.owned, req.snap_depth, req.plant_at = [], set(), 0, 0
        if req in self.running:
            self.running.remove(req)

    def _preempt(self, req: Request) -> None:
        self._release(req, cache=True)
        req.status = Status.WAITING
        req.preemptions += 1
        req.pending_row = None
        self.waiting.appendleft(req)
        self.stats["preemptions"] += 1

    def _finish(self, req: Request, reason: str) -> None:
        if req.status is Status.RUNNING:
            self._release(req, cache=True)
        req.status, req.finish_reason = Status.FINISHED, reason
        if self.drafter is not None:
            self.drafter.forget(req.id)
        req.metrics["finish"] = time.perf_counter()
        self.requests.pop(req.id, None)
        self.finished.append(req)

    def drain_finished(self) -> list[Request]:
        out, self.finished = self.finished, []
        return out

    # ---- one step -----------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan(decode=[], prefill=[])
        planned: set = set()
        align = self.align
        ps = self.cfg.page_size
        for req in list(self.running):
            if req.status is not Status.RUNNING or req.in_prefill or req.scheduled_samples >= req.sampling.max_new_tokens:
                continue  # (a request preempted earlier in this loop is WAITING)
            if len(plan.decode) == self.cfg.max_running:
                break
            if self.cfg.spec_gamma:
                if self._schedule_block(req, plan, planned):
                    planned.add(req)
                continue
            if req.computed >= len(req.pages) * ps and not self._grow(req, req.computed + 1, planned, preempt=True):
                continue  # nothing left to preempt; it waits for memory
            i = req.computed - len(req.prompt)
            if i < len(req.output):
                tok = req.output[i]
            else:  # sampled by the in-flight step: resolved on device
                assert req.pending_row is not None and req.pending_row[0] == self._plan_id, "no pending sample"
                tok = -(1 + req.pending_row[1])
            end = req.computed + 1
            snap = self._snapshot_slot(req) if end % align == 0 else 0
            plan.decode.append(SeqPlan(req, [tok], req.computed, snap_dst=snap, sample=True))
            self._advance(req, end, snap)
            planned.add(req)

        budget = self.cfg.prefill_budget
        candidates = [r for r in self.running if r.in_prefill and r not in planned]  # set lookups
        while budget > 0 and len(plan.prefill) < self.cfg.max_prefill_seqs:
            fresh = not candidates
            if candidates:
                req = candidates.pop(0)
            else:  # admit only with room for a whole aligned chunk (or the whole rest of a short prompt)
                req = next((r for r in self.waiting if r.inflight == 0), None)
                if req is None or budget < align or len(self.running) >= self.cfg.max_running or not self._admit(req):
                    break
                self.waiting.remove(req)
            end = min(req.prefill_target, req.computed + budget)
            # chunks end at aligned depths (checkpoint candidates); with the cache on, the unaligned
            # tail of the prompt runs as its own chunk so the deepest aligned state gets a snapshot
            if end < req.prefill_target or (self.tree is not None and (end // align) * align > req.computed):
                end = (end // align) * align
            if req.plant_at and req.computed < req.plant_at < end:
                end = req.plant_at
            # the oldest running request may preempt newer ones, so prefill always progresses
            ok = end > req.computed and self._grow(req, end, planned, preempt=req is self.running[0])
            if not ok:
                if fresh:
                    self._unadmit(req)
                    break
                continue
            restore = req.restore[0] if req.restore is not None else 0
            snap = self._snapshot_slot(req) if end % align == 0 else 0
            sample = end == req.prefill_target
            plan.prefill.append(SeqPlan(req, req.fed[req.computed:end], req.computed, restore, snap, sample))
            budget -= end - req.computed
            self._advance(req, end, snap)
            planned.add(req)
        self._fresh_ckpts.clear()
        plan.pen_init = [r for r in self._pen_new if r.pen_row is not None]
        self._pen_new = []
        return plan

    def _schedule_block(self, req: Request, plan: StepPlan, planned: set) -> bool:
        """A verify block for a decoding request: its last sampled token and up to gamma drafts.
        The request's host view (computed, output) advances when the step's result is processed,
        so a request with a step in flight waits (with overlap it runs every other step)."""
        if req.inflight:
            return False
        assert req.computed == len(req.fed) - 1, f"{req.id}: a verify block starts at the last sampled token"
        remaining = req.sampling.max_new_tokens - len(req.output)
        drafts = self.drafter.propose(req.id, req.fed, min(self.cfg.spec_gamma, remaining - 1))
        if req.media is not None:  # a generated token is never an image key: a draft stops before one
            drafts = list(itertools.takewhile(lambda t: t not in req.media.key_ids, drafts))
        n = 1 + len(drafts)
        if not self._grow(req, req.computed + n, planned, preempt=True):
            return False  # nothing left to preempt; it waits for memory
        # a checkpoint boundary inside the block: snapshot there if the block gets that far
        b = (req.computed // self.align + 1) * self.align
        snap_at = b - req.computed if b <= req.computed + n else 0
        snap = self._snapshot_slot(req) if snap_at else 0
        plan.decode.append(SeqPlan(req, [req.fed[-1], *drafts], req.computed, snap_dst=snap, sample=True,
                                   snap_at=snap_at if snap else 0))
        req.inflight += 1
        req.snap_inflight = bool(snap)
        self.stats["spec_drafted"] += len(drafts)
        return True

    def _process_block(self, sp: SeqPlan, out) -> bool:
        """Apply a verify block's result (out: [count, tokens...]). Returns whether tokens arrived."""
        req = sp.req
        req.snap_inflight = False
        if req.status is Status.FINISHED or req.aborted:
            return False
        n = int(out[0])
        self.stats["spec_blocks"] += 1
        self.stats["spec_accepted"] += n - 1
        self.stats["computed_tokens"] += n
        req.recomputed += n
        if req.status is Status.RUNNING:
            req.computed = sp.start + n
            if sp.snap_at and n >= sp.snap_at:
                req.snap_depth = sp.start + sp.snap_at
                self.stats["spec_block_snapshots"] += 1
        for tok in out[1: 1 + n]:
            if self._emit(req, int(tok)):
                break
        req.scheduled_samples = len(req.output)
        return True

    def _unadmit(self, req: Request) -> None:
        """Undo an admission that could not get its first chunk's pages."""
        self._release(req, cache=False)
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    def _advance(self, req: Request, end: int, snap: int) -> None:
        """Host bookkeeping of a scheduled chunk ending at `end`."""
        self.stats["computed_tokens"] += end - req.computed
        req.recomputed += end - req.computed
        req.computed = end
        req.inflight += 1
        if snap:
            req.snap_depth = end
            donate = self.cfg.policy == "every_chunk" and req.in_prefill or end == req.plant_at
            if donate and self.tree is not None:
                self._donate(req, end)
        if self.tree is not None and req.in_prefill:
            self._publish(req, end)
        if req.restore is not None:  # the restore copy is issued with this step
            self.stats["restored_tokens"] += req.restore[1].depth
            self.tree.unpin_ckpt(req.restore[1])
            req.restore = None

    def commit(self, plan: StepPlan) -> None:
        """The plan was dispatched: remember which row samples each request's next token."""
        self._plan_id += 1
        plan.id = self._plan_id
        for row, sp in plan.rows():
            if sp.sample:
                sp.req.pending_row = (plan.id, row)
                sp.req.scheduled_samples += 1

    # ---- results ------------------------------------------------------------------------------
    def process(self, plan: StepPlan, tokens, logprobs=None) -> list[Request]:
        """Apply a finished step's sampled tokens. Returns the requests that got a token. `logprobs`: a callable
        returning the step's `token_logprobs` host arrays (or None), called only if a request wants them."""
        touched = []
        for row, sp in plan.rows():
            req = sp.req
            req.inflight -= 1
            if not sp.sample:
                continue
            if req.pending_row == (plan.id, row):
                req.pending_row = None
            if req.status is Status.FINISHED or req.aborted:
                continue
            if self.cfg.spec_gamma and row < len(plan.decode):  # a verify block
                if self._process_block(sp, tokens[row]):
                    touched.append(req)
                continue
            tok = int(tokens[row][1] if self.cfg.spec_gamma else tokens[row])
            lp = logprobs() if req.sampling.logprobs is not None and logprobs is not None else None
            self._emit(req, tok, None if lp is None else logprob_entry(tok, req.sampling.logprobs, row, lp))
            touched.append(req)
        return touched

    def _emit(self, req: Request, tok: int, logprobs: dict | None = None) -> bool:
        """Append one output token (and its `logprob_entry`) and apply the stop conditions. Returns whether req
        finished."""
        req.output.append(tok)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        req.metrics.setdefault("first_token", time.perf_counter())
        if req.detok is not None:
            req.text += req.detok.push(tok)
        sp = req.sampling
        reason = sp.token_stop(tok, self.cfg.eos_token_id)
        if reason is None and sp.stop_strings and any(s in req.text[-(len(s) + 64):] for s in sp.stop_strings):
            reason = "stop"
        if reason is None and len(req.output) >= sp.max_new_tokens:
            reason = "length"
        if reason is None:
            return False
        if req.detok is not None:
            req.text += req.detok.flush()
        if req.status is Status.WAITING:  # preempted while this step was in flight
            self.waiting.remove(req)
        self._finish(req, reason)
        return True

    # ---- invariants ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every page, slot and penalty row is free or has exactly one owner; raises AssertionError otherwise."""
        page_owner: dict[int, str] = {}
        slot_owner: dict[int, str] = {}
        pen_owner: dict[int, str] = {}

        def own(table, ids, who):
            for i in ids:
                assert i not in table, f"id {i} owned by both {table[i]} and {who}"
                table[i] = who

        own(page_owner, self.pages.free_ids(), "free list")
        own(slot_owner, self.slots.free_ids(), "free list")
        for req in self.running:
            assert req.slot is not None, f"running request {req.id} has no working slot"
            own(page_owner, req.owned, f"request {req.id}")
            assert req.owned <= set(req.pages), f"request {req.id} owns pages outside its page table"
            own(slot_owner, [s for s in (req.slot, req.extra) if s is not None], f"request {req.id}")
            assert (req.pen_row is not None) == req.sampling.needs_logit_row, f"{req.id}: penalty row mismatch"
            own(pen_owner, [req.pen_row] if req.pen_row is not None else [], f"request {req.id}")
        own(pen_owner, self._pen_free, "penalty free list")
        assert set(pen_owner) == set(range(1, self.cfg.max_running + 1)), "a penalty row is lost"
        for req in list(self.requests.values()) + self.finished:
            if req.status is not Status.RUNNING:
                assert req.slot is None and not req.owned and req.lock_node is None, f"{req.id} leaks resources"
                assert req.pen_row is None, f"{req.id} leaks its penalty row"
                assert req not in self.running
        if self.tree is not None:
            self.tree.check()
            own(page_owner, self.tree.all_pages(), "radix tree")
            own(slot_owner, self.tree.all_ckpt_slots(), "radix tree checkpoint")
            locks = sum(1 for r in self.running if r.lock_node is not None)
            assert self.tree.root.lock == 1 + locks, "radix locks do not match the running requests"
        assert set(page_owner) == set(self.pages.all_ids()), "a page is lost"
        assert set(slot_owner) == set(self.slots.all_ids()), "a slot is lost"
        if self.memory is not None:
            self.memory.check()
