"""What every route shares once the engine is ready: the engine client, the tokenizer, the flags, and the checks
a request passes before anything reaches the engine (model name, the engine's own limits, backpressure)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from tokenmill.engine.messages import EngineReady, validate_request
from tokenmill.reasoning import ReasoningSpec
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.engine_client import EngineClient
from tokenmill.server.errors import ModelNotFound, Overloaded
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.server_config import ServerConfig


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: object
    engine: EngineReady
    config: ServerConfig
    model_root: str  # the --model the server was started with: always accepted as a model name
    reasoning: ReasoningSpec | None = None  # --reasoning-parser
    tracer: object | None = None  # a RequestTracer when tracing is on
    metrics: ServerMetrics = field(init=False)
    _token_strs: dict[int, str] = field(default_factory=dict, init=False)

    def __post_init__(self):
        e = self.engine
        self.metrics = ServerMetrics(self.model_names[0], e.max_model_len, e.num_blocks, e.block_size,
                                     e.enable_prefix_caching)
        self.client.metrics = self.metrics

    @functools.cached_property
    def model_names(self) -> list[str]:
        return self.config.served_model_name or [self.model_root]

    @functools.cached_property
    def grammar_compiler(self):
        from tokenmill.engine.structured_output import GrammarCompiler
        return GrammarCompiler(self.tokenizer, self.engine.vocab_size)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names and model != self.model_root:
            raise ModelNotFound(model)

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    def validate(self, prompt_ids: list[int], params: SamplingParams, priority: int) -> None:
        """The engine's own checks (context length, logprobs, vocabulary, priority), before anything is sent."""
        e = self.engine
        validate_request(prompt_ids, params, priority, e.max_model_len, e.max_logprobs, e.vocab_size,
                         e.scheduling_policy, e.num_blocks * e.block_size, self.reasoning is not None)

    def check_queue(self, prompts: list[list[int]]) -> None:
        """Backpressure: refuse work past the queue limits instead of queueing without bound."""
        max_reqs, max_tokens = self.config.max_num_queued_reqs, self.config.max_num_queued_tokens
        queued_reqs, queued_tokens = self.client.num_queued_requests, self.client.num_queued_tokens
        if max_reqs is not None and queued_reqs + len(prompts) > max_reqs:
            raise Overloaded(f"The server is overloaded: {queued_reqs} requests are queued "
                             f"(--max-num-queued-reqs {max_reqs}); retry later.")
        new_tokens = sum(len(ids) for ids in prompts)
        if max_tokens is not None and queued_tokens + new_tokens > max_tokens:
            raise Overloaded(f"The server is overloaded: {queued_tokens} prompt tokens are queued "
                             f"(--max-num-queued-tokens {max_tokens}); retry later.")
