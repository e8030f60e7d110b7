"""Id pools for KV pages and recurrent-state slots (numpy-free, no jax).

Id 0 is the padding sink of both device pools and is never handed out. Allocation is all or
nothing; freeing an id that is not allocated is a bug and raises at once.
"""

from __future__ import annotations


class IdPool:
    def __init__(self, size: int, what: str):
        if size < 2:
            raise ValueError(f"a {what} pool needs at least 2 entries (entry 0 is the padding sink), got {size}")
        self.size = size
        self.what = what
        self._free = list(range(size - 1, 0, -1))  # a stack: low ids are handed out first
        self._is_free = [False] + [True] * (size - 1)

    @property
    def capacity(self) -> int:
        """Usable ids (the sink excluded)."""
        return self.size - 1

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self, n: int = 1) -> list[int] | None:
        """n ids, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for i in out:
            self._is_free[i] = False
        return out

    def alloc_one(self) -> int | None:
        got = self.alloc(1)
        return got[0] if got else None

    def free(self, ids) -> None:
        for i in ids:
            if i <= 0 or i >= self.size or self._is_free[i]:
                raise RuntimeError(f"double free or invalid {self.what} id {i}")
            self._is_free[i] = True
            self._free.append(i)

    def free_ids(self) -> list[int]:
        return list(self._free)

    def all_ids(self) -> list[int]:
        return list(range(1, self.size))

    @staticmethod
    def physical(ids):
        """Device ids of these ids: the same ids (the unified memory facades translate)."""
        return list(ids)


class PagePool(IdPool):
    def __init__(self, size: int, page_size: int):
        super().__init__(size, "page")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)


class SlotPool(IdPool):
    MIN_SLOTS = 4  # sink + a working slot + an extra-buffer slot + one of headroom

    def __init__(self, size: int):
        if size < self.MIN_SLOTS:
            raise ValueError(f"state_slots must be >= {self.MIN_SLOTS} (sink, working, extra buffer, headroom), "
                             f"got {size}")
        super().__init__(size, "slot")
