"""What a KV tier's worker, writing received blocks into the pool, costs the step loop that shares its core.

A decode-sized loop of torch ops (30 x 8 linears of 576 x 576 on 4 rows, one thread) is timed alone and then
beside a worker thread that, at the tier worker's priority (nice 10, kv_offload.py), checks and writes 2,000-token
transfers of the default model's float32 layout (125 blocks, 92 MB) without pause. Two writes are compared:
`blocks`, BlockLayout.write as it is (each payload's slices copied straight into the pool), and `join`, an earlier
write (the blocks joined with bytearray().join, one copy that holds the GIL, then one scatter per cache).
Run it on one core (`taskset -c 1`), as a decode instance runs in benchmarks/pd_disagg.sh.

Usage: taskset -c 1 python benchmarks/kv_write_contention.py [--write blocks|join] [--nice 10] [--steps 40]"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

import numpy as np
import torch

from tokenmill.engine.kv_blocks import BlockLayout, unpack

LAYERS, BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 30, 1000, 16, 3, 64  # SmolLM2-135M's KV, float32


def join_write(layout: BlockLayout, block_ids: list[int], payloads: list) -> None:
    rows = np.frombuffer(bytearray().join(payloads), dtype=np.uint8).reshape(len(block_ids), layout.block_bytes)
    ids, offset = np.asarray(block_ids), 0
    for cache in layout._host:
        cache[ids] = rows[:, offset:offset + cache.shape[1]]
        offset += cache.shape[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", choices=["blocks", "join"], default="blocks")
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)
    caches = [(torch.zeros(BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM), torch.zeros(BLOCKS, BLOCK_SIZE, KV_HEADS,
                                                                                  HEAD_DIM), None)
              for _ in range(LAYERS)]
    layout = BlockLayout(caches, {"benchmark": "kv_write_contention"})
    key, block_hash = layout.key(), b"h" * 32
    entries = layout.entries(list(range(0, 250, 2)), [block_hash] * 125)
    targets = list(range(300, 550, 2))
    weights, x = [torch.randn(576, 576) for _ in range(8)], torch.randn(4, 576)

    def step() -> float:
        t = time.perf_counter()
        for _ in range(30):
            y = x
            for w in weights:
                y = torch.nn.functional.linear(y, w)
        return time.perf_counter() - t

    stop, writes = threading.Event(), [0]

    def worker() -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), args.nice)
        while not stop.is_set():
            payloads = [unpack(memoryview(e), key, block_hash)[0] for e in entries]
            (layout.write if args.write == "blocks" else lambda i, p: join_write(layout, i, p))(targets, payloads)
            writes[0] += 1

    alone = [step() for _ in range(args.steps // 2)]
    thread = threading.Thread(target=worker)
    thread.start()
    start = time.perf_counter()
    beside = [step() for _ in range(args.steps)]
    elapsed = time.perf_counter() - start
    stop.set()
    thread.join()
    print(json.dumps({"write": args.write, "nice": args.nice, "mb_per_write": round(len(entries) * layout.block_bytes
                                                                                      / 1e6, 1),
                      "step_alone_ms": {"p50": round(statistics.median(alone) * 1e3, 1)},
                      "step_beside_ms": {"p50": round(statistics.median(beside) * 1e3, 1),
                                         "max": round(max(beside) * 1e3, 1)},
                      "writes_per_s": round(writes[0] / elapsed, 2)}))


if __name__ == "__main__":
    main()
