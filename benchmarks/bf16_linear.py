"""bf16 linears on a CPU without native bf16 (no AVX512-BF16 or AMX): torch's emulated bf16 matmul against the
path tokenmill/models/linear.py takes from BF16_VIA_FLOAT32_MIN_ROWS rows (both operands to float32, the output
rounded to bf16), per shape of the default model and row count; then the engine's bf16 prefill with that path on
and off (the threshold set out of reach), alternating. Prints a JSON document (benchmarks/results/bf16-linear.*).

    .venv/bin/python benchmarks/bf16_linear.py > out.json
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.models import linear as linear_module  # noqa: E402
from tokenmill.models.linear import onednn_linear_supported  # noqa: E402

SHAPES = {"qkv 576->960": (960, 576), "gate_up 576->3072": (3072, 576), "down 1536->576": (576, 1536),
          "lm_head 576->49152": (49152, 576)}
ROWS = [8, 16, 32, 64, 128, 512]


def ms(f, repeat: int = 5) -> float:
    f()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def linears() -> dict:
    out = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k).to(torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k).to(torch.bfloat16)
            out[f"{name} M={m}"] = {
                "bf16_ms": ms(lambda: F.linear(x, w)),
                "via_float32_ms": ms(lambda: F.linear(x.float(), w.float()).to(torch.bfloat16))}
    return out


def prefill() -> dict:
    """8 prompts of 256 tokens, max_tokens 1, in one generate call (prefill-bound), the float32 path on and off,
    alternating 3 times each."""
    llm = LLM(dtype="bfloat16", quantization="none", kv_cache_memory="256MiB", max_model_len=2048)
    prompts = [[(97 * i + 13 * j) % 40000 + 1000 for j in range(256)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    on = linear_module.BF16_VIA_FLOAT32_MIN_ROWS
    runs = {"bf16_emulated": [], "via_float32": []}
    for i in range(3):
        for j, (name, rows) in enumerate((("bf16_emulated", 1 << 62), ("via_float32", on))):
            linear_module.BF16_VIA_FLOAT32_MIN_ROWS = rows
            fresh = [[p[0] + 1 + 2 * i + j] + p[1:] for p in prompts]  # a first token of its own: no prefix hits
            t = time.perf_counter()
            llm.generate(fresh, params, use_tqdm=False)
            runs[name].append(8 * 256 / (time.perf_counter() - t))
    linear_module.BF16_VIA_FLOAT32_MIN_ROWS = on
    return {name: {"prefill_tok_s": v, "median": statistics.median(v)} for name, v in runs.items()}


def main() -> None:
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    flags = next((line.split(":", 1)[1].split() for line in flags.splitlines() if line.startswith("Flags")), [])
    doc = {"date": time.strftime("%Y-%m-%d"),
           "commit": subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip(),
           "cpu": platform.processor() or platform.machine(),
           "flags": [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))],
           "onednn_bf16": onednn_linear_supported(torch.bfloat16), "torch_threads": torch.get_num_threads(),
           "linears": linears(), "prefill": prefill()}
    json.dump(doc, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
