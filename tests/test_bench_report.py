"""Bench report artifacts (JSON, CSV, PNG, self-contained HTML) and the shipped synthetic ShareGPT dataset."""
from __future__ import annotations

import csv
import json
import os
import re
import statistics

from tokenmill.bench.report import CSV_COLUMNS, format_comparison, format_table, write_report

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
