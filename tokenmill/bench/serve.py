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
from tokenmill.bench.loadgen import benchmark_endpoint, parse_levels


DEFAULT_SLO = "ttft_p99_ms=2000,itl_p50_ms=100"
LONG_INPUT_LEN, LONG_OUTPUT_LEN = 1600, 32  # --long-prompt-share's defaults: a pasted document, a short answer


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
    parser.add_argument("--long-prompt-share", type=float, default=0.0,
                        help="random: this share of the requests (e.g. 0.125, one in 8) are long prompts, placed at "
                             "random (seeded) among the others; each class is also reported apart")
    parser.add_argument("--long-input-len", type=int, default=None,
                        help=f"random: a long prompt's tokens (default {LONG_INPUT_LEN}; spread like the short ones "
                             "relative to the mean)")
    parser.add_argument("--long-output-len", type=int, default=None,
                        help=f"random: a long prompt's answer tokens (default {LONG_OUTPUT_LEN})")
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
                        help="open-loop mode: requests/s, comma-separated levels (instead of --concurrency); "
                             "START:STOP:STEP for a range, e.g. 0.5:6:0.5,7,8. With --goodput the levels stop "
                             "after the first rate with under 90%% of requests good, and the run's goodput is the "
                             "highest rate with at least 90%%")
    parser.add_argument("--arrival", choices=("poisson", "constant"), default="poisson")
    parser.add_argument("--warmup", type=int, default=10, help="requests run and discarded before the first level")
    parser.add_argument("--slo", default=None,
                        help=f"a level's SLO as percentiles over all its requests (default {DEFAULT_SLO}); its "
                             "limits also bound each request for the per-request goodput unless --goodput is given")
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="vLLM's: per-request bounds in ms, any of ttft, tpot, e2el (e.g. ttft:2000 tpot:60); a "
                             "request is good when within all of them, a level meets the SLO when >= 90%% of its "
                             "requests are good (DistServe). Replaces --slo")
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
    objective = objective_from_args(args)
    check_dataset_args(args)
    for flag, text, kind in (("--request-rate", args.request_rate, float), ("--concurrency", args.concurrency, int)):
        if text:
            try:
                parse_levels(text, kind, flag)
            except ValueError as e:
                raise SystemExit(str(e)) from None
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
            runs.append(benchmark_endpoint(name, url, args, pool, objective))
    finally:
        if server is not None:
            stop_server(server)
    written = report.write_report(out_dir, runs)
    if len(runs) > 1:
        print(report.format_comparison(runs))
    for run in runs:
        print(report.format_table(run))
        knee = run["results_at_knee"]
        where = (f"concurrency {knee['concurrency']}" if knee and knee["concurrency"] is not None
                 else f"rate {knee['request_rate']}" if knee else "none (no level meets the SLO)")
        print(f"{run['engine']}: knee at {where}")
        if (line := report.goodput_summary(run)) is not None:
            print(f"{run['engine']}: {line}")
    print(f"wrote {', '.join(sorted(written.values()))}")
    return 0


def objective_from_args(args: argparse.Namespace) -> metrics.Objective:
    """--goodput (vLLM's per-request bounds, DistServe's 90% attainment) or --slo (percentiles over a level, whose
    limits bound each request too); one or the other, since each says when a level is good enough."""
    try:
        if args.goodput:
            if args.slo is not None:
                raise ValueError("--slo and --goodput both state the SLO: give one (--goodput: per-request bounds "
                                 "and 90% of requests within them; --slo: percentiles over each level)")
            return metrics.Objective.from_goodput(metrics.parse_goodput(args.goodput))
        return metrics.Objective.from_slo(metrics.parse_slo(DEFAULT_SLO if args.slo is None else args.slo))
    except ValueError as e:
        raise SystemExit(str(e)) from None


def check_dataset_args(args: argparse.Namespace) -> None:
    """The long-prompt mix is a random-dataset option: refused elsewhere, and its lengths without a share."""
    if not 0 <= args.long_prompt_share < 1:
        raise SystemExit(f"--long-prompt-share must be in [0, 1), not {args.long_prompt_share}")
    given = [f for f, v in (("--long-input-len", args.long_input_len), ("--long-output-len", args.long_output_len))
             if v is not None]
    if not args.long_prompt_share:
        if given:
            raise SystemExit(f"{', '.join(given)} need --long-prompt-share")
        return
    if args.dataset != "random":
        raise SystemExit(f"--long-prompt-share mixes long prompts into --dataset random, not {args.dataset}")
    args.long_input_len = LONG_INPUT_LEN if args.long_input_len is None else args.long_input_len
    args.long_output_len = LONG_OUTPUT_LEN if args.long_output_len is None else args.long_output_len
    if args.long_input_len < 1 or args.long_output_len < 1:
        raise SystemExit("--long-input-len and --long-output-len must be at least 1")
