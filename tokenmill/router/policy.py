"""Which replica serves a request: each policy ranks the routable replicas, best first (the rest are where a
request that fails before its first byte is retried), and names the reason for the choice (a metric label).

- kv: cost = predicted uncached prompt tokens + load x --load-tokens-per-request (load: the router's in-flight
  requests, corrected by the replica's own counts, tokenmill/router/replicas.py). The prediction is exact while
  the replica's KV events are current (tokenmill/router/kv_index.py), so a shared prefix goes where it is
  cached until that replica is busier than the prefill it saves.
- session: bounded-load consistent hashing (Mirrokni, Thorup, Zadimoghaddam 2018) on the x-session-id header
  or the `user` field: a session stays on its replica while that replica's load is under
  --session-load-factor x the mean, and moves to the next replica on the ring when it is not, or leaves.
- round_robin, least_load (the lowest load; ties in turn)."""
from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenmill.router.kv_index import prompt_block_hashes
from tokenmill.router.replicas import Replica

VIRTUAL_NODES = 64  # ring points per replica: spreads sessions evenly with a handful of replicas


@dataclass
class RouteRequest:
    """What a policy may look at: the prompt's block keys and length, the session key if any, and the model it
    names (a LoRA adapter's blocks are keyed as each replica keys that adapter: block_hashes_on)."""
    block_hashes: list[bytes]  # as the base model's blocks are keyed
    num_prompt_tokens: int
    session_key: str | None = None
    model: str | None = None
    token_ids: Sequence[int] = ()
    adapter_hashes: dict[tuple, list[bytes]] = field(default_factory=dict)  # by the adapter's extra keys
    salt_keys: tuple = ()  # the request's cache_salt's (sampling_params.cache_salt_keys), before an adapter's

    def block_hashes_on(self, replica: Replica) -> list[bytes]:
        """The prompt's block keys on `replica`: an adapter's, with the extra keys its KV events showed (none
        seen: it holds no block of that adapter), else the base model's."""
        if self.model is None or replica.serves_as_base(self.model):
            return self.block_hashes
        known = replica.index.adapter_keys.get(self.model)
        if known is None:
            return []
        keys = known[1]
        hashes = self.adapter_hashes.get(keys)
        if hashes is None:
            hashes = self.adapter_hashes[keys] = prompt_block_hashes(self.token_ids, replica.index.block_size,
                                                                     self.salt_keys + keys)
        return hashes


@dataclass
class Route:
    ranked: list[Replica]
    reason: str
    predicted_cached_tokens: dict[Replica, int]


class Policy:
    name = ""

    def __init__(self):
        self._turn = itertools.count()

    def rank(self, replicas: list[Replica], request: RouteRequest) -> Route:
        raise NotImplementedError

    def _rotation(self, replicas: list[Replica]) -> list[Replica]:
        start = next(self._turn) % len(replicas)
        return replicas[start:] + replicas[:start]


def _predictions(replicas: list[Replica], request: RouteRequest) -> dict[Replica, int]:
    return {r: r.index.predicted_cached_tokens(request.block_hashes_on(r)) for r in replicas}


class RoundRobin(Policy):
    name = "round_robin"

    def rank(self, replicas, request):
        return Route(self._rotation(replicas), "round_robin", _predictions(replicas, request))


class LeastLoad(Policy):
    name = "least_load"

    def rank(self, replicas, request, reason: str = "least_load"):
        # the rotation breaks ties in turn, so an idle fleet is used evenly; sorted() keeps that order for ties
        ranked = sorted(self._rotation(replicas), key=lambda r: r.load)
        return Route(ranked, reason, _predictions(replicas, request))


class KVAware(Policy):
    name = "kv"

    def __init__(self, load_tokens_per_request: int):
        super().__init__()
        self.load_tokens_per_request = load_tokens_per_request

    def rank(self, replicas, request):
        predicted = _predictions(replicas, request)

        def cost(r: Replica) -> int:
            return request.num_prompt_tokens - predicted[r] + r.load * self.load_tokens_per_request

        ranked = sorted(self._rotation(replicas), key=cost)
        best = ranked[0]
        if predicted[best] > 0:
            reason = "kv_hit"
        elif any(predicted.values()):
            reason = "kv_load"  # a replica holds some of the prefix but is too busy
        else:
            reason = "kv_miss"
        return Route(ranked, reason, predicted)


def _ring_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


class SessionAffinity(Policy):
    name = "session"

    def __init__(self, load_factor: float):
        super().__init__()
        self.load_factor = load_factor
        self.fallback = LeastLoad()
        self._ring: list[tuple[int, str]] = []
        self._ring_for: tuple[str, ...] = ()

    def rank(self, replicas, request):
        if request.session_key is None:
            return self.fallback.rank(replicas, request, "no_session")
        by_url = {r.url: r for r in replicas}
        ring = self._ring_of(sorted(r.url for r in replicas))
        total = sum(r.load for r in replicas)
        capacity = math.ceil(self.load_factor * (total + 1) / len(replicas))
        start = bisect.bisect(ring, (_ring_hash(request.session_key), ""))
        walk, seen = [], set()
        for i in range(len(ring)):
            url = ring[(start + i) % len(ring)][1]
            if url not in seen:
                seen.add(url)
                walk.append(by_url[url])
        # the first replica on the ring under capacity, then the others in ring order
        ranked = [r for r in walk if r.load < capacity] + [r for r in walk if r.load >= capacity]
        reason = "session" if ranked[0] is walk[0] else "session_overflow"
        return Route(ranked, reason, _predictions(replicas, request))

    def _ring_of(self, urls: list[str]) -> list[tuple[int, str]]:
        key = tuple(urls)
        if key != self._ring_for:
            self._ring = sorted((_ring_hash(f"{url}#{i}"), url) for url in urls for i in range(VIRTUAL_NODES))
            self._ring_for = key
        return self._ring


def make_policy(name: str, load_tokens_per_request: int, session_load_factor: float) -> Policy:
    if name == "kv":
        return KVAware(load_tokens_per_request)
    if name == "session":
        return SessionAffinity(session_load_factor)
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    raise ValueError(f"unknown policy {name!r}")
