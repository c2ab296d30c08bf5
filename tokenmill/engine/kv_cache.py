"""Paged KV cache bookkeeping: a pool of fixed-size blocks, per-request block tables and prefix caching.

The tensors themselves live in the model runner; this module only decides which block ids a request owns.
A full block is keyed by block_hash.hash_block_tokens(parent, tokens, extra_keys), so a shared prefix maps to the
same chain of keys in every process (the router uses the same function to predict cache hits).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.engine.block_hash import hash_block_tokens, hash_request_blocks  # noqa: F401 - re-exported
from tokenmill.engine.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from tokenmill.engine.request import Request


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    """All blocks, the LRU free queue and the hash→block map.

    Free blocks sit in one queue, oldest first. A freed block that holds a cached prefix goes to the tail and
    stays findable by hash until it reaches the head and is taken for fresh data (eviction)."""

    def __init__(self, num_blocks: int):
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0
        self.events: list[KVEvent] | None = None  # KV events since the last take, when they are published

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def take_fresh(self, n: int) -> list[KVCacheBlock]:
        assert n <= len(self.free_queue), "caller must check num_free_blocks"
        out, evicted = [], []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                evicted.append(block.block_hash)
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.events is not None:
            self.events.append(BlockRemoved(evicted, MEDIUM_GPU))
        return out

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on cached blocks found by hash (they may be sitting in the free queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Sequence[KVCacheBlock]) -> None:
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.block_hash is None:  # holds nothing reusable: hand it out before cached blocks
                    self.free_queue.move_to_end(block.block_id, last=False)

    def cache(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """True if block_hash is new to the cache (a duplicate of a cached block stays unregistered)."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
            return True
        return False


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[KVCacheBlock]] = {}
        self.prefix_cache_queries = 0  # tokens looked up, counted once per admission
        self.prefix_cache_hits = 0  # tokens found
        self.external_queries = 0  # tokens looked up in the tier beyond the pool (kv_offload.py)
        self.external_hits = 0  # tokens loaded from it
        # with a tier: (block, request, block index) of each block newly cached, saved once its step has run
        self.newly_cached: list[tuple[KVCacheBlock, Request, int]] | None = None

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, as blocks and tokens; at most num_tokens - 1 tokens, so
        that the last token is always computed and yields logits."""
        if not self.enable_prefix_caching:
            return [], 0
        hashes = hash_request_blocks(request.all_token_ids, self.block_size, request.extra_keys,
                                     request.block_hashes)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for h in hashes[:max_blocks]:
            block = self.pool.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[KVCacheBlock] = (), cache: bool = True) -> bool:
        """Make room for num_new_tokens more tokens after the computed ones; False (and no change) if the
        pool cannot. computed_blocks are prefix-cache hits for a request that has none yet. cache=False: the new
        blocks are not registered by hash (a tier is loading them: cache_loaded registers those it filled)."""
        table = self.block_tables.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens) - len(table) - len(computed_blocks)
        # Touching a hit that sits in the free queue removes it from there, so it is not free to take.
        reclaimable = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if need > self.pool.num_free_blocks - reclaimable:
            if not table:
                del self.block_tables[request.request_id]
            return False
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table.extend(computed_blocks)
        if need > 0:
            table.extend(self.pool.take_fresh(need))
        if self.enable_prefix_caching and cache:  # drafts (past num_tokens) are never cached: see keep_verified
            self._cache_full_blocks(request, table, num_computed, min(num_computed + num_new_tokens,
                                                                      request.num_tokens))
        return True

    def keep_verified(self, request: Request, first_token: int) -> None:
        """After a speculative step that started at first_token: cache the blocks that accepted drafts filled
        (request.num_computed_tokens now counts them), and free the blocks that only rejected drafts reached."""
        table = self.block_tables[request.request_id]
        keep = self.blocks_needed(request.num_computed_tokens)
        if len(table) > keep:
            self.pool.free(reversed(table[keep:]))
            del table[keep:]
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, table, first_token, request.num_computed_tokens)

    def cache_loaded(self, request: Request, first: int, filled: int) -> None:
        """A tier filled blocks first..first+filled-1 of the request's table: register them by hash (so other
        requests share them) and hand the blocks it did not fill back to the pool."""
        table = self.block_tables[request.request_id]
        keep = first + filled
        if len(table) > keep:
            self.pool.free(reversed(table[keep:]))
            del table[keep:]
        self._cache_full_blocks(request, table, first * self.block_size, keep * self.block_size, save=False)

    def has_table(self, request: Request) -> bool:
        return bool(self.block_tables.get(request.request_id))

    def record_admission(self, request: Request, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def _cache_full_blocks(self, request: Request, table: list[KVCacheBlock], start_token: int,
                           end_token: int, save: bool = True) -> None:
        # Blocks are registered when scheduled, not when computed: within a step every layer writes all new
        # K/V before any attention reads, so a request admitted in the same step may already share them.
        first, last = start_token // self.block_size, end_token // self.block_size
        if last <= first:
            return
        if len(request.block_hashes) < last:
            hash_request_blocks(request.all_token_ids[:last * self.block_size], self.block_size,
                                request.extra_keys, request.block_hashes)
        stored = [i for i in range(first, last) if self.pool.cache(table[i], request.block_hashes[i])]
        if stored and self.pool.events is not None:
            self._record_stored(request, stored)
        if save and self.newly_cached is not None:
            self.newly_cached.extend((table[i], request, i) for i in stored)

    def take_newly_cached(self) -> list[tuple[KVCacheBlock, Request, int]]:
        out, self.newly_cached = self.newly_cached, []
        return out

    def _record_stored(self, request: Request, stored: list[int]) -> None:
        """One BlockStored per run of consecutive newly cached blocks, chained to the block before the run."""
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        bs, hashes, lora = self.block_size, request.block_hashes, request.lora_request
        lora_id, lora_name = (lora.lora_int_id, lora.lora_name) if lora is not None else (None, None)
        for run in runs:
            first, last = run[0], run[-1] + 1
            self.pool.events.append(BlockStored(
                hashes[first:last], hashes[first - 1] if first else None,
                request.all_token_ids[first * bs:last * bs], bs, lora_id, MEDIUM_GPU, lora_name,
                [list(request.extra_keys)] * len(run) if request.extra_keys else None))

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block (vLLM's reset_prefix_cache): no prefix is found again, blocks of running
        requests stay theirs, free ones are handed out first. Records AllBlocksCleared, which is then true: no
        block is findable. Returns how many blocks were forgotten."""
        forgotten = len(self.pool.cached)
        for block in self.pool.cached.values():
            block.block_hash = None
            if block.ref_cnt == 0:
                self.pool.free_queue.move_to_end(block.block_id, last=False)
        self.pool.cached.clear()
        if self.pool.events is not None:
            self.pool.events.append(AllBlocksCleared())
        return forgotten

    def enable_events(self) -> None:
        """Record BlockStored/BlockRemoved events from now on, for take_events() (--kv-events-config)."""
        self.pool.events = []

    def take_events(self) -> list[KVEvent]:
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def free(self, request: Request) -> None:
        table = self.block_tables.pop(request.request_id, [])
        # Reverse order: the tail of a sequence is the least likely to be shared, so it is evicted first.
        self.pool.free(reversed(table))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.block_tables.get(request_id, ())]
