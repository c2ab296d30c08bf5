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
