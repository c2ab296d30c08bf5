"""`tokenmill bench serve`: goodput of any OpenAI-compatible endpoint under concurrency sweeps or a request rate.

The load generator must not steal the server's CPU on a small machine: every prompt is built before a level
starts, the client never spins (it waits on sockets and timers), one asyncio process drives all streams, and the
client's own CPU use is measured and reported per level.

Modules: client (one streamed request, the endpoint), loadgen (levels and the whole run against one endpoint),
launch (--launch), env_probe (the machine, for the report); this one is the command line."""
from __future__ import annotations

import argparse
import datetime
import json
import os

from tokenmill import envs
from tokenmill.bench import datasets, metrics, report
from tokenmill.bench.launch import launch_server, stop_server
from tokenmill.bench.loadgen import benchmark_endpoint


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
    parser.add_argument("--output-dir", default=None, help="default: benchmarks/runs/<timestamp>/ (ignored by git)")


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
        "benchmarks", "runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
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
