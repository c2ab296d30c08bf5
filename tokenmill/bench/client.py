"""The client side of one endpoint: a streamed completion timed chunk by chunk, the request body each benchmark
request sends, and the endpoint's model card and version.

Stream chunks are decoded with msgspec into the few fields the figures need (text and usage), so that parsing a
chunk costs the client microseconds, not the server's CPU."""
from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx
import msgspec

from tokenmill.bench import datasets, metrics


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Choice(msgspec.Struct):
    text: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict) -> tuple[metrics.RequestRecord, str]:
    """Sends one streaming completion; returns its record (every text chunk timestamped) and the text."""
    record = metrics.RequestRecord(start=time.perf_counter())
    pieces: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread())[:300].decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {detail}"
                return record, ""
            record.replica = response.headers.get("x-tokenmill-replica")  # set by `tokenmill router`
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = _decode_chunk(payload)
                if chunk.choices and chunk.choices[0].text:
                    record.token_times.append(now)
                    pieces.append(chunk.choices[0].text)
                if chunk.usage is not None:
                    record.input_tokens = chunk.usage.prompt_tokens
                    record.output_tokens = chunk.usage.completion_tokens
        record.end = time.perf_counter()
        if not record.output_tokens:
            record.output_tokens = len(record.token_times)
        if not record.token_times:
            record.error = "the stream carried no tokens"
    except (httpx.HTTPError, msgspec.DecodeError) as e:
        record.error = f"{type(e).__name__}: {e}"
    return record, "".join(pieces)


class Endpoint:
    def __init__(self, base_url: str, args: argparse.Namespace, model: str):
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.args = args
        self.model = model
        self.rng = random.Random(args.seed)  # which adapter each request asks for, with --lora-modules

    def client(self, connections: int, timeout: float) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        return httpx.AsyncClient(timeout=timeout, limits=limits, headers=auth_headers(self.args.api_key))

    def body(self, prompt: str, output_len: int) -> dict:
        model = self.rng.choice(self.args.lora_modules) if self.args.lora_modules else self.model
        body = {"model": model, "prompt": prompt, "max_tokens": output_len, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": self.args.temperature}
        if self.args.ignore_eos:
            body["ignore_eos"] = True
        return {**body, **(self.args.extra_body or {})}

    async def run_session(self, client: httpx.AsyncClient, session: datasets.Session,
                          records: list[metrics.RequestRecord], on_done) -> None:
        history = ""
        records_of_session: list[metrics.RequestRecord] = []
        for i, turn in enumerate(session.turns):
            if i and session.think_time_s:
                await asyncio.sleep(session.think_time_s)
            history += turn.text
            record, answer = await stream_completion(client, self.url, self.body(history, turn.output_len))
            record.turn, record.tag = i, turn.tag
            if i:  # behind a router: did this turn land where the conversation's previous turn ran?
                prev = records_of_session[-1].replica
                record.same_replica = None if prev is None or record.replica is None else prev == record.replica
            records_of_session.append(record)
            records.append(record)
            on_done()
            if record.error:
                return  # the rest of a broken conversation would measure nothing real
            history += answer


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def endpoint_info(base_url: str, model: str | None, api_key: str | None) -> dict:
    base = base_url.rstrip("/")
    with httpx.Client(timeout=30, headers=auth_headers(api_key)) as client:
        cards = client.get(base + "/v1/models").raise_for_status().json()["data"]
        try:
            version = client.get(base + "/version").json().get("version", "unknown")
        except (httpx.HTTPError, ValueError):
            version = "unknown"
    card = next((c for c in cards if c["id"] == model), cards[0]) if cards else {}
    return {"model": model or card.get("id"), "owner": card.get("owned_by", "unknown"), "version": version}
