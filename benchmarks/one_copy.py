"""Prefill-sized linears from the small-M layout against oneDNN's (issue 41, item 4: one copy of the weights).

Where the small-M kernel serves prefill chunks from its own layout (AMX-BF16: kernels/csrc/gemm_small_m.cpp), the
model drops oneDNN's copy (models/linear.py one_layout). This times SmolLM2-135M's four decoder linears in bf16 at
--rows rows, 2 threads: small_m_linear on each path this CPU runs (amx_bf16, and the 8-row "vector" blocks that
serve elsewhere) against oneDNN on its prepacked weight (what the model ran before); best of --repeats calls,
the paths in turns. The engine's RSS before and after is benchmarks/engine_rss.py's.

    .venv/bin/python benchmarks/one_copy.py [--rows 512] [--repeats 30] [--json OUT]"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tokenmill.kernels import cpu_flags, cpu_ops
from tokenmill.models.linear import linear, pack_weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_ops()
    paths = ["vector"]
    try:
        ops.small_m_select_path("amx_bf16")
        paths.insert(0, "amx_bf16")
    except RuntimeError:
        pass
    rows = []
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
        small, packed = ops.pack_small_m(w), pack_weight(w)
        x = torch.randn(args.rows, k).to(torch.bfloat16)
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
    if args.json:
        flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")))
        with open(args.json, "w") as f:
            json.dump({"flags": flags, "rows": args.rows, "threads": args.threads, "linears": rows,
                       "sums_ms": totals}, f, indent=1)


if __name__ == "__main__":
    main()
