"""Start-up, exec to ready, of tokenmill and the peers, in turns on one machine: the phases of tokenmill's start
read from its own log lines, and for every server the seconds to /health 200 (/v1/models 200 for a server without
/health: llama-cpp-python's) and to the first token.

Each round starts every named server once, one at a time (never two at once: they would share the 2 cores), in
an order rotated every round, and stops it with SIGTERM before the next starts. A server's phases are the
timestamps of the log lines below, counted from the exec (both clocks are the wall clock, millisecond log
stamps). Prints one row per server with the median over rounds and writes startup.json.

Usage: .venv/bin/python benchmarks/startup.py OUT_DIR [--rounds 5] NAME='command' [NAME='command' ...]
    .venv/bin/python benchmarks/startup.py benchmarks/runs/startup \\
        tokenmill='.venv/bin/tokenmill serve --port 8000' \\
        vllm='PORT=8100 bash ../shared/peers/serve_vllm.sh' \\
        llamacpp='PORT=8101 bash ../shared/peers/serve_llamacpp.sh'
The port is read from the command (--port N or PORT=N)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import httpx

from tokenmill.bench.env_probe import cpuinfo

# tokenmill's log lines that close a phase, in the order they come
PHASES = [
    ("api_server_up", "Started server process"),  # the port is bound and answers /health/live
    ("engine_process_up", "tokenmill.engine.core_proc: using"),  # spawned, its first imports done
    ("kernels_loaded", "tokenmill.kernels: CPU kernels"),  # torch, transformers, the checkpoint's config
    ("weights_loaded", "tokenmill.loader: weights"),
    ("kv_pool_allocated", "tokenmill.runner: KV cache"),
    ("engine_ready", "tokenmill.server: engine ready"),
]
STAMP = re.compile(r"^\w+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def port_of(command: str) -> int:
    m = re.search(r"--port[ =](\d+)", command) or re.search(r"\bPORT=(\d+)", command)
    if not m:
        raise SystemExit(f"no --port N or PORT=N in {command!r}")
    return int(m.group(1))


def phases(log: str, t0: float) -> dict[str, float]:
    found = {}
    for line in log.splitlines():
        m = STAMP.match(line)
        if not m:
            continue
        for name, marker in PHASES:
            if name not in found and marker in line:
                stamp = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                found[name] = round(stamp - t0, 3)
    return found


def first_token(base: str) -> None:
    """One token, not streamed: the same first-token time, and llama-cpp-python's server cuts a stream of one
    token without ending its chunked body."""
    model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    httpx.post(f"{base}/v1/completions", json=body, timeout=120).raise_for_status()


def one_start(name: str, command: str, out_dir: str, round_no: int, timeout: float) -> dict:
    port = port_of(command)
    base = f"http://127.0.0.1:{port}"
    log_path = os.path.join(out_dir, f"{name}-{round_no}.log")
    with open(log_path, "w") as log:
        t0 = time.time()
        proc = subprocess.Popen(["bash", "-c", command], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "TOKENMILL_NO_PROGRESS": "1"})
        row: dict = {"round": round_no}
        try:
            while time.time() - t0 < timeout:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; see {log_path}")
                try:
                    status = httpx.get(f"{base}/health", timeout=2).status_code
                    if status == 404:  # llama-cpp-python's server has no /health: ready when it lists its model
                        status = httpx.get(f"{base}/v1/models", timeout=2).status_code
                        row["ready_path"] = "/v1/models"
                    if status == 200:
                        row["health_200_s"] = round(time.time() - t0, 3)
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)  # a probe every 0.1 s: faster polling steals a core from the start it times
            else:
                raise RuntimeError(f"{name} not ready within {timeout:.0f} s")
            try:
                first_token(base)
                row["first_token_s"] = round(time.time() - t0, 3)
            except httpx.HTTPError as e:  # recorded: a peer's failed request does not void its start-up time
                row["first_token_error"] = repr(e)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            row["exit_code"] = proc.returncode
    with open(log_path) as f:
        row["phases"] = phases(f.read(), t0)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("servers", nargs="+", help="NAME='command'")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    servers = [s.split("=", 1) for s in args.servers]
    os.makedirs(args.out_dir, exist_ok=True)
    runs: dict[str, list[dict]] = {name: [] for name, _ in servers}
    for r in range(args.rounds):
        k = r % len(servers)
        for name, command in servers[k:] + servers[:k]:
            row = one_start(name, command, args.out_dir, r, args.timeout)
            runs[name].append(row)
            print(name, json.dumps(row), flush=True)
    summary = {}
    for name, rows in runs.items():
        keys = {k for row in rows for k in row["phases"]}
        summary[name] = {
            "health_200_s": statistics.median(row["health_200_s"] for row in rows),
            "first_token_s": (statistics.median(row["first_token_s"] for row in rows)
                              if all("first_token_s" in row for row in rows) else None),
            "phases": {k: statistics.median(row["phases"][k] for row in rows if k in row["phases"])
                       for k, _ in PHASES if k in keys},
            "exit_codes": sorted({row["exit_code"] for row in rows}),
        }
    first = servers[0][0]
    print(f"\nmedian of {args.rounds} starts, seconds from exec:")
    print(f"{'server':<12} {'/health 200':>12} {'first token':>12} {'vs ' + first:>10}")
    for name, s in summary.items():
        ratio = s["health_200_s"] / summary[first]["health_200_s"]
        print(f"{name:<12} {s['health_200_s']:>12.2f} {s['first_token_s'] or float('nan'):>12.2f} {ratio:>9.1f}x")
    for name, s in summary.items():
        if s["phases"]:
            print(f"{name} phases: " + ", ".join(f"{k} {v:.2f}" for k, v in s["phases"].items()))
    with open(os.path.join(args.out_dir, "startup.json"), "w") as f:
        json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), **provenance(),
                   "servers": dict(servers), "rounds": args.rounds, "summary": summary, "runs": runs}, f, indent=1)


def provenance() -> dict:
    """What a results table records beside the figures: the CPU (name, family/model, the flags the kernels dispatch
    on) and the commit."""
    info = cpuinfo()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    return {"cpu": info.get("model name", "unknown"), "cpu_family": info.get("cpu family"),
            "cpu_model": info.get("model"), "cpu_flags": [f for f in wanted if f in info.get("flags", "").split()],
            "commit": commit}


if __name__ == "__main__":
    sys.exit(main())
