"""The engine core in its own process.

It speaks the messages of tokenmill/engine/messages.py over two ZMQ PUSH/PULL sockets; the API server binds
both sockets and this process connects to them.

The loop: while requests are unfinished, drain the input socket without blocking and run one engine step; when
idle, block on the input socket (waking once a second to notice a dead parent)."""
from __future__ import annotations

import logging
import collections
import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

from tokenmill import envs
from tokenmill.config import EngineConfig
from tokenmill.engine.host_memory import release_freed_memory
from tokenmill.engine.kv_event_publisher import ZmqEventPublisher, make_publisher
from tokenmill.engine.messages import (
    AbortRequests,
    AddLoRA,
    AddRequest,
    AddRequests,
    EngineCoreOutputs,
    EngineInput,
    EngineReady,
    EngineStartupFailed,
    ControlReply,
    RemoveLoRA,
    EngineCoreOutput,
    Profile,
    ResetPrefixCache,
    RequestError,
    Shutdown,
    Sleep,
    SleepReply,
    StatsQuery,
    StatsReply,
    WakeUp,
)
from tokenmill.heap import freeze_startup_heap
from tokenmill.sampling_params import ParamError

logger = logging.getLogger("tokenmill.engine.core_proc")

_IDLE_POLL_MS = 1000  # when idle: how often to check that the API server still lives
_PIN_POLL_MS = 50  # when idle with KV blocks pinned for decode instances: how often to free those they are done with


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, parent_pid: int,
                    fault_path: str | None = None) -> None:
    """Entry point of the engine process (multiprocessing spawn target). fault_path: where a fatal signal's
    traceback goes (faulthandler), for the API server to quote if this process dies without a word."""
    # Ctrl-C and SIGTERM reach the whole process group (a terminal, `docker stop`, systemd): the API server decides
    # when this process ends (a Shutdown message, once it has drained), so both are ignored here. The API server
    # spawned this process with SIGTERM blocked (engine_client.py), so one sent before this line is dropped too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if fault_path is not None:
        import faulthandler
        faulthandler.enable(open(fault_path, "w"))  # noqa: SIM115 - open for the life of the process
    from tokenmill.logs import configure_logging
    configure_logging()  # the API server's --log-format, through the environment
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    try:
        _set_engine_threads(config)
        from tokenmill.engine.engine import EngineCore
        # the engine with its code and libraries and no model: sleep level 2 returns close to it (README)
        logger.info("engine process: %.0f MiB resident before loading the model", _rss_bytes() / 2**20)
        engine = EngineCore(config)
        publisher = make_publisher(config.kv_events_config)  # a taken port fails the start-up here
        if publisher is not None:
            engine.kv_cache.enable_events()
    except BaseException as e:  # noqa: BLE001 - report any failure to load, then exit
        if isinstance(e, (ValueError, FileNotFoundError)):  # a configuration problem: the message says it all
            logger.error("engine failed to start: %s", e)
        else:
            logger.error("engine failed to start:\n%s", traceback.format_exc())
        outputs.send(encoder.encode(EngineStartupFailed(f"{type(e).__name__}: {e}")))
        ctx.destroy(linger=2000)  # closes both sockets, delivering the message first
        logging.shutdown()
        # Skip interpreter finalizers: after a failed load, torch's exit hooks can print a spurious traceback
        # (torch/library.py _del_library) that would bury the reason logged above.
        os._exit(1)
    outputs.send(encoder.encode(EngineReady(
        engine.max_model_len, engine.runner.vocab_size, config.max_logprobs, config.scheduling_policy,
        engine.kv_cache.num_blocks, engine.kv_cache.block_size, config.enable_prefix_caching, engine.runner_type,
        engine.matryoshka, config.kv_cache_dtype, max_loras=config.max_loras if engine.lora is not None else 0)))
    freeze_startup_heap()
    EngineCoreLoop(engine, inputs, outputs, parent_pid, publisher).run()


def _rss_bytes() -> int:
    """This process's resident memory: the figure sleep mode's levels are measured against (README)."""
    import psutil
    return psutil.Process().memory_info().rss


def _set_engine_threads(config: EngineConfig) -> None:
    """On CPU the engine computes on every core it may use. Measured on 2 cores (SmolLM2, bf16, bench serve
    ISL 256 / OSL 128): 2 threads against 1 gave 205 vs 143 output tok/s at c=8 and 281 vs 179 at c=32, and TTFT
    p99 at c=8 went from 2.5 s to 1.6 s; the API server's share of the CPU is small and the OS scheduler hands
    it a core when it needs one (/health stays fast, see benchmarks/results/health-under-load.md). OMP_NUM_THREADS, when set, wins."""
    if envs.OMP_NUM_THREADS or config.device not in ("auto", "cpu"):
        return
    import torch
    if config.device == "auto" and torch.cuda.is_available():
        return
    threads = max(1, len(os.sched_getaffinity(0)))
    torch.set_num_threads(threads)
    logger.info("using %d torch threads (set OMP_NUM_THREADS to override)", threads)


class EngineCoreLoop:
    def __init__(self, engine, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int,
                 kv_event_publisher: ZmqEventPublisher | None = None):
        self.engine = engine
        self.kv_event_publisher = kv_event_publisher
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = parent_pid
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.encoder = msgspec.msgpack.Encoder()
        self.errors: list[RequestError] = []
        self.stats_queries: list[int] = []
        self.control_replies: list[ControlReply] = []
        self.aborted = False  # since the last message: the state changed without a step
        # Sleep and WakeUp in arrival order, one at a time: a Sleep in "wait" mode stays first until the engine
        # has finished its requests, so that concurrent callers' sleeps and wakes apply in the order they came
        self.sleep_ops: collections.deque[Sleep | WakeUp] = collections.deque()
        self.sleep_replies: list[SleepReply] = []
        self.outputs_pending: list[EngineCoreOutput] = []  # requests a sleep aborted

    def run(self) -> None:
        while True:
            if not self.engine.has_unfinished_requests() and not self.sleep_ops:
                self._wait_for_input()
            self._drain_inputs()
            if self.sleep_ops:
                self._run_sleep_ops()
            stepped = self.engine.has_unfinished_requests()
            outputs = self.engine.step() if stepped else []
            if not stepped and self.engine.release_kv_pins():
                self.aborted = True  # blocks freed with no step: report the state
            if self.outputs_pending:
                outputs, self.outputs_pending = self.outputs_pending + outputs, []
            if stepped and self.kv_event_publisher is not None:
                events = self.engine.kv_cache.take_events()
                if events:
                    self.kv_event_publisher.publish(events)
            replies = self.stats_queries or self.control_replies or self.sleep_replies
            if stepped or self.errors or self.aborted or replies:
                stats = [StatsReply(q, self.engine.scheduler_stats()) for q in self.stats_queries]
                # Every change of state is reported (an abort frees blocks with no step after it), so the server's
                # copy is always current and /metrics never has to wait for a step to end.
                sched_stats = None
                if stepped or self.aborted:
                    sched_stats = self.engine.scheduler_stats(self.engine.last_step_tokens if stepped else 0)
                msg = EngineCoreOutputs(outputs, self.errors, stats, time.monotonic(), sched_stats,
                                        self.control_replies, self.sleep_replies)
                self.outputs.send(self.encoder.encode(msg), copy=False)
                self.errors, self.stats_queries, self.aborted, self.control_replies = [], [], False, []
                self.sleep_replies = []

    def _wait_for_input(self) -> None:
        if not self.inputs.poll(0):
            release_freed_memory()  # falling idle: the steps' freed heap goes back to the OS
        while not self.inputs.poll(_PIN_POLL_MS if self.engine.holds_kv_pins else _IDLE_POLL_MS):
            if os.getppid() != self.parent_pid:
                logger.info("the API server is gone; exiting")
                sys.exit(0)
            if self.engine.holds_kv_pins and self.engine.release_kv_pins():
                self.aborted = True
                return

    def _drain_inputs(self) -> None:
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(self.decoder.decode(frame.buffer))

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            try:
                if msg.pooling is not None:
                    self.engine.add_pooling_request(msg.request_id, msg.prompt_token_ids, msg.pooling, msg.priority,
                                                    msg.arrival_time)
                else:
                    self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.eos_token_id,
                                            msg.priority, msg.arrival_time, lora_request=msg.lora_request)
            except ParamError as e:
                self.errors.append(RequestError(msg.request_id, str(e), e.param))
            except Exception as e:  # noqa: BLE001 - one bad request must not take the engine down
                logger.exception("add_request %s failed", msg.request_id)
                self.errors.append(RequestError(msg.request_id, f"{type(e).__name__}: {e}"))
        elif isinstance(msg, AddRequests):
            for request in msg.requests:
                self._handle(request)
        elif isinstance(msg, AbortRequests):
            for request_id in msg.request_ids:
                self.engine.abort_request(request_id)
            self.aborted = True
        elif isinstance(msg, StatsQuery):
            self.stats_queries.append(msg.query_id)
        elif isinstance(msg, ResetPrefixCache):
            logger.info("prefix cache reset: %d cached blocks forgotten", self.engine.reset_prefix_cache())
            if self.kv_event_publisher is not None:  # AllBlocksCleared now, not with the next step's events
                self.kv_event_publisher.publish(self.engine.kv_cache.take_events())
            self.stats_queries.append(msg.query_id)
        elif isinstance(msg, (AddLoRA, RemoveLoRA)):
            self.control_replies.append(self._lora_reply(msg))
        elif isinstance(msg, Profile):
            try:
                self.engine.profiler.start() if msg.start else self.engine.profiler.stop()
                self.control_replies.append(ControlReply(msg.query_id))
            except ValueError as e:
                self.control_replies.append(ControlReply(msg.query_id, str(e)))
        elif isinstance(msg, (Sleep, WakeUp)):
            self.sleep_ops.append(msg)
        elif isinstance(msg, Shutdown):
            logger.info("shutting down")
            sys.exit(0)  # SystemExit: multiprocessing's finalizers run, the exit status is 0

    def _run_sleep_ops(self) -> None:
        """Runs the queued Sleep and WakeUp messages in order; a Sleep in "wait" mode waits (the loop keeps
        stepping) until the requests the engine has are finished."""
        engine = self.engine
        while self.sleep_ops:
            op = self.sleep_ops[0]
            if isinstance(op, Sleep) and op.mode == "wait" and engine.scheduler.has_unfinished():
                return
            self.sleep_ops.popleft()
            error = None
            try:
                if isinstance(op, Sleep):
                    aborted = list(engine.scheduler.requests)
                    engine.sleep(op.level)
                    # normally none: the API server failed them before it sent the Sleep; never a silent end
                    self.outputs_pending += [EngineCoreOutput(rid, [], "abort") for rid in aborted]
                else:
                    engine.wake_up(op.tags)
            except ValueError as e:
                error = str(e)
            except Exception as e:  # noqa: BLE001 - the engine stays up, in the state the reply reports
                logger.exception("%s failed", type(op).__name__)
                error = f"{type(op).__name__.lower()} failed: {type(e).__name__}: {e}"
            if self.kv_event_publisher is not None:  # AllBlocksCleared now, not with the next step's events
                events = engine.kv_cache.take_events()
                if events:
                    self.kv_event_publisher.publish(events)
            self.sleep_replies.append(SleepReply(op.query_id, engine.sleep_level, engine.asleep_parts(),
                                                 engine.scheduler_stats(), error))

    def _lora_reply(self, msg: AddLoRA | RemoveLoRA) -> ControlReply:
        try:
            if isinstance(msg, AddLoRA):
                self.engine.add_lora(msg.lora_request)
            elif not self.engine.remove_lora(msg.lora_int_id):
                return ControlReply(msg.query_id, f"LoRA adapter id {msg.lora_int_id} is not loaded", not_found=True)
        except ValueError as e:  # lora.adapter.LoRAError (not imported: the API server imports this module), ParamError
            return ControlReply(msg.query_id, str(e), getattr(e, "not_found", False))
        except Exception as e:  # noqa: BLE001 - one bad adapter must not take the engine down
            logger.exception("loading a LoRA adapter failed")
            return ControlReply(msg.query_id, f"{type(e).__name__}: {e}")
        return ControlReply(msg.query_id)
