"""The tiers beyond the pool: blocks saved to stores as they are computed, and loaded back into free blocks when a
later request's prefix misses the pool but hits a store: host memory or a directory (vLLM's
`--kv-offloading-size`), and a Valkey server shared by replicas (`--kv-transfer-config` with ValkeyConnector).

Write-through, not write-on-evict: a block is saved once, right after the step that computed it, whatever
becomes of it in the pool. Saving on eviction would have to copy the block out before the step that reuses it
runs, inside the step loop; and a store shared by replicas must hold what a replica computed, evicted or not.

Nothing here runs on the step loop's time but bookkeeping. One worker thread, at a lower OS priority, does the
copies, checksums and I/O: saves of pinned blocks (a reference is held until the copy is done, so the pool
cannot hand the block out meanwhile), and loads into blocks that a waiting request owns (scheduler.py keeps it
out of every step until `poll_loads` reports it), and lookups in a remote store (the request is stepped over
until the answer comes). Lookups and loads go before saves. A load stops at the first entry that is
missing or fails its checks (engine/kv_blocks.py): the rest of the chain is computed, never guessed. Store
errors (a full or read-only disk, a store that went away) cost only recomputation, with one log line each time
the tier's state changes, and a counter."""
from __future__ import annotations

import collections
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from tokenmill.engine.kv_blocks import BlockLayout, unpack
from tokenmill.engine.kv_transfer import KVBlockClient, TransferError
from tokenmill.engine.messages import OffloadStats
from tokenmill.kv_transfer_params import KVTransferParams

logger = logging.getLogger("tokenmill.engine")


SAVE_BATCH = 16  # saves the worker takes at once


@dataclass
class Tier:
    store: object  # engine/kv_store.py: MemoryStore, DiskStore or ValkeyStore
    read: bool = True  # looked up and loaded from (not for a kv_producer)
    write: bool = True  # saved to (not for a kv_consumer)


@dataclass
class SaveJob:
    block_id: int
    block_hash: bytes
    event: tuple  # (parent hash, token ids, lora id, lora name, extra keys): for the tier's BlockStored
    stored: list[str] = field(default_factory=list)  # the media it was written to
    evicted: list[tuple[str, list[bytes]]] = field(default_factory=list)  # (medium, keys) the writes pushed out


@dataclass
class LoadJob:
    request_id: str
    blocks: list[tuple[bytes, int]]  # (block hash, block id), in chain order
    started: float = field(default_factory=time.monotonic)
    num_ok: int = 0
    # set: fetched from a prefill instance (engine/kv_transfer.py), not from the tiers; `first` is the chain
    # index of blocks[0]. No blocks: only tells the prefill instance that this request needs none of them
    remote: KVTransferParams | None = None
    first: int = 0


@dataclass
class LookupJob:
    request_id: str
    keys: list[bytes]
    found: int = 0


@dataclass
class OffloadCounters:
    """Cumulative since start (SchedulerStats carries them to /metrics)."""
    bytes_written: int = 0
    bytes_read: int = 0
    blocks_written: int = 0
    blocks_read: int = 0
    blocks_rejected: collections.Counter = field(default_factory=collections.Counter)  # reason → blocks
    store_errors: collections.Counter = field(default_factory=collections.Counter)  # medium → failed calls
    saves_skipped: int = 0  # the block left the pool before a save had room (too many in flight)
    load_seconds: list[float] = field(default_factory=list)  # per load, taken by each stats message


class KVOffloader:
    def __init__(self, tiers: list[Tier], layout: BlockLayout, max_pending_saves: int,
                 fetcher: KVBlockClient | None = None):
        """tiers: local ones (no I/O to know what they hold) first, then remote ones. fetcher: a decode
        instance's client of prefill instances (loads with `remote` set)."""
        self.tiers = tiers
        self.fetcher = fetcher
        self.layout = layout
        self.max_pending_saves = max_pending_saves
        self.counters = OffloadCounters()
        self._jobs: collections.deque = collections.deque()  # lookups and loads, first come first served
        self._saves: collections.deque[SaveJob] = collections.deque()
        self._done: list = []  # finished jobs of every kind, for poll()
        self._looked_up: dict[str, int] = {}  # request id → blocks found, until lookup() takes it
        self._pending_lookups: set[str] = set()
        self._forgotten: set[str] = set()
        self._pending_saves = 0
        self._cond = threading.Condition()
        # set between the step's forward passes: saves wait for it, so that on a machine with as many cores as the
        # step has threads the worker does not take one from them mid-pass (the step loop clears and sets it)
        self.quiet = threading.Event()
        self.quiet.set()
        self._healthy = {tier.store.medium: True for tier in tiers}
        self._stop = False
        self._thread = threading.Thread(target=self._work, name="kv-offload", daemon=True)
        self._thread.start()

    # ---- keys ----

    def key(self, block_hash: bytes) -> bytes:
        """The stores' key: the layout's and the block's, so models sharing a store never meet."""
        return self.layout.key()[:8] + block_hash

    def _holder(self, key: bytes):
        """The first readable tier known to hold key (no I/O)."""
        for tier in self.tiers:
            if tier.read and tier.store.contains(key):
                return tier.store
        return None

    # ---- the step loop's side ----

    def lookup(self, request_id: str, block_hashes: list[bytes]) -> int | None:
        """How many of these blocks, from the first, the tiers hold; None while a remote store is asked (the
        caller steps the request over and asks again)."""
        if not self.layout.final():  # a one-byte cache before its scales are set: nothing is loadable yet
            return 0
        keys = [self.key(h) for h in block_hashes]
        local = 0
        while local < len(keys) and self._holder(keys[local]) is not None:
            local += 1
        if request_id in self._looked_up:
            return max(local, self._looked_up.pop(request_id))
        remote = [t.store for t in self.tiers if t.read and getattr(t.store, "remote", False)]
        if local == len(keys) or not remote or not remote[0].available():
            return local  # (a store that is down is not asked while its circuit is open)
        if request_id not in self._pending_lookups:
            self._pending_lookups.add(request_id)
            self._submit(self._jobs, LookupJob(request_id, keys))
        return None

    def forget(self, request_id: str) -> None:
        """A request that ended before it took its lookup's answer."""
        self._looked_up.pop(request_id, None)
        if request_id in self._pending_lookups:
            self._forgotten.add(request_id)

    def load(self, request_id: str, blocks: list[tuple[bytes, int]], remote: KVTransferParams | None = None,
             first: int = 0) -> None:
        """Fills these (block hash, block id) pairs from the tiers, or from the prefill instance `remote` names
        (blocks[0] being block `first` of its request), in order; poll reports how many."""
        self._submit(self._jobs, LoadJob(request_id, blocks, remote=remote, first=first))

    @property
    def room(self) -> int:
        """Saves that may be queued now (each pins a block)."""
        return self.max_pending_saves - self._pending_saves

    @property
    def busy(self) -> bool:
        return self._pending_saves > 0 or bool(self._pending_lookups)

    @property
    def writes(self) -> bool:
        """Whether some tier saves computed blocks."""
        return any(t.write for t in self.tiers)

    def save(self, jobs: list[SaveJob]) -> list[SaveJob]:
        """Queues saves of the blocks some writable tier lacks (at most `room`); returns the ones queued: the
        caller pins their blocks until poll reports them."""
        writable = [t.store for t in self.tiers if t.write]
        todo = [job for job in jobs
                if not all(store.contains(self.key(job.block_hash)) for store in writable)][:self.room]
        self._pending_saves += len(todo)
        if todo:
            with self._cond:
                self._saves.extend(todo)
                self._cond.notify()
        return todo

    def _submit(self, queue: collections.deque, job) -> None:
        with self._cond:
            queue.append(job)
            self._cond.notify()

    def poll(self) -> tuple[list[LoadJob], list[SaveJob]]:
        """Finished loads and saves (lookups are kept for the next lookup() of their request)."""
        with self._cond:
            done, self._done = self._done, []
        loads, saves = [], []
        for job in done:
            if isinstance(job, LookupJob):
                self._pending_lookups.discard(job.request_id)
                if job.request_id in self._forgotten:
                    self._forgotten.discard(job.request_id)
                else:
                    self._looked_up[job.request_id] = job.found
            elif isinstance(job, LoadJob):
                loads.append(job)
            else:
                saves.append(job)
        self._pending_saves -= len(saves)
        return loads, saves

    def wait(self, timeout: float) -> None:
        """Blocks until some job finishes or timeout passes (the step loop has nothing else to do)."""
        with self._cond:
            if not self._done:
                self._cond.wait(timeout)

    def stats(self) -> OffloadStats:
        """The counters, and the load latencies since the last call (they go to one report only)."""
        c = self.counters
        seconds, c.load_seconds = c.load_seconds, []
        return OffloadStats(c.bytes_written, c.bytes_read, c.blocks_written, c.blocks_read, c.saves_skipped,
                            dict(c.blocks_rejected), dict(c.store_errors),
                            {t.store.medium: t.store.occupancy for t in self.tiers},
                            {t.store.medium: getattr(t.store, "capacity", 0) for t in self.tiers},
                            dict(self._healthy), seconds)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=5)

    # ---- the worker ----

    def _work(self) -> None:
        try:  # below the step loop's threads: a save may wait, a step should not
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except (AttributeError, OSError):
            pass
        while True:
            with self._cond:
                while not (self._jobs or self._saves or self._stop):
                    self._cond.wait()
                if self._stop:
                    return
                if self._jobs:
                    jobs = [self._jobs.popleft()]
                else:  # saves in batches, each block only between two forward passes (self.quiet)
                    jobs = [self._saves.popleft() for _ in range(min(SAVE_BATCH, len(self._saves)))]
            try:
                if isinstance(jobs[0], LookupJob):
                    self._lookup(jobs[0])
                elif isinstance(jobs[0], LoadJob):
                    (self._load_remote if jobs[0].remote is not None else self._load)(jobs[0])
                else:
                    self._save(jobs)
            except Exception:  # a bug must cost recomputation, not a worker that is gone and requests that hang
                logger.exception("KV tier worker: %s failed; its requests recompute", type(jobs[0]).__name__)
                if isinstance(jobs[0], LoadJob):
                    jobs[0].num_ok = 0
            with self._cond:
                self._done.extend(jobs)
                self._cond.notify_all()

    def _lookup(self, job: LookupJob) -> None:
        for tier in self.tiers:
            if tier.read and getattr(tier.store, "remote", False):
                try:
                    job.found = max(job.found, tier.store.count_present(job.keys))
                except OSError as e:
                    self._failed(tier.store, "lookup", e)
                else:
                    self._set_healthy(tier.store, True)

    def _save(self, jobs: list[SaveJob]) -> None:
        layout_key = self.layout.key()
        writable = [t.store for t in self.tiers if t.write]
        jobs = [job for job in jobs if not all(s.contains(layout_key[:8] + job.block_hash) for s in writable)]
        for job in jobs:
            self.quiet.wait()
            key = layout_key[:8] + job.block_hash
            entry = self.layout.entries([job.block_id], [job.block_hash])[0]
            for store in writable:
                if store.contains(key):
                    continue
                try:
                    evicted = store.put(key, entry)
                except OSError as e:
                    self._failed(store, "writing", e)
                    continue
                self._set_healthy(store, True)
                self.counters.bytes_written += len(entry)
                self.counters.blocks_written += 1
                job.stored.append(store.medium)
                if evicted:
                    job.evicted.append((store.medium, evicted))

    def _load(self, job: LoadJob) -> None:
        layout_key = self.layout.key()
        good: list[tuple[int, memoryview]] = []
        for block_hash, block_id in job.blocks:
            key = layout_key[:8] + block_hash
            store = self._holder(key)
            if store is None:
                break
            try:
                entry = store.get(key)
            except OSError as e:
                self._failed(store, "reading", e)
                break
            payload, why = unpack(entry, layout_key, block_hash)
            if payload is None:
                self.counters.blocks_rejected[why] += 1
                if entry is not None:
                    logger.warning("KV %s tier: block %s rejected (%s); it is recomputed", store.medium,
                                   block_hash.hex()[:16], why)
                    store.discard(key)
                break
            good.append((block_id, payload))
            self.counters.bytes_read += len(entry)
        self.layout.write([block_id for block_id, _ in good], [payload for _, payload in good])
        self.counters.blocks_read += len(good)
        job.num_ok = len(good)
        self.counters.load_seconds.append(time.monotonic() - job.started)

    def _load_remote(self, job: LoadJob) -> None:
        """Fetches the job's blocks from its prefill instance (releasing them there) and writes those that pass
        their checks, up to the first that does not."""
        counters, params = self.fetcher.counters, job.remote
        phases, t0 = counters.phase_seconds, time.monotonic()
        phases["queued"] += t0 - job.started
        try:
            entries = self.fetcher.fetch(params, list(range(job.first, job.first + len(job.blocks))),
                                         [block_hash for block_hash, _ in job.blocks])
        except TransferError as e:
            counters.failed(e.reason)
            logger.warning("KV transfer of %s from %s failed (%s); %s", job.request_id, params.remote_request_id, e,
                           "its blocks are recomputed" if job.blocks else "its blocks stay pinned there until "
                           "they time out")
            return
        t1 = time.monotonic()
        phases["network"] += t1 - t0
        if not job.blocks:
            return
        layout_key = self.layout.key()
        good: list[tuple[int, memoryview]] = []
        for (block_hash, block_id), entry in zip(job.blocks, entries):
            payload, why = unpack(entry, layout_key, block_hash)
            if payload is None:
                counters.failed(f"block_{why}")
                logger.warning("KV transfer of %s: block %s rejected (%s); the rest is recomputed", job.request_id,
                               block_hash.hex()[:16], why)
                break
            good.append((block_id, payload))
            counters.bytes_received += len(entry)
        if len(entries) < len(job.blocks) and len(good) == len(entries):
            counters.failed("missing")  # the prefill instance holds another prompt from there on
        t2 = time.monotonic()
        self.layout.write([block_id for block_id, _ in good], [payload for _, payload in good])
        phases["checks"] += t2 - t1
        phases["write"] += time.monotonic() - t2
        counters.blocks_fetched += len(good)
        job.num_ok = len(good)
        counters.fetch_seconds.append(time.monotonic() - job.started)
        counters.tokens_fetched.append(len(good) * self.layout.identity.get("block_size", 1))

    def _failed(self, store, what: str, error: OSError) -> None:
        self.counters.store_errors[store.medium] += 1
        if self._healthy[store.medium]:
            self._healthy[store.medium] = False
            logger.warning("KV %s tier: %s failed (%s); requests recompute until it works again", store.medium,
                           what, error)

    def _set_healthy(self, store, healthy: bool) -> None:
        if healthy and not self._healthy[store.medium]:
            self._healthy[store.medium] = True
            logger.info("KV %s tier: works again", store.medium)
