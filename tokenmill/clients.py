"""`tokenmill chat` and `tokenmill complete`: vLLM's terminal clients of an OpenAI-compatible server (this one, a
router, or any other). chat keeps the conversation and prints each answer as it streams; complete prints each
prompt's continuation. -q/--quick sends one message (or prompt), prints the answer and exits; otherwise they read
lines until end of input. Without --model-name they use the first model the server lists."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator

import httpx

from tokenmill import envs

DEFAULT_URL = "http://localhost:8000/v1"


def add_common_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help="the server's OpenAI API base URL")
    parser.add_argument("--model-name", default=None, help="the model to ask (default: the first the server lists)")
    parser.add_argument("--api-key", default=None, help="the bearer key (default: $OPENAI_API_KEY)")
    parser.add_argument("-q", "--quick", default=None, metavar="MESSAGE",
                        help="send this one message (or prompt), print the answer, and exit")


def add_chat_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_cli_args(parser)
    parser.add_argument("--system-prompt", default=None, help="a system message opening the conversation")


def add_complete_cli_args(parser: argparse.ArgumentParser) -> None:
    add_common_cli_args(parser)
    parser.add_argument("--max-tokens", type=int, default=None, help="the most tokens of each continuation")


def _client(args: argparse.Namespace) -> httpx.Client:
    key = args.api_key or envs.OPENAI_API_KEY
    return httpx.Client(base_url=args.url.rstrip("/"), headers={"Authorization": f"Bearer {key}"} if key else {},
                        timeout=httpx.Timeout(600, connect=10))


def _model(client: httpx.Client, args: argparse.Namespace) -> str:
    if args.model_name:
        return args.model_name
    models = client.get("/models")
    models.raise_for_status()
    return models.json()["data"][0]["id"]


def _stream(client: httpx.Client, path: str, body: dict, text_of) -> str:
    """Prints the streamed answer as it comes; returns it whole. A refusal is raised with the server's message."""
    parts = []
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{response.status_code}: {_message(response)}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", chunk["error"]))
            for choice in chunk.get("choices", ()):
                text = text_of(choice) or ""
                parts.append(text)
                print(text, end="", flush=True)
    print(flush=True)
    return "".join(parts)


def _message(response: httpx.Response) -> str:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text


def _lines(quick: str | None) -> Iterator[str]:
    if quick is not None:
        yield quick
        return
    while True:
        try:
            yield input("> ")
        except EOFError:
            return


def run_chat(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            model = _model(client, args)
            messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
            for line in _lines(args.quick):
                messages.append({"role": "user", "content": line})
                answer = _stream(client, "/chat/completions", {"model": model, "messages": messages},
                                 lambda c: c.get("delta", {}).get("content"))
                messages.append({"role": "assistant", "content": answer})
        except (httpx.HTTPError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


def run_complete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            model = _model(client, args)
            for line in _lines(args.quick):
                body = {"model": model, "prompt": line}
                if args.max_tokens is not None:
                    body["max_tokens"] = args.max_tokens
                _stream(client, "/completions", body, lambda c: c.get("text"))
        except (httpx.HTTPError, RuntimeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0
