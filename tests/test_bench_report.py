"""Bench report artifacts (JSON, CSV, PNG, self-contained HTML) and the shipped synthetic ShareGPT dataset."""
from __future__ import annotations

import csv
import json
import os
import re
import statistics

from tokenmill.bench.report import CSV_COLUMNS, format_comparison, format_table, goodput_summary, write_report

SLO = {"ttft_p99_ms": 2000.0, "itl_p50_ms": 100.0}


def _stats(base: float | None) -> dict:
    if base is None:
        return {k: None for k in ("mean", "p50", "p90", "p95", "p99")}
    return {"mean": base * 1.1, "p50": base, "p90": base * 1.8, "p95": base * 2.2, "p99": base * 3.0}


def _level(c: int, scale: float, ok: bool, empty: bool = False) -> dict:
    done = 0 if empty else 200
    return {"concurrency": c, "request_rate": None, "num_requests": 200, "completed": done,
            "errors": 200 - done, "duration_s": 60.0, "requests_per_s": done / 60.0,
            "output_tok_per_s": 0.0 if empty else 100.0 * c * scale, "total_tok_per_s": 0.0 if empty else 300.0 * c,
            "mean_input_len": 256.0, "mean_output_len": 128.0,
            "ttft_ms": _stats(None if empty else 100.0 * c), "itl_ms": _stats(None if empty else 20.0 * c),
            "tpot_ms": _stats(None if empty else 21.0 * c), "e2e_ms": _stats(None if empty else 3000.0 * c),
            "goodput_tok_per_s": 0.0 if empty else (90.0 * c * scale if ok else 10.0),
            "goodput_req_pct": 0.0 if empty else (95.0 if ok else 10.0), "meets_slo": ok, "client_cpu_pct": 2.5}


def _run(engine: str, scale: float) -> dict:
    # Levels 1 and 2 meet the SLO, 4 does not, 8 had no completed request at all.
    results = [_level(1, scale, True), _level(2, scale, True), _level(4, scale, False), _level(8, scale, False, True)]
    return {"harness": "tokenmill-bench", "harness_version": "0.1.0", "model": "SmolLM2-135M-Instruct",
            "precision": "bf16", "hardware": {"cpu": "Test CPU <x86>", "cores": 2, "memory_gib": 23.4, "gpu": None},
            "dataset": {"name": "random", "input_len": 256, "input_len_stddev": 0, "output_len": 128,
                        "output_len_stddev": 0, "num_prompts": 200},
            "slo": SLO, "engine": engine, "engine_version": "0.1.0", "base_url": "http://127.0.0.1:8000",
            "mode": "concurrency", "concurrency_sweep": [1, 2, 4, 8], "results": results,
            "results_at_knee": results[1]}


def test_write_report_compare(tmp_path):
    runs = [_run("a", 1.0), _run("b/v2", 1.5)]
    out = str(tmp_path / "report")
    written = write_report(out, runs)
    names = {"results.json", "results-a.json", "results-b_v2.json", "results.csv",
             "pareto.png", "ttft.png", "itl.png", "goodput.png", "report.html"}
    assert names <= set(written)
    for path in written.values():
        assert os.path.isfile(path) and os.path.dirname(path) == out

    with open(written["results.json"]) as f:
        doc = json.load(f)
    assert doc["harness"] == "tokenmill-bench" and doc["comparison"] == runs
    with open(written["results-a.json"]) as f:
        assert json.load(f) == runs[0]

    with open(written["results.csv"], newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == CSV_COLUMNS and "ttft_p99_ms" in rows[0]
    assert len(rows) == 1 + 8 and all(len(r) == len(CSV_COLUMNS) for r in rows)

    for name in ("pareto.png", "ttft.png", "itl.png", "goodput.png"):
        with open(written[name], "rb") as f:
            data = f.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000

    with open(written["report.html"], encoding="utf-8") as f:
        page = f.read()
    assert "<h2>a 0.1.0</h2>" in page and "b/v2" in page and "side by side" in page
    assert "class=knee" in page and "concurrency 2" in page
    assert page.count("data:image/png;base64,") == 4
    assert "Test CPU &lt;x86&gt;" in page  # escaped
    assert not re.search(r"""(src|href)\s*=\s*["']?https?://""", page)


def test_write_report_single_run_and_no_knee(tmp_path):
    run = _run("tokenmill", 1.0)
    run["results_at_knee"] = None
    written = write_report(str(tmp_path), [run])
    assert not any(n.startswith("results-") for n in written)
    with open(written["results.json"]) as f:
        assert json.load(f) == run
    with open(written["report.html"], encoding="utf-8") as f:
        page = f.read()
    assert "class=knee" not in page and "side by side" not in page


def test_text_tables():
    runs = [_run("a", 1.0), _run("b", 2.0)]
    table = format_table(runs[0])
    lines = table.splitlines()
    assert len(lines) == 2 + 4 and "TTFT p99" in lines[1]
    assert lines[3].startswith("*")  # the knee is level 2
    assert "\u2014" in lines[5]  # the level without completions
    comp = format_comparison(runs)
    assert "a TTFT p99" in comp and "b goodput tok/s" in comp
    assert "a: concurrency 2" in comp and "b: concurrency 2" in comp


def test_sharegpt_synthetic_dataset():
    path = os.path.join(os.path.dirname(__file__), "..", "tokenmill", "bench", "data", "sharegpt_synthetic.json")
    assert os.path.getsize(path) < 5 * 1024 * 1024
    with open(path) as f:
        data = json.load(f)
    assert len(data) >= 500
    assert len({c["id"] for c in data}) == len(data)
    human = []
    for conv in data:
        turns = conv["conversations"]
        assert turns and turns[0]["from"] == "human"
        assert all(t["from"] == ("human" if i % 2 == 0 else "gpt") for i, t in enumerate(turns))
        human += [len(t["value"].split()) for t in turns if t["from"] == "human"]
    assert 20 <= statistics.median(human) <= 120


def test_request_rate_mode(tmp_path):
    run = _run("a", 1.0)
    run["mode"], run["concurrency_sweep"] = "request_rate", [0.5, 1.5, 3.0, 6.0]
    for lv, rate in zip(run["results"], run["concurrency_sweep"]):
        lv["concurrency"], lv["request_rate"] = None, rate
    written = write_report(str(tmp_path), [run])
    assert "request rate (req/s)" in format_table(run) and "1.5" in format_table(run)
    with open(written["results.csv"], newline="") as f:
        assert [r["request_rate"] for r in csv.DictReader(f)] == ["0.5", "1.5", "3.0", "6.0"]


def test_goodput_rate_run(tmp_path):
    """A --request-rate run with --goodput and long prompts mixed in: goodput req/s and attainment per level, the
    classes' columns, and the run's goodput as one figure in the table, the CSV and the HTML."""
    run = _run("a", 1.0)
    run.update(mode="request_rate", concurrency_sweep=[0.5, 1.0, 1.5], slo={}, goodput={"ttft": 2000.0, "tpot": 60.0},
               goodput_from="--goodput", goodput_attainment_pct=90.0, goodput_request_rate=1.0)
    run["results"] = run["results"][:3]
    for lv, rate, pct in zip(run["results"], run["concurrency_sweep"], (100.0, 92.5, 71.0)):
        lv.update(concurrency=None, request_rate=rate, goodput_req_pct=pct, meets_slo=pct >= 90,
                  request_goodput=rate * pct / 100, classes=["long", "short"],
                  short_itl_ms=_stats(30.0 * rate), long_ttft_ms=_stats(900.0 * rate),
                  short_goodput_req_pct=pct, long_goodput_req_pct=pct - 20)
    run["results_at_knee"] = run["results"][1]
    assert goodput_summary(run) == "goodput: 1 req/s (the highest rate with >= 90% of requests within --goodput " \
                                   "ttft:2000 tpot:60)"
    table = format_table(run)
    header = table.splitlines()[1]
    assert "goodput req/s" in header and "SLO attained %" in header and "short ITL p99" in header \
        and "long TTFT p99" in header
    # rate 1: short ITL p99 90 ms, short attained 92.5%, long TTFT p99 2700 ms, long attained 72.5%
    assert table.splitlines()[3].split()[-4:] == ["90.0", "92.5", "2700.0", "72.5"]
    written = write_report(str(tmp_path), [run])
    with open(written["results.csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["short_itl_p99_ms"] for r in rows] == ["45.0", "90.0", "135.0"]
    assert rows[1]["long_ttft_p50_ms"] == "900.0" and rows[2]["request_goodput"] == str(1.5 * 0.71)
    with open(written["report.html"], encoding="utf-8") as f:
        page = f.read()
    assert "goodput: 1 req/s" in page and "ttft \u2264 2000 ms and tpot \u2264 60 ms (from --goodput)" in page

    run["goodput_request_rate"] = None
    assert goodput_summary(run).startswith("goodput: under 0.5 req/s (no rate tried had 90% of requests")
    assert goodput_summary(_run("b", 1.0)) is None  # concurrency mode: the knee, not a goodput rate
    assert "goodput" not in format_comparison([_run("b", 1.0), _run("c", 1.0)]).split("knee:")[1]
