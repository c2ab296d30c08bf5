"""What every route shares once the engine is ready: the engine client, the tokenizer, the flags, and the checks
a request passes before anything reaches the engine (model name, the engine's own limits, backpressure).

Tokenizing and templating run off the event loop: a long prompt takes seconds (12 MB of text: 17 s on 2 cores),
and meanwhile /health, /metrics and every stream must keep answering. A text too long for the context whatever
its tokens is refused before it is tokenized at all."""
from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.api.chat_protocol import ChatMessage
from tokenmill.api.chat_utils import render_chat
from tokenmill.api.errors import ModelNotFound, Overloaded
from tokenmill.api.server_config import ServerConfig
from tokenmill.engine.messages import EngineReady, validate_request
from tokenmill.lora.request import LoRARequest
from tokenmill.pooling_params import check_generate_runner, check_pooling_runner
from tokenmill.reasoning import ReasoningSpec
from tokenmill.sampling_params import ParamError, SamplingParams
from tokenmill.server.engine_client import EngineClient
from tokenmill.server.metrics import ServerMetrics
from tokenmill.tokenizer import INLINE_ENCODE_CHARS, encode


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: object
    engine: EngineReady
    config: ServerConfig
    model_root: str  # the --model the server was started with: always accepted as a model name
    reasoning: ReasoningSpec | None = None  # --reasoning-parser
    tracer: object | None = None  # a RequestTracer when tracing is on
    # --generation-config: request field → the model's default (tokenmill/models/generation_config.py)
    generation_defaults: dict = field(default_factory=dict)
    metrics: ServerMetrics = field(init=False)
    max_chars_per_token: int = field(init=False)  # the longest token's text: n characters are ≥ n / this tokens
    _token_strs: dict[int, str] = field(default_factory=dict, init=False)
    server_load: int = field(default=0, init=False)  # requests in flight (--enable-server-load-tracking)
    # the LoRA adapters the API serves, by name (serving_models.py): --lora-modules and runtime loads
    loras: dict[str, LoRARequest] = field(default_factory=dict, init=False)

    def __post_init__(self):
        self.max_chars_per_token = max(len(token) for token in self.tokenizer.get_vocab())
        e = self.engine
        self.metrics = ServerMetrics(self.model_names[0], e.max_model_len, e.num_blocks, e.block_size,
                                     e.enable_prefix_caching, e.cache_dtype, e.max_loras)
        self.client.metrics = self.metrics

    @functools.cached_property
    def model_names(self) -> list[str]:
        return self.config.served_model_name or [self.model_root]

    @functools.cached_property
    def grammar_compiler(self):
        from tokenmill.engine.structured_output import GrammarCompiler
        return GrammarCompiler(self.tokenizer, self.engine.vocab_size)

    def check_model(self, model: str | None, runner: str | None = "generate") -> LoRARequest | None:
        """The model name, and that the engine runs what the endpoint needs (`--runner`; None: either), before any
        other check. Returns the LoRA adapter the name selects (None: the base model)."""
        lora = self.loras.get(model) if model is not None else None
        if model is not None and lora is None and model not in self.model_names and model != self.model_root:
            raise ModelNotFound(model)
        if runner is not None:
            (check_generate_runner if runner == "generate" else check_pooling_runner)(self.engine.runner)
        return lora

    def served_model_name(self, lora: LoRARequest | None) -> str:
        """The `model` a response reports: the adapter's name, as vLLM, or the first served name."""
        return lora.lora_name if lora is not None else self.model_names[0]

    def token_str(self, token_id: int, context: Sequence[int] = ()) -> str:
        """A token's text for logprobs. A byte-level token that ends inside a multi-byte character decodes alone to
        U+FFFD; as vLLM, with the tokens sampled before it (context, oldest first) its text is what it completes
        (the whole character, counted on the token that completes it), and "" while the character is still open."""
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if not s.endswith("\ufffd") or not context:
            return s
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=False)
        context = list(context[-4:])  # a UTF-8 character spans at most 4 byte tokens
        for n in range(1, len(context) + 1):
            tail = context[-n:]
            whole = decode(tail + [token_id])
            if whole.endswith("\ufffd"):
                continue
            # the context tokens that are part of the same open character gave "": their bytes are counted here
            clean = len(tail)
            while clean and self.token_str(tail[clean - 1]).endswith("\ufffd"):
                clean -= 1
            prefix = decode(tail[:clean]) if clean else ""
            return whole[len(os.path.commonprefix([prefix, whole])):]
        return ""

    def validate(self, prompt_ids: list[int], params: SamplingParams, priority: int) -> None:
        """The engine's own checks (context length, logprobs, vocabulary, priority), before anything is sent."""
        e = self.engine
        check_generate_runner(e.runner)
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

    def check_text_length(self, num_chars: int, param: str) -> None:
        """Refuses, without tokenizing it, text that cannot fit the context: every token covers at most
        max_chars_per_token characters of its vocabulary form (which is never shorter than the text it stands
        for), and a factor 2 covers normalizers that compose characters."""
        at_least = num_chars // (2 * self.max_chars_per_token)
        if at_least > self.engine.max_model_len:
            raise ParamError(f"This model's maximum context length is {self.engine.max_model_len} tokens. However, "
                             f"the {param} is {num_chars} characters long, at least {at_least} tokens. Please reduce "
                             f"the length of the {param}.", param)

    async def encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Prompts as token ids: short ones on the event loop, longer ones off it (INLINE_ENCODE_CHARS)."""
        self.check_text_length(max(len(t) for t in texts), "prompt")
        if sum(len(t) for t in texts) <= INLINE_ENCODE_CHARS:
            return [encode(self.tokenizer, t, add_special_tokens) for t in texts]
        return await asyncio.to_thread(lambda: [encode(self.tokenizer, t, add_special_tokens) for t in texts])

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          continue_final_message: bool, chat_template_kwargs: dict | None,
                          tools: list | None) -> tuple[str, list[int]]:
        """The chat template and its token ids: a short conversation without tools on the event loop, others off
        it (INLINE_ENCODE_CHARS), as the router does."""
        own_template = (chat_template_kwargs or {}).get("chat_template") is not None
        if own_template and not self.config.trust_request_chat_template:
            raise ParamError("Chat template is passed with request, but --trust-request-chat-template is not set. "
                             "Refused request with untrusted chat template.", "chat_template")
        num_chars = sum(_num_chars(m) for m in messages)
        self.check_text_length(num_chars, "messages")
        args = (self.tokenizer, messages, add_generation_prompt, continue_final_message, chat_template_kwargs, tools,
                self.config.chat_template_content_format)
        if num_chars <= INLINE_ENCODE_CHARS and not tools:
            return render_chat(*args)
        return await asyncio.to_thread(render_chat, *args)


def _num_chars(message: ChatMessage) -> int:
    content = message.content
    if isinstance(content, list):
        return sum(len(part.text or "") for part in content)
    return len(content or "")
