"""`tokenmill bench latency`: vLLM's `bench latency`, the time the offline engine takes to serve one batch end to
end (every prompt --input-len random tokens, every sample exactly --output-len tokens), warmed up, then timed over
--num-iters batches: the mean and vLLM's percentiles. --profile records the timed batches with torch's profiler
(VLLM_TORCH_PROFILER_DIR)."""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from tokenmill.bench.throughput import random_prompts
from tokenmill.config import EngineConfig

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, help="same as --model")
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--input-len", type=int, default=32, help="tokens in each prompt")
    parser.add_argument("--output-len", type=int, default=128, help="tokens each sample generates")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts in the batch")
    parser.add_argument("--n", type=int, default=1, help="samples of each prompt (the beam width with beam search)")
    parser.add_argument("--use-beam-search", action="store_true")
    parser.add_argument("--num-iters-warmup", type=int, default=10, help="batches run before the timed ones")
    parser.add_argument("--num-iters", type=int, default=30, help="batches timed")
    parser.add_argument("--profile", action="store_true",
                        help="profile the timed batches with torch's profiler (needs VLLM_TORCH_PROFILER_DIR)")
    parser.add_argument("--output-json", default=None, help="write the latencies to this file")


def main(args: argparse.Namespace) -> int:
    from tokenmill import LLM, BeamSearchParams, SamplingParams
    if args.model_tag:
        args.model = args.model_tag
    for name in ("input_len", "output_len", "batch_size", "n", "num_iters"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be at least 1")
    config = EngineConfig.from_cli_args(args)
    llm = LLM(**vars(config))
    prompts = random_prompts(args.batch_size, args.input_len, llm.engine.runner.vocab_size, config.seed)
    if args.use_beam_search:
        beams = BeamSearchParams(beam_width=args.n, max_tokens=args.output_len, ignore_eos=True)

        def run_batch() -> None:
            llm.beam_search([{"prompt_token_ids": p} for p in prompts], beams)
    else:
        params = SamplingParams(n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.output_len, ignore_eos=True)

        def run_batch() -> None:
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert all(len(c.token_ids) == args.output_len for o in outs for c in o.outputs)

    print(f"model {llm.engine.model_info.path}: batch {args.batch_size} x n {args.n}, {args.input_len} tokens in, "
          f"{args.output_len} out{', beam search' if args.use_beam_search else ''}", flush=True)
    for _ in range(args.num_iters_warmup):
        run_batch()
    if args.profile:
        llm.start_profile()
    latencies = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        run_batch()
        latencies.append(time.perf_counter() - start)
    if args.profile:
        llm.stop_profile()
    latencies_arr = np.array(latencies)
    percentiles = np.percentile(latencies_arr, PERCENTILES)
    print(f"Avg latency: {latencies_arr.mean():.4f} seconds")
    for p, value in zip(PERCENTILES, percentiles):
        print(f"{p}% percentile latency: {value:.4f} seconds")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"avg_latency": float(latencies_arr.mean()), "latencies": latencies,
                       "percentiles": {str(p): float(v) for p, v in zip(PERCENTILES, percentiles)}}, f, indent=2)
    return 0
