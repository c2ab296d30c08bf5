"""Sleep and wake of a real server: the seconds `POST /wake_up` takes after `POST /sleep?level=1` and `level=2`
(median over rounds), the engine process's RSS awake and at each level, and the first token after each wake,
checked against the greedy text served before any sleep.

Usage: .venv/bin/python benchmarks/sleep_wake.py OUT_DIR [--rounds 5] [--port 8000] [serve flags...]
    .venv/bin/python benchmarks/sleep_wake.py benchmarks/runs/sleep-wake --rounds 5
Starts `tokenmill serve --enable-sleep-mode` with VLLM_SERVER_DEV_MODE=1 (vLLM's dev endpoints) and stops it
at the end. Writes sleep_wake.json."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
import psutil

from startup import provenance

PROMPT = "The capital of France is"


def completion(base: str, model: str) -> tuple[str, float]:
    """The greedy text of 16 tokens and the seconds to its first streamed token."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 16, "stream": True, "temperature": 0}
    t0, first, text = time.perf_counter(), None, ""
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                first = first or time.perf_counter() - t0
                text += json.loads(line[6:])["choices"][0]["text"]
    return text, first


def engine_rss_mib(server: psutil.Process) -> float:
    """The RSS of the largest descendant (the engine process)."""
    return max(p.memory_info().rss for p in server.children(recursive=True)) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--port", type=int, default=8000)
    args, serve_flags = parser.parse_known_args()  # the rest goes to tokenmill serve
    os.makedirs(args.out_dir, exist_ok=True)
    base = f"http://127.0.0.1:{args.port}"
    command = [os.path.join(os.path.dirname(sys.executable), "tokenmill"), "serve", "--port", str(args.port),
               "--enable-sleep-mode", *serve_flags]
    log = open(os.path.join(args.out_dir, "server.log"), "w")  # noqa: SIM115 - for the server's life
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "VLLM_SERVER_DEV_MODE": "1", "TOKENMILL_NO_PROGRESS": "1"})
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        else:
            raise SystemExit("the server did not start; see server.log")
        server = psutil.Process(proc.pid)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        reference, ttft_awake = completion(base, model)
        completion(base, model)  # warm
        rows = []
        for level in (1, 2):
            for r in range(args.rounds):
                awake = engine_rss_mib(server)
                httpx.post(f"{base}/sleep", params={"level": level}, timeout=120).raise_for_status()
                time.sleep(0.5)  # the engine's malloc_trim and the kernel's page release
                asleep = engine_rss_mib(server)
                t0 = time.perf_counter()
                httpx.post(f"{base}/wake_up", timeout=120).raise_for_status()
                wake_s = time.perf_counter() - t0
                text, ttft = completion(base, model)
                row = {"level": level, "round": r, "wake_s": round(wake_s, 3), "ttft_after_wake_s": round(ttft, 3),
                       "rss_awake_mib": round(awake), "rss_asleep_mib": round(asleep), "same_text": text == reference}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    summary = {}
    for level in (1, 2):
        mine = [row for row in rows if row["level"] == level]
        summary[f"level_{level}"] = {k: statistics.median(row[k] for row in mine)
                                     for k in ("wake_s", "ttft_after_wake_s", "rss_awake_mib", "rss_asleep_mib")}
        summary[f"level_{level}"]["all_same_text"] = all(row["same_text"] for row in mine)
    summary["ttft_awake_s"] = round(ttft_awake, 3)
    print(f"\nmedian of {args.rounds} rounds per level:")
    for level in (1, 2):
        s = summary[f"level_{level}"]
        print(f"level {level}: wake_up {s['wake_s']:.3f} s, then first token {s['ttft_after_wake_s']:.3f} s; "
              f"engine RSS {s['rss_awake_mib']:.0f} MiB awake, {s['rss_asleep_mib']:.0f} MiB asleep; "
              f"same greedy text: {s['all_same_text']}")
    with open(os.path.join(args.out_dir, "sleep_wake.json"), "w") as f:
        json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), **provenance(),
                   "command": " ".join(command), "rounds": args.rounds, "summary": summary, "runs": rows}, f,
                  indent=1)


if __name__ == "__main__":
    sys.exit(main())
