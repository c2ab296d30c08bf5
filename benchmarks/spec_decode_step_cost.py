"""What verifying drafts costs: the time of one engine forward (runner.execute) for B decoding requests with k
drafts each, i.e. B x (k + 1) query tokens, on contexts of --context tokens. The knee where the time stops being
flat (weight-bound) and grows with the tokens (compute-bound) sets adaptive.DEFAULT_MAX_VERIFY_TOKENS: the last
lines print the step time by token count (median over the B x k cells with that count), what each doubling of the
tokens added, and the knee: the most tokens reached while every doubling added at most --doubling (50%).

    .venv/bin/python benchmarks/spec_decode_step_cost.py [--model M] [--context 256] [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics

from step_time_ab import prepared, timed_forward  # this folder's: python puts a script's folder on the path

from tokenmill.config import EngineConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=EngineConfig.model)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batches", default="1,2,4,8,16,32")
    parser.add_argument("--drafts", default="0,1,3,7,15")
    parser.add_argument("--doubling", type=float, default=0.5,
                        help="the most a doubling of the tokens may add (a fraction) below the knee")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    drafts = [int(k) for k in args.drafts.split(",")]
    engine = prepared({"model": args.model}, max(batches), args.context, 0)
    requests = list(engine.scheduler.running)
    print(f"step time (ms, median of {args.repeats}) by batch B (rows) and drafts k per request; "
          f"tokens = B x (k + 1); context {args.context}")
    print("B \\ k " + "".join(f"{k:>10}" for k in drafts))
    by_tokens: dict[int, list[float]] = {}
    for b in batches:
        row = []
        for k in drafts:
            batch = requests[:b]
            times = [timed_forward(engine, batch, [k] * b) for _ in range(args.repeats)]
            row.append(statistics.median(times))
            by_tokens.setdefault(b * (k + 1), []).append(row[-1])
        print(f"{b:<6}" + "".join(f"{t:>10.1f}" for t in row))
    times = {n: statistics.median(t) for n, t in sorted(by_tokens.items())}
    print("by tokens (ms): " + ", ".join(f"{n}: {t:.1f}" for n, t in times.items()))
    knee = min(times)
    for n, t in times.items():  # up to the first doubling that added more (noise past it does not count)
        if n > knee and n == 2 * knee:
            added = t / times[knee] - 1
            print(f"  {knee} -> {n} tokens: +{100 * added:.0f}%")
            if added > args.doubling:
                break
            knee = n
    print(f"knee: {knee} tokens (each doubling up to it added <= {100 * args.doubling:.0f}%)")


if __name__ == "__main__":
    main()
