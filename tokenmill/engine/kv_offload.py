"""The tier beyond the pool: blocks saved to a store as they are computed, and loaded back into free blocks when a
later request's prefix misses the pool but hits the store (vLLM's `--kv-offloading-size`).

Write-through, not write-on-evict: a block is saved once, right after the step that computed it, whatever
becomes of it in the pool. Saving on eviction would have to copy the block out before the step that reuses it
runs, inside the step loop; and a store shared by replicas must hold what a replica computed, evicted or not.

Nothing here runs on the step loop's time but bookkeeping. One worker thread, at a lower OS priority, does the
copies, checksums and I/O: saves of pinned blocks (a reference is held until the copy is done, so the pool
cannot hand the block out meanwhile), and loads into blocks that a waiting request owns (scheduler.py keeps it
out of every step until `poll_loads` reports it). Loads go before saves. A load stops at the first entry that is
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

from tokenmill.engine.kv_blocks import BlockLayout, pack, unpack

logger = logging.getLogger("tokenmill.engine")


@dataclass
class SaveJob:
    block_id: int
    block_hash: bytes
    event: tuple  # (parent hash, token ids, lora id, lora name, extra keys): for the tier's BlockStored


@dataclass
class LoadJob:
    request_id: str
    blocks: list[tuple[bytes, int]]  # (block hash, block id), in chain order
    started: float = field(default_factory=time.monotonic)
    num_ok: int = 0


@dataclass
class OffloadCounters:
    """Cumulative since start (SchedulerStats carries them to /metrics)."""
    bytes_written: int = 0
    bytes_read: int = 0
    blocks_written: int = 0
    blocks_read: int = 0
    blocks_rejected: collections.Counter = field(default_factory=collections.Counter)  # reason → blocks
    store_errors: int = 0
    saves_skipped: int = 0  # the block left the pool before a save had room (too many in flight)
    load_seconds: list[float] = field(default_factory=list)  # per load, taken by each stats message


class KVOffloader:
    def __init__(self, store, layout: BlockLayout, max_pending_saves: int):
        self.store = store
        self.layout = layout
        self.max_pending_saves = max_pending_saves
        self.counters = OffloadCounters()
        self._saves: collections.deque[SaveJob] = collections.deque()
        self._loads: collections.deque[LoadJob] = collections.deque()
        self._saved: list[tuple[SaveJob, bool, list[bytes]]] = []  # (job, stored, evicted keys)
        self._loaded: list[LoadJob] = []
        self._pending_saves = 0
        self._loading = 0  # loads the worker has taken and not yet reported
        self._cond = threading.Condition()
        self._healthy = True
        self._stop = False
        self._thread = threading.Thread(target=self._work, name="kv-offload", daemon=True)
        self._thread.start()

    # ---- keys ----

    def key(self, block_hash: bytes) -> bytes:
        """The store's key: the layout's and the block's, so models sharing a store never meet."""
        return self.layout.key()[:8] + block_hash

    # ---- the step loop's side ----

    def lookup(self, block_hashes: list[bytes]) -> int:
        """How many of these blocks, from the first, the store holds (an index lookup: no I/O)."""
        n = 0
        for h in block_hashes:
            if not self.store.contains(self.key(h)):
                break
            n += 1
        return n

    @property
    def room(self) -> int:
        """Saves that may be queued now (each pins a block)."""
        return self.max_pending_saves - self._pending_saves

    @property
    def busy(self) -> bool:
        return self._pending_saves > 0

    def save(self, jobs: list[SaveJob]) -> list[SaveJob]:
        """Queues saves of the blocks the store lacks (at most `room`); returns the ones queued: the caller pins
        their blocks until poll_saves reports them."""
        todo = [job for job in jobs if not self.store.contains(self.key(job.block_hash))][:self.room]
        self._pending_saves += len(todo)
        if todo:
            with self._cond:
                self._saves.extend(todo)
                self._cond.notify()
        return todo

    def load(self, request_id: str, blocks: list[tuple[bytes, int]]) -> None:
        """Fills these (block hash, block id) pairs from the store, in order; poll_loads reports how many."""
        job = LoadJob(request_id, blocks)
        with self._cond:
            self._loads.append(job)
            self._cond.notify()

    @property
    def num_loading(self) -> int:
        return len(self._loads) + len(self._loaded) + self._loading

    def poll_loads(self) -> list[LoadJob]:
        with self._cond:
            done, self._loaded = self._loaded, []
        return done

    def poll_saves(self) -> list[tuple[SaveJob, bool, list[bytes]]]:
        with self._cond:
            done, self._saved = self._saved, []
        self._pending_saves -= len(done)
        return done

    def wait(self, timeout: float) -> None:
        """Blocks until a load or save finishes or timeout passes (the step loop has nothing else to do)."""
        with self._cond:
            if not (self._loaded or self._saved):
                self._cond.wait(timeout)

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
                while not (self._loads or self._saves or self._stop):
                    self._cond.wait()
                if self._stop:
                    return
                if self._loads:
                    job, self._loading = self._loads.popleft(), 1
                else:
                    job = self._saves.popleft()
            if isinstance(job, LoadJob):
                self._load(job)
                with self._cond:
                    self._loaded.append(job)
                    self._loading = 0
                    self._cond.notify_all()
            else:
                stored, evicted = self._save(job)
                with self._cond:
                    self._saved.append((job, stored, evicted))
                    self._cond.notify_all()

    def _save(self, job: SaveJob) -> tuple[bool, list[bytes]]:
        layout_key = self.layout.key()
        entry = pack(layout_key, job.block_hash, self.layout.read(job.block_id))
        try:
            evicted = self.store.put(layout_key[:8] + job.block_hash, entry)
        except OSError as e:
            self.counters.store_errors += 1
            self._set_healthy(False, f"writing failed ({e})")
            return False, []
        self._set_healthy(True, "writing again")
        self.counters.bytes_written += len(entry)
        self.counters.blocks_written += 1
        return True, evicted

    def _load(self, job: LoadJob) -> None:
        layout_key = self.layout.key()
        for block_hash, block_id in job.blocks:
            key = layout_key[:8] + block_hash
            try:
                entry = self.store.get(key)
            except OSError as e:
                self.counters.store_errors += 1
                self._set_healthy(False, f"reading failed ({e})")
                break
            payload, why = unpack(entry, layout_key, block_hash)
            if payload is None:
                self.counters.blocks_rejected[why] += 1
                if entry is not None:
                    logger.warning("KV %s tier: block %s rejected (%s); it is recomputed", self.store.medium,
                                   block_hash.hex()[:16], why)
                    self.store.discard(key)
                break
            self.layout.write(block_id, payload)
            self.counters.bytes_read += len(entry)
            self.counters.blocks_read += 1
            job.num_ok += 1
        self.counters.load_seconds.append(time.monotonic() - job.started)

    def _set_healthy(self, healthy: bool, what: str) -> None:
        if healthy != self._healthy:
            self._healthy = healthy
            log = logger.info if healthy else logger.warning
            log("KV %s tier: %s%s", self.store.medium, what, "" if healthy else "; requests recompute")
