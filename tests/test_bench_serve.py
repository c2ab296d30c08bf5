"""`tokenmill bench serve` against a real tokenmill server: exact prompt lengths, pinned output lengths, every
dataset, the sweep, --launch, and the files it writes."""
from __future__ import annotations

import json
import os
import random

import pytest

from helpers import API_KEY, MODEL, SERVER_ARGS, free_port
from tokenmill.bench import datasets
from tokenmill.cli import main as cli_main


@pytest.fixture(scope="module")
def pool(tokenizer):
    return datasets.WordPool(tokenizer)


def test_prompts_have_exact_lengths(pool, tokenizer):
    rng = random.Random(0)
    for n in (1, 7, 64, 300):
        assert len(tokenizer(pool.text(n, rng), add_special_tokens=False)["input_ids"]) == n
    sessions = datasets.prefix_sessions(pool, groups=2, per_group=3, prefix_len=40, suffix_len=8, output_len=4,
                                        seed=1)
    assert len(sessions) == 6
    texts = [s.turns[0].text for s in sessions]
    assert texts[0][:100] == texts[2][:100] != texts[1][:100]  # groups interleave
    assert all(len(tokenizer(t, add_special_tokens=False)["input_ids"]) == 48 for t in texts)


def test_sharegpt_dataset_loads(pool):
    sessions = datasets.sharegpt_sessions(pool, datasets.SHAREGPT_DEFAULT, 50, None, seed=0)
    assert len(sessions) == 50
    lens = [s.turns[0].input_len for s in sessions]
    assert min(lens) >= 4 and max(lens) <= 1024 and len(set(lens)) > 10  # realistic spread, not fixed


def run_bench(tmp_path, *args) -> dict:
    out = tmp_path / "out"
    rc = cli_main(["bench", "serve", "--output-dir", str(out), "--api-key", API_KEY, "--warmup", "1",
                   "--ignore-eos", *args])
    assert rc == 0
    with open(out / "results.json") as f:
        return json.load(f)


def test_concurrency_levels_on_a_real_server(server, tmp_path):
    result = run_bench(tmp_path, "--base-url", server.url, "--dataset", "random", "--input-len", "24",
                       "--output-len", "6", "--num-prompts", "4", "--concurrency", "1,2",
                       "--slo", "ttft_p99_ms=60000,itl_p50_ms=60000")
    assert result["engine"] == "tokenmill" and result["model"] == MODEL
    assert result["concurrency_sweep"] == [1, 2]
    for level in result["results"]:
        assert level["completed"] == 4 and level["errors"] == 0
        assert level["mean_input_len"] == 24  # the server's own count: the prompts are exact
        assert level["mean_output_len"] == 6
        assert level["ttft_ms"]["p50"] > 0 and level["itl_ms"]["p50"] > 0 and level["meets_slo"]
        assert 0 <= level["client_cpu_pct"] < 100
    assert result["results_at_knee"]["concurrency"] == 2
    out = tmp_path / "out"
    assert {"results.json", "results.csv", "report.html"} <= set(os.listdir(out))


def test_sweep_request_rate_and_multiturn(server, tmp_path):
    # An SLO every level meets: the sweep doubles from 1 up to the cap, and the knee is the last level.
    swept = run_bench(tmp_path / "sweep", "--base-url", server.url, "--input-len", "16", "--output-len", "4",
                      "--num-prompts", "4", "--concurrency", "1", "--sweep", "--max-concurrency", "4",
                      "--slo", "ttft_p99_ms=600000")
    assert swept["concurrency_sweep"] == [1, 2, 4] and swept["results_at_knee"]["concurrency"] == 4
    # An SLO nothing meets: past the knee and saturated (no goodput) at once, so the sweep stops there.
    missed = run_bench(tmp_path / "missed", "--base-url", server.url, "--input-len", "16", "--output-len", "4",
                       "--num-prompts", "4", "--concurrency", "1", "--sweep", "--slo", "ttft_p99_ms=0.001")
    assert missed["concurrency_sweep"] == [1] and missed["results_at_knee"] is None

    rated = run_bench(tmp_path / "rate", "--base-url", server.url, "--input-len", "16", "--output-len", "4",
                      "--num-prompts", "6", "--request-rate", "4", "--arrival", "constant")
    assert rated["mode"] == "request_rate" and rated["results"][0]["completed"] == 6
    assert rated["results"][0]["request_rate"] == 4.0

    turns = run_bench(tmp_path / "multi", "--base-url", server.url, "--dataset", "multiturn", "--turns", "2",
                      "--think-time", "0", "--input-len", "16", "--output-len", "4", "--num-prompts", "2",
                      "--concurrency", "2")
    level = turns["results"][0]
    assert level["completed"] == 4  # 2 sessions x 2 turns
    assert level["mean_input_len"] > 16  # second turns carry the first turn and its answer
    assert level["ttft_later_turns_ms"]["p50"] is not None and "ttft_other_replica_ms" not in level  # no router


@pytest.mark.slow  # --launch starts a server of its own
def test_launch_starts_and_stops_a_server(tmp_path):
    port = free_port()
    result = run_bench(tmp_path, "--launch", "--base-url", f"http://127.0.0.1:{port}", "--input-len", "8",
                       "--output-len", "3", "--num-prompts", "2", "--concurrency", "1", "--engine-name", "mine",
                       *SERVER_ARGS)
    assert result["engine"] == "mine" and result["results"][0]["completed"] == 2
    with pytest.raises(Exception):
        import httpx
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
