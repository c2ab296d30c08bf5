"""Two server configurations measured in turns, both up at once: the paired form of benchmarks/alternating.sh.

alternating.sh runs one server at a time for a whole run (a minute or more) and restarts it each round. On this
shared 2-core machine the speed drifts by 10-30% over minutes (a c=1 run of the same server went from 98 to 140
tok/s between rounds), which a ratio of whole runs cannot tell from a 3% difference. Here both servers are
started and stay up; the same prompts are sent in turns of TURN_PROMPTS prompts at CONCURRENCY, A's turn and B's
turn back to back, the order swapped every pair (AB BA AB ...), so that both see the same minute of the machine
and a drift within a pair is charged to each side equally often. An idle server costs nothing (its engine
blocks on its input socket), so the two do not compete.

Prints each configuration's output tokens per second and ITL p50/p99 over all its turns, the ratio of every pair of turns, their
median and a bootstrap 90% interval of the ratio of totals, and writes paired.json (with the servers'
vllm:spec_decode_* counters).

Usage: .venv/bin/python benchmarks/paired.py OUT_DIR NAME='serve flags' NAME='serve flags'
         [--pairs 32] [--turn-prompts 1] [--concurrency 1] [--input-len 256] [--output-len 128]
  issue 13 (draft model at c=1):
    .venv/bin/python benchmarks/paired.py benchmarks/runs/spec-decode-c1-paired off='' \\
      draft_model='--speculative-config {"method":"draft_model","model":"/tmp/tokenmill-draft-keep-every-3","num_speculative_tokens":4}'
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys

import httpx

from tokenmill.bench import datasets
from tokenmill.bench.client import Endpoint, endpoint_info
from tokenmill.bench.launch import launch_server, stop_server
from tokenmill.bench.loadgen import run_closed_loop
from tokenmill.bench.metrics import summarize
from tokenmill.bench.serve import add_cli_args
from tokenmill.models.paths import resolve_model_path
from tokenmill.tokenizer import load_tokenizer


def turn_tokens_and_time(endpoint: Endpoint, sessions, concurrency: int) -> tuple[int, float, list[float]]:
    """The turn's output tokens, its wall time, and its inter-token gaps (seconds)."""
    timeout = endpoint.args.request_timeout
    records, wall = asyncio.run(run_closed_loop(endpoint, sessions, concurrency, timeout, lambda: None))
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:2]}")
    return sum(r.output_tokens for r in records), wall, [gap for r in records for gap in r.itls]


def bootstrap_ratio(tokens: dict, times: dict, a: str, b: str, pairs: int, seed: int = 0) -> tuple[float, float]:
    """A 90% interval of (B's tok/s) / (A's tok/s) over pairs resampled with replacement."""
    rng = random.Random(seed)
    ratios = []
    for _ in range(2000):
        idx = [rng.randrange(pairs) for _ in range(pairs)]
        rate = {n: sum(tokens[n][i] for i in idx) / sum(times[n][i] for i in idx) for n in (a, b)}
        ratios.append(rate[b] / rate[a])
    ratios.sort()
    return ratios[int(0.05 * len(ratios))], ratios[int(0.95 * len(ratios)) - 1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("configs", nargs=2, help="NAME='serve flags'; the first is the reference")
    parser.add_argument("--pairs", type=int, default=32)
    parser.add_argument("--turn-prompts", type=int, default=1, help="prompts per turn")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=4, help="prompts sent to each server before the pairs")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--port", type=int, default=8051)
    args = parser.parse_args()
    names = [c.split("=", 1)[0] for c in args.configs]
    flags = {n: c.split("=", 1)[1].split() for n, c in zip(names, args.configs)}  # as alternating.sh reads them
    urls = {n: f"http://127.0.0.1:{args.port + i}" for i, n in enumerate(names)}
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "lscpu.txt"), "w") as f:
        f.write(subprocess.run(["lscpu"], capture_output=True, text=True).stdout)

    pool = datasets.WordPool(load_tokenizer(resolve_model_path(None)))
    count = args.warmup + args.pairs * args.turn_prompts
    sessions = datasets.random_sessions(pool, count, args.input_len, 0, args.output_len, 0, args.seed)
    warmup, measured = sessions[:args.warmup], sessions[args.warmup:]
    bench_parser = argparse.ArgumentParser()
    add_cli_args(bench_parser)  # what an Endpoint reads, with `tokenmill bench serve`'s defaults (greedy)
    bench_args = bench_parser.parse_args(["--ignore-eos", "--seed", str(args.seed)])
    servers = {}
    try:
        for n in names:
            servers[n] = launch_server(urls[n], ["--max-model-len", "2048", "--uvicorn-log-level", "warning",
                                                 *flags[n]])
        endpoints = {n: Endpoint(urls[n], bench_args, endpoint_info(urls[n], None, None)["model"]) for n in names}
        for n in names:
            turn_tokens_and_time(endpoints[n], warmup, args.concurrency)
        tokens = {n: [] for n in names}
        times = {n: [] for n in names}
        itls = {n: [] for n in names}
        for p in range(args.pairs):
            turn = measured[p * args.turn_prompts:(p + 1) * args.turn_prompts]
            for n in (names if p % 2 == 0 else names[::-1]):
                t, s, gaps = turn_tokens_and_time(endpoints[n], turn, args.concurrency)
                tokens[n].append(t)
                times[n].append(s)
                itls[n].extend(gaps)
        spec_counters = {n: [line for line in httpx.get(urls[n] + "/metrics", timeout=30).text.splitlines()
                             if line.startswith("vllm:spec_decode_num_")] for n in names}
    finally:
        for proc in servers.values():
            stop_server(proc)

    a, b = names
    rate = {n: sum(tokens[n]) / sum(times[n]) for n in names}
    pair_ratios = [(tokens[b][i] / times[b][i]) / (tokens[a][i] / times[a][i]) for i in range(args.pairs)]
    low, high = bootstrap_ratio(tokens, times, a, b, args.pairs)
    result = {
        "configs": {n: flags[n] for n in names}, "pairs": args.pairs, "turn_prompts": args.turn_prompts,
        "concurrency": args.concurrency, "input_len": args.input_len, "output_len": args.output_len,
        "machine": platform.processor() or platform.machine(), "python": sys.version.split()[0],
        "output_tok_per_s": rate, "ratio_of_totals": rate[b] / rate[a], "ratio_90pct_interval": [low, high],
        "itl_ms": {n: summarize(itls[n]) for n in names},
        "pair_ratios": pair_ratios, "median_pair_ratio": statistics.median(pair_ratios),
        "turn_seconds": times, "turn_tokens": tokens, "spec_decode_counters": spec_counters,
    }
    with open(os.path.join(args.out_dir, "paired.json"), "w") as f:
        json.dump(result, f, indent=1)
    for n in names:
        itl = result["itl_ms"][n]
        itl_text = (f"ITL p50 {itl['p50']:.1f} ms, p99 {itl['p99']:.1f} ms" if itl["p50"] is not None
                    else "no ITL (one output token)")
        print(f"{n:12s} {rate[n]:.1f} output tok/s over {args.pairs} turns of {args.turn_prompts} prompt(s) "
              f"at c={args.concurrency}; {itl_text}")
    print(f"{b} / {a}: {rate[b] / rate[a]:.3f} (90% interval {low:.3f}-{high:.3f}); median of pairs "
          f"{statistics.median(pair_ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
