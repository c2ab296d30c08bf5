"""--speculative-config: vLLM's JSON shape, e.g. '{"method": "ngram", "num_speculative_tokens": 4,
"prompt_lookup_min": 2, "prompt_lookup_max": 5}', '{"method": "suffix"}' or '{"method": "draft_model", "model":
PATH, "num_speculative_tokens": 4}' (as in vLLM, a "model" without a "method" means draft_model).

Torch-free, like the rest of the config (tokenmill/config.py), so the API server can parse the flag."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.json_flag import parse_json_flag

METHODS = ("ngram", "suffix", "draft_model")


@dataclass
class SpeculativeConfig:
    # None: draft_model when a model is given (vLLM's inference), else ngram
    method: str | None = None
    # Most drafts per request and step. ngram: required in vLLM, 4 here by default; suffix: the tree depth
    # bounds it (vLLM's default there is suffix_decoding_max_tree_depth); draft_model: required, as in vLLM.
    num_speculative_tokens: int | None = None
    # draft_model: the draft (an HF directory or a GGUF file) sharing the target's tokenizer, and its
    # --quantization (None: auto, its weights as they are, as vLLM infers it from the draft).
    model: str | None = None
    quantization: str | None = None
    # ngram (prompt lookup): the longest n-gram of the context's tail, min..max tokens long, found earlier in
    # the prompt or output, proposes the tokens that followed it.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # suffix (vLLM's / Arctic Inference's names): a match is at most max_tree_depth tokens long; a draft is at
    # most max_spec_factor x the match length; a path is followed while its estimated probability (the product
    # of the continuation frequencies along it) stays >= min_token_prob; finished requests' outputs are kept
    # for cross-request matches, the newest max_cached_requests of them.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10_000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # tokenmill's own: choose the draft length per request and step from its measured acceptance and the
    # batch size (tokenmill/engine/spec_decode/adaptive.py); false: always propose up to num_speculative_tokens.
    adaptive: bool = True
    # The most tokens (decode rows plus drafts) a step may verify before drafts are cut; None: the measured
    # default (adaptive.DEFAULT_MAX_VERIFY_TOKENS).
    max_verify_tokens: int | None = None

    def __post_init__(self):
        if self.method is None:
            self.method = "draft_model" if self.model is not None else "ngram"
        if self.method not in METHODS:
            raise ValueError(f"--speculative-config: method must be one of {list(METHODS)}, got {self.method!r}")
        if self.method == "ngram":
            # vLLM's rule: one bound given, the other defaults to it; neither: 5 and 5 in vLLM, 2..5 here (a
            # 135M model's copies are found sooner with shorter keys, and a longer match is preferred anyway).
            if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
                self.prompt_lookup_min, self.prompt_lookup_max = 2, 5
            elif self.prompt_lookup_min is None:
                self.prompt_lookup_min = self.prompt_lookup_max
            elif self.prompt_lookup_max is None:
                self.prompt_lookup_max = self.prompt_lookup_min
            if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
                raise ValueError("--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max")
            if self.num_speculative_tokens is None:
                self.num_speculative_tokens = 4
        elif self.method == "draft_model":
            if self.model is None or self.num_speculative_tokens is None:
                raise ValueError('--speculative-config: method draft_model needs "model" (the draft\'s path) and '
                                 '"num_speculative_tokens"')
        elif self.num_speculative_tokens is None:
            self.num_speculative_tokens = self.suffix_decoding_max_tree_depth
        if self.method != "draft_model" and (self.model is not None or self.quantization is not None):
            raise ValueError(f'--speculative-config: "model" and "quantization" are for method draft_model, not '
                             f"{self.method}")
        if self.num_speculative_tokens < 1:
            raise ValueError("--speculative-config: num_speculative_tokens must be at least 1")
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("--speculative-config: suffix_decoding_max_tree_depth must be >= 1 and "
                             "suffix_decoding_max_cached_requests >= 0")
        if self.max_verify_tokens is not None and self.max_verify_tokens < 2:
            raise ValueError("--speculative-config: max_verify_tokens must be at least 2")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """The flag's JSON text, or (offline LLM) a dict or a SpeculativeConfig."""
        return parse_json_flag(cls, "--speculative-config", value)
