"""Paged attention on this CPU: prefill on each path it runs (the float32-FMA tiles against bf16 pairs, AMX-BF16
tile products or AVX512-BF16's vdpbf16ps: kernels/csrc/attention.cpp attention_item_pairs) side by side in one
process, and a batch of decodes.

Prefill, the paths in turns (ops.attention_select_path) so that a drift of the machine's speed is shared:
- the kernel alone, SmolLM2-135M's attention shape (9 heads, 3 KV heads, head_dim 64, bf16, blocks of 16) for 30
  layers, at chunk sizes and contexts a prefill meets (a chunk of q tokens whose last token is at ctx);
- a whole prompt's prefill through the engine (the default model, bf16 dense, step bound off), in chunks of
  --chunk tokens: what the attention's share of a long prompt's TTFT comes to.
Decode: --decode-seqs sequences of one query each at --decode-context tokens, 30 layers each with its own cache
(so that the KV comes from memory, as in a step), scattered blocks: the step time and the rate the KV is read at.
To compare two builds, run the script from each in turns.

    .venv/bin/python benchmarks/attention.py [--repeats 10] [--prompt 1500] [--json OUT]"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tokenmill.kernels import cpu_flags, cpu_ops

CASES = [(16, 1000), (64, 1000), (128, 1500), (240, 240), (512, 512)]  # (query tokens, context)
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30


def kernel_rows(ops, paths: list[str], repeats: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    num_blocks = 512
    k_cache = torch.randn(num_blocks, KV_HEADS, HEAD_DIM, BLOCK, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, KV_HEADS, BLOCK, HEAD_DIM, generator=g).to(torch.bfloat16)
    rows = []
    for q_len, ctx in CASES:
        q = torch.randn(q_len, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
        out = torch.empty_like(q)
        table = torch.randperm(num_blocks, generator=g)[:-(-ctx // BLOCK)].int().view(1, -1)
        lens, qsl = torch.tensor([ctx], dtype=torch.int32), torch.tensor([0, q_len], dtype=torch.int32)
        times = {p: [] for p in paths}
        for _ in range(repeats):
            for path in paths:
                ops.attention_select_path(path)
                start = time.perf_counter()
                for _ in range(LAYERS):
                    ops.paged_attention(out, q, k_cache, v_cache, table, lens, qsl, HEAD_DIM ** -0.5)
                times[path].append((time.perf_counter() - start) * 1e3)
        row = {"query_tokens": q_len, "context": ctx, **{f"{p}_ms": round(statistics.median(t), 3)
                                                         for p, t in times.items()}}
        rows.append(row)
        print(f"attention, {q_len} query tokens at context {ctx}, {LAYERS} layers: "
              + "  ".join(f"{p} {row[f'{p}_ms']:.2f} ms" for p in paths))
    return rows


def decode_row(ops, repeats: int, seqs: int, context: int) -> dict:
    g = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    num_blocks = seqs * per_seq
    caches = [(torch.randn(num_blocks, KV_HEADS, HEAD_DIM, BLOCK, generator=g).to(torch.bfloat16),
               torch.randn(num_blocks, KV_HEADS, BLOCK, HEAD_DIM, generator=g).to(torch.bfloat16))
              for _ in range(LAYERS)]
    table = torch.randperm(num_blocks, generator=g).int().view(seqs, per_seq)
    lens, qsl = torch.full((seqs,), context, dtype=torch.int32), torch.arange(seqs + 1, dtype=torch.int32)
    q = torch.randn(seqs, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    out = torch.empty_like(q)
    times = []
    for _ in range(repeats + 2):
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            ops.paged_attention(out, q, k_cache, v_cache, table, lens, qsl, HEAD_DIM ** -0.5)
        times.append((time.perf_counter() - start) * 1e3)
    ms = statistics.median(times[2:])
    kv_bytes = seqs * context * KV_HEADS * HEAD_DIM * 2 * 2 * LAYERS
    row = {"seqs": seqs, "context": context, "ms": round(ms, 2), "kv_mb": round(kv_bytes / 1e6),
           "gb_per_s": round(kv_bytes / ms / 1e6, 1)}
    print(f"decode, {seqs} sequences at context {context}, {LAYERS} layers: {ms:.2f} ms, KV {row['kv_mb']} MB "
          f"read at {row['gb_per_s']} GB/s")
    return row


def prefill_rows(ops, paths: list[str], repeats: int, prompt: int, chunks: list[int]) -> list[dict]:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.engine import EngineCore
    from tokenmill.sampling_params import SamplingParams
    rows = []
    for chunk in chunks:
        engine = EngineCore(EngineConfig(max_model_len=2048, dtype="bfloat16", quantization="none",
                                         max_step_latency_ms=0, max_num_batched_tokens=chunk,
                                         enable_prefix_caching=False))
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        seed = iter(range(10 ** 6))

        def prefill() -> float:
            i = next(seed)
            engine.add_request(str(i), [(i * 7919 + j * 31) % 40000 + 100 for j in range(prompt)], params)
            start = time.perf_counter()
            while engine.scheduler.requests:
                engine.step()
            return (time.perf_counter() - start) * 1e3

        prefill()
        times = {p: [] for p in paths}
        for _ in range(repeats):
            for path in paths:
                ops.attention_select_path(path)
                times[path].append(prefill())
        row = {"prompt": prompt, "chunk": chunk, **{f"{p}_ms": round(statistics.median(t), 1)
                                                    for p, t in times.items()}}
        rows.append(row)
        print(f"prefill of {prompt} tokens in chunks of {chunk}: "
              + "  ".join(f"{p} {row[f'{p}_ms']:.0f} ms" for p in paths))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--prompt", type=int, default=1500)
    parser.add_argument("--chunks", default="512,64", help="prefill chunk sizes, comma-separated")
    parser.add_argument("--decode-seqs", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_ops()
    paths = ["vector"]
    for path in ("amx_bf16", "avx512_bf16"):
        try:
            ops.attention_select_path(path)
            paths.append(path)
        except RuntimeError as e:
            print(e)
    try:
        decode = decode_row(ops, args.repeats, args.decode_seqs, args.decode_context)
        kernel = kernel_rows(ops, paths, args.repeats)
        prefill = prefill_rows(ops, paths, max(3, args.repeats // 2), args.prompt,
                               [int(c) for c in args.chunks.split(",")])
    finally:
        ops.attention_select_path("auto")
    if args.json:
        flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")))
        with open(args.json, "w") as f:
            json.dump({"flags": flags, "threads": args.threads, "decode": decode, "kernel_30_layers": kernel,
                       "prefill": prefill},
                      f, indent=1)


if __name__ == "__main__":
    main()
