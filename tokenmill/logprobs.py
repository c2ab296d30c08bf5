"""The logprobs of one position, as the engine computes them and every layer above passes them on: the engine's
messages, LLM's outputs, the API server's logprob fields, beam search."""
from __future__ import annotations

from typing import NamedTuple


class TokenLogprobs(NamedTuple):
    """The logprobs of one position: the token there, its logprob and rank, and the top alternatives.
    A NamedTuple crosses the wire as a plain msgpack array, and reads by name in Python."""
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top_token_ids: list[int]
    top_logprobs: list[float]
