"""Stores for KV blocks beyond the pool: host memory (vLLM's `native` offloading) and a local directory.

A store maps a key (the layout key's prefix and the block hash: engine/kv_blocks.py) to an entry's bytes, keeps
at most `capacity` bytes and drops the least recently used entries past it. It knows nothing of what the bytes
mean: the entry's header and checksum are checked by whoever reads it. Every method may be called from the
offloader's worker thread and from the step loop (`contains`), so the index is guarded by a lock; the slow
part, file I/O, runs outside it."""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict

logger = logging.getLogger("tokenmill.engine")


class MemoryStore:
    """Entries in host memory (vLLM's `--kv-offloading-backend native`): on a CPU device, a second, larger and
    cheaper pool that holds blocks as bytes instead of in the attention layout."""

    medium = "CPU"

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[bytes, bytearray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def occupancy(self) -> int:
        return self._bytes

    def contains(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> bytearray | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: bytes, entry: bytes) -> list[bytes]:
        """Stores an entry; returns the keys it evicted."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return []
            self._entries[key] = bytearray(entry)
            self._bytes += len(entry)
            return self._evict()

    def discard(self, key: bytes) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._bytes -= len(entry)

    def _evict(self) -> list[bytes]:
        evicted = []
        while self._bytes > self.capacity and self._entries:
            key, entry = self._entries.popitem(last=False)
            self._bytes -= len(entry)
            evicted.append(key)
        return evicted


class DiskStore:
    """Entries as files under `root` (one per block, in 256 sub-directories by the key's first byte), written to
    a temporary name and renamed, so a reader never sees half a file. The index (key → size, in LRU order) is
    rebuilt from the directory at start, oldest modification first, so a restarted engine finds its blocks."""

    medium = "DISK"

    def __init__(self, root: str, capacity: int):
        self.root = root
        self.capacity = capacity
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        os.makedirs(root, exist_ok=True)
        self._scan()

    @property
    def occupancy(self) -> int:
        return self._bytes

    def _path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.root, name[:2], name[2:])

    def _scan(self) -> None:
        found = []
        for sub in os.listdir(self.root):
            folder = os.path.join(self.root, sub)
            if len(sub) != 2 or not os.path.isdir(folder):
                continue
            for name in os.listdir(folder):
                try:
                    key = bytes.fromhex(sub + name)
                    st = os.stat(os.path.join(folder, name))
                except (ValueError, OSError):  # a temporary file, or one removed meanwhile
                    continue
                found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
        for key in self._evict():  # the cap may have been lowered since
            self._unlink(key)

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def get(self, key: bytes) -> bytearray | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                entry = bytearray(size)
                n = f.readinto(entry)
        except FileNotFoundError:
            self._forget(key)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
        return entry if n == size else entry[:n]

    def put(self, key: bytes, entry: bytes) -> list[bytes]:
        """Writes an entry (raises OSError: disk full, read-only...); returns the keys it evicted."""
        if key in self._index:
            with self._lock:
                self._index.move_to_end(key)
            return []
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(entry)
            os.replace(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        with self._lock:
            self._index[key] = len(entry)
            self._bytes += len(entry)
            evicted = self._evict()
        for k in evicted:
            self._unlink(k)
        return evicted

    def _evict(self) -> list[bytes]:
        evicted = []
        while self._bytes > self.capacity and self._index:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            evicted.append(key)
        return evicted

    def _forget(self, key: bytes) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size

    def discard(self, key: bytes) -> None:
        """Drops an entry that failed its checks, so it is neither read again nor counted."""
        self._forget(key)
        self._unlink(key)

    def _unlink(self, key: bytes) -> None:
        try:
            os.unlink(self._path(key))
        except OSError:
            pass


class ValkeyStore:
    """Entries in a Valkey (or Redis) server that several replicas share (--kv-transfer-config with
    ValkeyConnector), so that a prefix one replica computed is loaded by the others. The server's own eviction
    (`maxmemory` with `maxmemory-policy allkeys-lru`) bounds it.

    Every call is network I/O, made only from the offloader's worker: `contains` answers from what this process
    wrote or found there (no I/O, for the step loop), `count_present` asks the server. A server that is down or
    slow raises OSError after `timeout` seconds, like a failing disk; a few failures in a row open a circuit for
    `backoff` seconds in which calls fail at once, so requests do not each wait for a dead server."""

    medium = "VALKEY"
    remote = True

    def __init__(self, url: str, timeout: float = 0.5, backoff: float = 5.0, failures_to_open: int = 2):
        try:
            import valkey
        except ImportError:
            raise ValueError("ValkeyConnector needs the valkey package: pip install valkey") from None
        self.url = url
        self._errors = (valkey.exceptions.ValkeyError, OSError)
        self._client = valkey.Valkey.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._known: OrderedDict[bytes, None] = OrderedDict()  # keys seen there, most recent last
        self._max_known = 1 << 20
        self.backoff, self.failures_to_open = backoff, failures_to_open
        self._failures, self._open_until = 0, 0.0
        self.bytes_written = 0

    @property
    def occupancy(self) -> int:
        return self.bytes_written

    def _call(self, fn, *args):
        import time
        if time.monotonic() < self._open_until:
            raise OSError(f"{self.url} is unreachable (retrying in at most {self.backoff:.0f} s)")
        try:
            out = fn(*args)
        except self._errors as e:
            self._failures += 1
            if self._failures >= self.failures_to_open:
                self._open_until = time.monotonic() + self.backoff
            raise OSError(f"{self.url}: {e}") from None
        self._failures = 0
        return out

    def _remember(self, key: bytes) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > self._max_known:
            self._known.popitem(last=False)

    def contains(self, key: bytes) -> bool:
        return key in self._known

    def available(self) -> bool:
        """False while the circuit is open (the server failed just now): not worth a lookup."""
        import time
        return time.monotonic() >= self._open_until

    def count_present(self, keys: list[bytes]) -> int:
        """How many of keys, from the first, the server holds (one round trip)."""
        if not keys:
            return 0

        def exists(keys):
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return pipe.execute()
        n = 0
        for key, present in zip(keys, self._call(exists, keys)):
            if not present:
                break
            self._remember(key)
            n += 1
        return n

    def get(self, key: bytes) -> bytearray | None:
        entry = self._call(self._client.get, key)
        if entry is None:
            self._known.pop(key, None)
            return None
        return bytearray(entry)

    def put(self, key: bytes, entry: bytes) -> list[bytes]:
        self._call(self._client.set, key, bytes(entry))
        self._remember(key)
        self.bytes_written += len(entry)
        return []

    def discard(self, key: bytes) -> None:
        self._known.pop(key, None)
        try:
            self._call(self._client.delete, key)
        except OSError:
            pass
