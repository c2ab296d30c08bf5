"""What each replica's prefix cache holds, kept from its KV events, and the cache hit a prompt would get there.

The index is exact, not a guess from past request text: the engine publishes the keys of the blocks it caches
and evicts (tokenmill/engine/kv_events.py), and the router computes a prompt's keys with the same function
(tokenmill/engine/block_hash.py). The predicted hit is the longest run of the prompt's leading keys in the set,
capped as the engine caps it (the last prompt token is always computed).

A LoRA adapter's blocks are keyed with its extra keys, which hold the id the replica gave it when it loaded it
(tokenmill/lora/request.py), so each replica keys one adapter differently. The router learns them where the
engine states them: each BlockStored event carries its blocks' extra keys with the adapter's name and id. A
replica that has stored no block of an adapter holds none of its prefixes, so it needs no key for it; when an
adapter is loaded anew (a new id) or unloaded, its old key is forgotten and events with older ids are ignored.

Sequence numbers keep it honest: a gap is filled from the replica's replay socket, and a sequence number that
goes backwards means the engine restarted, so everything known of the old process is dropped."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import zmq
import zmq.asyncio

from tokenmill.engine.block_hash import hash_request_blocks
from tokenmill.engine.kv_event_publisher import END_OF_REPLAY
from tokenmill.engine.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecodeError,
    decode_batch,
)

logger = logging.getLogger("tokenmill.router.kv_index")

REPLAY_TIMEOUT_S = 2.0


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: tuple = ()) -> list[bytes]:
    """The keys of the blocks the engine could find cached for this prompt: never the block holding its last
    token (the engine always computes that token, for its logits)."""
    num_blocks = (len(token_ids) - 1) // block_size if token_ids else 0
    return hash_request_blocks(token_ids[:num_blocks * block_size], block_size, extra_keys)


class KVIndex:
    """One replica's cached block keys."""

    def __init__(self, name: str, block_size: int):
        self.name = name
        self.block_size = block_size
        self.blocks: set[bytes | int] = set()  # in the replica's pool (medium GPU, or none said)
        # in a tier beyond its pool (engine/kv_offload.py), by medium: DISK, CPU, VALKEY. Kept apart, so that a
        # block that left the pool is not predicted as a pool hit, and a tier eviction does not hide a pool block.
        self.tier_blocks: dict[str, set[bytes | int]] = {}
        self.next_seq: int | None = None  # the sequence number expected next; None before the first batch
        self.num_gaps = 0
        self.num_restarts = 0
        self._warned_block_size = False
        # a LoRA adapter's name → (its id, the extra keys its blocks are hashed with), from BlockStored events
        self.adapter_keys: dict[str, tuple[int, tuple]] = {}
        self._adapter_floor: dict[str, int] = {}  # an adapter name → the lowest id still current (forget_adapter)
        self._max_adapter_id = 0  # the replica numbers every load from one counter

    def predicted_cached_tokens(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n * self.block_size

    def clear(self) -> None:
        self.blocks.clear()
        self.adapter_keys.clear()  # a new process numbers its adapters anew
        self._adapter_floor.clear()
        self._max_adapter_id = 0

    def forget_adapter(self, name: str) -> None:
        """The adapter was unloaded or loaded again (with a new id, above every id before it): its key so far
        finds no block in the engine."""
        self.adapter_keys.pop(name, None)
        self._adapter_floor[name] = self._max_adapter_id + 1

    def _learn_adapter(self, event: BlockStored) -> None:
        if event.lora_name is None or event.lora_id is None or not event.extra_keys or event.extra_keys[0] is None:
            return
        self._max_adapter_id = max(self._max_adapter_id, event.lora_id)
        known = self.adapter_keys.get(event.lora_name)
        if event.lora_id < self._adapter_floor.get(event.lora_name, 0) or (known and known[0] >= event.lora_id):
            return  # a request that ran with an older load of this name
        # the adapter's own keys: a salted request's blocks carry its cache_salt's in front of them
        keys = tuple(k for k in _frozen(event.extra_keys[0]) if k and k[0] == "lora")
        self.adapter_keys[event.lora_name] = (event.lora_id, keys)

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.block_size != self.block_size and not self._warned_block_size:
                    self._warned_block_size = True
                    logger.warning("%s stores blocks of %d tokens but the router hashes blocks of %d: set "
                                   "--block-size %d", self.name, event.block_size, self.block_size, event.block_size)
                self._held(event.medium).update(event.block_hashes)
                self._learn_adapter(event)
            elif isinstance(event, BlockRemoved):
                self._held(event.medium).difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.blocks.clear()

    def _held(self, medium: str | None) -> set:
        if medium in (None, MEDIUM_GPU):
            return self.blocks
        return self.tier_blocks.setdefault(medium, set())


def _frozen(value):
    """Decoded msgpack arrays as tuples: hashable, and encoded as the engine encoded them."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


class KVEventSubscriber:
    """Feeds a KVIndex from a replica's PUB socket (and its replay socket, for gaps)."""

    def __init__(self, index: KVIndex, endpoint: str, replay_endpoint: str | None, ctx: zmq.asyncio.Context,
                 topic: str = ""):
        self.index = index
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.ctx = ctx
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self._replayed: dict[int, bytes] = {}  # the start-up replay's batches, until the live stream passes them

    async def run(self) -> None:
        try:
            await self.sync()
            while True:
                frames = await self.sub.recv_multipart()
                if len(frames) != 3:
                    logger.warning("%s: ignoring a KV event message of %d frames", self.index.name, len(frames))
                    continue
                await self.receive(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            self.sub.close(linger=0)

    async def sync(self) -> None:
        """What the replica cached before we subscribed, from its replay buffer: the live batches that were
        already in flight arrive again, and are recognised and skipped."""
        if self.replay_endpoint is None:
            return
        self._replayed = await self._replay(0, None)
        if self._replayed:
            self.index.next_seq = max(self._replayed) + 1

    async def receive(self, seq: int, payload: bytes) -> None:
        index = self.index
        expected = index.next_seq
        if self._replayed:
            if self._replayed.get(seq) == payload:
                return  # seen in the start-up replay
            self._replayed = {}
        if expected is not None and seq < expected:
            # The publisher counts from 0 again: a new engine process, whose cache starts empty.
            logger.info("%s: KV event sequence restarted (%d after %d); dropping its index", index.name, seq,
                        expected - 1)
            index.num_restarts += 1
            index.clear()
            expected = 0 if seq > 0 else None
        if expected is None and seq > 0:
            await self.fill_gap(0, seq)  # joined late: what the replica cached before, as far as it buffers
        elif expected is not None and seq > expected:
            index.num_gaps += 1
            await self.fill_gap(expected, seq)
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError as e:
            logger.warning("%s: undecodable KV event batch %d: %s", index.name, seq, e)
        else:
            index.apply(batch)
        index.next_seq = seq + 1

    async def fill_gap(self, start: int, end: int) -> None:
        """Replays batches start..end-1 (vLLM's protocol: send the start as 8 bytes, receive [seq, batch] until
        seq -1). Without a replay endpoint the batches are lost and the index may be off until they are
        superseded."""
        if self.replay_endpoint is None:
            logger.warning("%s: lost KV event batches %d..%d and no replay endpoint", self.index.name, start, end - 1)
            return
        await self._replay(start, end)

    async def _replay(self, start: int, end: int | None) -> dict[int, bytes]:
        """Applies the replica's buffered batches from start (to end, exclusive, if given); returns them by seq."""
        name, applied = self.index.name, {}
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), REPLAY_TIMEOUT_S)
                _, seq_bytes, payload = frames
                if seq_bytes == END_OF_REPLAY:
                    return applied
                seq = int.from_bytes(seq_bytes, "big")
                if seq >= start and (end is None or seq < end):
                    self.index.apply(decode_batch(payload))
                    applied[seq] = payload
        except (asyncio.TimeoutError, ValueError, zmq.ZMQError) as e:
            logger.warning("%s: replay of KV event batches from %d failed: %r", name, start, e)
        finally:
            sock.close(linger=0)
        return applied


class KVEventFeeds:
    """The running KVEventSubscriber of each replica, on one zmq context: started for the replicas the router
    starts with, and for each replica that joins later (tokenmill/router/ray_serve.py); cancelled when its replica
    leaves or the router stops."""

    def __init__(self):
        self.ctx = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task] = {}  # by replica name

    def start(self, index: KVIndex, endpoint: str, replay_endpoint: str | None) -> None:
        subscriber = KVEventSubscriber(index, endpoint, replay_endpoint, self.ctx)
        self._tasks[index.name] = asyncio.create_task(subscriber.run())

    def stop(self, name: str) -> None:
        task = self._tasks.pop(name, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks, self._tasks = list(self._tasks.values()), {}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.ctx.destroy(linger=0)
