"""The replicas behind the router: their health, cooldowns and in-flight requests.

A replica is routable while its last `GET /health/ready` passed and no cooldown runs. A failed check, or a
connection that fails while proxying, ejects it at once; the next passing check re-admits it. A replica that
answers 503 with Retry-After (overloaded, loading, draining) gets that many seconds of cooldown. An ejected
replica's KV index is dropped: whatever comes back may be a new process with an empty cache.

Load: the router counts the requests it has in flight on each replica, which it knows at once; with each health
check it also reads the replica's own `vllm:num_requests_running` and `vllm:num_requests_waiting`, which include
work from other clients and routers. A replica's load is the router's count plus whatever the replica reported
beyond the router's count at that moment.

Roles (disaggregated serving, --prefill and --decode): a replica is a prefill or a decode instance, and each
request asks for the routable replicas of the role it needs.

Sleep (--sleep-after-idle, tokenmill/router/sleep.py): a replica the router put to sleep stays admitted (a
request to it waits for its wake) while it answers; a health check that it fails with an HTTP answer (a replica
may say it is not ready while asleep) does not eject it, and its sleep is confirmed by GET /is_sleeping. Asleep,
it weighs one request more in its load, so that the policies wake it when the awake replicas are busier, not on a
tie with an idle one.

Models: with each health check the router also reads the replica's /v1/models, the names it serves (its base
model's and the LoRA adapters loaded on it, those with a `parent`): a request goes to the replicas that serve its
`model` (tokenmill/router/proxy.py).

The HTTP client to the replicas is tokenmill/router/replica_client.py."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import msgspec

from tokenmill.router.kv_index import KVIndex
from tokenmill.router.replica_client import TRANSPORT_ERRORS, ReplicaClient

logger = logging.getLogger("tokenmill.router.replicas")

DEFAULT_COOLDOWN_S = 5.0  # after a 503 without a usable Retry-After


@dataclass(eq=False)
class Replica:
    url: str
    index: KVIndex
    healthy: bool = False  # until the first check passes
    cooldown_until: float = 0.0  # time.monotonic()
    in_flight: int = 0  # requests the router has sent and not yet seen end
    external_load: int = 0  # requests running or waiting on the replica that the router did not send (last poll)
    models: dict[str, bool] | None = None  # served model name → is a LoRA adapter (its last /v1/models); None: unread
    role: str | None = None  # "prefill" or "decode" when disaggregated; None: a --backend replica, which does both
    asleep: bool = False  # the router sent it /sleep (or found it asleep) and has not woken it since
    transition: asyncio.Task | None = None  # its /sleep or /wake_up in flight (tokenmill/router/sleep.py)
    last_active: float = field(default_factory=time.monotonic)  # when a request last started or ended on it

    @property
    def load(self) -> int:
        return self.in_flight + self.external_load + self.asleep

    @property
    def name(self) -> str:
        return self.url

    def routable(self, now: float) -> bool:
        return self.healthy and now >= self.cooldown_until

    def serves(self, model: str) -> bool:
        return self.models is None or model in self.models

    def serves_as_base(self, model: str) -> bool:
        """`model` names the base model here (or is not known as an adapter, before /v1/models was read)."""
        if self.models is None:
            return model not in self.index.adapter_keys
        return self.models.get(model) is False


@dataclass
class ReplicaSet:
    replicas: list[Replica]
    client: ReplicaClient
    check_interval_s: float
    on_change: list = field(default_factory=list)  # callbacks(replica) when health flips, for metrics

    def routable(self, role: str | None = None) -> list[Replica]:
        """The admitted replicas not cooling down; of `role` only, if given."""
        now = time.monotonic()
        return [r for r in self.replicas if r.routable(now) and (role is None or r.role == role)]

    def eject(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            logger.warning("ejecting %s: %s", replica.name, reason)
        replica.healthy = False
        replica.index.clear()
        self._changed(replica)

    def cool_down(self, replica: Replica, retry_after: str | None) -> None:
        try:
            seconds = float(retry_after) if retry_after is not None else DEFAULT_COOLDOWN_S
        except ValueError:
            seconds = DEFAULT_COOLDOWN_S
        replica.cooldown_until = time.monotonic() + max(0.0, seconds)
        logger.info("%s answered 503: no requests for %.1f s", replica.name, seconds)

    async def check(self, replica: Replica) -> None:
        answered = False
        try:
            status, _, _ = await self.client.get(replica.url + "/health/ready", self.check_interval_s * 2)
            ok, answered = status == 200, True
            reason = f"/health/ready answered {status}"
        except TRANSPORT_ERRORS as e:
            ok, reason = False, f"/health/ready failed: {type(e).__name__}"
        if not ok and answered and replica.asleep:
            ok = True  # not ready because asleep: admitted all the same, its sleep checked by /is_sleeping (sleep.py)
        if ok and not replica.healthy:
            logger.info("admitting %s", replica.name)
            replica.healthy = True
            self._changed(replica)
        elif not ok:
            self.eject(replica, reason)
        if ok:
            await self.read_load(replica)
            await self.read_models(replica)

    async def read_load(self, replica: Replica) -> None:
        in_flight_now = replica.in_flight
        try:
            status, body, _ = await self.client.get(replica.url + "/metrics", self.check_interval_s * 2)
        except TRANSPORT_ERRORS:
            return  # the health check decides about ejection
        if status == 200:
            reported = replica_reported_load(body.decode(errors="replace"))
            if reported is not None:
                replica.external_load = max(0, reported - in_flight_now)

    async def read_models(self, replica: Replica) -> None:
        """The replica's served names from its /v1/models; an adapter that left it is forgotten by its index."""
        try:
            status, body, _ = await self.client.get(replica.url + "/v1/models", self.check_interval_s * 2)
            cards = msgspec.json.decode(body)["data"] if status == 200 else None
            models = {card["id"]: card.get("parent") is not None for card in cards} if cards is not None else None
        except (*TRANSPORT_ERRORS, msgspec.DecodeError, KeyError, TypeError):
            return  # the health check decides about ejection; the last list stands
        if models is None:
            return
        for name, adapter in (replica.models or {}).items():
            if adapter and name not in models:
                replica.index.forget_adapter(name)
        replica.models = models

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas))

    async def poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval_s)
            await self.check_all()

    def _changed(self, replica: Replica) -> None:
        for callback in self.on_change:
            callback(replica)


LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def replica_reported_load(metrics_text: str) -> int | None:
    """Running plus waiting requests from a replica's Prometheus text (summed over engines), or None."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        if line.startswith(LOAD_METRICS):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in LOAD_METRICS:
                try:
                    total += float(line.rsplit(" ", 1)[1])
                    seen = True
                except (IndexError, ValueError):
                    continue
    return int(total) if seen else None
