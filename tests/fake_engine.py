"""An in-process stand-in for the engine process, and the OpenAI app built on it, for the API tests.

FakeEngineClient has EngineClient's interface (the one the server and GenerationStream use) but no process: every
request generates a fixed continuation, one token per event-loop turn. Everything above it is real: the FastAPI
app, validation, the tokenizer and chat template, GenerationStream (detokenization, stop strings, n), SSE framing
and the lifecycle's 503s. So these tests check HTTP behaviour in milliseconds, without a model; what depends on the
model is tested against the real engine (test_server*.py)."""
from __future__ import annotations

import asyncio

import httpx

from tokenmill.api.errors import EngineDeadError
from tokenmill.api.lifecycle import Lifecycle, LifecycleApp
from tokenmill.api.server_config import ServerConfig
from tokenmill.config import EngineConfig
from tokenmill.engine.messages import EngineCoreOutput, EngineReady, SchedulerStats
from tokenmill.logprobs import TokenLogprobs
from tokenmill.server.api_server import build_app
from tokenmill.server.generation_stream import GenerationStream
from tokenmill.server.server_state import ServerState

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "test-key-123"
CONTINUATION = " Red, green and blue are three colors. They are the primary colors of light."


class FakeEngineClient:
    def __init__(self, tokenizer, ready: EngineReady):
        self.ready = ready
        self.config = EngineConfig()  # the engine's flags, as EngineClient has them (sleep mode off)
        self.asleep = False
        self.dead_reason: str | None = None
        self.metrics = None
        self.on_dead = lambda reason: None
        self.tokens = tokenizer.encode(CONTINUATION, add_special_tokens=False)
        self.eos_token_id = tokenizer.eos_token_id
        self.added: dict[str, tuple] = {}  # engine request id → (prompt ids, params, priority)
        self.aborted: list[str] = []
        self.num_queued_requests = 0  # tests set these to exercise backpressure
        self.num_queued_tokens = 0
        self.die_after_tokens: int | None = None  # tests set it: the engine process "dies" after that many tokens
        self.max_generated_tokens: int | None = None  # tests set it: finish with "length" after that many tokens
        self.num_cached_tokens = 0  # tests set it: the prefix-cache hit every request reports
        self._queues: dict[str, asyncio.Queue] = {}
        self._tasks: dict[str, asyncio.Task] = {}

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None

    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def generate(self, request_id, prompts, params, tokenizer, priority=0, lora_request=None) -> GenerationStream:
        stream = GenerationStream(request_id, prompts, params, tokenizer, self.abort)
        self.add_requests(stream.engine_requests(), tokenizer.eos_token_id, priority, stream.queue, lora_request)
        return stream

    def add_requests(self, requests, eos_token_id, priority, queue, lora_request=None) -> None:
        for request_id, prompt_token_ids, params in requests:
            self.add_request(request_id, prompt_token_ids, params, eos_token_id, priority, queue)

    def add_request(self, request_id, prompt_token_ids, params, eos_token_id, priority, queue) -> None:
        self.check_alive()
        self.added[request_id] = (prompt_token_ids, params, priority)
        self._queues[request_id] = queue
        self._tasks[request_id] = asyncio.get_running_loop().create_task(
            self._run(request_id, prompt_token_ids, params, queue))

    async def _run(self, request_id, prompt_ids, params, queue) -> None:
        max_tokens = params.max_tokens if params.max_tokens is not None else self.ready.max_model_len - len(prompt_ids)
        max_tokens = min(max_tokens, self.max_generated_tokens or max_tokens)
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [self._logprobs(t, params.prompt_logprobs, chosen_first=False)
                                        for t in prompt_ids[1:]]
        for i in range(max_tokens):
            await asyncio.sleep(0)
            token = self.tokens[i % len(self.tokens)]
            last = i == max_tokens - 1
            queue.put_nowait(EngineCoreOutput(
                request_id, [token], "length" if last else None,
                [self._logprobs(token, params.logprobs)] if params.logprobs is not None else None,
                prompt_logprobs if i == 0 else None, self.num_cached_tokens))
            if self.die_after_tokens is not None and i + 1 >= self.die_after_tokens:
                self.die()
                return
        self._queues.pop(request_id, None)

    @staticmethod
    def _logprobs(token: int, k: int, chosen_first: bool = True) -> TokenLogprobs:
        """Sampled tokens are the argmax; a prompt token is not (token + 1 ranks above it)."""
        if chosen_first:
            top = [token, token + 1][:k]
            return TokenLogprobs(token, -0.25, 1, top, [-0.25, -1.5][:len(top)])
        top = [token + 1, token][:k]
        return TokenLogprobs(token, -1.5, 2, top, [-0.25, -1.5][:len(top)])

    def abort(self, request_ids, finished_reason="abort") -> None:
        for request_id in request_ids:
            self.aborted.append(request_id)
            self._queues.pop(request_id, None)
            task = self._tasks.pop(request_id, None)
            if task is not None:
                task.cancel()

    def die(self, reason: str = "the engine process died (exit code -9)") -> None:
        """What EngineClient does when the engine process exits."""
        self.dead_reason = reason
        self._tasks.clear()  # the caller may be one of them: nothing left to cancel in a dead engine
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
        self._queues.clear()
        self.on_dead(reason)

    async def stats(self) -> SchedulerStats:
        self.check_alive()
        return SchedulerStats(0, 0, 0.0, 0, 0, 0)

    def shutdown(self) -> None:
        for task in self._tasks.values():
            task.cancel()


class InProcessServer:
    """The app as `tokenmill serve` builds it, behind LifecycleApp, on a FakeEngineClient."""

    def __init__(self, tokenizer, max_model_len: int = 2048, num_blocks: int = 4096, **config):
        ready = EngineReady(max_model_len=max_model_len, vocab_size=len(tokenizer), max_logprobs=20,
                            scheduling_policy="fcfs", num_blocks=num_blocks, block_size=16,
                            enable_prefix_caching=True)
        self.client = FakeEngineClient(tokenizer, ready)
        self.config = ServerConfig(**{"api_key": API_KEY, "max_n": 8, "enable_tokenizer_info_endpoint": True,
                                      "enable_server_load_tracking": True, **config})  # as helpers.SERVER_ARGS
        self.state = ServerState(self.client, tokenizer, ready, self.config, MODEL)
        self.lifecycle = Lifecycle(shutdown_timeout_s=30)
        self.lifecycle.phase = "ready"
        self.lifecycle.engine_alive = lambda: self.client.is_alive
        self.root = LifecycleApp(self.lifecycle)
        self.root.inner = build_app(self.state)

    def http(self, api_key: str | None = API_KEY) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.root), base_url="http://tokenmill",
                                 headers=headers, timeout=10)


async def post(app: InProcessServer, path: str, body: dict | str, api_key: str | None = API_KEY) -> httpx.Response:
    """POST a JSON body (a dict, or a string sent as it is) to the in-process app."""
    async with app.http(api_key) as client:
        if isinstance(body, str):
            return await client.post(path, content=body, headers={"Content-Type": "application/json"})
        return await client.post(path, json=body)
