"""The key of a full KV block: one function, shared by the engine's prefix cache and the router's index.

A block is keyed by SHA-256 over (parent key, its token ids, extra keys), so a prefix maps to the same chain of
keys in every process and under every Python hash seed. The router (tokenmill/router/) computes the same chain
from a request's tokens to predict which replica already holds it, so this module must stay torch-free and
small; the engine's BlockStored events (tokenmill/engine/kv_events.py) carry these keys as they are."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

_ROOT_HASH = b"tokenmill-kv-root"
_encode = msgspec.msgpack.Encoder().encode


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    """SHA-256 key of one full block; deterministic across processes and Python hash seeds."""
    payload = _encode((parent_hash or _ROOT_HASH, list(token_ids), list(extra_keys)))
    return hashlib.sha256(payload).digest()


def hash_request_blocks(token_ids: Sequence[int], block_size: int, extra_keys: tuple = (),
                        known: list[bytes] | None = None) -> list[bytes]:
    """The hash chain of every full block of token_ids, extending `known` (a prefix of the chain) in place."""
    hashes = known if known is not None else []
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra_keys))
    return hashes
