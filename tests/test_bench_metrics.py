"""The benchmark's metric math on synthetic timings: percentiles, per-request latencies, goodput, knee, sweep stop."""
from __future__ import annotations

import random

import numpy as np
import pytest

from tokenmill.bench.metrics import (RequestRecord, find_knee, level_metrics, parse_slo, percentile,
                                     request_meets_slo, sweep_should_stop)


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
    slo = parse_slo("ttft_p99_ms=1000,itl_p50_ms=100")
    assert request_meets_slo(stream(0, 0.9, [0.05, 0.05, 0.5]), slo)  # median gap 50 ms: one slow gap is fine
    assert not request_meets_slo(stream(0, 1.1, [0.05, 0.05]), slo)  # TTFT over
    assert not request_meets_slo(stream(0, 0.1, [0.2, 0.2, 0.05]), slo)  # median gap 200 ms
    failed = stream(0, 0.1, [0.05])
    failed.error = "HTTP 503"
    assert not request_meets_slo(failed, slo)


def test_level_metrics_on_known_timings():
    slo = parse_slo("ttft_p99_ms=1000,itl_p50_ms=100")
    good = [stream(i, 0.2, [0.05] * 9) for i in range(3)]  # 10 tokens each, within the SLO
    slow = stream(0, 2.0, [0.05] * 9)  # TTFT 2 s: counted in throughput, not in goodput
    broken = RequestRecord(start=0.0, error="HTTP 500")
    level = level_metrics(good + [slow, broken], duration_s=10.0, slo=slo, concurrency=4)
    assert level["num_requests"] == 5 and level["completed"] == 4 and level["errors"] == 1
    assert level["output_tok_per_s"] == pytest.approx(40 / 10)
    assert level["total_tok_per_s"] == pytest.approx((40 + 40) / 10)
    assert level["requests_per_s"] == pytest.approx(0.4)
    assert level["goodput_tok_per_s"] == pytest.approx(30 / 10)
    assert level["goodput_req_pct"] == pytest.approx(60.0)
    assert level["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert level["ttft_ms"]["p99"] == pytest.approx(float(np.percentile([200, 200, 200, 2000], 99)))
    assert level["itl_ms"]["p50"] == pytest.approx(50.0)
    assert level["tpot_ms"]["mean"] == pytest.approx(50.0)
    assert level["e2e_ms"]["p50"] == pytest.approx(650.0)
    assert level["mean_output_len"] == 10
    assert not level["meets_slo"]  # an error and a p99 TTFT over the limit

    clean = level_metrics(good, duration_s=5.0, slo=slo, concurrency=1)
    assert clean["meets_slo"] and clean["goodput_req_pct"] == 100.0
    empty = level_metrics([broken], duration_s=1.0, slo=slo, concurrency=1)
    assert empty["completed"] == 0 and empty["ttft_ms"]["p99"] is None and not empty["meets_slo"]


def test_later_turns_are_summarized_by_where_they_ran():
    """Multiturn behind a router: a later turn's TTFT, by whether it ran where its conversation's previous turn did
    (its KV in that pool) or on another replica (its KV from a shared store, or recomputed)."""
    first, same, other, unknown = (stream(0, t, [0.05] * 3) for t in (0.9, 0.1, 0.3, 0.5))
    same.turn, same.same_replica = 1, True
    other.turn, other.same_replica = 1, False
    unknown.turn = 2  # no router said where it ran
    level = level_metrics([first, same, other, unknown], duration_s=1.0, slo={}, concurrency=1)
    assert level["ttft_later_turns_ms"]["p50"] == pytest.approx(300.0)
    assert level["ttft_same_replica_ms"]["p50"] == pytest.approx(100.0)
    assert level["ttft_other_replica_ms"]["p50"] == pytest.approx(300.0)
    assert "ttft_later_turns_ms" not in level_metrics([first], duration_s=1.0, slo={}, concurrency=1)


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
