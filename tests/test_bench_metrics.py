"""The benchmark's metric math on synthetic timings: percentiles, per-request latencies, goodput (--slo's and
vLLM's --goodput), SLO attainment, per-class metrics, knee, sweep stops, and the level lists of --request-rate."""
from __future__ import annotations

import random

import numpy as np
import pytest

from tokenmill.bench.loadgen import parse_levels
from tokenmill.bench.metrics import (Objective, RequestRecord, find_knee, goodput_rate, level_metrics, parse_goodput,
                                     parse_slo, percentile, rate_sweep_should_stop, request_is_good,
                                     sweep_should_stop)


def test_percentile_matches_numpy():
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101, 1000):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for p in (0, 50, 90, 95, 99, 100):
            assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0], 50) == 1.5


def stream(start: float, ttft: float, gaps: list[float]) -> RequestRecord:
    times = [start + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(start=start, token_times=times, end=times[-1], input_tokens=10,
                         output_tokens=len(times))


def test_request_latencies():
    r = stream(1.0, 0.5, [0.1, 0.2, 0.3])
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx(0.6 / 3)
    single = stream(0.0, 0.2, [])
    assert single.tpot is None and single.itls == []


def test_parse_slo():
    assert parse_slo("ttft_p99_ms=2000,itl_p50_ms=100") == {"ttft_p99_ms": 2000.0, "itl_p50_ms": 100.0}
    assert parse_slo("e2e_p95_ms=5000") == {"e2e_p95_ms": 5000.0}
    assert parse_slo("") == {}
    for bad in ("ttft=2", "latency_p99_ms=1", "ttft_p99_ms", "itl_p50=3"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_request_goodput_uses_its_own_latencies():
    bounds = Objective.from_slo(parse_slo("ttft_p99_ms=1000,itl_p50_ms=100")).bounds
    assert bounds == {"ttft": 1000.0, "itl_p50": 100.0}
    assert request_is_good(stream(0, 0.9, [0.05, 0.05, 0.5]), bounds)  # median gap 50 ms: one slow gap is fine
    assert not request_is_good(stream(0, 1.1, [0.05, 0.05]), bounds)  # TTFT over
    assert not request_is_good(stream(0, 0.1, [0.2, 0.2, 0.05]), bounds)  # median gap 200 ms
    failed = stream(0, 0.1, [0.05])
    failed.error = "HTTP 503"
    assert not request_is_good(failed, bounds)


def test_level_metrics_on_known_timings():
    slo = parse_slo("ttft_p99_ms=1000,itl_p50_ms=100")
    good = [stream(i, 0.2, [0.05] * 9) for i in range(3)]  # 10 tokens each, within the SLO
    slow = stream(0, 2.0, [0.05] * 9)  # TTFT 2 s: counted in throughput, not in goodput
    broken = RequestRecord(start=0.0, error="HTTP 500")
    level = level_metrics(good + [slow, broken], duration_s=10.0, objective=Objective.from_slo(slo), concurrency=4)
    assert level["num_requests"] == 5 and level["completed"] == 4 and level["errors"] == 1
    assert level["output_tok_per_s"] == pytest.approx(40 / 10)
    assert level["total_tok_per_s"] == pytest.approx((40 + 40) / 10)
    assert level["requests_per_s"] == pytest.approx(0.4)
    assert level["goodput_tok_per_s"] == pytest.approx(30 / 10)
    assert level["goodput_req_pct"] == pytest.approx(60.0)
    assert level["request_goodput"] == pytest.approx(3 / 10)
    assert level["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert level["ttft_ms"]["p99"] == pytest.approx(float(np.percentile([200, 200, 200, 2000], 99)))
    assert level["itl_ms"]["p50"] == pytest.approx(50.0)
    assert level["tpot_ms"]["mean"] == pytest.approx(50.0)
    assert level["e2e_ms"]["p50"] == pytest.approx(650.0)
    assert level["mean_output_len"] == 10
    assert not level["meets_slo"]  # an error and a p99 TTFT over the limit

    clean = level_metrics(good, duration_s=5.0, objective=Objective.from_slo(slo), concurrency=1)
    assert clean["meets_slo"] and clean["goodput_req_pct"] == 100.0
    empty = level_metrics([broken], duration_s=1.0, objective=Objective.from_slo(slo), concurrency=1)
    assert empty["completed"] == 0 and empty["ttft_ms"]["p99"] is None and not empty["meets_slo"]


def test_later_turns_are_summarized_by_where_they_ran():
    """Multiturn behind a router: a later turn's TTFT, by whether it ran where its conversation's previous turn did
    (its KV in that pool) or on another replica (its KV from a shared store, or recomputed)."""
    first, same, other, unknown = (stream(0, t, [0.05] * 3) for t in (0.9, 0.1, 0.3, 0.5))
    same.turn, same.same_replica = 1, True
    other.turn, other.same_replica = 1, False
    unknown.turn = 2  # no router said where it ran
    level = level_metrics([first, same, other, unknown], duration_s=1.0, objective=Objective({}), concurrency=1)
    assert level["ttft_later_turns_ms"]["p50"] == pytest.approx(300.0)
    assert level["ttft_same_replica_ms"]["p50"] == pytest.approx(100.0)
    assert level["ttft_other_replica_ms"]["p50"] == pytest.approx(300.0)
    assert "ttft_later_turns_ms" not in level_metrics([first], duration_s=1.0, objective=Objective({}),
                                                      concurrency=1)


def fake_level(c: int, meets: bool, ttft_p99: float, tput: float, goodput: float) -> dict:
    return {"concurrency": c, "meets_slo": meets, "ttft_ms": {"p99": ttft_p99}, "output_tok_per_s": tput,
            "goodput_tok_per_s": goodput, "completed": 10}


def test_knee_is_the_last_level_meeting_the_slo():
    levels = [fake_level(1, True, 100, 10, 10), fake_level(2, True, 120, 19, 19),
              fake_level(4, True, 150, 35, 35), fake_level(8, False, 900, 50, 20)]
    assert find_knee(levels)["concurrency"] == 4
    assert find_knee([fake_level(1, False, 3000, 5, 0)]) is None
    # a level that recovers after a miss (noise) is still the last one meeting it
    assert find_knee(levels + [fake_level(16, True, 400, 60, 60)])["concurrency"] == 16


def test_sweep_stops_only_past_the_knee_once_saturated():
    base = fake_level(1, True, 100, 10, 10)
    assert not sweep_should_stop([base, fake_level(2, True, 250, 19, 19)])  # doubled, but still within SLO
    assert not sweep_should_stop([base, fake_level(2, False, 150, 19, 15)])  # missed, not saturated
    assert sweep_should_stop([base, fake_level(2, False, 210, 19, 15)])  # missed and TTFT doubled
    assert sweep_should_stop([base, fake_level(2, False, 150, 19, 5)])  # missed and goodput < 50%


def test_parse_goodput_takes_vllms_terms():
    assert parse_goodput(["ttft:2000", "tpot:60"]) == {"ttft": 2000.0, "tpot": 60.0}
    assert parse_goodput(["e2el:5000.5"]) == {"e2el": 5000.5}
    assert parse_goodput(None) == {}
    for bad in (["ttft=2000"], ["itl:50"], ["e2e:100"], ["tpot:-1"], ["ttft:fast"], ["ttft:inf"],
                ["ttft:1", "ttft:2"]):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput(bad)


def test_tpot_is_vllms_per_request_definition():
    """(e2e - ttft) / (output tokens - 1), with the server's token count, not the chunks seen."""
    r = stream(2.0, 0.4, [0.1, 0.1, 0.4])  # 4 chunks, but the server says 11 tokens (several per chunk)
    r.output_tokens = 11
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / 10) == pytest.approx(0.06)
    assert request_is_good(r, {"tpot": 60.001}) and not request_is_good(r, {"tpot": 59.9})
    assert request_is_good(stream(0, 0.1, []), {"tpot": 0.0})  # one token: no TPOT to miss, as vLLM's 0


def test_goodput_bounds_every_given_term_and_only_those():
    r = stream(0, 0.5, [0.0625] * 8)  # TTFT 500 ms, TPOT 62.5 ms, E2E 1000 ms (exact in binary)
    assert request_is_good(r, parse_goodput(["ttft:500", "tpot:62.5", "e2el:1000"]))
    assert not request_is_good(r, parse_goodput(["ttft:499"]))
    assert not request_is_good(r, parse_goodput(["tpot:62"]))
    assert not request_is_good(r, parse_goodput(["e2el:999"]))
    assert request_is_good(r, parse_goodput(["e2el:1000"]))  # only the given terms count
    # --slo's terms bound each request too, the tighter one where two name the same latency
    assert Objective.from_slo(parse_slo("ttft_p99_ms=2000,ttft_p50_ms=500,e2e_p90_ms=900,tpot_p50_ms=70")).bounds \
        == {"ttft": 500.0, "e2el": 900.0, "tpot": 70.0}


def test_goodput_level_meets_the_slo_at_90_percent_attainment():
    objective = Objective.from_goodput(parse_goodput(["ttft:1000", "tpot:100"]))
    good = [stream(i, 0.2, [0.05] * 4) for i in range(9)]
    slow = stream(0, 1.5, [0.05] * 4)
    level = level_metrics(good + [slow], duration_s=4.0, objective=objective, request_rate=2.0)
    assert level["goodput_req_pct"] == pytest.approx(90.0) and level["meets_slo"]
    assert level["request_goodput"] == pytest.approx(9 / 4)  # vLLM's request_goodput: good requests per second
    assert level["goodput_tok_per_s"] == pytest.approx(9 * 5 / 4)
    level = level_metrics(good[:8] + [slow, slow], duration_s=4.0, objective=objective, request_rate=2.0)
    assert level["goodput_req_pct"] == pytest.approx(80.0) and not level["meets_slo"]
    # a failed request counts against the attainment: 9 good of 10 sent, and one error, still meets it
    broken = RequestRecord(start=0.0, error="HTTP 500")
    level = level_metrics(good + [broken], duration_s=4.0, objective=objective, request_rate=2.0)
    assert level["errors"] == 1 and level["meets_slo"]
    # the percentile SLO plays no part: a TTFT p99 of 1.5 s would miss ttft_p99_ms=1000
    assert objective.slo == {} and objective.attainment_pct == 90.0


def test_each_request_class_is_summarized_apart():
    shorts = [stream(i, 0.1, [0.02] * 5) for i in range(6)]
    shorts[0] = stream(0, 0.1, [0.02, 0.3, 0.02])  # a decode stalled behind a long prefill
    longs = [stream(i, 1.2, [0.02]) for i in range(2)]
    for r in shorts:
        r.tag = "short"
    for r in longs:
        r.tag = "long"
    objective = Objective.from_goodput({"ttft": 1000.0})
    level = level_metrics(shorts + longs, duration_s=2.0, objective=objective, request_rate=4.0)
    assert level["classes"] == ["long", "short"]
    assert level["short_completed"] == 6 and level["long_completed"] == 2
    short_gaps = [g for r in shorts for g in r.itls]
    assert level["short_itl_ms"]["p99"] == pytest.approx(float(np.percentile(short_gaps, 99)) * 1000)
    assert level["long_ttft_ms"]["p99"] == pytest.approx(1200.0)
    assert level["short_goodput_req_pct"] == 100.0 and level["long_goodput_req_pct"] == 0.0
    assert level["goodput_req_pct"] == pytest.approx(75.0)
    untagged = [stream(0, 0.1, [0.02])]
    assert "classes" not in level_metrics(untagged, duration_s=1.0, objective=objective)


def rate_level(rate: float, pct: float, meets: bool) -> dict:
    return {"request_rate": rate, "concurrency": None, "goodput_req_pct": pct, "meets_slo": meets}


def test_rate_sweep_stops_after_the_first_rate_under_90_percent():
    goodput = Objective.from_goodput({"ttft": 2000.0, "tpot": 60.0})
    assert not rate_sweep_should_stop(rate_level(1.0, 95.0, True), goodput)
    assert rate_sweep_should_stop(rate_level(1.5, 71.0, False), goodput)
    # --slo keeps running every level asked for
    assert not rate_sweep_should_stop(rate_level(1.5, 71.0, False), Objective.from_slo(parse_slo("ttft_p99_ms=1")))
    levels = [rate_level(0.5, 100.0, True), rate_level(1.0, 92.0, True), rate_level(1.5, 71.0, False)]
    assert goodput_rate(levels) == 1.0
    assert goodput_rate([rate_level(0.5, 40.0, False)]) is None
    assert goodput_rate([rate_level(2.0, 95.0, True), rate_level(1.0, 99.0, True)]) == 2.0  # the highest, not last


def test_request_rate_levels_and_ranges():
    assert parse_levels("0.5:6:0.5,7,8", float, "--request-rate") == [0.5 * i for i in range(1, 13)] + [7.0, 8.0]
    assert parse_levels("0.1:0.3:0.1", float, "--request-rate") == [0.1, 0.2, 0.3]  # decimal steps, no drift
    assert parse_levels("1,4,8", int, "--concurrency") == [1, 4, 8]
    assert parse_levels("1:4:1", int, "--concurrency") == [1, 2, 3, 4]
    assert parse_levels("1:2:0.4", float, "--request-rate") == [1.0, 1.4, 1.8]  # stops at or before STOP
    for bad in ("0", "-1", "fast", "1:2", "2:1:0.5", "1:2:0", "nan", "inf", "1,,2"):
        with pytest.raises(ValueError, match="--request-rate"):
            parse_levels(bad, float, "--request-rate")
    with pytest.raises(ValueError, match="whole"):
        parse_levels("1.5", int, "--concurrency")
