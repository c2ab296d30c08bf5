"""What moving one prompt's KV blocks as bytes costs each side, by phase, on one thread, without a model.

The prefill side (or a tier's save) makes entries (BlockLayout.entries: the blocks gathered from the pool behind
their headers, and a CRC-32 of each); the decode side (or a tier's load) checks them (kv_blocks.unpack: header and
CRC-32) and writes them into its pool (BlockLayout.write). The layout is the default model's KV (SmolLM2-135M:
30 layers, 3 KV heads of 64, blocks of 16 tokens) in random caches; a 2,000-token prompt is 125 blocks, 92 MB in
float32. Each phase: the best of --repeats. The network between the two sides is not in it (loopback or not,
tokenmill's transfer is ZMQ over TCP: engine/kv_transfer.py).

Usage: taskset -c 1 python benchmarks/kv_block_bytes.py [--tokens 2000] [--dtype float32] [--repeats 7] [--json OUT]"""
from __future__ import annotations

import argparse
import json
import time

import torch

from tokenmill.engine.kv_blocks import BlockLayout, unpack

try:  # a checkout before 08d256e: blocks read, then each joined to its header (run it there to compare)
    from tokenmill.engine.kv_blocks import pack
except ImportError:
    pack = None

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 30, 16, 3, 64


def best_ms(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return round(best * 1e3, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = -(-args.tokens // BLOCK_SIZE)
    dtype = getattr(torch, args.dtype)
    caches = [tuple(torch.randn(2 * n + 8, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(2)) + (None,)
              for _ in range(LAYERS)]
    layout = BlockLayout(caches, {"benchmark": "kv_block_bytes"})
    key, sources, targets = layout.key(), list(range(0, 2 * n, 2)), list(range(1, 2 * n, 2))
    hashes = [i.to_bytes(32, "little") for i in range(n)]

    def make_entries() -> list:
        if pack is not None:
            return [pack(key, h, payload) for h, payload in zip(hashes, layout.read(sources))]
        return layout.entries(sources, hashes)

    entries = make_entries()
    payloads = [unpack(e, key, h)[0] for e, h in zip(entries, hashes)]
    figures = {
        "entries_ms": best_ms(make_entries, args.repeats),
        "checks_ms": best_ms(lambda: [unpack(e, key, h) for e, h in zip(entries, hashes)], args.repeats),
        "write_ms": best_ms(lambda: layout.write(targets, payloads), args.repeats),
    }
    layout.write(targets, payloads)
    assert [bytes(b) for b in layout.read(targets)] == [bytes(b) for b in layout.read(sources)]
    out = {"api": "read+pack" if pack is not None else "entries", "tokens": args.tokens, "blocks": n,
           "dtype": args.dtype, "mb": round(n * layout.block_bytes / 1e6, 1),
           **figures, "ms_per_1000_tokens": {k.removesuffix("_ms"): round(v * 1000 / args.tokens, 2)
                                             for k, v in figures.items()}}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
