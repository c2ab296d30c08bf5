"""Reasoning models: the `<think> … </think>` scratchpad.

Two views of the same markup. The API server splits generated *text* into reasoning and content
(ReasoningSplitter, streaming-safe). The engine follows *token ids* (ThinkingTracker): it needs to know, step by
step, whether a request is still thinking, so that a structured-output grammar starts only after thinking ends and
a `thinking_token_budget` can force the end string."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningSpec:
    start: str
    end: str
    # DeepSeek-R1 templates open the block in the prompt, and older ones let the model skip `<think>`: text before
    # the end string is reasoning even when no start string was seen.
    implicit_start: bool = False


REASONING_PARSERS = {
    "deepseek_r1": ReasoningSpec("<think>", "</think>", implicit_start=True),
    "qwen3": ReasoningSpec("<think>", "</think>"),
}


def reasoning_spec(parser: str | None, start: str | None = None, end: str | None = None) -> ReasoningSpec | None:
    """The engine config's --reasoning-parser, with --think-start-str/--think-end-str overriding its strings;
    None when reasoning is off."""
    if parser is None and start is None and end is None:
        return None
    if parser is not None and parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; choose one of {', '.join(REASONING_PARSERS)}")
    base = REASONING_PARSERS[parser] if parser else ReasoningSpec("<think>", "</think>")
    spec = ReasoningSpec(start or base.start, end or base.end, base.implicit_start)
    if not spec.start or not spec.end:
        raise ValueError("the reasoning start and end strings must not be empty")
    return spec


def opens_in_reasoning(spec: ReasoningSpec, last_start: int, last_end: int) -> bool:
    """Whether generation starts inside a thinking block, from where the prompt last opened and closed one
    (-1: never). The chat template may prefill the start string."""
    return last_start > last_end or (spec.implicit_start and last_start == last_end == -1)


def held_back(text: str, marker: str) -> int:
    """The length of the longest end of `text` that could be the start of `marker` (wait for more text)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """Feeds on generated text, returns (reasoning, content) deltas; the markup itself goes to neither."""

    def __init__(self, spec: ReasoningSpec, prompt_text: str):
        self.spec = spec
        opened = opens_in_reasoning(spec, prompt_text.rfind(spec.start), prompt_text.rfind(spec.end))
        self.state = "reasoning" if opened else "undecided"
        self.at_start = True  # a start string first thing in the output is markup, even inside an open block
        self.pending = ""
        self.saw_reasoning = opened

    def feed(self, text: str) -> tuple[str, str]:
        self.pending += text
        start, end = self.spec.start, self.spec.end
        if self.at_start:
            head = self.pending.lstrip()
            if head.startswith(start):
                self.pending, self.state, self.at_start = head[len(start):], "reasoning", False
                self.saw_reasoning = True
            elif start.startswith(head):  # whitespace only, or a prefix of the start string: wait
                return "", ""
            else:
                self.at_start = False
                if self.state == "undecided":
                    self.state = "content"
        reasoning = ""
        if self.state == "reasoning":
            i = self.pending.find(end)
            if i < 0:
                keep = held_back(self.pending, end)
                reasoning, self.pending = self.pending[:len(self.pending) - keep], self.pending[len(self.pending) - keep:]
                return reasoning, ""
            reasoning, self.pending, self.state = self.pending[:i], self.pending[i + len(end):], "content"
        content, self.pending = self.pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once generation ended: unfinished reasoning stays reasoning."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.state == "reasoning" else ("", rest)


def _last_index(ids: list[int], pattern: list[int]) -> int:
    n = len(pattern)
    for i in range(len(ids) - n, -1, -1):
        if ids[i:i + n] == pattern:
            return i
    return -1


class ThinkingTracker:
    """Engine-side, per request: whether it is thinking, how many tokens it has thought, and which token a spent
    `thinking_token_budget` forces next (the end string's tokens, one per step)."""

    def __init__(self, spec: ReasoningSpec, start_ids: list[int], end_ids: list[int], prompt_ids: list[int],
                 budget: int | None):
        self.start_ids, self.end_ids, self.budget = start_ids, end_ids, budget
        self.thinking = opens_in_reasoning(spec, _last_index(prompt_ids, start_ids), _last_index(prompt_ids, end_ids))
        self.num_thinking_tokens = 0

    def forced_token(self, output_ids: list[int]) -> int | None:
        if not self.thinking or self.budget is None or self.num_thinking_tokens < self.budget:
            return None
        # continue the end string from however much of it the output already ends with
        end = self.end_ids
        done = next((k for k in range(len(end) - 1, 0, -1) if output_ids[-k:] == end[:k]), 0)
        return end[done]

    def observe(self, output_ids: list[int]) -> bool:
        """After a token was appended; True if it belongs to the thinking block or its markup (no grammar)."""
        if self.thinking:
            if output_ids[-len(self.end_ids):] == self.end_ids:
                self.thinking = False
            elif self.num_thinking_tokens < (self.budget if self.budget is not None else float("inf")):
                self.num_thinking_tokens += 1
            return True
        if output_ids[-len(self.start_ids):] == self.start_ids:
            self.thinking = True
            return True
        return False
