"""W8A8 prefill against the dense path, per kernel path this CPU runs (issue 41: W8A8 prefill tok/s >= 1.6x dense).

Two measures, each per W8A8 path, each in a child process of its own since the kernel build is chosen once per
process: the AVX-512 build (TOKENMILL_CPU_ISA=avx512) with each of its paths the CPU runs (amx_int8 on AMX CPUs,
avx512_vnni; chosen with the w8a8_select_path op), then the AVX2 build (its vpmaddubsw path):
- engine: a --tokens prefill (one prompt, max_tokens 1) through the offline engine of the default model, dense
  (--quantization none) against --quantization w8a8, in each --dtypes (bfloat16 where the CPU has native bf16:
  the serving dtype; float32, the dense path of CPUs without it). tok/s of the fastest of --repeats runs.
- linears: SmolLM2-135M's four decoder linears at --linear-rows rows (default: 1, 8 and --tokens), dense as the
  model runs them (the small-M kernel up to its 8 rows where it serves the dtype, else oneDNN on a prepacked
  weight) against w8a8_linear; ms per call, fastest of those made in --seconds.

    .venv/bin/python benchmarks/w8a8.py [--tokens 512] [--repeats 5] [--threads 2] [--isas avx512,avx2]
        [--dtypes bfloat16,float32] [--linear-rows 1,8,512] [--skip-engine] [--skip-linears] [--json OUT]

Timings on a shared machine mean little: run it on a quiet one. A smoke run: --tokens 32 --repeats 1
--seconds 0.05."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def best_of(fn, repeats: int = 0, min_seconds: float = 0.0) -> float:
    fn()
    best, n, start = float("inf"), 0, time.perf_counter()
    while n < max(repeats, 1) or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        n += 1
    return best


def engine_rows(args) -> list[dict]:
    import torch

    from tokenmill import LLM, SamplingParams
    rows = []
    for dtype in args.dtypes.split(","):
        for quantization in ("none", "w8a8"):
            llm = LLM(dtype=dtype, device="cpu", quantization=quantization, max_model_len=args.tokens + 16,
                      kv_cache_memory="256MiB", max_num_batched_tokens=max(args.tokens, 512),
                      enable_prefix_caching=False)
            prompt = torch.randint(100, 20000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
            params = SamplingParams(temperature=0.0, max_tokens=1)
            t = best_of(lambda: llm.generate([prompt], params, use_tqdm=False), repeats=args.repeats)
            rows.append({"measure": "engine", "dtype": dtype, "quantization": quantization,
                         "tok_s": args.tokens / t})
            del llm
    return rows


def linear_rows(args) -> list[dict]:
    import torch

    from tokenmill.kernels import cpu_ops
    from tokenmill.models.linear import SMALL_M_MAX_ROWS, linear, pack_small_m, pack_weight
    from tokenmill.models.quantization import W8A8Weight
    ops, rows = cpu_ops(), []
    counts = [int(r) for r in args.linear_rows.split(",")] if args.linear_rows else [1, 8, args.tokens]
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for name, (n, k) in SHAPES.items():
            w = torch.randn(n, k) * 0.02
            dense, packed = w.to(dtype), pack_weight(w.to(dtype))
            small = pack_small_m(ops, dense, None)
            q = W8A8Weight(w)
            for m in counts:
                x = torch.randn(m, k).to(dtype)
                if small is not None and m <= SMALL_M_MAX_ROWS:
                    td = best_of(lambda: ops.small_m_linear(x, small, None, n), min_seconds=args.seconds)
                else:
                    td = best_of(lambda: linear(x, dense, None, packed), min_seconds=args.seconds)
                tq = best_of(lambda: ops.w8a8_linear(x, q.qweight, q.meta, None, n), min_seconds=args.seconds)
                rows.append({"measure": "linear", "dtype": dtype_name, "shape": name, "rows": m,
                             "dense_ms": td * 1e3, "w8a8_ms": tq * 1e3})
    return rows


def child(args) -> None:
    import torch
    torch.set_num_threads(args.threads)
    from tokenmill.kernels import cpu_ops
    cpu_ops().w8a8_select_path(args.path)
    out = {"isa": os.environ.get("TOKENMILL_CPU_ISA"), "path": cpu_ops().w8a8_linear_path(), "rows": []}
    if not args.skip_linears:
        out["rows"] += linear_rows(args)
    if not args.skip_engine:
        out["rows"] += engine_rows(args)
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="prefill length (engine) and rows (linears)")
    parser.add_argument("--repeats", type=int, default=5, help="engine prefills per figure (the fastest counts)")
    parser.add_argument("--seconds", type=float, default=0.5, help="time spent per linear figure")
    parser.add_argument("--linear-rows", default=None, help="rows of the linear figures (default: 1,8,--tokens)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isas", default=None, help="default: every ISA build this CPU runs")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-linears", action="store_true")
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", default="auto", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    from tokenmill.kernels import cpu_flags, runnable_isas
    isas = args.isas.split(",") if args.isas else runnable_isas()
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx", "avx_vnni", "avx2")))
    print(f"CPU flags: {' '.join(flags)}; threads {args.threads}; {args.tokens} tokens")
    argv = ["--tokens", str(args.tokens), "--repeats", str(args.repeats), "--seconds", str(args.seconds),
            "--threads", str(args.threads), "--dtypes", args.dtypes]
    argv += ["--linear-rows", args.linear_rows] if args.linear_rows else []
    argv += ["--skip-engine"] * args.skip_engine + ["--skip-linears"] * args.skip_linears
    runs = []
    for isa in isas:
        paths = ["auto"]
        if isa == "avx512":
            paths = [p for p, need in (("amx_int8", {"amx_tile", "amx_int8"}), ("avx512_vnni", {"avx512_vnni"}))
                     if need <= cpu_flags()] or ["auto"]
        runs += [(isa, path) for path in paths]
    results = []
    for isa, path in runs:
        env = {**os.environ, "TOKENMILL_CPU_ISA": isa, "TOKENMILL_NO_PROGRESS": "1"}
        proc = subprocess.run([sys.executable, __file__, "--child", "--path", path, *argv], env=env,
                              capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{isa}: failed\n{proc.stderr[-3000:]}")
            continue
        result = json.loads(line.removeprefix("RESULT "))
        results.append(result)
        print(f"\nbuild {isa}, w8a8 path {result['path']}")
        for r in result["rows"]:
            if r["measure"] == "linear":
                print(f"  linear {r['shape']:>8} {r['dtype']:>9} x{r['rows']:<4}: dense {r['dense_ms']:8.3f} ms  "
                      f"w8a8 {r['w8a8_ms']:8.3f} ms  ({r['dense_ms'] / r['w8a8_ms']:.2f}x)")
        engine = {(r["dtype"], r["quantization"]): r["tok_s"] for r in result["rows"] if r["measure"] == "engine"}
        for dtype in args.dtypes.split(","):
            if (dtype, "none") in engine:
                dense, w8a8 = engine[(dtype, "none")], engine[(dtype, "w8a8")]
                print(f"  engine prefill {dtype:>9}: dense {dense:9.1f} tok/s  w8a8 {w8a8:9.1f} tok/s  "
                      f"({w8a8 / dense:.2f}x)")
    if args.json:
        from tokenmill.bench.env_probe import hardware
        with open(args.json, "w") as f:
            json.dump({"hardware": hardware(), "flags": flags, "threads": args.threads, "tokens": args.tokens,
                       "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
