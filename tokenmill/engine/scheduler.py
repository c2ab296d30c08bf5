"""Continuous batching, vLLM v1 style: every step maps request ids to a number of new tokens.

Prompt and output tokens are treated alike: a request is scheduled for the tokens it has that are not yet in
the KV cache. Running requests go first (a decode costs one token), waiting ones fill the rest of the token
budget, and a long prompt is split across steps, so decodes never stall behind it."""
from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.engine.block_hash import hash_request_blocks
from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)  # in batch order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class WaitingQueue:
    """FCFS: a deque, with preempted requests put back at the front. Priority: a heap on
    (priority, arrival), so a preempted request also goes back ahead of those that arrived after it."""

    def __init__(self, policy: str):
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def add(self, request: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            self._fifo.appendleft(request) if front else self._fifo.append(request)
        else:
            heapq.heappush(self._heap, (*request.sort_key(), next(self._counter), request))

    def __iter__(self):
        return iter(self._fifo) if self.policy == "fcfs" else (entry[-1] for entry in self._heap)

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][-1]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.remove(request)
        else:
            self._heap = [e for e in self._heap if e[-1] is not request]
            heapq.heapify(self._heap)


class Scheduler:
    def __init__(self, kv_cache: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs"):
        self.kv_cache = kv_cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.is_ready: Callable[[Request], bool] = lambda request: True  # e.g. False while its grammar compiles
        self.speculator = None  # a spec_decode.Speculator with --speculative-config
        # the runner's LoRAManager with --enable-lora: at most max_loras adapters among running requests, and a
        # finished request releases its adapter
        self.lora = None
        # the tier beyond the pool (kv_offload.KVOffloader) with --kv-offloading-size, and the requests whose
        # prefix it is loading: they wait outside the queue, in no step, until finish_load
        self.offload = None
        self.loading: dict[str, Request] = {}
        # --max-step-latency-ms: bounds prefill chunks while decodes run (engine/step_cost.StepCostModel)
        self.step_cost = None
        # a prefill instance's block server (kv_transfer.KVBlockServer, TCPConnector as kv_producer or kv_both):
        # a do_remote_decode request that ends at its length limit leaves its prompt blocks pinned there
        self.kv_sender = None

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests or self.loading)

    def _prefill_budget(self, budget: int) -> int:
        """The step's tokens for prefill chunks: all of the budget, unless decodes run and the step-cost model
        bounds what a chunk may add to their step (engine/step_cost.py)."""
        if self.step_cost is None:
            return budget
        rows = [r for r in self.running if r.num_tokens - r.num_computed_tokens <= 1]
        if not rows:
            return budget
        prefilling = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        return self.step_cost.prefill_budget(len(rows), sum(r.num_computed_tokens for r in rows),
                                             prefilling[0].num_computed_tokens if prefilling else 0, budget,
                                             len(prefilling) + len(self.waiting))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prefill_left = self._prefill_budget(budget)
        if self.speculator is not None:  # a decoding request with k drafts is scheduled for k + 1 tokens
            self.speculator.plan(self.running, budget, self.max_model_len)
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            remaining = request.num_tokens - request.num_computed_tokens
            if remaining > 1 and prefill_left <= 0:  # a prefill chunk waits for the next step
                i += 1
                continue
            num_new = min(remaining + len(request.spec_token_ids), budget)
            if remaining > 1:
                num_new = min(num_new, prefill_left)
            del request.spec_token_ids[max(0, num_new - 1):]
            while not self.kv_cache.allocate_slots(request, num_new):
                if request.spec_token_ids:  # drafts are given up before anyone is preempted
                    num_new -= len(request.spec_token_ids)
                    request.spec_token_ids = []
                    continue
                victim = self._pick_victim(i)
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                self._schedule(out, request, num_new)
                budget -= num_new
                if remaining > 1:
                    prefill_left -= num_new
                i += 1
        if self.speculator is not None:
            for request in self.running[i:]:  # not reached this step: their drafts are stale by the next one
                request.spec_token_ids = []

        # A step that had to preempt has no room for newcomers.
        not_ready: list[Request] = []
        loras = self.running_loras() if self.lora is not None else None
        while (not out.preempted and len(self.waiting) and min(budget, prefill_left) > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting.peek()
            # stepped over, keeping its place in the queue: its grammar compiles, or its adapter has no slot
            if not self.is_ready(request) or (loras is not None and not self._lora_fits(request, loras)):
                not_ready.append(self.waiting.pop())
                continue
            hits, num_hit = [], 0
            loaded = request.kv_loaded and self.kv_cache.has_table(request)  # holds the tier's blocks already
            if loaded:
                num_hit = request.num_computed_tokens
            elif request.params.prompt_logprobs is None:  # prompt logprobs need every prompt position's logits
                hits, num_hit = self.kv_cache.get_computed_blocks(request)
                if self.offload is not None and not request.kv_loaded and request.pooling is None:
                    started = (self._load_from_remote(request, hits) if request.kv_remote is not None
                               else self._load_from_tier(request, hits))
                    if started == "asking":  # a remote store is asked what it holds: keeps its place
                        not_ready.append(self.waiting.pop())
                        continue
                    if started == "no room":
                        break
                    if started == "loading":
                        continue
            num_new = min(request.num_tokens - num_hit, budget, prefill_left)
            if request.pooling is not None and num_new < request.num_tokens - num_hit:
                break  # pooled in one step, never chunked: it waits for a step with room for all of it
            if not self.kv_cache.allocate_slots(request, num_new, hits):
                if loaded and not self.running:  # nothing running will free blocks: give its own back (they
                    self.kv_cache.free(request)  # stay cached, so the next try finds what is left of them)
                    request.num_computed_tokens = 0
                break
            self.waiting.pop()
            self.kv_cache.record_admission(request, num_hit - request.num_external_tokens)
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit
                request.times.first_scheduled = time.monotonic()
            request.num_computed_tokens = num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if loras is not None and request.lora_request is not None:
                loras.add(request.lora_request.lora_int_id)
            self._schedule(out, request, num_new)
            budget -= num_new
            prefill_left -= num_new
        for request in reversed(not_ready):
            self.waiting.add(request, front=True)
        return out

    def _load_from_tier(self, request: Request, hits: list) -> str | None:
        """Starts loading the blocks past the pool's hits that the tiers hold into fresh blocks ("loading"); None
        if they hold none, "asking" while a remote store is asked, "no room" if the pool has none for them."""
        bs = self.kv_cache.block_size
        start, end = len(hits), (request.num_tokens - 1) // bs  # the last token is always computed
        if end <= start:
            return None
        found = self.offload.lookup(request.request_id, request.block_hashes[start:end])
        if found is None:
            return "asking"
        request.kv_loaded = True  # asked once per admission; a preemption asks again
        self.kv_cache.external_queries += (end - start) * bs
        if not found:
            return None
        if not self.kv_cache.allocate_slots(request, found * bs, hits, cache=False):
            request.kv_loaded = False
            return "no room"
        self.waiting.pop()
        request.num_computed_tokens = start * bs
        self.loading[request.request_id] = request
        table = self.kv_cache.block_tables[request.request_id]
        self.offload.load(request.request_id, [(request.block_hashes[i], table[i].block_id)
                                               for i in range(start, start + found)])
        return "loading"

    def _load_from_remote(self, request: Request, hits: list) -> str | None:
        """A decode instance's do_remote_prefill request: starts fetching the prompt blocks past the pool's hits
        from the prefill instance into fresh blocks ("loading"); None if the pool holds all of them (the prefill
        instance is told to release them), "no room" if the pool has none for them."""
        bs, remote = self.kv_cache.block_size, request.kv_remote
        start = len(hits)
        end = min((request.num_tokens - 1) // bs, len(remote.remote_block_ids))  # the last token is computed
        request.kv_loaded = True
        if end <= start:
            self.offload.fetcher.counters.blocks_skipped += end
            request.kv_remote = None
            self.offload.load(request.request_id, [], remote)  # nothing to fetch: release them there
            return None
        if not self.kv_cache.allocate_slots(request, (end - start) * bs, hits, cache=False):
            request.kv_loaded = False
            return "no room"
        self.offload.fetcher.counters.blocks_skipped += start
        self.kv_cache.external_queries += (end - start) * bs
        request.kv_remote = None  # fetched once; a preempted request finds the blocks in the pool (or recomputes)
        self.waiting.pop()
        request.num_computed_tokens = start * bs
        self.loading[request.request_id] = request
        table = self.kv_cache.block_tables[request.request_id]
        self.offload.load(request.request_id, [(request.block_hashes[i], table[i].block_id) for i in range(start, end)],
                          remote, start)
        return "loading"

    def finish_load(self, request_id: str, num_loaded: int) -> None:
        """The tier filled the first num_loaded of the blocks it was asked for (it stops at a missing or
        rejected one): they join the prefix cache, and the request goes back to the front of the queue."""
        request = self.loading.pop(request_id)
        if request.status.finished:  # aborted while its blocks were written: they are free only now
            self.kv_cache.free(request)
            return
        first = request.num_computed_tokens // self.kv_cache.block_size
        self.kv_cache.cache_loaded(request, first, num_loaded)
        request.num_computed_tokens = (first + num_loaded) * self.kv_cache.block_size
        request.num_external_tokens = num_loaded * self.kv_cache.block_size
        self.kv_cache.external_hits += request.num_external_tokens
        if not self.kv_cache.has_table(request):
            self.kv_cache.free(request)
        self.waiting.add(request, front=True)

    def running_loras(self) -> set[int]:
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def _lora_fits(self, request: Request, loras: set[int]) -> bool:
        """vLLM's rule: a request whose adapter is not among the running ones waits while max_loras are."""
        lora = request.lora_request
        return lora is None or lora.lora_int_id in loras or len(loras) < self.lora.max_loras

    def _schedule(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        out.requests.append(request)
        out.num_scheduled_tokens[request.request_id] = num_new

    def _pick_victim(self, first_unscheduled: int) -> Request:
        """Lowest priority first (largest priority value), then the newest; never one already in this step."""
        candidates = self.running[first_unscheduled:]
        if self.policy == "priority":
            return max(candidates, key=Request.sort_key)
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        # Recompute mode: the blocks go back to the pool but stay cached, so the request, put back at the
        # front of the queue, usually finds its own prefix there again.
        self.running.remove(request)
        self.kv_cache.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.kv_loaded = False
        request.num_external_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request, front=True)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request (stop, length or abort) and release its blocks at once."""
        if request.status.finished:
            return
        loading = request.request_id in self.loading
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not loading:
            self.waiting.remove(request)
        request.status = status
        request.times.finished = time.monotonic()
        if self.kv_sender is not None and status == RequestStatus.FINISHED_LENGTH:
            self._pin_for_decode(request)
        if request.kv_remote is not None and self.offload is not None:  # never fetched: release them there
            self.offload.load(request.request_id, [], request.kv_remote)
            request.kv_remote = None
        if not loading:  # a tier is writing its blocks: finish_load frees them
            self.kv_cache.free(request)
        if self.offload is not None:
            self.offload.forget(request.request_id)
        if self.speculator is not None:
            self.speculator.finish(request)
        if self.lora is not None and request.lora_request is not None:
            self.lora.release(request.lora_request)
        self.requests.pop(request.request_id, None)

    def _pin_for_decode(self, request: Request) -> None:
        """A do_remote_decode request at its length limit (vLLM's rule: an aborted or stopped one hands nothing
        over): its full prompt blocks stay referenced, in the block server, until the decode instance fetched them
        or the timeout passed; request.kv_transfer_out says where they are."""
        kv = request.params.kv_transfer_params
        if kv is None or not kv.do_remote_decode:
            return
        n = min(request.num_prompt_tokens // self.kv_cache.block_size,
                len(self.kv_cache.block_tables.get(request.request_id, ())))
        hash_request_blocks(request.all_token_ids[:n * self.kv_cache.block_size], self.kv_cache.block_size,
                            request.extra_keys, request.block_hashes)  # (known already with prefix caching)
        blocks = self.kv_cache.block_tables.get(request.request_id, [])[:n]
        self.kv_cache.pool.touch(blocks)
        request.kv_transfer_out = self.kv_sender.pin(request.request_id, blocks, request.block_hashes[:n])

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request
