"""`tokenmill serve-ray`: tokenmill replicas as a Ray Serve deployment, behind the router, scaled on their queues.

Two deployments in one Serve application, on a local Ray cluster (`ray.init(num_cpus=...)`) or a multi-node one
(`--ray-address auto`) alike:
- TokenmillReplica: each Serve replica runs one `tokenmill serve` process on its node (on all interfaces, a free
  port, KV events on) and registers its URL and KV-event endpoints with the router by a heartbeat; it leaves on
  scale-down (Serve calls its __del__: it unregisters, then the engine drains on SIGTERM). Serve's health check is
  the engine process being alive; Serve replaces a replica whose engine died.
- TokenmillRouter: the ingress behind Serve's HTTP proxy. It is `tokenmill router` itself (tokenmill/router/app.py:
  the same KV-event index, policies, retries, stream resumption, tenants, metrics, tracing), whose replicas join
  and leave with the heartbeats. One router replica: the registrations go to it.

Requests go from the router to the engines over HTTP, not through Serve's handles, so Serve's own count of
ongoing requests stays at zero and cannot drive autoscaling. Each replica reports its engine's own queue instead
(vllm:num_requests_running + vllm:num_requests_waiting, what Serve calls ongoing requests: those being processed
and those queued), and engine_queue_autoscaling_policy applies Serve's default rule to it: replicas = ongoing
requests / target_ongoing_requests, within min/max replicas and after Serve's upscale/downscale delays.

Ray is an optional extra (`pip install 'tokenmill[ray]'`): nothing here imports it until it is used."""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from tokenmill.api.lifecycle import Lifecycle
from tokenmill.ports import free_ports
from tokenmill.router.app import build_app, build_state, join, leave, load_router_tokenizer
from tokenmill.router.replica_client import TRANSPORT_ERRORS, ReplicaClient
from tokenmill.router.replicas import Replica, replica_reported_load
from tokenmill.router.router_config import RouterConfig

logger = logging.getLogger("tokenmill.router.ray_serve")

APP_NAME = "tokenmill"
ROUTER_DEPLOYMENT = "TokenmillRouter"
REPLICA_DEPLOYMENT = "TokenmillReplica"
ENGINE_QUEUE_METRIC = "engine_ongoing_requests"  # running + waiting on one replica's engine
HEARTBEAT_S = 1.0  # a replica re-registers this often...
EXPIRY_S = 10.0  # ...and is dropped by the router after this long without a heartbeat (it died unannounced)
ENGINE_STARTUP_TIMEOUT_S = 900.0
# Serve's proxy stops sending to the router at this many requests in flight; the router's own admission
# (--max-concurrent-requests, --max-queued-requests) is the limit meant, so Serve's must not bind first.
ROUTER_MAX_ONGOING_REQUESTS = 100_000
# Serve's AutoscalingConfig, where tokenmill's default differs: a batching engine serves many requests at once,
# Serve's default target (2) is for models that serve one at a time.
DEFAULT_AUTOSCALING = {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 16}
# the flags of `tokenmill router` that do not apply here: the replicas join by themselves, Serve's proxy serves HTTP
# (disaggregated serving and idle sleep need instances started for them: not Serve's replicas)
ROUTER_ONLY_FLAGS = ("backend", "prefill", "decode", "kv_events_endpoint", "kv_events_replay_endpoint",
                     "sleep_after_idle", "sleep_level", "min_awake", "uvicorn_log_level")
SHARED_FLAGS = ("model", "tokenizer", "chat_template", "block_size")  # given to the router and every replica


@dataclass
class RayServeConfig(RouterConfig):
    autoscaling_config: str | None = field(default=None, metadata={
        "help": "Ray Serve's autoscaling_config, JSON, e.g. '{\"min_replicas\": 1, \"max_replicas\": 4, "
                "\"target_ongoing_requests\": 16, \"upscale_delay_s\": 30}' (Serve's names and defaults, but "
                f"{DEFAULT_AUTOSCALING}); the ongoing requests are each engine's running + waiting requests"})
    replica_num_cpus: float = field(default=1.0, metadata={
        "help": "CPUs each replica reserves in Ray; its engine gets as many torch threads (at least 1)"})
    replica_num_gpus: float = field(default=0.0, metadata={"help": "GPUs each replica reserves in Ray"})
    router_num_cpus: float = field(default=0.0, metadata={"help": "CPUs the router reserves in Ray"})
    ray_address: str | None = field(default=None, metadata={
        "help": "the Ray cluster to join ('auto': the one `ray start` runs on this machine's node; or its head's "
                "address); default: start a local one (with --num-cpus CPUs)"})
    num_cpus: int | None = field(default=None, metadata={
        "help": "CPUs of the local Ray cluster this command starts (default: all); not with --ray-address"})

    def __post_init__(self):
        super().__post_init__()
        if self.ray_address is not None and self.num_cpus is not None:
            raise ValueError("--num-cpus sizes a local Ray cluster: not with --ray-address")
        if min(self.replica_num_cpus, self.replica_num_gpus, self.router_num_cpus) < 0:
            raise ValueError("--replica-num-cpus, --replica-num-gpus and --router-num-cpus must not be negative")

    @property
    def engine_threads(self) -> int:
        return max(1, round(self.replica_num_cpus))


def engine_queue_autoscaling_policy(ctx) -> tuple[float, dict]:
    """Serve's default rule (replicas = ongoing requests / target_ongoing_requests) on the engines' own counts,
    averaged by Serve over look_back_period_s. Serve then rounds up, bounds and delays the decision as for its
    default policy. Runs in Serve's controller."""
    per_replica = (ctx.aggregated_metrics or {}).get(ENGINE_QUEUE_METRIC) or {}
    if not per_replica:  # no replica has reported yet
        return ctx.target_num_replicas, {}
    return sum(per_replica.values()) / ctx.config.get_target_ongoing_requests(), {}


def serve_autoscaling_config(text: str | None) -> dict:
    """--autoscaling-config over tokenmill's defaults, checked against Serve's AutoscalingConfig (which ignores
    keys it does not know, so they are refused here)."""
    from ray.serve.config import AutoscalingConfig
    try:
        given = json.loads(text) if text else {}
    except ValueError as e:
        raise ValueError(f"--autoscaling-config is not JSON: {e}") from None
    unknown = sorted(set(given) - set(AutoscalingConfig.model_fields)) if isinstance(given, dict) else given
    if not isinstance(given, dict) or unknown:
        raise ValueError(f"--autoscaling-config takes a JSON object with Ray Serve's AutoscalingConfig keys "
                         f"{sorted(AutoscalingConfig.model_fields)}; got {unknown!r}")
    merged = {**DEFAULT_AUTOSCALING, **given}
    merged.setdefault("policy", {"policy_function": f"{__name__}:{engine_queue_autoscaling_policy.__name__}"})
    AutoscalingConfig(**merged)  # pydantic's ValidationError is a ValueError
    return merged


def _configure_logging() -> None:
    """tokenmill's log lines in a Ray worker (Ray keeps them in the worker's log and shows them to the driver),
    as `tokenmill router` has them: replicas joining, leaving, ejected."""
    from tokenmill.logs import configure_logging
    configure_logging()


# ---------------------------------------------------------------- the replicas ----------------------------------

def _die_with_parent():
    """A preexec_fn: the engine must not outlive its replica's actor, even one that Ray kills outright (Linux's
    PR_SET_PDEATHSIG; tokenmill serve's engine process in turn follows its parent). prctl is looked up here, in
    the parent: between fork and exec the child only calls it."""
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


class TokenmillReplica:
    """One Serve replica: a `tokenmill serve` process on this node, registered with the router while it lives."""

    async def __init__(self, serve_args: list[str], engine_threads: int, shutdown_timeout: float):
        import ray
        from ray import serve
        _configure_logging()
        self.process: subprocess.Popen | None = None
        self.heartbeat: asyncio.Task | None = None
        self.stopping = False
        self.shutdown_timeout = shutdown_timeout
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        node = ray.util.get_node_ip_address()
        port, pub, replay = free_ports(3, "")  # below the ephemeral range: tokenmill/ports.py
        events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}",
                  "topic": "kv"}
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", *serve_args, "--host", "0.0.0.0", "--port", str(port),
               "--kv-events-config", json.dumps(events)]
        env = {**os.environ, "OMP_NUM_THREADS": str(engine_threads), "TOKENMILL_NO_PROGRESS": "1"}
        self.process = subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent())
        self.local_url = f"http://127.0.0.1:{port}"
        self.client = ReplicaClient(10.0)
        await self._wait_ready()
        self.registration = {"replica_id": self.replica_id, "url": f"http://{node}:{port}",
                             "kv_events_endpoint": f"tcp://{node}:{pub}",
                             "kv_events_replay_endpoint": f"tcp://{node}:{replay}"}
        self.router = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=context.app_name)
        await self._register()  # routed to from the moment Serve counts it as running
        self.heartbeat = asyncio.create_task(self._beat())
        logger.info("replica %s: tokenmill serve on %s", self.replica_id, self.registration["url"])

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + ENGINE_STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited with {self.process.returncode} while starting (its "
                                   "output is in this replica's log)")
            try:
                if (await self.client.get(self.local_url + "/health"))[0] == 200:
                    return
            except TRANSPORT_ERRORS:
                pass
            await asyncio.sleep(0.5)
        self.process.kill()
        raise TimeoutError(f"tokenmill serve was not ready within {ENGINE_STARTUP_TIMEOUT_S:.0f} s")

    async def _register(self) -> None:
        try:
            await asyncio.wait_for(self.router.register.remote(self.registration), 2 * HEARTBEAT_S)
        except Exception as e:  # noqa: BLE001 - the router is starting or restarting: the next beat registers
            logger.debug("replica %s: registration failed: %r", self.replica_id, e)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            await self._register()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric: the engine's running + waiting requests."""
        if self.stopping:  # Serve asks until the replica is gone, the engine may be already
            return {ENGINE_QUEUE_METRIC: 0.0}
        _, body, _ = await self.client.get(self.local_url + "/metrics")
        return {ENGINE_QUEUE_METRIC: float(replica_reported_load(body.decode(errors="replace")) or 0)}

    async def check_health(self) -> None:
        """Serve replaces a replica whose engine died (an overloaded or draining one is alive: the router's own
        health checks stop routing to it)."""
        if self.process.poll() is not None:
            raise RuntimeError(f"tokenmill serve exited with {self.process.returncode}")
        status, _, _ = await self.client.get(self.local_url + "/health/live")
        if status != 200:
            raise RuntimeError(f"tokenmill serve's /health/live answered {status}")

    async def __del__(self):
        self.stopping = True
        if self.heartbeat is not None:
            self.heartbeat.cancel()
            try:  # not long: the router may be stopping too (serve.shutdown)
                await asyncio.wait_for(self.router.unregister.remote(self.replica_id), HEARTBEAT_S)
            except Exception as e:  # noqa: BLE001 - the router drops it when its heartbeats stop
                logger.debug("replica %s: unregistering failed: %r", self.replica_id, e)
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # the engine drains what it still runs
            try:
                await asyncio.to_thread(self.process.wait, self.shutdown_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()


# ---------------------------------------------------------------- the router ------------------------------------

class TokenmillRouter:
    """The ingress: `tokenmill router`'s app, whose replicas are the registered TokenmillReplicas."""

    async def __init__(self, config: RayServeConfig, replicas_deployment):
        # replicas_deployment (a handle) is not called: binding it is what makes Serve deploy the replicas
        _configure_logging()
        self.state = build_state(config, await asyncio.to_thread(load_router_tokenizer, config))
        self.members: dict[str, Replica] = {}  # by Serve replica id
        self.last_seen: dict[str, float] = {}
        self.expiry = asyncio.create_task(self._expire())

    def __serve_build_asgi_app__(self):
        return build_app(self.state, Lifecycle(self.state.config.shutdown_timeout))

    async def register(self, registration: dict) -> None:
        replica_id = registration["replica_id"]
        self.last_seen[replica_id] = time.monotonic()
        if replica_id not in self.members:
            logger.info("replica %s joined: %s", replica_id, registration["url"])
            self.members[replica_id] = replica = join(self.state, registration["url"],
                                                      registration["kv_events_endpoint"],
                                                      registration["kv_events_replay_endpoint"])
            await self.state.replicas.check(replica)

    async def unregister(self, replica_id: str) -> None:
        replica = self.members.pop(replica_id, None)
        self.last_seen.pop(replica_id, None)
        if replica is not None:
            logger.info("replica %s left: %s", replica_id, replica.url)
            leave(self.state, replica)

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            now = time.monotonic()
            for replica_id in [r for r, seen in self.last_seen.items() if now - seen > EXPIRY_S]:
                logger.warning("replica %s sent no heartbeat for %.0f s: dropping it", replica_id, EXPIRY_S)
                await self.unregister(replica_id)

    async def __del__(self):
        self.expiry.cancel()


def build_ray_app(config: RayServeConfig, serve_args: list[str]):
    """The Serve application: the router, bound to the autoscaled replica deployment."""
    from ray import serve
    replicas = serve.deployment(
        TokenmillReplica, name=REPLICA_DEPLOYMENT, autoscaling_config=serve_autoscaling_config(
            config.autoscaling_config), graceful_shutdown_timeout_s=config.shutdown_timeout,
        ray_actor_options={"num_cpus": config.replica_num_cpus, "num_gpus": config.replica_num_gpus})
    router = serve.deployment(
        serve.ingress()(TokenmillRouter), name=ROUTER_DEPLOYMENT, num_replicas=1,
        max_ongoing_requests=ROUTER_MAX_ONGOING_REQUESTS, graceful_shutdown_timeout_s=config.shutdown_timeout,
        # no line per request, as `tokenmill router` (uvicorn at warning), nor per replica heartbeat
        logging_config={"enable_access_log": False}, ray_actor_options={"num_cpus": config.router_num_cpus})
    return router.bind(config, replicas.bind(serve_args, config.engine_threads, config.shutdown_timeout))


def replica_serve_args(config: RayServeConfig, extra: list[str]) -> list[str]:
    """Each replica's `tokenmill serve` flags: the shared ones, then the rest of the command line; checked here
    with tokenmill serve's own parser (which exits with its usage error), before any replica starts."""
    from tokenmill.api.server_config import add_serve_cli_args
    if any(arg.split("=", 1)[0] == "--kv-events-config" for arg in extra):
        raise ValueError("serve-ray sets each replica's --kv-events-config (and --host, --port) itself")
    args = []
    for name in SHARED_FLAGS:
        if getattr(config, name) is not None:
            args += ["--" + name.replace("_", "-"), str(getattr(config, name))]
    args += extra
    parser = argparse.ArgumentParser(prog="tokenmill serve-ray (the replicas' tokenmill serve flags)",
                                     allow_abbrev=False)
    add_serve_cli_args(parser)
    if parser.parse_args(args).model_tag is not None:
        raise ValueError("give the model as --model: the router loads its tokenizer too")
    return args


def deploy(config: RayServeConfig, serve_args: list[str]) -> None:
    """Starts Serve's HTTP proxy on --host/--port and deploys the application (on the Ray cluster this process
    joined); returns once the router and --autoscaling-config's initial replicas are running."""
    from ray import serve
    app = build_ray_app(config, serve_args)
    serve.start(http_options={"host": config.host, "port": config.port})
    serve.run(app, name=APP_NAME, route_prefix="/")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    RayServeConfig.add_cli_args(parser, skip=ROUTER_ONLY_FLAGS)


def run_from_cli(args: argparse.Namespace, extra: list[str]) -> int:
    from tokenmill.logs import configure_logging
    try:
        import ray
        from ray import serve
    except ImportError:
        raise SystemExit("error: tokenmill serve-ray needs Ray Serve: pip install 'tokenmill[ray]'") from None
    try:
        config = RayServeConfig.from_cli_args(args)
        serve_args = replica_serve_args(config, extra)
        serve_autoscaling_config(config.autoscaling_config)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    configure_logging()
    ray.init(address=config.ray_address, num_cpus=config.num_cpus)
    try:
        deploy(config, serve_args)
        logger.info("serving on http://%s:%d (the router; Ray Serve application %r)", config.host, config.port,
                    APP_NAME)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            pass
        logger.info("stopping: the replicas drain, then Ray shuts down")
        serve.delete(APP_NAME)
    finally:
        ray.shutdown()
    return 0
