"""The load generator of `tokenmill bench serve`: closed-loop (N streams always in flight) and open-loop
(arrivals at a fixed rate) levels, and a whole run against one endpoint: warm-up, the levels or a concurrency
sweep, and the run's record for the report.

Every prompt of a level is built before it starts, the client never spins (it waits on sockets and timers), one
asyncio loop drives all streams, and the client's own CPU use is measured per level."""
from __future__ import annotations

import asyncio
import datetime
import os
import random
import time

import tokenmill
from tokenmill.bench import datasets, metrics
from tokenmill.bench.client import Endpoint, endpoint_info
from tokenmill.bench.env_probe import hardware


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
            f"SLO {'met' if level['meets_slo'] else 'missed'}, client CPU {level['client_cpu_pct']:.1f}%"
            + "".join(f", {label} TTFT p50 {ms(level[key], 'p50')} ms" for key, label in (
                ("ttft_later_turns_ms", "turns>=2"), ("ttft_same_replica_ms", "same-replica"),
                ("ttft_other_replica_ms", "other-replica")) if key in level))


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
