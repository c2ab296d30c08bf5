"""The step bound's predictions against the steps it bounds, through the engine alone (no HTTP server, no client).

stall_free.sh measures ITL as a client sees it; this runs the same mixed workload (`tokenmill bench serve`'s random
dataset with --long-prompt-share 0.125: one request in 8 a long prompt of --long-len tokens with 32 out, the rest
--short-len in / 128 out) closed loop at --concurrency, straight into the engine (add_request / step), and records
for each step what the step-cost model predicted (once fitted) and what the step took. It tells the model's errors
apart from what the serving stack adds: if the steps here stay within the target while a served run's ITL p99 does
not, the difference is outside the engine's steps.

    .venv/bin/python benchmarks/step_fit.py [--dtype float32] [--requests 64] [--concurrency 8] [--json OUT]

Run it on a quiet machine."""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--short-len", type=int, default=240)
    parser.add_argument("--long-len", type=int, default=1500)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import tokenmill.engine.step_cost as step_cost
    from tokenmill import LLM, SamplingParams
    from tokenmill.bench.datasets import WordPool, random_sessions
    steps = []  # (prefill tokens, decode rows, seconds, predicted seconds or None, target or None)
    record = step_cost.StepCostModel.record

    def recording(self, prefill_tokens, prefill_pairs, decode_rows, decode_context, seconds):
        fitted = self.coef is not None
        predicted = self.predict(prefill_tokens, prefill_pairs, decode_rows, decode_context) if fitted else None
        target = None
        if fitted and decode_rows:
            target = self.target(self.predict(0, 0, decode_rows, decode_context), decode_rows, 1)
        steps.append((prefill_tokens, decode_rows, seconds, predicted, target))
        return record(self, prefill_tokens, prefill_pairs, decode_rows, decode_context, seconds)
    step_cost.StepCostModel.record = recording

    llm = LLM(dtype=args.dtype, max_model_len=2048, kv_cache_memory="256MiB")
    engine, tokenizer = llm.engine, llm.tokenizer
    sessions = random_sessions(WordPool(tokenizer), args.requests, args.short_len, 0, 128, 0, seed=0,
                               long_share=0.125, long_input_len=args.long_len, long_output_len=32)
    waiting = []
    for i, session in enumerate(sessions):
        turn = session.turns[0]
        prompt = tokenizer.encode(turn.text, add_special_tokens=False)
        waiting.append((f"r{i}", prompt, SamplingParams(temperature=0, ignore_eos=True, max_tokens=turn.output_len)))
    running, start = set(), time.perf_counter()
    while waiting or running:
        while waiting and len(running) < args.concurrency:
            rid, prompt, params = waiting.pop(0)
            engine.add_request(rid, prompt, params, None)
            running.add(rid)
        for out in engine.step():
            if out.finish_reason is not None:
                running.discard(out.request_id)
    elapsed = time.perf_counter() - start

    result = {"dtype": args.dtype, "requests": args.requests, "concurrency": args.concurrency,
              "steps": len(steps), "seconds": elapsed}
    fitted = [s for s in steps if s[3] is not None]
    unfitted = [s[2] for s in steps if s[3] is None and s[1]]  # steps with decodes before the fit
    if unfitted:
        result["with_decodes_before_the_fit"] = {"steps": len(unfitted),
                                                 "ms_p50": float(np.percentile(unfitted, 50) * 1e3),
                                                 "ms_p99": float(np.percentile(unfitted, 99) * 1e3)}
        before = result["with_decodes_before_the_fit"]
        print(f"before the fit: {len(unfitted)} steps with decodes, {before['ms_p50']:.1f} / {before['ms_p99']:.1f} ms "
              f"p50 / p99")
    for name, rows in (("mixed", [s for s in fitted if s[0] and s[1]]),
                       ("decode_only", [s for s in fitted if not s[0] and s[1]])):
        if not rows:
            continue
        took = np.array([s[2] for s in rows])
        ratio = took / np.array([s[3] for s in rows])
        result[name] = {"steps": len(rows), "ms_p50": float(np.percentile(took, 50) * 1e3),
                        "ms_p99": float(np.percentile(took, 99) * 1e3),
                        "actual_over_predicted_p50_p90_p99": [float(v) for v in np.percentile(ratio, [50, 90, 99])]}
        if name == "mixed":
            over = [s[2] / s[4] for s in rows if s[4]]
            result[name]["over_target_share"] = float(np.mean(np.array(over) > 1.0)) if over else None
        print(f"{name}: {len(rows)} steps after the fit, {result[name]['ms_p50']:.1f} / {result[name]['ms_p99']:.1f} "
              f"ms p50 / p99; actual / predicted p50, p90, p99: "
              f"{', '.join(f'{v:.2f}' for v in result[name]['actual_over_predicted_p50_p90_p99'])}")
    if "mixed" in result:
        print(f"mixed steps over their target: {100 * (result['mixed']['over_target_share'] or 0):.1f}%")
    print(f"{len(steps)} steps, {len(steps) - len(fitted)} before the fit, {elapsed:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
