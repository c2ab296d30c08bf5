"""`tokenmill bench serve` against a real tokenmill server: exact prompt lengths, pinned output lengths, every
dataset, the sweep, --launch, and the files it writes."""
from __future__ import annotations

import json
import os
import random
import re

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


def test_long_prompts_mixed_into_chat(pool, tokenizer):
    """--long-prompt-share: that share of the requests, exactly, at seeded random positions, with the long lengths
    counted in the model's tokenizer; the rest are the short ones. Without it, the workload is as before."""
    def count(text):
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    mixed = datasets.random_sessions(pool, 24, 16, 0, 8, 0, seed=3, long_share=0.125, long_input_len=120,
                                     long_output_len=2)
    turns = [s.turns[0] for s in mixed]
    longs = [t for t in turns if t.tag == "long"]
    assert len(longs) == 3 and sum(t.tag == "short" for t in turns) == 21
    assert all(count(t.text) == t.input_len == 120 and t.output_len == 2 for t in longs)
    assert all(count(t.text) == t.input_len == 16 and t.output_len == 8 for t in turns if t.tag == "short")
    positions = [i for i, t in enumerate(turns) if t.tag == "long"]
    again = datasets.random_sessions(pool, 24, 16, 0, 8, 0, seed=3, long_share=0.125, long_input_len=120,
                                     long_output_len=2)
    assert [i for i, s in enumerate(again) if s.turns[0].tag == "long"] == positions  # seeded
    other = [[i for i, s in enumerate(datasets.random_sessions(pool, 24, 16, 0, 8, 0, seed=seed, long_share=0.125,
                                                               long_input_len=120, long_output_len=2))
              if s.turns[0].tag == "long"] for seed in (4, 5, 6)]
    assert any(p != positions for p in other) and positions != [0, 1, 2]  # drawn, not the first ones
    # a spread on the short prompts spreads the long ones as much relative to their mean
    spread = datasets.random_sessions(pool, 40, 20, 4, 8, 0, seed=1, long_share=0.5, long_input_len=200,
                                      long_output_len=2)
    long_lens = [s.turns[0].input_len for s in spread if s.turns[0].tag == "long"]
    assert len(long_lens) == 20 and len(set(long_lens)) > 5 and 140 < sum(long_lens) / 20 < 260
    plain = datasets.random_sessions(pool, 5, 16, 0, 8, 0, seed=3)
    assert all(s.turns[0].tag is None for s in plain)


@pytest.mark.parametrize("flags, message", [
    (["--goodput", "ttft:2000", "--slo", "ttft_p99_ms=2000"], "give one"),
    (["--goodput", "itl:50"], "bad --goodput term"),
    (["--long-prompt-share", "0.125", "--dataset", "sharegpt"], "not sharegpt"),
    (["--long-input-len", "1600"], "need --long-prompt-share"),
    (["--long-prompt-share", "1.5"], "in [0, 1)"),
    (["--request-rate", "0.5:6"], "START:STOP:STEP"),
    (["--concurrency", "1,2.5"], "whole"),
])
def test_refused_flags(flags, message, tmp_path):
    """Refused before any tokenizer loads or request is sent, naming the flag."""
    with pytest.raises(SystemExit, match=re.escape(message)):
        cli_main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--output-dir", str(tmp_path), *flags])


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


def test_goodput_rate_sweep_with_long_prompts(server, tmp_path, capsys):
    """--goodput over a --request-rate range with long prompts mixed in: every rate runs while 90% of requests are
    good and the goodput is the highest; a bound nothing meets stops after the first rate."""
    mixed = ["--base-url", server.url, "--dataset", "random", "--input-len", "16", "--output-len", "3",
             "--long-prompt-share", "0.25", "--long-input-len", "48", "--long-output-len", "2", "--num-prompts", "4"]
    result = run_bench(tmp_path / "all", *mixed, "--request-rate", "20:40:20", "--goodput", "ttft:600000",
                       "tpot:600000")
    assert result["concurrency_sweep"] == [20.0, 40.0] and result["goodput_request_rate"] == 40.0
    assert result["goodput"] == {"ttft": 600000.0, "tpot": 600000.0} and result["slo"] == {}
    assert result["dataset"]["long_prompt_share"] == 0.25 and result["dataset"]["long_input_len"] == 48
    for level in result["results"]:
        assert level["goodput_req_pct"] == 100.0 and level["meets_slo"]
        assert level["request_goodput"] > 0 and level["classes"] == ["long", "short"]
        assert level["long_completed"] == 1 and level["short_completed"] == 3
        assert level["mean_input_len"] == (48 + 3 * 16) / 4  # the server's own count
        assert level["long_ttft_ms"]["p99"] > 0 and level["short_itl_ms"]["p99"] > 0
    out = capsys.readouterr().out
    assert "goodput: 40 req/s (the highest rate with >= 90% of requests within --goodput" in out
    assert "SLO attained %" in out and "long TTFT p99" in out  # the table printed at the end

    stopped = run_bench(tmp_path / "stop", *mixed, "--request-rate", "20,40,60", "--goodput", "ttft:0.001")
    assert stopped["concurrency_sweep"] == [20.0] and len(stopped["results"]) == 1
    assert stopped["goodput_request_rate"] is None and stopped["results"][0]["goodput_req_pct"] == 0.0
    out = capsys.readouterr().out
    assert "rates [40.0, 60.0] not run" in out and "goodput: under 20 req/s" in out


@pytest.mark.slow  # --launch starts a server of its own
def test_launch_starts_and_stops_a_server(tmp_path, tiny_llama_dir):
    """The engine flags after --launch reach `tokenmill serve`: here the model too (the tiny random one, which
    starts in seconds), served under the name the bench then requests."""
    port = free_port()
    result = run_bench(tmp_path, "--launch", "--base-url", f"http://127.0.0.1:{port}", "--input-len", "8",
                       "--output-len", "3", "--num-prompts", "2", "--concurrency", "1", "--engine-name", "mine",
                       tiny_llama_dir, "--served-model-name", "tiny", *SERVER_ARGS)
    assert result["engine"] == "mine" and result["model"] == "tiny" and result["results"][0]["completed"] == 2
    with pytest.raises(Exception):
        import httpx
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
