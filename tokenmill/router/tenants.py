"""Who may send how much: API keys mapped to tenants with RPM and TPM limits (token buckets), and one bounded
global admission queue in front of the replicas.

Each tenant has two buckets that refill continuously, each holding at most a minute's allowance: a request
takes one from the RPM bucket and its prompt tokens from the TPM bucket when it is admitted, and its completion
tokens when it ends (the router learns them from the usage it relays; it cannot know them in advance). A bucket
that cannot pay is a 429 whose Retry-After is the time until it can; a tenant that overdrew with completion
tokens waits for the debt to refill. A flooding tenant thus meets its own limits while the others' buckets are
untouched.

The admission queue bounds the work the router has in flight over all tenants (--max-concurrent-requests):
a request past it waits, at most --max-queued-requests of them and each at most --queue-timeout seconds, and is
refused with 503 `queue_full` or `queue_timeout` (LiteLLM's names) otherwise."""
from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec


class TenantSpec(msgspec.Struct, forbid_unknown_fields=True):
    tenant: str
    rpm: float | None = None  # None: no limit
    tpm: float | None = None
    max_parallel_requests: int | None = None  # LiteLLM's name: the tenant's requests in flight at once
    # the replicas (their --backend URLs) this tenant's requests may go to; None: any. A tenant class on a pool of
    # its own, as LiteLLM's tag-based routing puts tenants on deployments: batch traffic on replicas that
    # interactive traffic never waits behind
    replicas: list[str] | None = None


def load_tenants(path: str, backends: list[str]) -> dict[str, TenantSpec]:
    """The --tenants-config file: JSON, API key → {"tenant": name, "rpm": N, "tpm": N, "max_parallel_requests": N,
    "replicas": [URL, ...]}; the replicas a tenant names must be among `backends` (--backend)."""
    with open(path, "rb") as f:
        try:
            specs = msgspec.json.decode(f.read(), type=dict[str, TenantSpec])
        except msgspec.ValidationError as e:
            raise ValueError(f"--tenants-config {path}: {e}") from None
    known = {url.rstrip("/") for url in backends}
    for key, spec in specs.items():
        for name in ("rpm", "tpm", "max_parallel_requests"):
            value = getattr(spec, name)
            if value is not None and value <= 0:
                raise ValueError(f"--tenants-config {path}: {name} of key ...{key[-4:]} must be positive")
        if spec.replicas is not None and not spec.replicas:
            raise ValueError(f"--tenants-config {path}: replicas of key ...{key[-4:]} is empty")
        unknown = [url for url in spec.replicas or () if url.rstrip("/") not in known]
        if unknown:
            raise ValueError(f"--tenants-config: tenant {spec.tenant!r} names {unknown[0]}, not a --backend")
    return specs


@dataclass
class TokenBucket:
    """Refills `per_minute / 60` a second up to `per_minute`; `level` may go negative (a debt)."""
    per_minute: float
    level: float = field(init=False)
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self):
        self.level = self.per_minute

    def _refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self.updated) * self.per_minute / 60.0)
        self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until `amount` can be taken (0: now). An amount above a minute's allowance waits for a full
        bucket, so that one large request is not refused forever."""
        self._refill(now)
        needed = min(amount, self.per_minute) - self.level
        return 0.0 if needed <= 0 else needed * 60.0 / self.per_minute

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= amount


class Tenant:
    def __init__(self, spec: TenantSpec):
        self.name = spec.tenant
        self.requests = TokenBucket(spec.rpm) if spec.rpm else None
        self.tokens = TokenBucket(spec.tpm) if spec.tpm else None
        self.max_parallel = spec.max_parallel_requests
        self.replicas = frozenset(url.rstrip("/") for url in spec.replicas) if spec.replicas else None
        self.in_flight = 0

    def may_use(self, replicas: list) -> list:
        """Those of `replicas` this tenant's requests may go to."""
        return replicas if self.replicas is None else [r for r in replicas if r.url.rstrip("/") in self.replicas]

    def refusal_before_tokenizing(self) -> tuple[str, float] | None:
        """The limits that need no token count (requests per minute, requests in flight), checked before the
        router spends CPU on the prompt: a flood refused here costs the router almost nothing."""
        if self.max_parallel is not None and self.in_flight >= self.max_parallel:
            return "max_parallel_requests", 1.0
        if self.requests is not None and (wait := self.requests.wait_for(1, time.monotonic())) > 0:
            return "rpm", wait
        return None

    def admit(self, prompt_tokens: int) -> tuple[str, float] | None:
        """Takes the request's share and a place in flight (give it back with release()), or returns (the
        limit it hit, seconds until it would not)."""
        now = time.monotonic()
        if (refused := self.refusal_before_tokenizing()) is not None:
            return refused
        if self.tokens is not None and (wait := self.tokens.wait_for(prompt_tokens, now)) > 0:
            return "tpm", wait
        if self.requests is not None:
            self.requests.take(1, now)
        if self.tokens is not None:
            self.tokens.take(prompt_tokens, now)
        self.in_flight += 1
        return None

    def release(self) -> None:
        self.in_flight -= 1

    def charge(self, completion_tokens: int) -> None:
        if self.tokens is not None and completion_tokens:
            self.tokens.take(completion_tokens, time.monotonic())


class TenantRegistry:
    """API key → Tenant (tenants sharing a name share their buckets)."""

    def __init__(self, specs: dict[str, TenantSpec]):
        by_name: dict[str, Tenant] = {}
        self.by_key = {key: by_name.setdefault(spec.tenant, Tenant(spec)) for key, spec in specs.items()}

    def authenticate(self, authorization: str | None) -> Tenant | None:
        if not authorization or not authorization.startswith("Bearer "):
            return None
        return self.by_key.get(authorization[7:].strip())


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


class Rejected(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class AdmissionQueue:
    """At most `limit` requests in flight (0: no limit); up to `max_queued` more wait, first come first served,
    each at most `timeout_s`."""

    def __init__(self, limit: int, max_queued: int, timeout_s: float):
        self.limit = limit
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self.in_flight = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if not self.limit or (self.in_flight < self.limit and not self._waiters):
            self.in_flight += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise Rejected("queue_full", f"the router's admission queue is full ({self.max_queued} requests wait "
                                         f"for {self.limit} slots)")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.timeout_s)
        except asyncio.TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # the slot came as the timeout fired: keep it
            waiter.cancel()
            raise Rejected("queue_timeout", f"the request waited {self.timeout_s:g} s in the router's admission "
                                            "queue") from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # handed a slot, then the client left
            else:
                waiter.cancel()
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self) -> None:
        """A slot passes to the oldest live waiter (in_flight stays), or is freed."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.in_flight -= 1
