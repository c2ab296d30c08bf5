"""KV cache events in vLLM's wire format, so that any router that consumes vLLM's events consumes ours.

A ZMQ PUB message is three frames: topic, sequence number (8 bytes, big-endian) and a msgpack KVEventBatch.
vLLM first encoded every struct as a positional array (`["BlockStored", hashes, parent, ...]`); PR #42892 moved
to maps (`{"type": "BlockStored", "block_hashes": ...}`) and consumers that read positions broke. We publish
vLLM's current layout (maps) and decode both, field by name or by vLLM's positions, so a router can front a
mixed fleet. The block hashes are the engine's own keys (tokenmill/engine/block_hash.py): 32-byte SHA-256
digests, which vLLM's format allows (its ExternalBlockHash is bytes or int).

Torch-free: the router imports this module."""
from __future__ import annotations

from typing import Any

import msgspec

# vLLM's name for the engine's own KV pool (the tier a router indexes), whatever the device; vLLM-CPU says it too.
MEDIUM_GPU = "GPU"

BlockHash = bytes | int


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Tagged: in the map layout the tag is the "type" key, in the array layout the first element."""


class BlockStored(KVCacheEvent):
    """Consecutive blocks of one request that became full and were cached; parent_block_hash is the key of the
    block before the first (None at the start of a sequence). token_ids: every token of these blocks."""
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # no defaults here, as in vLLM: always on the wire
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None  # one entry per block: what else entered its hash
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks evicted from the cache (their hashes no longer find anything)."""
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The cache is empty: published first by a (re)started engine, so that consumers drop what they knew."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
_LATER_FIELDS = {"medium", "lora_name"}
_EVENT_TYPES: dict[str, type] = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float  # wall-clock seconds
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(batch: KVEventBatch, layout: str = "map") -> bytes:
    """vLLM's current map layout, or the array layout of vLLM before PR #42892 (trailing defaults omitted, as
    msgspec's omit_defaults did there)."""
    if layout == "map":
        return _encoder.encode(batch)
    if layout != "array":
        raise ValueError(f"layout must be 'map' or 'array', got {layout!r}")
    events = [[type(e).__name__, *_positional(e)] for e in batch.events]
    outer = [batch.ts, events] + ([batch.data_parallel_rank] if batch.data_parallel_rank is not None else [])
    return _encoder.encode(outer)


def _positional(event: KVCacheEvent) -> list:
    values = list(msgspec.structs.astuple(event))
    defaults = [f.default for f in msgspec.structs.fields(event)]
    while values and defaults[len(values) - 1] is not msgspec.NODEFAULT and values[-1] == defaults[len(values) - 1]:
        values.pop()
    return values


class KVEventDecodeError(ValueError):
    pass


def decode_batch(payload: bytes) -> KVEventBatch:
    """A batch in either layout (outer and inner each array or map); unknown map keys are ignored, so later
    additions to vLLM's schema do not break us."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise KVEventDecodeError(f"not msgpack: {e}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise KVEventDecodeError(f"a KVEventBatch is an array or a map, got {type(raw).__name__}")
    if not isinstance(ts, (int, float)) or not isinstance(events, list):
        raise KVEventDecodeError("a KVEventBatch needs ts (a number) and events (a list)")
    return KVEventBatch(float(ts), [_decode_event(e) for e in events], rank)


def _decode_event(raw) -> KVEvent:
    if isinstance(raw, dict):
        tag, values = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        tag, values = raw[0], None
    else:
        raise KVEventDecodeError(f"an event is a tagged array or map, got {raw!r:.80}")
    cls = _EVENT_TYPES.get(tag)
    if cls is None:
        raise KVEventDecodeError(f"unknown KV event type {tag!r}")
    names = msgspec.structs.fields(cls)
    if values is None:  # positional: vLLM's field order; older producers send fewer fields, newer ones more
        values = {f.name: v for f, v in zip(names, raw[1:])}
    # Fields added to vLLM's schema after the first release are absent from older producers' events.
    kwargs = {f.name: values.get(f.name) for f in names if f.name in values or f.name in _LATER_FIELDS}
    try:
        return msgspec.convert(kwargs, cls)
    except msgspec.ValidationError as e:
        raise KVEventDecodeError(f"bad {tag}: {e}") from None
