"""Prefill-sized linears from the small-M layout against oneDNN's (issue 41, item 4: one copy of the weights).

Where the small-M kernel serves prefill chunks from its own layout (AMX-BF16 in bf16, the blocked float32 GEMM in
the AVX2 build: kernels/csrc/gemm_small_m.cpp), the model drops oneDNN's copy (models/linear.py one_layout). This
times SmolLM2-135M's four decoder linears in --dtype at --rows rows, 2 threads: small_m_linear on each path this
CPU runs for that dtype (amx_bf16 or f32_gemm, and the 8-row "vector" blocks) against oneDNN on its prepacked
weight (what the model ran before); best of --repeats calls, the paths in turns. With --engine, the default model
(quantization none) with one copy and with two (the 8-row path selected while it loads, so one_layout declines,
as before one copy), each in a fresh process, --engine-rounds of each in ABBA order: prefill of 8 prompts x 256
tokens and decode of 64 tokens at batch 16 (the layouts differ from 9 rows on), best of 4 in each process. The
engine's RSS before and after is benchmarks/engine_rss.py's.

    .venv/bin/python benchmarks/one_copy.py [--dtype bfloat16|float32] [--rows 512] [--repeats 30] [--engine]
        [--json OUT]"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from tokenmill.kernels import cpu_flags, cpu_ops
from tokenmill.models.linear import linear, pack_weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def engine_child(ops, dtype: str, copies: str) -> dict:
    """One setting in this process: prefill and decode tok/s, best of 4 after a warm-up."""
    from tokenmill import LLM, SamplingParams
    from tokenmill.models.linear import has_second_copies
    previous = ops.small_m_select_path("vector" if copies == "two" else "auto")
    try:
        llm = LLM(dtype=dtype, quantization="none", kv_cache_memory="256MiB", max_model_len=2048,
                  enable_prefix_caching=False)
    finally:
        ops.small_m_select_path(previous)
    assert has_second_copies(llm.engine.runner.model) == (copies == "two"), "one_layout declines on this CPU"
    prompts = [[1 + (p * 997 + i * 31) % 40000 for i in range(256)] for p in range(8)]
    work = {"prefill 8x256": (prompts, SamplingParams(temperature=0.0, max_tokens=1), 8 * 256),
            "decode batch 16": ([[7 + b, 11, 13, 17] for b in range(16)],
                                SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True), 16 * 64)}
    out = {}
    for key, (batch, params, tokens) in work.items():
        llm.generate(batch, params, use_tqdm=False)
        best = 0.0
        for _ in range(4):
            t = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            best = max(best, tokens / (time.perf_counter() - t))
        out[key] = round(best, 1)
    return out


def engine(dtype: str, rounds: int) -> dict:
    """The default model with two copies and with one, each in a fresh process, in ABBA order (in one process the
    one that ran second was faster: the order, not the layout, decided)."""
    runs = {"two_copies": [], "one_copy": []}
    for r in range(rounds):
        for copies in (("two", "one") if r % 2 == 0 else ("one", "two")):
            proc = subprocess.run([sys.executable, __file__, "--dtype", dtype, "--engine-child", copies],
                                  capture_output=True, text=True, check=True)
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            runs["two_copies" if copies == "two" else "one_copy"].append(result)
            print(copies, result, flush=True)
    return {name: {"runs": got, "median": {key: statistics.median(g[key] for g in got) for key in got[0]}}
            for name, got in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--engine", action="store_true", help="also time the engine with one copy and with two")
    parser.add_argument("--engine-rounds", type=int, default=4, help="fresh processes per setting")
    parser.add_argument("--engine-child", choices=["one", "two"], help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ops = cpu_ops()
    if args.engine_child:
        print(json.dumps(engine_child(ops, args.dtype, args.engine_child)))
        return
    paths = ["vector"]
    for path in (["amx_bf16"] if dtype == torch.bfloat16 else ["f32_gemm"]):
        try:
            ops.small_m_select_path(path)
            paths.insert(0, path)
        except RuntimeError:
            pass
    rows = []
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k) * 0.05).to(dtype)
        small, packed = ops.pack_small_m(w), pack_weight(w)
        x = torch.randn(args.rows, k).to(dtype)
        calls = {"onednn": lambda: linear(x, None, None, packed)}
        for path in paths:
            calls[path] = (lambda p: lambda: (ops.small_m_select_path(p), ops.small_m_linear(x, small, None, n)))(path)
        best = {key: float("inf") for key in calls}
        for _ in range(args.repeats):  # in turns, so that a drift of the machine's speed is shared
            for key, call in calls.items():
                t = time.perf_counter()
                call()
                best[key] = min(best[key], time.perf_counter() - t)
        row = {"shape": name, "n": n, "k": k, **{f"{key}_ms": round(v * 1e3, 4) for key, v in best.items()}}
        rows.append(row)
        print(f"{name:>8} {n}x{k} x{args.rows}: " + "  ".join(f"{key} {v * 1e3:.3f} ms" for key, v in best.items()))
    ops.small_m_select_path("auto")
    totals = {key: sum(r[f"{key}_ms"] for r in rows) for key in ["onednn", *paths]}
    print("sum: " + "  ".join(f"{key} {v:.3f} ms" for key, v in totals.items()))
    engine_runs = engine(args.dtype, args.engine_rounds) if args.engine else None
    if args.json:
        flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
        with open(args.json, "w") as f:
            json.dump({"flags": flags, "dtype": args.dtype, "rows": args.rows, "threads": args.threads,
                       "linears": rows, "sums_ms": totals, "engine": engine_runs}, f, indent=1)


if __name__ == "__main__":
    main()
