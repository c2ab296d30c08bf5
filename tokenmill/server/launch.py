"""`tokenmill serve`: the process's start-up. The flags become an EngineConfig and a ServerConfig; the port is bound
and answers before the model loads (/health/live 200, /health/ready 503 while the engine process loads it); the
tokenizer loads beside the engine; then the app (api_server.build_app) goes behind the lifecycle, and uvicorn
serves until SIGTERM drains it or the engine dies."""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import time

import uvicorn

from tokenmill import envs
from tokenmill.api.lifecycle import DrainingServer, Lifecycle, LifecycleApp
from tokenmill.api.server_config import ServerConfig, add_serve_cli_args
from tokenmill.api.tracing import make_tracer
from tokenmill.chat_templates import load_chat_template
from tokenmill.config import DEFAULT_MODEL, EngineConfig
from tokenmill.heap import freeze_startup_heap
from tokenmill.logs import configure_logging
from tokenmill.models import generation_config
from tokenmill.models.paths import resolve_model_path
from tokenmill.server.api_server import build_app
from tokenmill.server.engine_client import EngineClient
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.server_state import ServerState
from tokenmill.tokenizer import load_tokenizer

logger = logging.getLogger("tokenmill.server")


add_cli_args = add_serve_cli_args  # the hook tokenmill/cli.py calls: `tokenmill serve`'s flags


def configs_from_cli(args: argparse.Namespace) -> tuple[ServerConfig, EngineConfig]:
    """`tokenmill serve`'s flags (run-batch's too) as the two configs, or SystemExit naming what is wrong."""
    if args.model_tag is not None:
        if args.model not in (DEFAULT_MODEL, args.model_tag):
            raise SystemExit(f"error: the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.api_key is None:
        args.api_key = envs.TOKENMILL_API_KEY
    if args.chat_template is not None:
        try:
            args.chat_template = load_chat_template(args.chat_template)
        except OSError as e:
            raise SystemExit(f"error: cannot read --chat-template: {e}") from None
    try:
        server_config = ServerConfig.from_cli_args(args)
        engine_config = EngineConfig.from_cli_args(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if server_config.lora_modules and not engine_config.enable_lora:
        raise SystemExit("error: --lora-modules needs --enable-lora")
    if server_config.wake_on_demand and not engine_config.enable_sleep_mode:
        raise SystemExit("error: --wake-on-demand needs --enable-sleep-mode")
    return server_config, engine_config


def run_async(main) -> int:
    """Runs the coroutine on uvloop where it is installed; Ctrl-C is a clean exit."""
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        return run(main)
    except KeyboardInterrupt:
        return 0


def run_from_cli(args: argparse.Namespace) -> int:
    server_config, engine_config = configs_from_cli(args)
    configure_logging(server_config.log_format)
    return run_async(serve(server_config, engine_config))


# The kernel's send buffer of each connection (accepted sockets inherit it). Left to autotuning it grows to
# tcp_wmem's maximum (4 MiB here) for a client that stops reading, and the server would only notice the stall
# (--stream-stall-timeout) once that much of the stream sat unread. 64 KiB still carries 640 KB/s at 100 ms RTT;
# a token stream with 20 logprobs per token at 100 tokens/s is 70 KB/s.
SEND_BUFFER_BYTES = 64 * 1024


def _bind(host: str, port: int) -> socket.socket:
    """Binds the port now, so that a taken port fails before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES // 2)  # Linux doubles what it is given
    sock.bind((host, port))
    return sock


async def _log_stats(metrics: ServerMetrics) -> None:
    interval_s = envs.TOKENMILL_STATS_LOG_INTERVAL_S
    while True:
        line = metrics.stats_line(time.monotonic())
        if line:
            logger.info("%s", line)
        await asyncio.sleep(interval_s)


def make_state(config: ServerConfig, engine_config: EngineConfig, client: EngineClient, ready, tokenizer,
               generation_defaults) -> ServerState:
    """What the app's handlers share, once the engine is ready and the tokenizer loaded."""
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    return ServerState(client, tokenizer, ready, config, engine_config.model, engine_config.reasoning,
                       make_tracer(config.otlp_traces_endpoint, config.otlp_traces_include_text), generation_defaults)


async def make_app(state: ServerState):
    """The app, with --lora-modules' adapters loaded; None (logged) when one cannot be served, which ends the
    start-up, as in vLLM."""
    app = build_app(state)
    try:
        await app.state.models.load_static(state.config.lora_modules or [])
    except Exception as e:  # noqa: BLE001 - any adapter failure is reported the same way
        logger.error("--lora-modules: %s", e)
        return None
    return app


async def serve(config: ServerConfig, engine_config: EngineConfig) -> int:
    try:
        model_path = resolve_model_path(engine_config.model, engine_config.download_dir)
        generation_defaults = generation_config.generation_defaults(
            model_path, engine_config.generation_config, engine_config.override_generation_config)
        sock = _bind(config.host, config.port)
    except (OSError, ValueError) as e:
        logger.error("%s", e)
        return 1
    lifecycle = Lifecycle(config.shutdown_timeout)
    root = LifecycleApp(lifecycle)
    # log_config=None: uvicorn's loggers keep our handler (text or JSON, with request ids)
    server = DrainingServer(uvicorn.Config(root, log_level=config.uvicorn_log_level, timeout_keep_alive=30,
                                           access_log=not config.disable_uvicorn_access_log,
                                           lifespan="off", timeout_graceful_shutdown=5, log_config=None,
                                           ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile,
                                           root_path=config.root_path or ""), lifecycle)
    client = EngineClient(engine_config)
    client.stream_stall_timeout_s = config.stream_stall_timeout
    lifecycle.engine_alive = lambda: client.dead_reason is None
    # The port answers from now on: /health is 200 and /health/ready 503 while the model loads.
    http = asyncio.create_task(server.serve(sockets=[sock]))
    stats_task, state = None, None
    try:
        # The tokenizer loads here while the engine process loads the model.
        tokenizer_task = asyncio.create_task(asyncio.to_thread(load_tokenizer, model_path, engine_config.tokenizer,
                                                               engine_config.trust_remote_code))
        starting = asyncio.create_task(client.start())
        await asyncio.wait([starting, http], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # SIGTERM or Ctrl-C while loading
            starting.cancel()
            tokenizer_task.cancel()
            return 0
        try:
            ready = starting.result()
            tokenizer = await tokenizer_task
        except RuntimeError as e:
            tokenizer_task.cancel()
            logger.error("%s", e)
            return 1
        except Exception as e:  # noqa: BLE001 - any failure to load the tokenizer ends the server here
            logger.error("could not load the tokenizer: %s: %s", type(e).__name__, e)
            return 1
        logger.info("engine ready: max_model_len=%d, %d KV blocks of %d tokens", ready.max_model_len,
                    ready.num_blocks, ready.block_size)
        state = make_state(config, engine_config, client, ready, tokenizer, generation_defaults)
        client.on_dead = lifecycle.engine_died
        lifecycle.fail_pending = client.fail_pending
        app = await make_app(state)
        if app is None:
            return 1
        root.inner = app
        freeze_startup_heap()
        if lifecycle.phase == "loading":
            lifecycle.phase = "ready"
        if not config.disable_log_stats:
            stats_task = asyncio.create_task(_log_stats(state.metrics))
        scheme = "https" if config.ssl_certfile else "http"
        logger.info("serving %s on %s://%s:%d%s", state.model_names[0], scheme, config.host, config.port,
                    config.root_path or "")
        await http
        return lifecycle.exit_code
    finally:
        if stats_task is not None:
            stats_task.cancel()
        if state is not None and state.tracer is not None:
            state.tracer.shutdown()
        if not http.done():
            server.should_exit = True
            await http
        client.shutdown()
        sock.close()
