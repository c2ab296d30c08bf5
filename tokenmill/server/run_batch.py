"""`tokenmill run-batch -i IN.jsonl -o OUT.jsonl`: a file in OpenAI's Batch format, run offline (vLLM's
`vllm run-batch`). Each input line is `{"custom_id", "method": "POST", "url", "body"}`; each output line, in the
input's order, is `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, with the
endpoint's answer as the body, or, for a request the endpoint refused, no body and its error object as `error`
(vLLM's shapes).

The lines go through the app `tokenmill serve` builds (in process, over ASGI, no port), so that a batch request is
validated, templated and answered exactly as the same request sent to the server. What is wrong with the file itself
(a line that is not a request, a method other than POST, a URL run-batch does not serve, a streamed body, a
custom_id used twice) ends the run before the model loads, naming the line; what the endpoint refuses is that
line's error, and the batch goes on. The output file is written in order as the answers come, so a run that stops
leaves the answers to a prefix of the input. Input and output may be http(s) URLs (GET, and PUT of the finished
file, as vLLM)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import pydantic
import uvicorn
from fastapi import FastAPI
from fastapi.routing import APIRoute

from tokenmill.api.server_config import ServerConfig, add_serve_cli_args
from tokenmill.config import EngineConfig
from tokenmill.logs import configure_logging
from tokenmill.models import generation_config
from tokenmill.models.paths import resolve_model_path
from tokenmill.server.engine_client import EngineClient
from tokenmill.server.launch import configs_from_cli, make_app, make_state, run_async
from tokenmill.tokenizer import load_tokenizer

logger = logging.getLogger("tokenmill.run_batch")

# The endpoints a batch line may name: those that answer one JSON object (OpenAI's Batch API takes chat,
# completions, responses and embeddings; vLLM's run-batch adds score and rerank). A line for the other kind of
# model (embeddings on a generative one) is that line's 400, as the server answers it.
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
              "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
PROGRESS_INTERVAL_S = 5.0
UPLOAD_TRIES, UPLOAD_RETRY_DELAY_S = 5, 5.0  # a PUT of the output that fails is tried again, as vLLM does


class BatchRequestInput(pydantic.BaseModel):
    """One line of the input file (OpenAI's request input object)."""
    model_config = pydantic.ConfigDict(extra="forbid")

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


class BatchFileError(ValueError):
    """The input file cannot be run as a batch: the message names the line."""


def parse_batch(text: str) -> list[BatchRequestInput]:
    """Every non-blank line of the input as a request, or BatchFileError naming the first line that is not one."""
    requests, seen = [], {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            request = BatchRequestInput.model_validate_json(line)
        except pydantic.ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise BatchFileError(f"line {number}: {where + ': ' if where else ''}{first['msg']}") from None
        if request.method != "POST":
            raise BatchFileError(f"line {number}: method {request.method!r}: only POST is supported")
        if request.url not in BATCH_URLS:
            raise BatchFileError(f"line {number}: url {request.url!r} is not an endpoint run-batch serves; "
                                 f"supported: {', '.join(BATCH_URLS)}")
        if request.body.get("stream"):
            raise BatchFileError(f"line {number}: body.stream: a batch request must not be streamed")
        if request.custom_id in seen:
            raise BatchFileError(f"line {number}: custom_id {request.custom_id!r} is also line "
                                 f"{seen[request.custom_id]}'s; each must be unique")
        seen[request.custom_id] = number
        requests.append(request)
    return requests


def batch_output(request: BatchRequestInput, response: httpx.Response) -> dict:
    """One output line: the endpoint's answer, or its error (vLLM's BatchRequestOutput)."""
    try:
        body = response.json()
    except ValueError:  # an answer that is not JSON (none of the endpoints' own): its text as the error
        body = {"error": {"message": response.text, "type": "InternalServerError", "param": None,
                          "code": response.status_code}}
    ok = response.status_code == 200
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id,
            "response": {"status_code": response.status_code,
                         "request_id": response.headers.get("x-request-id", uuid.uuid4().hex),
                         "body": body if ok else None},
            "error": None if ok else body}


class OrderedWriter:
    """Writes the output lines in the input's order as they come: an answer that comes early waits in memory for
    the ones before it (at most as many as run at once)."""

    def __init__(self, file):
        self.file = file
        self.next_index = 0
        self.pending: dict[int, dict] = {}

    def add(self, index: int, record: dict) -> None:
        self.pending[index] = record
        while self.next_index in self.pending:
            self.file.write(json.dumps(self.pending.pop(self.next_index), ensure_ascii=False) + "\n")
            self.next_index += 1
        self.file.flush()


@dataclass
class BatchProgress:
    total: int
    done: int = 0
    failed: int = 0
    logged_at: float = 0.0

    def record(self, status_code: int) -> None:
        self.done += 1
        self.failed += status_code != 200
        now = time.monotonic()
        if now - self.logged_at >= PROGRESS_INTERVAL_S or self.done == self.total:
            self.logged_at = now
            logger.info("run-batch: %d/%d requests done (%d%%), %d failed", self.done, self.total,
                        100 * self.done // max(self.total, 1), self.failed)


async def run_batch(app, requests: list[BatchRequestInput], out, max_concurrency: int,
                    api_key: str | None = None) -> BatchProgress:
    """Sends each request to the app (in process) with at most max_concurrency in flight, and writes every answer to
    `out` in the input's order."""
    writer, progress = OrderedWriter(out), BatchProgress(len(requests))
    limit = asyncio.Semaphore(max_concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def one(index: int, request: BatchRequestInput, client: httpx.AsyncClient) -> None:
        try:
            response = await client.post(request.url, json=request.body)
        finally:
            limit.release()
        writer.add(index, batch_output(request, response))
        progress.record(response.status_code)

    # raise_app_exceptions off: a handler's unexpected failure is that line's 500, not the batch's end
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://run-batch", headers=headers,
                                 timeout=None) as client:
        async with asyncio.TaskGroup() as tasks:
            for index, request in enumerate(requests):
                await limit.acquire()  # at most max_concurrency requests in flight
                tasks.create_task(one(index, request, client))
    return progress


def _is_url(path: str) -> bool:
    return path.startswith(("http://", "https://"))


async def read_input(path: str) -> str:
    if _is_url(path):
        async with httpx.AsyncClient(timeout=60) as client:
            response = await client.get(path)
            response.raise_for_status()
            return response.text
    with open(path, encoding="utf-8") as f:
        return f.read()


async def upload(url: str, path: str) -> None:
    """PUTs the finished output file to the URL, tried UPLOAD_TRIES times."""
    for attempt in range(1, UPLOAD_TRIES + 1):
        try:
            with open(path, "rb") as f:
                async with httpx.AsyncClient(timeout=1000) as client:
                    response = await client.put(url, content=f.read())
            response.raise_for_status()
            return
        except httpx.HTTPError as e:
            if attempt == UPLOAD_TRIES:
                raise
            logger.warning("run-batch: uploading the output to %s failed (%s); again in %.0f s", url, e,
                           UPLOAD_RETRY_DELAY_S)
            await asyncio.sleep(UPLOAD_RETRY_DELAY_S)


def metrics_app(app: FastAPI) -> FastAPI:
    """--enable-metrics: the app's /metrics alone, for Prometheus to scrape while the batch runs (vLLM's)."""
    metrics = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    route = next(r for r in app.routes if isinstance(r, APIRoute) and r.path == "/metrics")
    metrics.add_api_route("/metrics", route.endpoint, methods=["GET"])
    return metrics


async def run(config: ServerConfig, engine_config: EngineConfig, args: argparse.Namespace) -> int:
    try:
        requests = parse_batch(await read_input(args.input_file))
    except (OSError, httpx.HTTPError, BatchFileError, UnicodeDecodeError) as e:
        logger.error("run-batch: %s: %s", args.input_file, e)
        return 1
    logger.info("run-batch: %d requests from %s", len(requests), args.input_file)
    try:
        model_path = resolve_model_path(engine_config.model, engine_config.download_dir)
        generation_defaults = generation_config.generation_defaults(
            model_path, engine_config.generation_config, engine_config.override_generation_config)
    except (OSError, ValueError) as e:
        logger.error("%s", e)
        return 1
    client = EngineClient(engine_config)
    metrics_server = metrics_task = None
    try:
        tokenizer_task = asyncio.create_task(asyncio.to_thread(load_tokenizer, model_path, engine_config.tokenizer,
                                                               engine_config.trust_remote_code))
        try:
            ready = await client.start()
            tokenizer = await tokenizer_task
        except RuntimeError as e:
            logger.error("%s", e)
            return 1
        state = make_state(config, engine_config, client, ready, tokenizer, generation_defaults)
        app = await make_app(state)
        if app is None:
            return 1
        if args.enable_metrics:
            metrics_server = uvicorn.Server(uvicorn.Config(metrics_app(app), host=config.host, port=config.port,
                                                           log_config=None, lifespan="off"))
            metrics_task = asyncio.create_task(metrics_server.serve())
        to_url = _is_url(args.output_file)
        if to_url:
            fd, out_path = tempfile.mkstemp(prefix="tokenmill-batch-", suffix=".jsonl", dir=args.output_tmp_dir)
            os.close(fd)
        else:
            out_path = args.output_file
        try:
            with open(out_path, "w", encoding="utf-8") as out:
                progress = await run_batch(app, requests, out, 2 * engine_config.max_num_seqs, config.api_key)
            if client.dead_reason is not None:
                logger.error("run-batch: the engine died: %s", client.dead_reason)
                return 1
            if to_url:
                await upload(args.output_file, out_path)
        finally:
            if to_url:
                os.unlink(out_path)
        logger.info("run-batch: %d requests, %d failed; answers in %s", progress.total, progress.failed,
                    args.output_file)
        return 0
    finally:
        if metrics_server is not None:
            metrics_server.should_exit = True
            await metrics_task
        client.shutdown()


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="the batch: a JSONL file in OpenAI's Batch format "
                        "(a local path or an http(s) URL to GET)")
    parser.add_argument("-o", "--output-file", required=True, help="where the answers go, a line per request in the "
                        "input's order (a local path, or an http(s) URL the finished file is PUT to)")
    parser.add_argument("--output-tmp-dir", default=None, help="where the output is written before it is PUT to an "
                        "output URL (default: the system's temporary directory)")
    parser.add_argument("--enable-metrics", action="store_true", help="serve /metrics on --host and --port while "
                        "the batch runs")
    add_serve_cli_args(parser)


def run_from_cli(args: argparse.Namespace) -> int:
    server_config, engine_config = configs_from_cli(args)
    if args.output_tmp_dir is not None and not _is_url(args.output_file):
        raise SystemExit("error: --output-tmp-dir is for an output URL; --output-file is a local path")
    configure_logging(server_config.log_format)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request sent to the app in process
    return run_async(run(server_config, engine_config, args))
