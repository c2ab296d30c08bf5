"""Sleep mode over HTTP: vLLM's development endpoints POST /sleep?level=1|2, POST /wake_up[?tags=weights&tags=kv_cache]
and GET /is_sleeping (served with VLLM_SERVER_DEV_MODE=1, as vLLM), which free and restore the engine's memory when
the server was started with --enable-sleep-mode (tokenmill/engine/engine.py says what each level frees).

While the engine sleeps, /health stays 200 (vLLM's: the server is alive and will serve once woken) and a request
that would run the model gets 503 with Retry-After, unless --wake-on-demand: then it wakes the engine and runs.
A sleep first deals with the requests in flight as its `mode` says (vLLM's parameter): "abort" (vLLM's default)
ends each with an error event or a 503, never a silently cut stream; "wait" lets them finish, admitting no new ones.

Sleeps and wakes run one at a time, in the order they came (one lock here, and the engine applies them in order
too), and each leaves the state the engine reports in its reply: /is_sleeping, the refusals and
vllm:engine_sleep_state always agree with the engine. A caller that disconnects does not cancel its operation."""
from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.api.errors import RequestAborted, ServiceUnavailable, exception_response
from tokenmill.engine.messages import SleepReply
from tokenmill.sampling_params import ParamError

logger = logging.getLogger("tokenmill.server")

SLEEP_LEVELS = (1, 2)
SLEEP_MODES = ("abort", "wait")  # vLLM's PauseMode, less "keep"
WAKE_TAGS = ("weights", "kv_cache")


class SleepControl:
    def __init__(self, state):
        self.state = state
        self.client = state.client
        self.enabled = self.client.config.enable_sleep_mode
        self.wake_on_demand = state.config.wake_on_demand
        self.level = 0  # as the engine last reported: 0 awake, else the level it sleeps at
        self.asleep_parts: list[str] = []
        self._lock = asyncio.Lock()

    @property
    def is_sleeping(self) -> bool:
        """True from the moment a sleep starts until every part is awake again: what requests see."""
        return self.client.asleep

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise ParamError("sleep mode is off: start the server with --enable-sleep-mode")

    async def sleep(self, level: int, mode: str) -> None:
        self._check_enabled()
        if level not in SLEEP_LEVELS:
            raise ParamError(f"level must be 1 (free the KV cache) or 2 (free the weights too), got {level}", "level")
        if level == 2 and self.client.ready.max_loras:
            raise ParamError("level 2 loads the weights again from the checkpoint, and --enable-lora's adapters are "
                             "attached to the ones loaded at start: use level 1", "level")
        if mode not in SLEEP_MODES:
            raise ParamError(f"mode must be one of {list(SLEEP_MODES)} (vLLM's 'keep' is not supported), got "
                             f"{mode!r}", "mode")
        await self._run(self._sleep(level, mode))

    async def _sleep(self, level: int, mode: str) -> None:
        self.client.asleep = True  # from now on requests are refused (or wait for a wake), before any await
        if mode == "abort":
            self.client.fail_pending("sleep", RequestAborted(f"the server was put to sleep (POST /sleep?level={level}"
                                                             "&mode=abort; mode=wait lets requests finish first)"))
        logger.info("sleep: level %d, mode %s", level, mode)
        self._apply(await self.client.sleep(level, mode))

    async def wake_up(self, tags: list[str] | None) -> None:
        self._check_enabled()
        unknown = [t for t in tags or () if t not in WAKE_TAGS]
        if unknown:
            raise ParamError(f"unknown tags {unknown}: wake_up takes {list(WAKE_TAGS)} (vLLM's 'scheduling' belongs "
                             "to its level 0, not supported)", "tags")
        await self._run(self._wake_up(tags))

    async def _wake_up(self, tags: list[str] | None, only_if_asleep: bool = False) -> None:
        if only_if_asleep and not self.client.asleep:
            return  # another request's wake got there first
        logger.info("wake_up: %s", "all" if tags is None else ", ".join(tags))
        self._apply(await self.client.wake_up(tags))

    async def wake_for_request(self) -> None:
        """--wake-on-demand: the request waits for the wake (one for all the requests that arrive meanwhile)."""
        await self._run(self._wake_up(None, only_if_asleep=True))

    async def _run(self, operation) -> None:
        """One operation at a time, in arrival order; shielded, so that a caller who leaves cannot cut it short and
        leave the server's view of the engine behind the engine's."""
        async def locked():
            async with self._lock:
                await operation
        await asyncio.shield(asyncio.ensure_future(locked()))

    def _apply(self, reply: SleepReply) -> None:
        self.level, self.asleep_parts = reply.level, reply.asleep
        self.client.asleep = bool(reply.asleep)
        metrics = self.state.metrics
        metrics.record_step(reply.stats)
        metrics.record_sleep_state(reply.level if reply.asleep else 0)
        if reply.error is not None:
            raise RuntimeError(reply.error)


class SleepGateMiddleware:
    """Requests to the routes that run the model (`paths`), while the engine sleeps: 503 with Retry-After, or with
    --wake-on-demand, a wake first."""

    def __init__(self, app, control: SleepControl, paths: frozenset[str]):
        self.app, self.control, self.paths = app, control, paths

    async def __call__(self, scope, receive, send):
        if (scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.paths
                and self.control.is_sleeping):
            if not self.control.wake_on_demand:
                error = ServiceUnavailable("the engine is asleep (POST /wake_up wakes it, or start the server with "
                                           "--wake-on-demand)")
                return await exception_response(error)(scope, receive, send)
            await self.control.wake_for_request()
        return await self.app(scope, receive, send)


def add_sleep_routes(app: FastAPI, control: SleepControl) -> None:
    """vLLM's routes and answers: 200 with no body; {"is_sleeping": bool}."""

    @app.post("/sleep")
    async def sleep(raw: Request):
        level = raw.query_params.get("level", "1")
        try:
            level = int(level)
        except ValueError:
            raise ParamError(f"level must be 1 or 2, got {level!r}", "level") from None
        await control.sleep(level, raw.query_params.get("mode", "abort"))
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(raw: Request):
        await control.wake_up(raw.query_params.getlist("tags") or None)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return JSONResponse({"is_sleeping": control.is_sleeping})
