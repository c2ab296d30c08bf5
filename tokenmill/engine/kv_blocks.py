"""One KV block as bytes: what a tier beyond the pool stores, and what a transfer to another instance sends.

A block's bytes are, layer by layer, its K then its V slice of the pool ([block] of each cache tensor, in the
backend's own layout). They mean something only to an engine with the same model, dtypes, backend layout,
block size and (for one-byte caches) KV scales, so every entry carries the layout key (a digest of all of those)
and its block hash, and a checksum of the payload: `unpack` returns None, with the reason, for an entry that is
short, corrupted, or was written by another layout or for another block. A wrong token is never an option;
recomputing is.

Reading and writing blocks copies between the pool and host bytes (numpy for a CPU pool, torch for a device's; both
release the GIL while they copy), so a tier's worker thread can do it while the step loop runs. The caller
guarantees that nobody writes a block while it is read (a saved block is pinned) and nobody reads one while it is
written (a loading request owns it)."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib

import numpy as np
import torch

from tokenmill.models.kv_quant import as_bytes

MAGIC = b"TMKVBLK1"
_HEADER = struct.Struct("<8s32s32sQI")  # magic, layout key, block hash, payload length, CRC-32 of the payload
HEADER_SIZE = _HEADER.size


def checksum(payload) -> int:
    """CRC-32: it catches a flipped, lost or torn byte (what disks and networks do), at 4 GB/s on one core where
    BLAKE2b makes 0.9 (on the worker that shares 2 cores with the step loop); the header's layout key and block hash
    catch the other way to be wrong, a well-formed entry of another block or model."""
    return zlib.crc32(payload)


def unpack(entry: bytearray | bytes | memoryview | None, layout_key: bytes,
           block_hash: bytes) -> tuple[memoryview | None, str]:
    """(payload, "") for a good entry, else (None, why): missing, short, magic, layout, hash, length, checksum.
    The payload is a read-only view of the entry, never a copy: BlockLayout.write copies it once, into the array
    it scatters into the pool."""
    if entry is None:
        return None, "missing"
    if len(entry) < HEADER_SIZE:
        return None, "short"
    magic, layout, key, length, digest = _HEADER.unpack_from(entry)
    if magic != MAGIC:
        return None, "magic"
    if layout != layout_key:
        return None, "layout"
    if key != block_hash:
        return None, "hash"
    payload = memoryview(entry)[HEADER_SIZE:]
    if len(payload) != length:
        return None, "length"
    if checksum(payload) != digest:
        return None, "checksum"
    return payload, ""


def model_fingerprint(path: str) -> dict:
    """What identifies a checkpoint wherever it is installed: its config and, per weight file, the name, size and
    digests of its first and last MiB (reading whole files would cost seconds at start-up)."""
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path)
        if f.endswith((".safetensors", ".gguf", ".bin", ".pt")) or f == "config.json")
    out = {}
    for f in files:
        size = os.path.getsize(f)
        with open(f, "rb") as fh:
            head = fh.read(1 << 20)
            fh.seek(max(0, size - (1 << 20)))
            tail = fh.read(1 << 20)
        out[os.path.basename(f)] = [size, hashlib.sha256(head).hexdigest(), hashlib.sha256(tail).hexdigest()]
    return out


class BlockLayout:
    """The pool's per-block layout: the K and V slices of every layer, and the key that names it."""

    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], identity: dict,
                 scales: torch.Tensor | None = None, final=lambda: True):
        """identity: model fingerprint, dtypes, backend, block size...; scales: the one-byte cache's KV scales,
        which change the meaning of every byte (None for other dtypes); final(): False until the first forward
        pass has calibrated them (until then no block may be loaded: its bytes would be read with other scales)."""
        self.kv_caches = kv_caches
        self.identity = identity
        self.scales = scales
        self.final = final
        self.slice_bytes = [(k[0].numel() * k.element_size(), v[0].numel() * v.element_size())
                            for k, v, _ in kv_caches]
        self.block_bytes = sum(a + b for a, b in self.slice_bytes)
        self._key: bytes | None = None
        # On the CPU, the caches as numpy byte arrays ([blocks, bytes per block], the pool's own memory), in a
        # block's byte order (each layer's K, then its V): numpy copies on the calling thread, where a torch op from
        # the tier's worker would start an OpenMP team of its own and take the cores the step's threads run on.
        self._host = None
        if kv_caches[0][0].device.type == "cpu":
            self._host = [c.view(torch.uint8).reshape(c.shape[0], -1).numpy() for k, v, _ in kv_caches for c in (k, v)]

    def key(self) -> bytes:
        """32 bytes naming the layout; a one-byte cache's scales enter it (read each time: the first forward pass
        may calibrate them)."""
        if self._key is None or self.scales is not None:
            ident = dict(self.identity, shapes=[[list(k.shape[1:]), list(v.shape[1:]), str(k.dtype)]
                                                 for k, v, _ in self.kv_caches])
            digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode())
            if self.scales is not None:
                digest.update(self.scales.detach().to("cpu", torch.float32).numpy().tobytes())
            self._key = digest.digest()
        return self._key

    def entries(self, block_ids: list[int], block_hashes: list[bytes]) -> list[memoryview]:
        """The blocks as entries (header, then payload: what a tier stores and a transfer sends), one view per
        block into one new array. Each payload is gathered from the pool straight behind its header's place, so
        a block is copied once and never joined to its header (a join copies it again); the array is np.empty,
        not a bytearray, whose zero-fill of fresh pages cost more than the gather. A 2,000-token prompt of the
        default model in float32 (92 MB), one AVX2 core: 56-75 ms this way, 179-227 ms read then joined
        (benchmarks/kv_block_bytes.py, pd-disagg.md)."""
        key, entries = self.key(), [memoryview(row) for row in self._gather(block_ids)]
        for entry, block_hash in zip(entries, block_hashes):
            _HEADER.pack_into(entry, 0, MAGIC, key, block_hash, self.block_bytes, checksum(entry[HEADER_SIZE:]))
        return entries

    def read(self, block_ids: list[int]) -> list[memoryview]:
        """The blocks' bytes (copies: a block may be reused once this returns), one view per block."""
        return [memoryview(row)[HEADER_SIZE:] for row in self._gather(block_ids)]

    def _gather(self, block_ids: list[int]) -> np.ndarray:
        """[n, HEADER_SIZE + block_bytes]: each block's bytes behind room for its header. Two copies per layer
        whatever the number of blocks, so that the Python overhead (and the GIL the step loop wants) is paid per
        batch, not per block."""
        n = len(block_ids)
        rows = np.empty((n, HEADER_SIZE + self.block_bytes), dtype=np.uint8)
        offset = HEADER_SIZE
        if self._host is not None:
            ids = np.asarray(block_ids, dtype=np.intp)
            if n and not (0 <= ids.min() and ids.max() < self._host[0].shape[0]):
                raise IndexError(f"block ids {block_ids} outside the pool")
            for cache in self._host:
                # into the rows' columns in place (mode "clip": "raise" would buffer a copy; checked above)
                np.take(cache, ids, axis=0, out=rows[:, offset:offset + cache.shape[1]], mode="clip")
                offset += cache.shape[1]
            return rows
        host = torch.from_numpy(rows)
        ids = torch.tensor(block_ids, device=self.kv_caches[0][0].device)
        for (k, v, _), (kb, vb) in zip(self.kv_caches, self.slice_bytes):
            for cache, size in ((k, kb), (v, vb)):
                host[:, offset:offset + size].copy_(as_bytes(cache).index_select(0, ids).reshape(n, -1)
                                                    .view(torch.uint8))
                offset += size
        return rows

    def write(self, block_ids: list[int], payloads: list) -> None:
        """Writes blocks' bytes (from read(), possibly in another process) into these blocks of this pool."""
        n = len(block_ids)
        if not n:
            return
        assert all(len(p) == self.block_bytes for p in payloads)
        if self._host is not None:
            # Each payload's slices straight into the pool: one copy, no array to join them in first. A join
            # (bytearray().join) copies every block in one call that holds the GIL (~30 ms for a 2,000-token prompt
            # of the default model in float32), and the tier's worker runs below the step loop's priority
            # (kv_offload.py), so the OS preempts it mid-join while the step loop waits for the GIL. On one AVX2
            # core, beside a worker (at nice 10) writing such prompts without pause, a decode-sized loop of torch
            # ops that takes 24-30 ms alone took up to 84-100 ms with the join, and at most 39-41 ms block by block
            # (benchmarks/kv_write_contention.py, pd-disagg.md); these copies are a few microseconds each.
            for block_id, payload in zip(block_ids, payloads):
                src = np.frombuffer(payload, dtype=np.uint8)
                offset = 0
                for cache in self._host:
                    cache[block_id] = src[offset:offset + cache.shape[1]]
                    offset += cache.shape[1]
            return
        rows = np.empty((n, self.block_bytes), dtype=np.uint8)  # one host array to move to the device
        for row, payload in zip(rows, payloads):
            row[:] = np.frombuffer(payload, dtype=np.uint8)
        host = torch.from_numpy(rows)
        ids = torch.tensor(block_ids, device=self.kv_caches[0][0].device)
        offset = 0
        for (k, v, _), (kb, vb) in zip(self.kv_caches, self.slice_bytes):
            for cache, size in ((k, kb), (v, vb)):
                dst = as_bytes(cache)  # (index_copy_ has no fp8 kernel)
                src = host[:, offset:offset + size].contiguous().view(dst.dtype).view(n, *dst.shape[1:])
                dst.index_copy_(0, ids, src.to(dst.device))
                offset += size
