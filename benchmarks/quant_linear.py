"""Per-linear microbenchmark: the quantized kernel (4-bit and 8-bit, as dispatched: int16 dot products up to its
row threshold; above, bf16 tiles on AVX512-BF16 CPUs (the path line says "+bf16_tiles", or "+amx_bf16_tiles" where
their blocks of 16 and 32 rows run on AMX-BF16), else dequantize + oneDNN)
against the dequantize + oneDNN path at every row count, oneDNN bf16 on a prepacked dense weight and the small-M
bf16 kernel, on the default model's linear shapes (SmolLM2-135M: qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536, lm_head 49152x576).

    .venv/bin/python benchmarks/quant_linear.py [--rows 1,4,8,16,32,128,512] [--threads 2] [--shapes qkv,o]

Prints ms per call for each path and rows, bf16 activations: the fastest of the calls made in --seconds (the
minimum is the figure least disturbed when the machine is shared)."""
from __future__ import annotations

import argparse
import time

import torch

from tokenmill.kernels import cpu_ops
from tokenmill.models.linear import pack_small_m, pack_weight
from tokenmill.models.quantization import QuantizedWeight, quantize

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def timed(fn, min_seconds: float) -> float:
    fn()
    best, n, start = float("inf"), 0, time.perf_counter()
    while n < 5 or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
        n += 1
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,32,128,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--seconds", type=float, default=0.5, help="time spent per figure")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_ops()
    print(f"kernel path: {ops.quant_linear_path()}, threads {args.threads}")
    torch.manual_seed(0)
    print(f"{'shape':>8} {'rows':>5} {'q4 ms':>8} {'q8 ms':>8} {'q4 deq+onednn':>14} {'onednn bf16':>12} "
          f"{'small-M bf16':>13}")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k) * 0.02
        q4, q8 = QuantizedWeight(quantize(w, "int4")), QuantizedWeight(quantize(w, "int8"))
        wb = w.bfloat16()
        packed, small = pack_weight(wb), pack_small_m(ops, wb, None)
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k).bfloat16()
            t4 = timed(lambda: ops.quant_linear(x, q4.qweight, q4.meta, None, n), args.seconds)
            t8 = timed(lambda: ops.quant_linear(x, q8.qweight, q8.meta, None, n), args.seconds)
            tq = timed(lambda: torch.ops.mkldnn._linear_pointwise(
                x, ops.quant_dequantize(q4.qweight, q4.meta, n, x.dtype), None, "none", [], ""), args.seconds)
            td = timed(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""), args.seconds) \
                if packed is not None else float("nan")
            ts = timed(lambda: ops.small_m_linear(x, small, None, n), args.seconds) \
                if small is not None and m <= 32 else float("nan")
            print(f"{name:>8} {m:>5} {t4:>8.3f} {t8:>8.3f} {tq:>14.3f} {td:>12.3f} {ts:>13.3f}", flush=True)


if __name__ == "__main__":
    main()
