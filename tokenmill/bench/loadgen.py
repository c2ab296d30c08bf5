"""The load generator of `tokenmill bench serve`: closed-loop (N streams always in flight) and open-loop
(arrivals at a fixed rate) levels, and a whole run against one endpoint: warm-up, the levels or a concurrency
sweep, and the run's record for the report.

Every prompt of a level is built before it starts, the client never spins (it waits on sockets and timers), one
asyncio loop drives all streams, and the client's own CPU use is measured per level."""
from __future__ import annotations

import asyncio
import datetime
import decimal
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


def parse_levels(text: str, kind: type, flag: str) -> list:
    """'0.5:6:0.5,7,8' → [0.5, 1.0, ..., 6.0, 7.0, 8.0]: comma-separated levels, where START:STOP:STEP stands for
    START, START+STEP, ... up to STOP inclusive (decimal steps, so 0.1 steps land on 0.3, not 0.30000000000000004).
    Every level must be positive, and for --concurrency whole."""
    levels = []
    for part in text.split(","):
        try:
            bounds = [decimal.Decimal(x.strip()) for x in part.split(":")]
        except decimal.InvalidOperation:
            bounds = []
        if not all(x.is_finite() for x in bounds):
            bounds = []
        if len(bounds) == 3 and bounds[2] > 0 and bounds[0] <= bounds[1]:
            start, stop, step = bounds
            values = [start + i * step for i in range(int((stop - start) / step) + 1)]
        elif len(bounds) == 1:
            values = bounds
        else:
            raise ValueError(f"{flag}: bad level {part!r}: expected a number or START:STOP:STEP")
        for v in values:
            if v <= 0 or (kind is int and v != v.to_integral_value()):
                raise ValueError(f"{flag}: level {v} must be a positive {'whole ' if kind is int else ''}number")
            levels.append(kind(v))
    return levels


def run_level(endpoint: Endpoint, sessions, objective, *, concurrency=None, rate=None, args, seed, desc) -> dict:
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
    level = metrics.level_metrics(records, duration, objective, concurrency=concurrency, request_rate=rate)
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
            f" ms, goodput {level['request_goodput']:.2f} req/s, {level['goodput_tok_per_s']:.1f} tok/s "
            f"({level['goodput_req_pct']:.1f}% of requests good), "
            f"SLO {'met' if level['meets_slo'] else 'missed'}, client CPU {level['client_cpu_pct']:.1f}%"
            + "".join(f", {tag} ({level[f'{tag}_completed']} ok) TTFT p99 {ms(level[f'{tag}_ttft_ms'], 'p99')} ms"
                      f" ITL p99 {ms(level[f'{tag}_itl_ms'], 'p99')} ms {level[f'{tag}_goodput_req_pct']:.0f}% good"
                      for tag in level.get("classes", ()))
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
    if args.long_prompt_share:
        info.update(long_prompt_share=args.long_prompt_share, long_input_len=args.long_input_len,
                    long_output_len=args.long_output_len)
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


def benchmark_endpoint(name: str | None, base_url: str, args, pool: datasets.WordPool,
                       objective: metrics.Objective) -> dict:
    info = endpoint_info(base_url, args.model, args.api_key)
    endpoint = Endpoint(base_url, args, info["model"])
    engine = name or args.engine_name or info["owner"]
    print(f"== {engine} at {base_url}: model {info['model']}, version {info['version']}", flush=True)
    if args.warmup:
        warm = datasets.random_sessions(pool, args.warmup, args.input_len, 0, min(args.output_len, 16), 0,
                                        args.seed + 10_000)
        first = parse_levels(args.concurrency, int, "--concurrency")[0] if not args.request_rate else 4
        asyncio.run(run_closed_loop(endpoint, warm, max(1, min(first, args.warmup)), args.request_timeout,
                                    lambda: None))
    levels: list[dict] = []
    if args.request_rate:
        plan = parse_levels(args.request_rate, float, "--request-rate")
    else:
        plan = parse_levels(args.concurrency, int, "--concurrency")
    index = 0
    while index < len(plan):
        value = plan[index]
        # Fresh prompts per level: a server's prefix cache must not carry over from the previous level.
        count = args.num_prompts
        if args.requests_per_stream and not args.request_rate:
            count = args.requests_per_stream * int(value)
        sessions = datasets.build_sessions(args, pool, max(count, 1), args.seed + index)
        if args.request_rate:
            level = run_level(endpoint, sessions, objective, rate=value, args=args, seed=args.seed + index,
                              desc=f"{engine} rate={value:g}")
        else:
            level = run_level(endpoint, sessions, objective, concurrency=value, args=args, seed=args.seed + index,
                              desc=f"{engine} c={value}")
        levels.append(level)
        print(level_line(engine, level), flush=True)
        index += 1
        if args.request_rate and index < len(plan) and metrics.rate_sweep_should_stop(level, objective):
            print(f"[{engine}] past the knee: {level['goodput_req_pct']:.1f}% of requests within --goodput at "
                  f"rate {value:g} (< {objective.attainment_pct:g}%); rates {plan[index:]} not run", flush=True)
            plan = plan[:index]
            break
        if args.sweep and not args.request_rate and index == len(plan):
            if not metrics.sweep_should_stop(levels) and 2 * value <= args.max_concurrency:
                plan.append(2 * value)
    return {
        "harness": "tokenmill-bench", "harness_version": tokenmill.__version__,
        "model": info["model"], "precision": args.precision, "hardware": hardware(),
        "dataset": dataset_info(args), "slo": objective.slo,
        # the per-request bounds (ms) that make a request good: --goodput's, or those --slo implies
        "goodput": objective.bounds, "goodput_from": "--goodput" if objective.attainment_pct is not None else "--slo",
        "goodput_attainment_pct": objective.attainment_pct,
        "engine": engine, "engine_version": info["version"], "base_url": base_url,
        "mode": "request_rate" if args.request_rate else "concurrency",
        "concurrency_sweep": plan, "results": levels, "results_at_knee": metrics.find_knee(levels),
        "goodput_request_rate": (metrics.goodput_rate(levels)
                                 if args.request_rate and objective.attainment_pct is not None else None),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
