"""Step time of two engine configurations side by side, in one process: the forward (runner.execute) of B decoding
requests on contexts of --context tokens, alternating between the engines step by step, so both see the same
machine (a server-level c=32 run varies by +-10% from run to run on these 2 cores; a step-level A/B does not
drift between A and B). Optionally with one extra row of --prefill query tokens (a prefill chunk mixed into the
batch, as continuous batching runs it; measured as a request verifying that many drafts, the same forward).

    .venv/bin/python benchmarks/step_time_ab.py --a '{"quantization": "none"}' --b '{"quantization": "auto"}'
        [--batch 32] [--prefill 0] [--context 256] [--repeats 40]

--a/--b are EngineConfig fields as JSON (the CLI flags' names with underscores). Prints each engine's median step
time and B / A, per decode-only step and, with --prefill, per mixed step."""
from __future__ import annotations

import argparse
import json
import statistics
import time

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import EngineCore
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.sampling_params import SamplingParams


def prepared(fields: dict, batch: int, context: int, extra: int) -> EngineCore:
    engine = EngineCore(EngineConfig(**{"max_model_len": context + extra + 64, **fields}))
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for i in range(batch):  # prefill every request, then one decode so each has an output token
        engine.add_request(str(i), [(i * 7 + j) % 5000 + 100 for j in range(context)], params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    return engine


def timed_forward(engine: EngineCore, batch: list, drafts: list[int]) -> float:
    """ms of one forward over `batch` (running requests), request i verifying drafts[i] made-up drafts (a row per
    draft, as a prefill chunk of that many tokens would add); then rolled back, nothing kept."""
    sched = SchedulerOutput()
    for r, k in zip(batch, drafts):
        r.spec_token_ids = [(r.num_tokens + j) % 5000 + 100 for j in range(k)]
        assert engine.kv_cache.allocate_slots(r, k + 1)
        sched.requests.append(r)
        sched.num_scheduled_tokens[r.request_id] = k + 1
    tables = {r.request_id: engine.kv_cache.block_ids(r.request_id) for r in batch}
    start = time.perf_counter()
    engine.runner.execute(sched, tables)
    elapsed = time.perf_counter() - start
    for r in batch:  # nothing was accepted: back to where it was
        r.spec_token_ids = []
        engine.kv_cache.keep_verified(r, r.num_computed_tokens)
    return elapsed * 1000


def step(engine: EngineCore, extra: int) -> float:
    """One forward over every running request, the first one with `extra` rows more."""
    batch = list(engine.scheduler.running)
    return timed_forward(engine, batch, [extra] + [0] * (len(batch) - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", default='{"quantization": "none"}')
    parser.add_argument("--b", default='{"quantization": "auto"}')
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prefill", type=int, default=0, help="query tokens of one extra prefill row (0: none)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args()
    engines = {"A": prepared(json.loads(args.a), args.batch, args.context, args.prefill),
               "B": prepared(json.loads(args.b), args.batch, args.context, args.prefill)}
    kinds = [("decode", 0)] + ([(f"decode+prefill{args.prefill}", args.prefill)] if args.prefill else [])
    print(f"A = {args.a}\nB = {args.b}\n{args.batch} decoding requests, context {args.context}, "
          f"{args.repeats} steps each, alternating")
    for name, extra in kinds:
        times: dict[str, list[float]] = {"A": [], "B": []}
        for engine in engines.values():
            step(engine, extra)  # warm
        for _ in range(args.repeats):
            for label, engine in engines.items():
                times[label].append(step(engine, extra))
        a, b = statistics.median(times["A"]), statistics.median(times["B"])
        pairs = sorted(y / x for x, y in zip(times["A"], times["B"]))
        print(f"{name}: A {a:.2f} ms, B {b:.2f} ms (medians); B / A {b / a:.3f}; per-pair ratio median "
              f"{statistics.median(pairs):.3f}, quartiles {pairs[len(pairs) // 4]:.3f}-{pairs[3 * len(pairs) // 4]:.3f}")


if __name__ == "__main__":
    main()
