"""Prompt lookup (vLLM's `ngram` method): the context's last n tokens, for the longest n in
prompt_lookup_max..prompt_lookup_min that occurred earlier in the prompt or output, propose the tokens that
followed that earlier occurrence (its most recent one: in an edit or a copy the latest match is the one being
followed).

vLLM scans the whole context on every step (KMP, compiled with numba). Here each request keeps a hash index from
every n-gram to where it last ended, extended by the tokens appended since the last call, so a proposal costs
O(prompt_lookup_max) dictionary look-ups however long the context is."""
from __future__ import annotations


class NgramIndex:
    """One request's n-grams (n in min_n..max_n) → the position just after their latest occurrence."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.next_pos: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in the index

    def propose(self, tokens: list[int], k: int) -> list[int]:
        # Index every n-gram that has a continuation, i.e. ends before the last token; the context's own tail
        # is never its own match.
        end = len(tokens) - 1
        for stop in range(max(self.indexed, self.min_n), end + 1):
            for n in range(self.min_n, min(self.max_n, stop) + 1):
                self.next_pos[tuple(tokens[stop - n:stop])] = stop
        self.indexed = max(self.indexed, end + 1)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self.next_pos.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + k]
        return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        index = self.indexes.get(request_id)
        if index is None:
            index = self.indexes[request_id] = NgramIndex(self.min_n, self.max_n)
        return index.propose(tokens, k)

    def finish(self, request_id: str, tokens: list[int], num_prompt_tokens: int) -> None:
        self.indexes.pop(request_id, None)
