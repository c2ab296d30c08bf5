"""Suffix speculation (vLLM's `suffix` method, after Arctic Inference's SuffixDecoding): match the context's tail
against the request's own prompt and output and against the outputs of past requests, and propose the
continuation that the matched occurrences most often had.

SuffixDecoding keeps suffix trees, one per request and one global. A depth-bounded suffix tree is a map from
every substring (up to max_tree_depth tokens) to its occurrences; here that map is an index from each bigram to
where it occurred (newest last), and a match is grown backwards from the candidates, which is what walking the
tree down from the root finds, at O(candidates x depth) per step and O(tokens) memory:
- the pattern: the longest tail of the context (up to max_tree_depth tokens) that occurred before; the
  candidates are all its occurrences (the newest MAX_CANDIDATES looked at);
- the draft: walking the tree below the pattern, the most frequent next token among the candidates that still
  agree, while the product of those frequencies (the path's estimated probability) stays >= min_token_prob,
  for at most max_spec_factor x the pattern length tokens (a short match predicts little);
- both sources are searched and the draft with the larger score (the sum of the path probabilities: its
  expected accepted length) wins.
Memory is bounded: a request's own index lives while it runs; finished requests' outputs enter the global
index, of which the newest max_cached_requests are kept (older ones are dropped with their entries)."""
from __future__ import annotations

from collections import OrderedDict

KEY = 2  # tokens of a bigram: the shortest match proposed
MAX_CANDIDATES = 64  # occurrences of a bigram looked at, newest first (a frequent bigram has thousands)


class SuffixIndex:
    """Sequences of tokens and, for every bigram in them, where it ended: (sequence id, position after it)."""

    def __init__(self):
        self.sequences: dict[int, list[int]] = {}
        self.indexed: dict[int, int] = {}
        self.occurrences: dict[tuple[int, int], list[tuple[int, int]]] = {}

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        """Index the tokens of a sequence added since the last call (sequences only grow)."""
        self.sequences[seq_id] = tokens
        start = max(self.indexed.get(seq_id, 0), KEY)
        for stop in range(start, len(tokens)):  # a bigram followed by a token: it has a continuation
            self.occurrences.setdefault((tokens[stop - 2], tokens[stop - 1]), []).append((seq_id, stop))
        self.indexed[seq_id] = max(start, len(tokens))

    def remove(self, seq_id: int) -> None:
        tokens = self.sequences.pop(seq_id, None)
        self.indexed.pop(seq_id, None)
        if tokens is None:
            return
        for stop in range(KEY, len(tokens)):
            key = (tokens[stop - 2], tokens[stop - 1])
            entries = self.occurrences.get(key)
            if entries is not None:
                kept = [e for e in entries if e[0] != seq_id]
                if kept:
                    self.occurrences[key] = kept
                else:
                    del self.occurrences[key]

    def match(self, context: list[int], max_depth: int) -> tuple[int, list[tuple[list[int], int]]]:
        """The longest pattern length and its occurrences as (sequence, position after the match)."""
        if len(context) < KEY:
            return 0, []
        entries = self.occurrences.get((context[-2], context[-1]))
        if not entries:
            return 0, []
        best, found = 0, []
        limit = min(max_depth, len(context))
        for seq_id, stop in reversed(entries[-MAX_CANDIDATES:]):
            seq = self.sequences[seq_id]
            n = KEY
            while n < limit and n < stop and seq[stop - n - 1] == context[-n - 1]:
                n += 1
            if n > best:
                best, found = n, [(seq, stop)]
            elif n == best:
                found.append((seq, stop))
        return best, found


def walk(candidates: list[tuple[list[int], int]], max_tokens: int, min_prob: float) -> tuple[list[int], float]:
    """The draft below a matched pattern: at each step the most frequent next token among the candidates that
    still agree; returns it and its score (the sum of the path probabilities)."""
    draft, score, prob = [], 0.0, 1.0
    live = candidates
    while len(draft) < max_tokens and live:
        counts: dict[int, int] = {}
        for seq, pos in live:
            if pos < len(seq):
                counts[seq[pos]] = counts.get(seq[pos], 0) + 1
        if not counts:
            break
        token, count = max(counts.items(), key=lambda kv: kv[1])
        prob *= count / len(live)
        if prob < min_prob:
            break
        draft.append(token)
        score += prob
        live = [(seq, pos + 1) for seq, pos in live if pos < len(seq) and seq[pos] == token]
    return draft, score


class SuffixProposer:
    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float):
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.local: dict[str, SuffixIndex] = {}  # running request → its prompt and output
        self.global_index = SuffixIndex()  # finished requests' outputs
        self.cached: OrderedDict[int, None] = OrderedDict()  # global sequence ids, oldest first
        self._next_id = 0

    def propose(self, request_id: str, tokens: list[int], k: int) -> list[int]:
        index = self.local.get(request_id)
        if index is None:
            index = self.local[request_id] = SuffixIndex()
        index.extend(0, tokens)
        best, best_score = [], 0.0
        for source in (index, self.global_index):
            length, candidates = source.match(tokens, self.max_depth)
            if not candidates:
                continue
            limit = min(k, int(self.max_spec_factor * length))
            draft, score = walk(candidates, limit, self.min_token_prob)
            if score > best_score:
                best, best_score = draft, score
        return best

    def finish(self, request_id: str, tokens: list[int], num_prompt_tokens: int) -> None:
        """The request's output joins the global index (past requests' outputs), the oldest leaving past the cap."""
        self.local.pop(request_id, None)
        output = tokens[num_prompt_tokens:]
        if self.max_cached_requests == 0 or len(output) <= KEY:
            return
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self.global_index.extend(seq_id, list(output))
        self.cached[seq_id] = None
        while len(self.cached) > self.max_cached_requests:
            old, _ = self.cached.popitem(last=False)
            self.global_index.remove(old)
