"""Per-request sampling options, with vLLM's field names and defaults."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenmill.kv_transfer_params import KVTransferParams


class ParamError(ValueError):
    """An invalid request parameter; `param` names it, as OpenAI's error JSON does."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint, as in vLLM: a JSON schema (dict or text), any JSON object, a regex, a choice
    among strings, an EBNF grammar (xgrammar's dialect, rule `root`), or a structural tag (JSON text: xgrammar's
    {"type": "structural_tag", "format": ...}, or vLLM's legacy {"structures": [...], "triggers": [...]})."""
    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ParamError("structured output takes exactly one of json, json_object, regex, choice, grammar, "
                             f"structural_tag; got {given or 'none'}", "structured_outputs")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ParamError("choice must be a non-empty list of strings", "guided_choice")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k alternatives per generated token (the sampled one is always given)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # reasoning models (needs a reasoning parser): after this many thinking tokens, force the end-of-thinking string
    thinking_token_budget: int | None = None
    # disaggregated prefill/decode (vLLM's kv_transfer_params): engine/kv_transfer.py
    kv_transfer_params: KVTransferParams | None = None
    # vLLM's: sample among these token ids only
    allowed_token_ids: list[int] | None = None
    # vLLM's: words never generated. The engine reads bad_words_token_ids (each word's tokens, with and without a
    # leading space: bad_words_token_ids()), which the front end (the API server, LLM) fills with its tokenizer.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # vLLM's cache_salt: enters every block hash of the request (cache_salt_keys), so that only requests with the
    # same salt share its cached prefix (tenants who must not learn each other's prompts from cache timings)
    cache_salt: str | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        self.validate()

    def validate(self) -> None:
        if self.n < 1:
            raise ParamError(f"n must be at least 1, got {self.n}", "n")
        if self.cache_salt is not None and not self.cache_salt:
            raise ParamError("cache_salt must be a non-empty string", "cache_salt")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ParamError("allowed_token_ids must not be empty: nothing could be sampled", "allowed_token_ids")
        if self.temperature < 0:
            raise ParamError(f"temperature must be non-negative, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise ParamError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ParamError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ParamError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
                             "frequency_penalty")
        if self.repetition_penalty <= 0:
            raise ParamError(f"repetition_penalty must be positive, got {self.repetition_penalty}",
                             "repetition_penalty")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParamError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ParamError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}", "min_tokens")
        if self.logprobs is not None and self.logprobs < 0:
            raise ParamError(f"logprobs must be non-negative, got {self.logprobs}", "logprobs")
        if self.thinking_token_budget is not None and self.thinking_token_budget < 0:
            raise ParamError(f"thinking_token_budget must be non-negative, got {self.thinking_token_budget}",
                             "thinking_token_budget")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ParamError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}", "prompt_logprobs")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of sample `index` of an n > 1 request: n=1, and a distinct seed if seeded."""
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's rule: each word's tokens as written (its leading spaces stripped), and with one leading space where
    that gives other tokens of the same length (mid-sentence, a word usually comes after a space)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            continue
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    return out


def cache_salt_keys(cache_salt: str | None) -> tuple:
    """The extra keys a salt adds to every block hash (engine/block_hash.py), before a LoRA adapter's: the engine
    keys the blocks with them and the router predicts with them. Tagged, so that they never equal another kind."""
    return (("cache_salt", cache_salt),) if cache_salt else ()
