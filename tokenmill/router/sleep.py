"""Idle replicas sleep (`--sleep-after-idle`), and wake when a request is routed to them.

Why: on a machine that serves several models, or a fleet sized for its peak, a replica that serves nothing
still holds its KV pool (and, at level 2, its weights). vLLM's sleep mode frees them on `POST /sleep?level=N` and
restores them on `POST /wake_up`; the router is what knows when a replica is idle and when it is needed again.

Every tick the router puts to sleep the replicas that have had nothing in flight (from the router or, by their own
load metrics, from anyone) for --sleep-after-idle seconds, longest idle first, keeping --min-awake of each group
awake: a group is the replicas serving one base model (and, disaggregated, of one role). A sleeping replica stays
routable; a request that the policy sends to it waits in tokenmill/router/proxy.py's `_open` while the router wakes
it, and the requests that arrive meanwhile share that one wake. A replica is marked asleep before its /sleep is
sent, so a request that comes during the /sleep waits for it to end and then for the wake, and a replica with a
request in flight is never sent to sleep (the check and the mark happen with no await between them).

A replica that refuses /sleep (no --enable-sleep-mode: 404; or busy) stays awake and is asked again only after
another idle period. A replica put to sleep behind the router's back answers a request with 503: the router
then asks its /is_sleeping, and wakes it and asks again. The sleep of a replica asleep is confirmed each tick by `GET /is_sleeping` (a replica woken
by someone else is awake again; one that no longer answers is ejected), and at start-up the router asks every
replica, so that one left asleep by an earlier router is admitted and woken on demand."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

import msgspec

from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.replica_client import TRANSPORT_ERRORS, ReplicaClient
from tokenmill.router.replicas import Replica, ReplicaSet

logger = logging.getLogger("tokenmill.router.sleep")

CONTROL_TIMEOUT_S = 120.0  # a /sleep or /wake_up: a level-2 wake maps the weights again
STATUS_TIMEOUT_S = 5.0  # a GET /is_sleeping


class WakeFailed(Exception):
    """The replica did not wake: its /wake_up failed (the message says how)."""


class IdleSleeper:
    def __init__(self, replicas: ReplicaSet, client: ReplicaClient, metrics: RouterMetrics, idle_s: float,
                 level: int, min_awake: int):
        self.replicas, self.client, self.metrics = replicas, client, metrics
        self.idle_s, self.level, self.min_awake = idle_s, level, min_awake
        self.tick_s = min(1.0, idle_s / 4)

    # ---------------- the idle policy ----------------

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            await self.confirm_asleep()
            await self.sleep_idle()

    async def sleep_idle(self) -> None:
        now = time.monotonic()
        groups: dict[tuple, list[Replica]] = defaultdict(list)
        for replica in self.replicas.replicas:
            if replica.healthy and not replica.asleep:
                groups[(replica.role, _base_model(replica))].append(replica)
        chosen = []
        for awake in groups.values():
            idle = sorted((r for r in awake if r.in_flight == 0 and r.external_load == 0
                           and now - r.last_active >= self.idle_s), key=lambda r: r.last_active)
            chosen += idle[:max(0, len(awake) - self.min_awake)]
        for replica in chosen:
            replica.asleep = True  # from now on a request to it waits for the wake
            replica.transition = asyncio.create_task(self._sleep(replica))
        await asyncio.gather(*(r.transition for r in chosen))

    async def _sleep(self, replica: Replica) -> None:
        try:
            status, body = await self._post(replica, f"/sleep?level={self.level}")
        except TRANSPORT_ERRORS as e:
            status, body = None, type(e).__name__
        if status != 200:
            replica.asleep = False
            replica.last_active = time.monotonic()  # asked again after another idle period
            logger.warning("%s did not go to sleep (%s): is it running with --enable-sleep-mode and "
                           "VLLM_SERVER_DEV_MODE=1?", replica.name,
                           f"answered {status}: {body[:200]!r}" if status is not None else body)
            return
        replica.index.blocks.clear()  # its KV cache is gone
        self.metrics.sleeps.labels(replica.name).inc()
        logger.info("%s is asleep (level %d) after %.1f s idle", replica.name, self.level,
                    time.monotonic() - replica.last_active)

    # ---------------- waking ----------------

    async def wake(self, replica: Replica) -> None:
        """Returns once `replica` is awake: after its /sleep in flight, if any, and its /wake_up, which the
        requests that wait meanwhile share. WakeFailed or a transport error if it does not wake."""
        while replica.asleep:
            transition = replica.transition
            if transition is None or transition.done():
                transition = replica.transition = asyncio.create_task(self._wake(replica))
            await asyncio.shield(transition)  # a request that leaves does not cancel the others' wake

    async def _wake(self, replica: Replica) -> None:
        started = time.monotonic()
        status, body = await self._post(replica, "/wake_up")
        if status != 200:
            raise WakeFailed(f"{replica.name} answered /wake_up with {status}: {body[:200]!r}")
        replica.asleep = False
        replica.last_active = time.monotonic()
        self.metrics.wakes.labels(replica.name).inc()
        self.metrics.wake_seconds.observe(replica.last_active - started)
        logger.info("%s woke in %.2f s", replica.name, replica.last_active - started)

    # ---------------- what the replicas say ----------------

    async def find_asleep(self) -> None:
        """At start-up: the replicas that are asleep already (left so by an earlier router)."""
        await asyncio.gather(*(self._read_sleeping(r, eject=False) for r in self.replicas.replicas))

    async def found_asleep(self, replica: Replica) -> bool:
        """After a 503 from `replica`: whether it is asleep (a /sleep sent to it directly), marked so if it is."""
        await self._read_sleeping(replica, eject=False)
        return replica.asleep

    async def confirm_asleep(self) -> None:
        await asyncio.gather(*(self._read_sleeping(r, eject=True) for r in self.replicas.replicas
                               if r.asleep and (r.transition is None or r.transition.done())))

    async def _read_sleeping(self, replica: Replica, eject: bool) -> None:
        try:
            status, body, _ = await self.client.get(replica.url + "/is_sleeping", STATUS_TIMEOUT_S)
        except TRANSPORT_ERRORS as e:
            if eject:
                self.replicas.eject(replica, f"/is_sleeping failed: {type(e).__name__}")
            return
        try:
            sleeping = msgspec.json.decode(body).get("is_sleeping") if status == 200 else None
        except (msgspec.DecodeError, AttributeError):
            sleeping = None
        if status == 404:
            sleeping = False  # no sleep mode (a new process, started without it): it cannot be asleep
        if isinstance(sleeping, bool) and (replica.transition is None or replica.transition.done()):
            if sleeping and not replica.asleep:
                logger.info("%s is asleep: it will be woken when a request is routed to it", replica.name)
            replica.asleep = sleeping

    async def _post(self, replica: Replica, path: str) -> tuple[int, str]:
        async def exchange():
            upstream = await self.client.post(replica.url, path, b"", {})
            try:
                return upstream.status, (await upstream.read()).decode(errors="replace")
            finally:
                upstream.release()
        return await asyncio.wait_for(exchange(), CONTROL_TIMEOUT_S)


def _base_model(replica: Replica) -> str | None:
    """The base model a replica serves (its /v1/models entry without a parent), or None before it was read."""
    return next((name for name, adapter in (replica.models or {}).items() if not adapter), None)
