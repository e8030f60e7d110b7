"""The drafter interface and the n-gram (prompt lookup) drafter.

A drafter proposes up to `gamma` tokens per request from what the request has seen (and, for model
drafters, the target's hidden states). Proposals never need to be right: verification is exact.
"""

from __future__ import annotations

from typing import Protocol, Sequence


class Drafter(Protocol):
    def propose(self, key: str, tokens: Sequence[int], gamma: int, hidden=None) -> list[int]:
        """Up to `gamma` draft tokens continuing `tokens` (the request's full context so far)."""

    def forget(self, key: str) -> None:
        """Drop what is cached for a finished request."""


class NgramDrafter:
    """Prompt lookup: find the most recent earlier occurrence of the context's last n tokens
    (n from `max_n` down to `min_n`) and propose what followed it. Each request keeps an index of
    its n-grams that grows with its context, so a proposal costs O(max_n + gamma), not O(context)."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError("need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[str, tuple[dict, int]] = {}  # key -> (n-gram -> position after it, indexed length)

    def _update(self, key: str, tokens: Sequence[int]) -> dict:
        index, done = self._index.get(key, ({}, 0))
        # index n-grams ending at positions < len(tokens): the final n-gram is the query, not a match
        for end in range(max(done, 1), len(tokens)):
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    index[tuple(tokens[end - n:end])] = end
        self._index[key] = (index, max(len(tokens), done))
        return index

    def propose(self, key: str, tokens: Sequence[int], gamma: int, hidden=None) -> list[int]:
        if gamma <= 0 or len(tokens) < self.min_n + 1:
            return []
        index = self._update(key, tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            pos = index.get(tuple(tokens[len(tokens) - n:]))
            if pos is not None:
                return list(tokens[pos:pos + gamma])
        return []

    def forget(self, key: str) -> None:
        self._index.pop(key, None)


class OracleDrafter:
    """Drafts from known continuations (tests and benchmarks): for a context that extends one of
    `answers`' prompts, propose the recorded continuation with the first `right(context_len,
    gamma)` tokens correct and the rest wrong. It pins acceptance lengths where a real drafter on
    random weights would have none. Default `right`: a deterministic cycle through 0..gamma+1."""

    def __init__(self, answers: dict, vocab_size: int, right=None):
        self.answers = {tuple(p): list(o) for p, o in answers.items()}
        self.vocab = vocab_size
        self.right = right or (lambda n, gamma: (n * 7) % (gamma + 2))

    def propose(self, key: str, tokens: Sequence[int], gamma: int, hidden=None) -> list[int]:
        n = len(tokens)
        prompt = max((p for p in self.answers if len(p) <= n and tuple(tokens[: len(p)]) == p), key=len, default=None)
        if prompt is None or gamma <= 0:
            return []
        cont = self.answers[prompt][n - len(prompt):][:gamma]
        k = self.right(n, gamma)
        return [t if i < k else (t + 1) % self.vocab for i, t in enumerate(cont)]

    def forget(self, key: str) -> None:
        pass
