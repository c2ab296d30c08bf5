"""`tokenmill bench serve`: goodput of any OpenAI-compatible endpoint under concurrency sweeps or a request rate.

The load generator must not steal the server's CPU on a small machine: every prompt is built before a level
starts, the client never spins (it waits on sockets and timers), one asyncio process drives all streams, and the
client's own CPU use is measured and reported per level."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import time
from urllib.parse import urlparse

import httpx
import msgspec

import tokenmill
from tokenmill import envs
from tokenmill.bench import datasets, metrics, report

DEFAULT_SLO = "ttft_p99_ms=2000,itl_p50_ms=100"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=envs.OPENAI_API_KEY,
                        help="bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--model", default=None, help="model id to request (default: the endpoint's first)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                        help="LoRA adapter names the server serves: each request asks for one of them, drawn at "
                             "random (vLLM's bench option), instead of --model")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer used to make prompt lengths exact (default: the default model's)")
    parser.add_argument("--dataset", choices=datasets.DATASETS, default="random")
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON (default: the synthetic one shipped), "
                        "or for copy a JSON list of {prompt, text} (default: data/copy_edit.json)")
    parser.add_argument("--input-len", type=int, default=256, help="mean prompt tokens (prefix: unique tokens)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--input-len-stddev", type=float, default=0)
    parser.add_argument("--output-len-stddev", type=float, default=0)
    parser.add_argument("--sharegpt-output-len", type=int, default=None, help="override the answers' lengths")
    parser.add_argument("--prefix-groups", type=int, default=4)
    parser.add_argument("--prefix-len", type=int, default=512, help="shared system-prompt tokens per group")
    parser.add_argument("--turns", type=int, default=3, help="multiturn: turns per session")
    parser.add_argument("--think-time", type=float, default=1.0, help="multiturn: seconds between turns")
    parser.add_argument("--num-prompts", type=int, default=200,
                        help="requests per level (multiturn: sessions per level)")
    parser.add_argument("--requests-per-stream", type=int, default=None,
                        help="concurrency mode: run N x concurrency requests per level instead of --num-prompts, "
                             "so every level lasts about as many rounds")
    parser.add_argument("--concurrency", default="1,4,8", help="closed-loop levels, comma-separated")
    parser.add_argument("--sweep", action="store_true",
                        help="double the concurrency from the first level until the server saturates")
    parser.add_argument("--max-concurrency", type=int, default=512, help="sweep cap; in rate mode, a cap on "
                        "requests in flight")
    parser.add_argument("--request-rate", default=None,
                        help="open-loop mode: requests/s, comma-separated levels (instead of --concurrency)")
    parser.add_argument("--arrival", choices=("poisson", "constant"), default="poisson")
    parser.add_argument("--warmup", type=int, default=10, help="requests run and discarded before the first level")
    parser.add_argument("--slo", default=DEFAULT_SLO, help="e.g. ttft_p99_ms=2000,itl_p50_ms=100")
    parser.add_argument("--ignore-eos", action="store_true", help="pin the output length")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--extra-body", type=json.loads, default=None,
                        help='JSON merged into every request, e.g. \'{"guided_json": {...}}\' (recorded in the report)')
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--precision", default="unknown", help="recorded in the report, e.g. bf16")
    parser.add_argument("--engine-name", default=None, help="name in the report (default: the endpoint's owner)")
    parser.add_argument("--compare", nargs="+", default=None, metavar="NAME=URL",
                        help="run the same protocol against each endpoint in turn, side by side")
    parser.add_argument("--launch", action="store_true",
                        help="start `tokenmill serve` with the unrecognised flags, benchmark it, stop it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None, help="default: benchmarks/results/<timestamp>/")


# ============================== one streamed request ==============================

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
        for i, turn in enumerate(session.turns):
            if i and session.think_time_s:
                await asyncio.sleep(session.think_time_s)
            history += turn.text
            record, answer = await stream_completion(client, self.url, self.body(history, turn.output_len))
            records.append(record)
            on_done()
            if record.error:
                return  # the rest of a broken conversation would measure nothing real
            history += answer


# ============================== one level ==============================

async def run_closed_loop(endpoint: Endpoint, sessions: list[datasets.Session], concurrency: int,
                          timeout: float, on_done) -> tuple[list[metrics.RequestRecord], float]:
    """N workers, each starting its next session the moment the previous one ends: always N in flight."""
    queue = list(reversed(sessions))
    records: list[metrics.RequestRecord] = []

    async def worker(client):
        while queue:
            await endpoint.run_session(client, queue.pop(), records, on_done)

    async with endpoint.client(concurrency, timeout) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return records, time.perf_counter() - start


async def run_open_loop(endpoint: Endpoint, sessions: list[datasets.Session], rate: float, arrival: str,
                        max_in_flight: int, timeout: float, seed: int,
                        on_done) -> tuple[list[metrics.RequestRecord], float]:
    """Sessions start at Poisson (or evenly spaced) arrival times fixed before the level starts."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) if arrival == "poisson" else 1.0 / rate for _ in sessions]
    records: list[metrics.RequestRecord] = []
    gate = asyncio.Semaphore(max_in_flight)

    async def one(client, session):
        async with gate:
            await endpoint.run_session(client, session, records, on_done)

    async with endpoint.client(max_in_flight, timeout) as client:
        start = time.perf_counter()
        tasks, due = [], start
        for gap, session in zip(gaps, sessions):
            due += gap
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(one(client, session)))
        await asyncio.gather(*tasks)
        return records, time.perf_counter() - start


def run_level(endpoint: Endpoint, sessions, slo, *, concurrency=None, rate=None, args, seed, desc) -> dict:
    from tqdm import tqdm
    total = sum(len(s.turns) for s in sessions)
    with tqdm(total=total, desc=desc, unit="req", leave=False, mininterval=1.0) as bar:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        if rate is None:
            coro = run_closed_loop(endpoint, sessions, concurrency, args.request_timeout, lambda: bar.update())
        else:
            coro = run_open_loop(endpoint, sessions, rate, args.arrival, args.max_concurrency,
                                 args.request_timeout, seed, lambda: bar.update())
        records, duration = asyncio.run(coro)
        cpu_pct = 100.0 * (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    level = metrics.level_metrics(records, duration, slo, concurrency=concurrency, request_rate=rate)
    level["client_cpu_pct"] = cpu_pct
    return level


# ============================== a whole run against one endpoint ==============================

def level_line(engine: str, level: dict) -> str:
    def ms(d, k):
        return "-" if d[k] is None else f"{d[k]:.0f}"
    where = f"c={level['concurrency']}" if level["concurrency"] is not None else f"rate={level['request_rate']:g}"
    return (f"[{engine} {where}] {level['completed']}/{level['num_requests']} ok, "
            f"{level['output_tok_per_s']:.1f} out tok/s, TTFT p50/p99 {ms(level['ttft_ms'], 'p50')}/"
            f"{ms(level['ttft_ms'], 'p99')} ms, ITL p50/p99 {ms(level['itl_ms'], 'p50')}/{ms(level['itl_ms'], 'p99')}"
            f" ms, goodput {level['goodput_tok_per_s']:.1f} tok/s ({level['goodput_req_pct']:.0f}%), "
            f"SLO {'met' if level['meets_slo'] else 'missed'}, client CPU {level['client_cpu_pct']:.1f}%")


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


def hardware() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = None
    if shutil.which("nvidia-smi"):
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            gpu = None
    import psutil
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "gpu": gpu}


def dataset_info(args) -> dict:
    info = {"name": args.dataset, "num_prompts": args.num_prompts, "requests_per_stream": args.requests_per_stream,
            "input_len": args.input_len,
            "input_len_stddev": args.input_len_stddev, "output_len": args.output_len,
            "output_len_stddev": args.output_len_stddev, "ignore_eos": args.ignore_eos,
            "temperature": args.temperature}
    if args.extra_body:
        info["extra_body"] = args.extra_body
    if args.lora_modules:
        info["lora_modules"] = args.lora_modules
    if args.dataset == "prefix":
        info.update(prefix_groups=args.prefix_groups, prefix_len=args.prefix_len)
    elif args.dataset == "multiturn":
        info.update(turns=args.turns, think_time_s=args.think_time)
    elif args.dataset == "sharegpt":
        info.update(path=os.path.basename(args.dataset_path or datasets.SHAREGPT_DEFAULT),
                    sharegpt_output_len=args.sharegpt_output_len)
    elif args.dataset == "copy":
        info.update(path=os.path.basename(args.dataset_path or datasets.COPY_DEFAULT))
    return info


def benchmark_endpoint(name: str | None, base_url: str, args, pool: datasets.WordPool, slo: dict) -> dict:
    info = endpoint_info(base_url, args.model, args.api_key)
    endpoint = Endpoint(base_url, args, info["model"])
    engine = name or args.engine_name or info["owner"]
    print(f"== {engine} at {base_url}: model {info['model']}, version {info['version']}", flush=True)
    if args.warmup:
        warm = datasets.random_sessions(pool, args.warmup, args.input_len, 0, min(args.output_len, 16), 0,
                                        args.seed + 10_000)
        first = int(args.concurrency.split(",")[0]) if not args.request_rate else 4
        asyncio.run(run_closed_loop(endpoint, warm, max(1, min(first, args.warmup)), args.request_timeout,
                                    lambda: None))
    levels: list[dict] = []
    if args.request_rate:
        plan = [float(r) for r in args.request_rate.split(",")]
    else:
        plan = [int(c) for c in args.concurrency.split(",")]
    index = 0
    while index < len(plan):
        value = plan[index]
        # Fresh prompts per level: a server's prefix cache must not carry over from the previous level.
        count = args.num_prompts
        if args.requests_per_stream and not args.request_rate:
            count = args.requests_per_stream * int(value)
        sessions = datasets.build_sessions(args, pool, max(count, 1), args.seed + index)
        if args.request_rate:
            level = run_level(endpoint, sessions, slo, rate=value, args=args, seed=args.seed + index,
                              desc=f"{engine} rate={value:g}")
        else:
            level = run_level(endpoint, sessions, slo, concurrency=value, args=args, seed=args.seed + index,
                              desc=f"{engine} c={value}")
        levels.append(level)
        print(level_line(engine, level), flush=True)
        index += 1
        if args.sweep and not args.request_rate and index == len(plan):
            if not metrics.sweep_should_stop(levels) and 2 * value <= args.max_concurrency:
                plan.append(2 * value)
    return {
        "harness": "tokenmill-bench", "harness_version": tokenmill.__version__,
        "model": info["model"], "precision": args.precision, "hardware": hardware(),
        "dataset": dataset_info(args), "slo": slo,
        "engine": engine, "engine_version": info["version"], "base_url": base_url,
        "mode": "request_rate" if args.request_rate else "concurrency",
        "concurrency_sweep": plan, "results": levels, "results_at_knee": metrics.find_knee(levels),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ============================== --launch ==============================

def launch_server(base_url: str, serve_args: list[str], timeout: float = 900.0) -> subprocess.Popen:
    parsed = urlparse(base_url)
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", parsed.hostname or "127.0.0.1",
           "--port", str(parsed.port or 8000), *serve_args]
    print("launching:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tokenmill serve exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(base_url.rstrip("/") + "/v1/models", timeout=5).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    stop_server(proc)
    raise RuntimeError(f"tokenmill serve was not ready within {timeout:.0f} s")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    if extra and not args.launch:
        raise SystemExit(f"unrecognised arguments: {' '.join(extra)} (engine flags need --launch)")
    slo = metrics.parse_slo(args.slo)
    from tokenmill.models.paths import resolve_model_path
    from tokenmill.tokenizer import load_tokenizer
    tok = args.tokenizer
    pool = datasets.WordPool(load_tokenizer(tok if tok and os.path.isdir(tok) else resolve_model_path(tok)))
    targets = [tuple(t.split("=", 1)) for t in args.compare] if args.compare else [(None, args.base_url)]
    if any(len(t) != 2 for t in targets):
        raise SystemExit("--compare takes NAME=URL pairs")
    out_dir = args.output_dir or os.path.join(
        "benchmarks", "results", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    runs = []
    server = launch_server(args.base_url, extra or []) if args.launch else None
    try:
        for name, url in targets:
            runs.append(benchmark_endpoint(name, url, args, pool, slo))
    finally:
        if server is not None:
            stop_server(server)
    written = report.write_report(out_dir, runs)
    if len(runs) > 1:
        print(report.format_comparison(runs))
    for run in runs:
        knee = run["results_at_knee"]
        where = (f"concurrency {knee['concurrency']}" if knee and knee["concurrency"] is not None
                 else f"rate {knee['request_rate']}" if knee else "none (no level meets the SLO)")
        print(f"{run['engine']}: knee at {where}")
    print(f"wrote {', '.join(sorted(written.values()))}")
    return 0
