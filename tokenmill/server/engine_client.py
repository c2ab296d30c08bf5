"""The API server's handle on the engine process: start it, send it requests, route its outputs back.

EngineClient is the one owner of a request in this process: generate() registers and submits it, the output loop
routes its outputs, abort() and fail_pending() end it, and the stall watchdog gives up on it. What a handler
iterates is a GenerationStream (generation_stream.py), a passive collector that is handed the client's abort and
nothing else. One asyncio task reads EngineCoreOutputs batches from ZMQ and puts each output on the queue of the
stream that owns the request. Another watches the open streams: one whose output has waited unread for
--stream-stall-timeout (its client stopped reading) is aborted, so that a client cannot make the server hold KV
blocks and buffer output without bound."""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time

import msgspec
import zmq
import zmq.asyncio

from tokenmill.api.errors import EngineDeadError, LoRANotFound, ServiceUnavailable, StreamStalled
from tokenmill.config import EngineConfig
from tokenmill.engine.core_proc import run_engine_core
from tokenmill.engine.messages import (AbortRequests, AddLoRA, AddRequest, AddRequests, ControlReply, EngineCoreOutputs,
                                       EngineMessage, EngineReady, EngineStartupFailed, Profile, RemoveLoRA,
                                       ResetPrefixCache, SchedulerStats, Shutdown, Sleep, SleepReply, StatsQuery,
                                       WakeUp)
from tokenmill.lora.request import LoRARequest
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import ParamError
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.generation_stream import GenerationStream
from tokenmill.server.metrics import ServerMetrics

logger = logging.getLogger("tokenmill.server.engine_client")


class EngineClient:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.ready: EngineReady | None = None
        self.dead_reason: str | None = None
        self._tmpdir = tempfile.mkdtemp(prefix="tokenmill-")
        self._input_address = f"ipc://{self._tmpdir}/input"
        self._output_address = f"ipc://{self._tmpdir}/output"
        self._fault_path = os.path.join(self._tmpdir, "engine-fault.txt")
        self._ctx = zmq.asyncio.Context()
        # A plain send on a PUSH socket never blocks here (no high-water mark), so aborts can be sent from
        # synchronous cleanup code, even while a task is being cancelled.
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(self._input_address)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(self._output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        self._queues: dict[str, asyncio.Queue] = {}  # engine request id → its stream's queue
        self._stats_waiters: dict[int, asyncio.Future] = {}  # query id → its StatsReply's (or ControlReply's) future
        self._query_ids = itertools.count()
        self.metrics: ServerMetrics | None = None  # set by the server once the engine is ready
        self.on_dead = lambda reason: None  # called once, after the pending requests have been failed
        self._queued: dict[str, int] = {}  # requests without their first output yet → prompt tokens
        self._process: multiprocessing.process.BaseProcess | None = None
        self._output_task: asyncio.Task | None = None
        self.stream_stall_timeout_s: float | None = None  # set by the server (--stream-stall-timeout)
        self._streams: dict[str, GenerationStream] = {}  # by request id, watched for stalls until closed
        self._watchdog_task: asyncio.Task | None = None
        # Closed (True) from the start of a POST /sleep until the engine is fully awake again: requests are
        # refused (503) rather than sent to an engine that cannot run them (tokenmill/server/sleep_mode.py)
        self.asleep = False

    # ---- lifecycle ----

    async def start(self, timeout_s: float = 600.0) -> EngineReady:
        """Spawns the engine process and waits until its model is loaded."""
        ctx = multiprocessing.get_context("spawn")
        self._process = ctx.Process(target=run_engine_core, name="tokenmill-engine", daemon=True,
                                    args=(self.config, self._input_address, self._output_address, os.getpid(),
                                          self._fault_path))
        # Spawned with SIGTERM blocked (the mask survives exec), until the engine ignores it: a SIGTERM to the
        # process group while the child starts up must not kill it. Here it waits until the mask is restored.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            self._process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        deadline = time.monotonic() + timeout_s
        while True:
            if await self._output.poll(200):
                msg = self._decoder.decode(await self._output.recv())
                if isinstance(msg, EngineReady):
                    break
                if isinstance(msg, EngineStartupFailed):
                    self.shutdown()
                    raise RuntimeError(f"the engine failed to start: {msg.message}")
            elif not self._process.is_alive():
                reason = self._exit_reason()
                self.shutdown()
                raise RuntimeError(f"{reason} while loading the model")
            elif time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"the engine did not become ready within {timeout_s:.0f} s")
        self.ready = msg
        loop = asyncio.get_running_loop()
        loop.add_reader(self._process.sentinel, self._on_engine_exit)
        self._output_task = loop.create_task(self._output_loop(), name="engine-output-loop")
        self._output_task.add_done_callback(self._on_output_loop_done)
        self._watchdog_task = loop.create_task(self._abort_stalled_streams(), name="stalled-stream-watchdog")
        return msg

    def shutdown(self) -> None:
        """Stops the engine process and releases the sockets; safe to call twice."""
        if self._ctx.closed:
            return
        for task in (self._output_task, self._watchdog_task):
            if task is not None:
                task.cancel()
        proc = self._process
        if proc is not None:
            try:
                asyncio.get_running_loop().remove_reader(proc.sentinel)
            except (RuntimeError, ValueError, OSError):
                pass
            if proc.is_alive() and self.ready is not None and self.dead_reason is None:
                self._send(Shutdown())  # the engine ignores SIGTERM: it ends when asked, between two steps
                proc.join(5)
            if proc.is_alive():  # still loading its model, or stuck
                proc.kill()
                proc.join(5)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    @property
    def is_alive(self) -> bool:
        return self.dead_reason is None and self.ready is not None

    def _on_engine_exit(self) -> None:
        proc = self._process
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        proc.join(1)
        self._fail_all(self._exit_reason())

    def _exit_reason(self) -> str:
        """Why the engine process ended, for a log line: its exit status or signal, and the traceback a fatal signal
        left (faulthandler); a Python error is logged by the engine process itself, just before."""
        code = self._process.exitcode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how = f"was killed by {name}" + (" (out of memory? see the kernel log)" if name == "SIGKILL" else "")
        else:
            how = f"exited with code {code} (its log lines above say why)"
        reason = f"the engine process {how}"
        try:
            with open(self._fault_path) as f:
                fault = f.read().strip()
        except OSError:
            fault = ""
        return f"{reason}: {fault[-2000:]}" if fault else reason

    def _on_output_loop_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("reading engine outputs failed", exc_info=task.exception())
            self._fail_all(f"reading engine outputs failed: {task.exception()!r}")

    def _fail_all(self, reason: str) -> None:
        """From now on every request fails with EngineDeadError, pending ones included."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("%s; failing %d pending requests", reason, len(self._queues))
        self.fail_pending(reason)
        error = EngineDeadError(reason)
        for waiter in self._stats_waiters.values():
            if not waiter.done():
                waiter.set_exception(error)
        self._stats_waiters.clear()
        self.on_dead(reason)

    def fail_pending(self, reason: str, error: BaseException | None = None) -> None:
        """Ends every pending request with `error` (default EngineDeadError): a 503, or an error event in a
        stream."""
        error = error if error is not None else EngineDeadError(reason)
        now = time.monotonic()
        for request_id, queue in self._queues.items():
            queue.put_nowait(error)
            if self.metrics is not None:
                self.metrics.request_finished(request_id, "abort", now)
        if self._queues and self.dead_reason is None:
            self._send(AbortRequests(list(self._queues)))
        self._queues.clear()
        self._queued.clear()

    @property
    def num_queued_requests(self) -> int:
        return len(self._queued)

    @property
    def num_queued_tokens(self) -> int:
        return sum(self._queued.values())

    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    # ---- engine traffic ----

    async def _output_loop(self) -> None:
        while True:
            frame = await self._output.recv(copy=False)
            msg = self._decoder.decode(frame.buffer)
            if not isinstance(msg, EngineCoreOutputs):
                continue
            metrics = self.metrics
            if metrics is not None and msg.scheduler_stats is not None:
                metrics.record_step(msg.scheduler_stats)
            if metrics is not None:
                metrics.record_iteration(msg.outputs)
            for out in msg.outputs:
                self._queued.pop(out.request_id, None)
                if metrics is not None:
                    metrics.record_output(out, msg.timestamp)
                    if out.finish_reason is not None:
                        metrics.request_finished(out.request_id, out.finish_reason,
                                                 out.finished_time or msg.timestamp)
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
                    if out.finish_reason is not None:
                        del self._queues[out.request_id]
            for err in msg.errors:
                self._queued.pop(err.request_id, None)
                queue = self._queues.pop(err.request_id, None)
                if queue is not None:
                    queue.put_nowait(err)
            for reply in [*msg.stats, *msg.control_replies, *msg.sleep_replies]:
                waiter = self._stats_waiters.pop(reply.query_id, None)
                if waiter is not None and not waiter.done():
                    waiter.set_result(reply if isinstance(reply, (ControlReply, SleepReply)) else reply.stats)

    async def _abort_stalled_streams(self) -> None:
        """Fails the streams whose reader has left output unread for longer than the stall timeout; forgets the
        streams their handlers have closed."""
        while True:
            timeout = self.stream_stall_timeout_s
            await asyncio.sleep(min(1.0, timeout / 4) if timeout else 1.0)
            self._streams = {rid: s for rid, s in self._streams.items() if not s.closed}
            if not timeout:
                continue
            now = time.monotonic()
            for stream in [s for s in self._streams.values() if not s.queue.empty() and now - s.last_read > timeout]:
                logger.warning("%s: the client has read nothing for %.0f s; aborting it", stream.request_id,
                               now - stream.last_read)
                if self.metrics is not None:
                    self.metrics.stalled_streams.inc()
                stream.fail(StreamStalled(f"the client read nothing for {timeout:g} s (--stream-stall-timeout)"))

    def _send(self, msg) -> None:
        self._input.send(self._encoder.encode(msg), copy=False)

    def check_awake(self) -> None:
        self.check_alive()
        if self.asleep:
            raise ServiceUnavailable("the engine is asleep (POST /wake_up wakes it)")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    eos_token_id: int | None, priority: int, queue: asyncio.Queue,
                    pooling: PoolingParams | None = None) -> None:
        self.check_awake()
        self._send(self._track(request_id, prompt_token_ids, params, eos_token_id, priority, queue, pooling))

    def add_requests(self, requests: list[tuple[str, list[int], SamplingParams]], eos_token_id: int | None,
                     priority: int, queue: asyncio.Queue, lora_request: LoRARequest | None = None) -> None:
        """(request id, prompt, params) each, in one message, so that the engine starts them in the same step:
        the samples of one API request, the beams of one beam-search step."""
        self.check_awake()
        self._send(AddRequests([self._track(request_id, prompt_token_ids, params, eos_token_id, priority, queue,
                                            lora_request=lora_request)
                                for request_id, prompt_token_ids, params in requests]))

    def _track(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, eos_token_id: int | None,
               priority: int, queue: asyncio.Queue, pooling: PoolingParams | None = None,
               lora_request: LoRARequest | None = None) -> AddRequest:
        self._queues[request_id] = queue
        self._queued[request_id] = len(prompt_token_ids)
        arrival = time.monotonic()
        if self.metrics is not None:
            max_tokens = params.max_tokens if params.max_tokens is not None else self.ready.max_model_len - len(
                prompt_token_ids)
            self.metrics.request_added(request_id, len(prompt_token_ids), arrival,
                                       max_tokens if pooling is None else None,
                                       lora_request.lora_name if lora_request is not None else None)
        return AddRequest(request_id, prompt_token_ids, params, eos_token_id, priority, arrival, pooling, lora_request)

    def abort(self, request_ids: list[str], finished_reason: str = "abort") -> None:
        """Stops requests in the engine; finished_reason is what the metrics record (a stop string that the
        front end matched ends a request as "stop")."""
        now = time.monotonic()
        for request_id in request_ids:
            self._queues.pop(request_id, None)
            self._queued.pop(request_id, None)
            if self.metrics is not None:
                self.metrics.request_finished(request_id, finished_reason, now)
        if request_ids and self.dead_reason is None:
            self._send(AbortRequests(request_ids))

    async def stats(self, timeout_s: float = 10.0) -> SchedulerStats:
        """The engine's state now, even when it is idle and sends no steps."""
        return await self._stats_call(StatsQuery(next(self._query_ids)), timeout_s)

    async def reset_prefix_cache(self, timeout_s: float = 30.0) -> SchedulerStats:
        """vLLM's reset_prefix_cache: the engine forgets every cached prefix; returns its state after it."""
        return await self._stats_call(ResetPrefixCache(next(self._query_ids)), timeout_s)

    async def sleep(self, level: int, mode: str) -> SleepReply:
        """vLLM's sleep; the reply comes once the engine is asleep ("wait": after its requests have finished, which
        has no time limit here: the caller's HTTP client has one)."""
        return await self._stats_call(Sleep(next(self._query_ids), level, mode), None)

    async def wake_up(self, tags: list[str] | None, timeout_s: float = 600.0) -> SleepReply:
        """vLLM's wake_up: the parts in tags ("weights", "kv_cache"), both when None; level 2 reloads the weights."""
        return await self._stats_call(WakeUp(next(self._query_ids), tags), timeout_s)

    async def _stats_call(self, msg: StatsQuery | ResetPrefixCache | Sleep | WakeUp,
                          timeout_s: float | None):
        self.check_alive()
        waiter = asyncio.get_running_loop().create_future()
        self._stats_waiters[msg.query_id] = waiter
        self._send(msg)
        try:
            return await asyncio.wait_for(waiter, timeout_s)
        finally:
            self._stats_waiters.pop(msg.query_id, None)

    async def add_lora(self, lora_request: LoRARequest, timeout_s: float = 300.0) -> None:
        """Loads an adapter into the engine (vLLM's add_lora): raises LoRANotFound when its path holds none, and
        ParamError when it cannot be served."""
        await self._control_call(AddLoRA(next(self._query_ids), lora_request), timeout_s)

    async def remove_lora(self, lora_int_id: int, timeout_s: float = 60.0) -> None:
        """Unloads an adapter; the engine keeps it until the requests that use it have finished."""
        await self._control_call(RemoveLoRA(next(self._query_ids), lora_int_id), timeout_s)

    async def start_profile(self, timeout_s: float = 60.0) -> None:
        """vLLM's start_profile (VLLM_TORCH_PROFILER_DIR): torch's profiler records the engine from now on."""
        await self._control_call(Profile(next(self._query_ids), True), timeout_s, None)

    async def stop_profile(self, timeout_s: float = 600.0) -> None:
        """vLLM's stop_profile: the recording ends and its trace is written (which can take a while)."""
        await self._control_call(Profile(next(self._query_ids), False), timeout_s, None)

    async def _control_call(self, msg: AddLoRA | RemoveLoRA | Profile, timeout_s: float,
                            param: str | None = "lora_path") -> None:
        self.check_alive()
        waiter = asyncio.get_running_loop().create_future()
        self._stats_waiters[msg.query_id] = waiter
        self._send(msg)
        try:
            reply: ControlReply = await asyncio.wait_for(waiter, timeout_s)
        finally:
            self._stats_waiters.pop(msg.query_id, None)
        if reply.error is not None:
            raise LoRANotFound(reply.error) if reply.not_found else ParamError(reply.error, param)

    def generate(self, request_id: str, prompts: list[list[int]], params: SamplingParams, tokenizer,
                 priority: int = 0, lora_request: LoRARequest | None = None) -> GenerationStream:
        """n samples of each prompt, registered and submitted now; use as `with client.generate(...) as stream:
        async for deltas in stream`. The server calls it right after its queue check, with no await between: a
        burst of requests checked first and sent later would all pass the check together."""
        stream = GenerationStream(request_id, prompts, params, tokenizer, self.abort)
        # one message: the engine starts every sample (every beam of a beam-search step) in the same step
        self.add_requests(stream.engine_requests(), tokenizer.eos_token_id, priority, stream.queue, lora_request)
        self._streams[request_id] = stream
        return stream
