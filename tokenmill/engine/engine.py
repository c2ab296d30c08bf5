"""The engine loop: schedule → run model → sample → update requests. No tokenizer here: token ids in and out.

Stop strings need text, so the front end (offline LLM or API server) detokenizes and aborts on a match."""
from __future__ import annotations

import collections
import functools
import logging
import os
import time

import msgspec

from tokenmill import envs
from tokenmill.config import EngineConfig, kv_transfer_refusal
from tokenmill.engine.encoder_runner import EncoderRunner
from tokenmill.engine.host_memory import release_freed_memory
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.kv_events import BlockRemoved, BlockStored
from tokenmill.engine.kv_offload import KVOffloader, SaveJob, Tier
from tokenmill.engine.kv_store import DiskStore, MemoryStore, ValkeyStore
from tokenmill.engine.kv_transfer import KVBlockClient, KVBlockServer, TransferCounters, new_engine_id
from tokenmill.engine.messages import EngineCoreOutput, KVTransferStats, SchedulerStats, validate_request
from tokenmill.engine.profiler import TorchProfiler
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.runner import ModelRunner
from tokenmill.engine.scheduler import Scheduler
from tokenmill.engine.spec_decode.draft_model import DraftModelProposer
from tokenmill.engine.spec_decode.speculator import Speculator
from tokenmill.engine.step_cost import StepCostModel
from tokenmill.engine.structured_output import StructuredOutputManager
from tokenmill.lora.adapter import LoRAError
from tokenmill.lora.request import LoRARequest
from tokenmill.models.loader import load_model_config
from tokenmill.models.paths import resolve_model_path
from tokenmill.models.pooler import PoolerConfig
from tokenmill.pooling_params import (ENCODER_ARCHITECTURES, PoolingParams, check_generate_runner, resolve_runner,
                                      validate_pooling_request)
from tokenmill.reasoning import ThinkingTracker
from tokenmill.sampling_params import ParamError, SamplingParams, cache_salt_keys
from tokenmill.tokenizer import load_tokenizer

logger = logging.getLogger("tokenmill.engine")

SLEEP_TAGS = ("weights", "kv_cache")  # the parts wake_up can restore one at a time (vLLM's tags)
LORA_LEVEL_2 = ("sleep level 2 loads the weights again from the checkpoint, and --enable-lora's adapters are attached "
                "to the ones loaded at start: use level 1")


def default_max_num_batched_tokens(device) -> int:
    """Measured with bench serve on 2 CPU cores (SmolLM2 bf16, ISL 256 / OSL 128, c=32): a 2048-token budget
    stalled running decodes for 1.3 s per prefill step (ITL p99 1309 ms), 1024 for 0.7 s, 512 for 0.38 s, with
    the same output tok/s (283, 295, 289) and TTFT p50 2.7 s, 1.7 s, 1.1 s."""
    return 512 if device.type == "cpu" else 2048


def step_cost_model(config: EngineConfig, runner_type: str) -> StepCostModel | None:
    """--max-step-latency-ms: a target, 0 off; unset, the derived target, unless --max-num-batched-tokens was
    given (then the token budget alone bounds a step, as in vLLM). Pooling runs no decodes to protect."""
    ms = config.max_step_latency_ms
    if runner_type == "pooling" or ms == 0 or (ms is None and config.max_num_batched_tokens is not None):
        return None
    return StepCostModel(None if ms is None else ms / 1000.0)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_info = load_model_config(resolve_model_path(config.model, config.download_dir), config.load_format,
                                            config.trust_remote_code, config.hf_overrides)
        model_len = getattr(self.model_info.hf_config, "max_position_embeddings", None) or 2048
        self.max_model_len = config.max_model_len or model_len
        self.runner_type = resolve_runner(config.runner, self.model_info.architecture)
        if config.enable_lora and self.runner_type != "generate":
            raise ValueError("--enable-lora serves adapters for generation; this model runs --runner pooling")
        encoder, self.pooler = self.model_info.architecture in ENCODER_ARCHITECTURES, None
        prefix_caching = config.enable_prefix_caching and not encoder  # an encoder keeps no KV
        if self.runner_type == "pooling":
            self.pooler = PoolerConfig.from_model(self.model_info.path, self.model_info.hf_config, encoder)
            # vLLM's rule: sentence-transformers' max_seq_length, the length the model was trained on, caps it
            self.max_model_len = config.max_model_len or min(model_len, self.pooler.max_seq_length or model_len)
            if encoder and self.max_model_len > model_len:  # its positions are a learned table of model_len rows
                raise ValueError(f"--max-model-len {self.max_model_len} is longer than the encoder's "
                                 f"max_position_embeddings ({model_len})")
            # a cached prefix has no hidden states to pool over; the last token is always computed
            prefix_caching = prefix_caching and self.pooler.method == "last"
        self.runner = (EncoderRunner if encoder else ModelRunner)(config, self.model_info, self.max_model_len)
        self.runner.pooler = self.pooler
        self.kv_cache = KVCacheManager(self.runner.num_blocks, config.block_size, prefix_caching)
        budget = config.max_num_batched_tokens or default_max_num_batched_tokens(self.runner.device)
        if self.runner_type == "pooling":  # a pooling prompt is never chunked: a step must hold the longest
            budget = max(budget, self.max_model_len)
        self.scheduler = Scheduler(self.kv_cache, config.max_num_seqs, budget,
                                   self.max_model_len, config.scheduling_policy)
        self.scheduler.step_cost = self.step_cost = step_cost_model(config, self.runner_type)
        self.lora = self.scheduler.lora = getattr(self.runner, "lora", None)  # a LoRAManager with --enable-lora
        self.num_steps = 0
        self.last_step_tokens = 0
        path, tokenizer = self.model_info.path, config.tokenizer
        get_tokenizer = functools.cache(lambda: load_tokenizer(path, tokenizer, config.trust_remote_code))
        self.structured = StructuredOutputManager(get_tokenizer, self.runner.vocab_size)
        self.reasoning = config.reasoning
        if self.reasoning is not None:
            encode = functools.partial(get_tokenizer().encode, add_special_tokens=False)
            self.think_ids = encode(self.reasoning.start), encode(self.reasoning.end)
        self.runner.structured = self.structured
        self.scheduler.is_ready = lambda request: self.structured.ready(request.request_id)
        self.speculator = None
        if config.speculative_config is not None and self.runner_type == "generate":
            proposer = None
            if config.speculative_config.method == "draft_model":
                proposer = DraftModelProposer(config, self.runner, self.max_model_len, get_tokenizer())
            self.speculator = self.scheduler.speculator = Speculator(config.speculative_config, proposer)
        self.kv_sender: KVBlockServer | None = None  # TCPConnector: a prefill instance's block server
        self.transfer_counters: TransferCounters | None = None
        self.offload = self.scheduler.offload = self._offloader(config, prefix_caching)
        self._save_backlog: collections.deque[SaveJob] = collections.deque()  # computed, not yet queued
        self.profiler = TorchProfiler()  # vLLM's start_profile / stop_profile (VLLM_TORCH_PROFILER_DIR)
        self.sleep_level = 0  # 0: awake; else the deepest level slept at since the engine was last fully awake
        if config.enable_sleep_mode and encoder:
            raise ValueError("--enable-sleep-mode frees a KV pool and its caches; this encoder model keeps none")
        if self.offload is not None and self.offload.writes:
            self.kv_cache.newly_cached = []

    def _offloader(self, config: EngineConfig, prefix_caching: bool) -> KVOffloader | None:
        """The tiers beyond the pool: --kv-offloading-size (host memory or a directory), then a store shared by
        replicas (--kv-transfer-config). A disk tier that cannot be created (a read-only or missing filesystem)
        is a warning, and a store that is down at start is one too: the server serves without them, recomputing."""
        tiers = []
        if config.kv_offloading_size is not None:
            capacity = int(config.kv_offloading_size * 1024**3)
            if config.kv_offloading_backend == "disk":
                root = config.kv_offloading_dir or os.path.join(envs.TOKENMILL_CACHE_DIR, "kv-blocks")
                try:
                    tiers.append(Tier(DiskStore(root, capacity)))
                    logger.info("KV disk tier: %s, %.2f GiB, %.1f MiB there now", root, config.kv_offloading_size,
                                tiers[-1].store.occupancy / 2**20)
                except OSError as e:
                    logger.warning("KV disk tier off: cannot use %s (%s); serving without it", root, e)
            else:
                tiers.append(Tier(MemoryStore(capacity)))
        transfer = config.kv_transfer_config
        if transfer is not None and transfer.kv_connector == "ValkeyConnector":
            tiers.append(Tier(ValkeyStore(transfer.url), read=transfer.kv_role != "kv_producer",
                              write=transfer.kv_role != "kv_consumer"))
            logger.info("KV blocks shared through %s (%s)", transfer.url, transfer.kv_role)
        tcp = transfer is not None and transfer.kv_connector == "TCPConnector"
        if not tiers and config.kv_offloading_size is None and not tcp:
            return None
        if self.runner_type != "generate" or not prefix_caching:
            raise ValueError("--kv-offloading-size and --kv-transfer-config keep prefix-cache blocks: they need "
                             "--enable-prefix-caching and a generating model")
        layout = self.runner.block_layout(self.model_info) if tiers or tcp else None
        fetcher = None
        if tcp:
            self.transfer_counters = TransferCounters()
            engine_id = transfer.engine_id or new_engine_id()
            if transfer.is_producer:
                self.kv_sender = self.scheduler.kv_sender = KVBlockServer(
                    layout, engine_id, transfer.kv_ip, transfer.kv_port, transfer.extra("abort_request_timeout"),
                    self.transfer_counters)
            if transfer.is_consumer:
                fetcher = KVBlockClient(layout, transfer.extra("fetch_timeout"), self.transfer_counters)
        if not tiers and fetcher is None:
            return None
        # a save pins its block until written: at most a quarter of the pool waits for the worker
        return KVOffloader(tiers, layout, max(8, self.kv_cache.num_blocks // 4), fetcher)

    @property
    def matryoshka(self) -> bool:
        """The model's embeddings may be cut to fewer `dimensions` (and renormalised)."""
        return self.pooler is not None and self.pooler.matryoshka

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> int:
        """Raises ParamError if the engine cannot take the request; returns its max_tokens."""
        check_generate_runner(self.runner_type)
        kv = params.kv_transfer_params
        refusal = kv_transfer_refusal(self.config.kv_transfer_config, kv) if kv is not None else None
        if refusal is not None:
            raise ParamError(f"kv_transfer_params: {refusal}", "kv_transfer_params")
        return validate_request(prompt_token_ids, params, priority, self.max_model_len, self.config.max_logprobs,
                                self.runner.vocab_size, self.scheduler.policy,
                                self.kv_cache.num_blocks * self.kv_cache.block_size, self.reasoning is not None)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_id: int | None = None, priority: int = 0, arrival_time: float | None = None,
                    extra_keys: tuple = (), lora_request: LoRARequest | None = None) -> Request:
        if self.sleep_level:
            raise ParamError("the engine is asleep: POST /wake_up wakes it", None)
        max_tokens = self.check_request(prompt_token_ids, params, priority)
        extra_keys = cache_salt_keys(params.cache_salt) + extra_keys
        if lora_request is not None:  # its adapter is loaded now (a bad one fails here) and kept until it ends
            try:
                self._lora_manager().acquire(lora_request)
            except LoRAError as e:
                raise ParamError(str(e), "model") from None
            extra_keys = extra_keys + lora_request.extra_keys
        request = Request(request_id, prompt_token_ids, params, eos_token_id, max_tokens, priority,
                          extra_keys, arrival_time)
        request.lora_request = lora_request
        request.eos_token_ids |= self.model_info.eos_token_ids
        if self.reasoning is not None and (params.thinking_token_budget is not None
                                           or params.structured_outputs is not None):
            request.thinking = ThinkingTracker(self.reasoning, *self.think_ids, prompt_token_ids,
                                               params.thinking_token_budget)
        if params.structured_outputs is not None:
            self.structured.add(request_id, params.structured_outputs)
        self.scheduler.add_request(request)
        return request

    def _lora_manager(self):
        if self.lora is None:
            raise ParamError("this engine serves no LoRA adapters: start it with --enable-lora", "model")
        return self.lora

    def reset_prefix_cache(self) -> int:
        """vLLM's reset_prefix_cache: the pool forgets every cached prefix (the tiers beyond it keep theirs)."""
        return self.kv_cache.reset_prefix_cache()

    # ---- sleep mode (--enable-sleep-mode): vLLM's sleep / wake_up / is_sleeping ----

    @property
    def _runners(self) -> list[ModelRunner]:
        """The runners whose memory sleep frees: the model's, and a draft model's."""
        proposer = self.speculator.proposer if self.speculator is not None else None
        draft = getattr(proposer, "runner", None)
        return [self.runner] + ([draft] if draft is not None else [])

    def sleep(self, level: int) -> None:
        """vLLM's sleep: level 1 frees the KV pool and the caches built from the weights, level 2 the weights too.
        Requests still unfinished are aborted (the caller has drained or aborted them already) and the tier's
        saves finish first, since they read the pool; the prefix cache is reset, so the pool is empty at wake_up
        and the KV event stream says AllBlocksCleared. Asleep already: whatever is still resident at this level
        is freed (level 2 after level 1 drops the weights)."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the server with --enable-sleep-mode")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (free the KV cache) or 2 (free the weights too), got {level}")
        if level == 2 and self.lora is not None:
            raise ValueError(LORA_LEVEL_2)
        for request_id in list(self.scheduler.requests):
            self.abort_request(request_id)
        while self.has_unfinished_requests():  # only the tier's saves can be left
            self.step()
        before = sum(r.kv_cache_bytes() for r in self._runners)
        copies = sum(r.second_copy_bytes() for r in self._runners)
        self.kv_cache.reset_prefix_cache()
        for runner in self._runners:
            runner.sleep(level)
        self.sleep_level = max(level, self.sleep_level)
        release_freed_memory()  # what glibc keeps of the freed heap goes back to the OS
        logger.info("asleep at level %d: %.2f GiB of KV cache freed, %.2f GiB of the weights' second (small-M) "
                    "copies%s", level, before / 2**30, copies / 2**30, ", and the weights" if level == 2 else "")

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's wake_up: the parts named ("weights", "kv_cache"; None: both) are restored as they were."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the server with --enable-sleep-mode")
        unknown = set(tags or ()) - set(SLEEP_TAGS)
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; the tags are {list(SLEEP_TAGS)}")
        for runner in self._runners:
            runner.wake_up(set(tags or SLEEP_TAGS))
        if not self.asleep_parts():
            self.sleep_level = 0
            logger.info("awake")

    def asleep_parts(self) -> list[str]:
        """The parts still asleep: "weights" (their caches or the weights themselves freed), "kv_cache"."""
        r = self.runner
        return [tag for tag, asleep in zip(SLEEP_TAGS, (r.weights_state != "awake", r.kv_asleep)) if asleep]

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Loads an adapter into the CPU cache ahead of its requests (vLLM's add_lora); raises LoRAError."""
        self._lora_manager().load(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unloads an adapter once the requests that use it have finished; False if it was not loaded."""
        return self._lora_manager().remove(lora_int_id)

    def add_pooling_request(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams,
                            priority: int = 0, arrival_time: float | None = None) -> Request:
        if self.sleep_level:
            raise ParamError("the engine is asleep: POST /wake_up wakes it", None)
        validate_pooling_request(prompt_token_ids, params, self.max_model_len, self.runner.vocab_size,
                                 self.matryoshka, self.runner_type)
        request = Request(request_id, prompt_token_ids, SamplingParams(max_tokens=1), None, 1, priority,
                          (), arrival_time)
        request.pooling = params
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.structured.remove(request_id)

    def release_kv_pins(self) -> bool:
        """A prefill instance frees the blocks decode instances are done with or never fetched in time; True if
        it freed some (the stats changed)."""
        if self.kv_sender is None:
            return False
        blocks = self.kv_sender.take_released()
        if blocks:
            self.kv_cache.pool.free(blocks)
        return bool(blocks)

    @property
    def holds_kv_pins(self) -> bool:
        return self.kv_sender is not None and self.kv_sender.num_pinned_requests > 0

    def has_unfinished_requests(self) -> bool:
        """Requests, or the tier's saves (so an idle engine still writes what it computed last)."""
        return self.scheduler.has_unfinished() or (
            self.offload is not None and (self.offload.busy or bool(self._save_backlog)))

    def step(self) -> list[EngineCoreOutput]:
        self.release_kv_pins()
        if self.offload is not None:
            self._offload_poll()
        sched = self.scheduler.schedule()
        self.last_step_tokens = sum(sched.num_scheduled_tokens.values())
        failed = [self._abort_failed(rid) for rid in self.structured.take_failed()]
        if not sched.requests:
            if self.offload is not None:  # only the tier's work to wait for: wait for it, not in a busy loop
                self._offload_save()
                if self.scheduler.loading or self.offload.busy:
                    self.offload.wait(0.005)
            return failed
        block_tables = {r.request_id: self.kv_cache.block_ids(r.request_id) for r in sched.requests}
        if self.offload is not None:
            self.offload.quiet.clear()
        started = time.perf_counter()
        try:
            result = self.runner.execute(sched, block_tables)
        finally:
            if self.offload is not None:
                self.offload.quiet.set()
        if self.step_cost is not None:
            self._record_step_cost(sched, time.perf_counter() - started)
        self.num_steps += 1
        now = time.monotonic()
        outputs = failed
        for r in sched.requests:
            if r.spec_token_ids:
                outputs.append(self._accept_verified(r, result.verified[r.request_id]))
                continue
            r.num_computed_tokens += sched.num_scheduled_tokens[r.request_id]
            if r.pooling is not None:  # done in its one step
                r.times.first_token = now
                self.scheduler.finish(r, RequestStatus.FINISHED_STOPPED)
                outputs.append(self._output(r, [], None, None, result.pooled[r.request_id]))
                continue
            prompt_lp = result.prompt_logprobs.get(r.request_id)
            token = result.sampled.get(r.request_id)
            if token is None:
                if prompt_lp:
                    outputs.append(self._output(r, [], None, prompt_lp))
                continue
            if r.times.first_token is None:
                r.times.first_token = now
            r.append_output_token(token)
            lp = result.logprobs.get(r.request_id)
            status = self._check_stop(r, token)
            thought = r.thinking is not None and r.thinking.observe(r.output_token_ids)
            # the grammar starts after thinking ends: thinking tokens and the end string are not fed to it
            if not thought and self.structured.accept(r.request_id, token) and status is None:
                status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
            if status is not None:
                self.scheduler.finish(r, status)
                self.structured.remove(r.request_id)
            outputs.append(self._output(r, [token], [lp] if lp else None, prompt_lp))
        if self.offload is not None:
            self._offload_save()
        return outputs

    def _record_step_cost(self, sched, seconds: float) -> None:
        """What this step computed, in the step-cost model's terms (before the step's tokens are counted)."""
        prefill_tokens = prefill_pairs = decode_rows = decode_context = 0
        for r in sched.requests:
            n, ctx = sched.num_scheduled_tokens[r.request_id], r.num_computed_tokens
            if r.num_tokens - ctx > 1:
                prefill_tokens += n
                prefill_pairs += n * ctx + n * (n + 1) // 2
            else:
                decode_rows += 1
                decode_context += ctx
        self.step_cost.record(prefill_tokens, prefill_pairs, decode_rows, decode_context, seconds)

    def _offload_save(self) -> None:
        """Saves the blocks this step computed, pinned until the tier's worker has copied them. Past the number
        of saves in flight (a quarter of the pool), blocks wait unpinned in a backlog; one the pool hands out
        meanwhile is not saved."""
        if self.kv_cache.newly_cached is None:  # no tier saves (a decode instance's TCPConnector only fetches)
            return
        pool, bs, backlog = self.kv_cache.pool, self.kv_cache.block_size, self._save_backlog
        for block, r, i in self.kv_cache.take_newly_cached():
            lora = r.lora_request
            backlog.append(SaveJob(block.block_id, r.block_hashes[i], (
                r.block_hashes[i - 1] if i else None, r.all_token_ids[i * bs:(i + 1) * bs],
                lora.lora_int_id if lora else None, lora.lora_name if lora else None, r.extra_keys)))
        jobs = []
        while backlog and len(jobs) < self.offload.room:
            job = backlog.popleft()
            if pool.blocks[job.block_id].block_hash == job.block_hash:
                jobs.append(job)
            else:
                self.offload.counters.saves_skipped += 1
        queued = self.offload.save(jobs)
        pool.touch([pool.blocks[job.block_id] for job in queued])

    def _offload_poll(self) -> None:
        """Takes the tier's finished work: loaded requests back to the queue, saved blocks unpinned (and their
        KV events, with the tier's medium)."""
        loads, saved = self.offload.poll()
        for job in loads:
            if job.blocks:  # (a prefill instance told that a request needs none of its blocks: nothing to do)
                self.scheduler.finish_load(job.request_id, job.num_ok)
        if not saved:
            return
        pool = self.kv_cache.pool
        pool.free([pool.blocks[job.block_id] for job in saved])
        if pool.events is None:
            return
        bs = self.kv_cache.block_size
        for job in saved:
            parent, tokens, lora_id, lora_name, extra_keys = job.event
            for medium in job.stored:
                pool.events.append(BlockStored([job.block_hash], parent, tokens, bs, lora_id, medium, lora_name,
                                               [list(extra_keys)] if extra_keys else None))
            for medium, keys in job.evicted:
                pool.events.append(BlockRemoved([key[8:] for key in keys], medium))

    def _accept_verified(self, r: Request, emitted: list[int]) -> EngineCoreOutput:
        """A request verified with drafts (spec_decode/): emitted holds its accepted drafts and the token after
        them. They are appended one by one, so the request ends at the first stop token, EOS or length limit
        among them, and no token after that one is output."""
        drafts, r.spec_token_ids, r.spec_draft_probs = r.spec_token_ids, [], None
        self.speculator.record(r, len(drafts), len(emitted) - 1)
        start = r.num_computed_tokens
        tokens, status = [], None
        for token in emitted:
            r.append_output_token(token)
            tokens.append(token)
            status = self._check_stop(r, token)
            if status is not None:
                break
        # The input token and the accepted drafts up to the last one kept have K/V; the token after the drafts
        # never does (it is computed next step). Blocks they filled are cached, even when the request ends here.
        r.num_computed_tokens = start + 1 + min(len(tokens), len(emitted) - 1)
        self.kv_cache.keep_verified(r, start)
        if status is not None:
            self.scheduler.finish(r, status)
        return self._output(r, tokens, None, None)

    def _abort_failed(self, request_id: str) -> EngineCoreOutput:
        request = self.scheduler.abort(request_id)
        return self._output(request, [], None, None)

    def _check_stop(self, r: Request, token: int) -> RequestStatus | None:
        p = r.params
        if r.num_output_tokens >= p.min_tokens:
            if (token in r.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if r.num_output_tokens >= r.max_tokens or r.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, r: Request, tokens: list[int], logprobs, prompt_logprobs, pooled=None) -> EngineCoreOutput:
        t = r.times
        return EngineCoreOutput(r.request_id, tokens, r.finish_reason, logprobs, prompt_logprobs,
                                r.num_cached_tokens, t.arrival, t.first_scheduled or 0.0, t.first_token or 0.0,
                                t.finished or 0.0, pooled, r.num_external_tokens, r.kv_transfer_out)

    def scheduler_stats(self, step_tokens: int = 0) -> SchedulerStats:
        s, kv, spec = self.scheduler, self.kv_cache, self.speculator
        stats = SchedulerStats(len(s.running), len(s.waiting), kv.usage, kv.prefix_cache_queries,
                               kv.prefix_cache_hits, s.num_preemptions, step_tokens, self.num_steps,
                               self.structured.mask_time_s, self.structured.num_compiling)
        if self.lora is not None:  # vLLM's LoRA stats: requests per adapter name, running and waiting
            for requests, counts in ((s.running, stats.running_lora_adapters),
                                     (s.waiting, stats.waiting_lora_adapters)):
                for r in requests:
                    if r.lora_request is not None:
                        counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
        if self.offload is not None:
            stats.external_prefix_cache_queries, stats.external_prefix_cache_hits = kv.external_queries, kv.external_hits
            stats.kv_offload = self.offload.stats()
            stats.kv_offload.num_loading = len(s.loading)
            stats.num_waiting += len(s.loading)  # vLLM counts them waiting, "deferred" (for their KV)
            stats.num_waiting_deferred += len(s.loading)
        c = self.transfer_counters
        if c is not None:
            seconds, c.fetch_seconds = c.fetch_seconds, []
            tokens, c.tokens_fetched = c.tokens_fetched, []
            sender = self.kv_sender
            stats.kv_transfer = KVTransferStats(
                sender.num_pinned_blocks if sender else 0, sender.num_pinned_requests if sender else 0,
                c.pins_expired, c.blocks_sent, c.bytes_sent, c.blocks_fetched, c.blocks_skipped, c.bytes_received,
                dict(c.fetch_failures), seconds, tokens, dict(c.phase_seconds))
        if spec is not None:
            stats.spec_num_drafts, stats.spec_num_draft_tokens = spec.num_drafts, spec.num_draft_tokens
            stats.spec_num_accepted_tokens = spec.num_accepted_tokens
            stats.spec_accepted_per_pos = list(spec.accepted_per_pos)
        return stats

    def stats(self) -> dict:
        """scheduler_stats() as a dict, plus the pool's shape (for the offline API and benchmarks)."""
        return {**msgspec.structs.asdict(self.scheduler_stats()), "num_blocks": self.kv_cache.num_blocks,
                "block_size": self.kv_cache.block_size}
