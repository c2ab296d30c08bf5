"""The numbers of one benchmark level, from per-request timestamps: latency percentiles, throughput, goodput
under an SLO, and the knee of a sweep. Pure functions over plain data, so they are tested on synthetic timings."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 95, 99)
SLO_METRICS = ("ttft", "itl", "tpot", "e2e")  # --slo's terms
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # vLLM's --goodput names
GOOD_ATTAINMENT_PCT = 90.0  # DistServe: a rate is sustained when at least 90% of its requests are good


@dataclass
class RequestRecord:
    """One request as the client saw it; times are time.perf_counter() seconds."""
    start: float
    token_times: list[float] = field(default_factory=list)  # arrival of every streamed chunk with text
    end: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0  # the server's usage count when it sends one, else the chunks seen
    error: str | None = None
    turn: int = 0  # its index in a multiturn conversation
    replica: str | None = None  # the replica that served it, when a router says (x-tokenmill-replica)
    same_replica: bool | None = None  # a later turn: on its previous turn's replica (None: no router said)
    tag: str | None = None  # its class in a mixed workload ('short' or 'long' with --long-prompt-share)

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.start

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for a single-token answer."""
        if self.output_tokens < 2:
            return None
        return (self.end - self.token_times[0]) / (self.output_tokens - 1)


def percentile(values: list[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), so p50 of [1, 2] is 1.5."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values_s: list[float]) -> dict[str, float | None]:
    """Mean and percentiles, converted from seconds to milliseconds."""
    ms = [v * 1000 for v in values_s]
    out: dict[str, float | None] = {"mean": sum(ms) / len(ms) if ms else None}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(ms, p)
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft_p99_ms=2000,itl_p50_ms=100' → {'ttft_p99_ms': 2000.0, 'itl_p50_ms': 100.0}."""
    slo: dict[str, float] = {}
    for part in filter(None, (text or "").split(",")):
        key, sep, value = part.partition("=")
        key = key.strip()
        match = re.fullmatch(r"(\w+?)_p(\d+(?:\.\d+)?)_ms", key)
        if not sep or not match or match.group(1) not in SLO_METRICS:
            raise ValueError(f"bad SLO term {part!r}: expected <{'|'.join(SLO_METRICS)}>_p<N>_ms=<milliseconds>")
        slo[key] = float(value)
    return slo


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """vLLM's --goodput: ['ttft:2000', 'tpot:60'] → {'ttft': 2000.0, 'tpot': 60.0}, milliseconds per request."""
    bounds: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            limit = float(value)
        except ValueError:
            limit = math.nan
        if not sep or name not in GOODPUT_METRICS or not math.isfinite(limit) or limit < 0:
            raise ValueError(f"bad --goodput term {pair!r}: expected <{'|'.join(GOODPUT_METRICS)}>:<milliseconds>, "
                             "a non-negative number")
        if name in bounds:
            raise ValueError(f"--goodput gives {name} twice")
        bounds[name] = limit
    return bounds


def _slo_terms(slo: dict[str, float]):
    for key, limit_ms in slo.items():
        metric, p = re.fullmatch(r"(\w+?)_p(\d+(?:\.\d+)?)_ms", key).groups()
        yield key, metric, float(p), limit_ms


@dataclass(frozen=True)
class Objective:
    """What requests and levels are judged by; one rule for each.

    A request is good when it is within every per-request bound (ms): its own TTFT, TPOT ((e2e - ttft) /
    (output tokens - 1), vLLM's), E2E latency, and, for bounds that come from --slo's ITL terms, that percentile of
    its own inter-token gaps: DistServe's per-request goodput, vLLM's `request_goodput`. The bounds are --goodput's
    when it is given, else those --slo implies (each term's limit applied to the request's own latency).

    A level meets the objective either by --slo's percentile terms over the whole level (p99 of every request's
    TTFT, p50 of all gaps pooled, ...; no failed request), or, with --goodput, by DistServe's attainment: at least
    90% of its requests good."""
    bounds: dict[str, float]
    slo: dict[str, float] = field(default_factory=dict)  # the level's percentile terms (empty with --goodput)
    attainment_pct: float | None = None  # with --goodput: the share of good requests a level needs

    @classmethod
    def from_slo(cls, slo: dict[str, float]) -> "Objective":
        bounds: dict[str, float] = {}
        for _, metric, p, limit_ms in _slo_terms(slo):
            key = f"itl_p{p:g}" if metric == "itl" else "e2el" if metric == "e2e" else metric
            bounds[key] = min(limit_ms, bounds.get(key, math.inf))  # two terms on one latency: the tighter holds
        return cls(bounds, dict(slo))

    @classmethod
    def from_goodput(cls, bounds: dict[str, float]) -> "Objective":
        return cls(dict(bounds), {}, GOOD_ATTAINMENT_PCT)


def request_is_good(r: RequestRecord, bounds: dict[str, float]) -> bool:
    """Within every per-request bound (Objective's rule). A failed request is not good; a one-token answer has
    no TPOT, which no bound can miss (vLLM counts it as 0)."""
    if not r.ok:
        return False
    for key, limit_ms in bounds.items():
        if key.startswith("itl_p"):
            value = percentile(r.itls, float(key[5:]))
        else:
            value = getattr(r, "e2e" if key == "e2el" else key)
        if value is not None and value * 1000 > limit_ms:
            return False
    return True


def level_meets_slo(level: dict, slo: dict[str, float]) -> bool:
    """A level meets the SLO when every term holds over the whole level: p99 TTFT of all requests, p50 of all
    inter-token gaps pooled, and so on. A level with failed requests does not."""
    if level["errors"] or not level["completed"]:
        return False
    for key, metric, p, limit_ms in _slo_terms(slo):
        value = level[f"{metric}_ms"].get(f"p{p:g}")
        if value is None or value > limit_ms:
            return False
    return True


def _request_metrics(records: list[RequestRecord], duration_s: float, bounds: dict[str, float]) -> dict:
    """The counts, latencies and goodput of a set of requests (a level, or one class of its requests)."""
    done = [r for r in records if r.ok]
    good = [r for r in done if request_is_good(r, bounds)]
    return {
        "num_requests": len(records), "completed": len(done), "errors": len(records) - len(done),
        "ttft_ms": summarize([r.ttft for r in done]),
        "itl_ms": summarize([gap for r in done for gap in r.itls]),
        "tpot_ms": summarize([t for r in done if (t := r.tpot) is not None]),
        "e2e_ms": summarize([r.e2e for r in done]),
        # DistServe's goodput: the good requests per second (vLLM's request_goodput), their output tokens per
        # second, and the SLO attainment, the share of all requests (failed ones included) that were good.
        "request_goodput": len(good) / duration_s if duration_s else 0.0,
        "goodput_tok_per_s": sum(r.output_tokens for r in good) / duration_s if duration_s else 0.0,
        "goodput_req_pct": 100.0 * len(good) / len(records) if records else 0.0,
    }


def level_metrics(records: list[RequestRecord], duration_s: float, objective: Objective,
                  concurrency: int | None = None, request_rate: float | None = None) -> dict:
    """Everything reported for one level; throughput counts only completed requests over the level's wall time.
    Requests of a tagged workload (a dataset that mixes long prompts into chat) are also summarized per class,
    under '<class>_' keys: what a long prompt does to the short requests' ITL shows there."""
    done = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.input_tokens for r in done)
    level = {"concurrency": concurrency, "request_rate": request_rate,
             **_request_metrics(records, duration_s, objective.bounds),
             "duration_s": duration_s,
             "requests_per_s": len(done) / duration_s if duration_s else 0.0,
             "output_tok_per_s": out_tokens / duration_s if duration_s else 0.0,
             "total_tok_per_s": (in_tokens + out_tokens) / duration_s if duration_s else 0.0,
             "mean_input_len": in_tokens / len(done) if done else None,
             "mean_output_len": out_tokens / len(done) if done else None}
    tags = sorted({r.tag for r in records if r.tag})
    if tags:
        level["classes"] = tags
        for tag in tags:
            mine = [r for r in records if r.tag == tag]
            level.update({f"{tag}_{k}": v for k, v in _request_metrics(mine, duration_s, objective.bounds).items()})
    later = [r for r in done if r.turn > 0]
    if later:  # multiturn: the turns that may find their conversation's KV (in the pool, a tier, another replica)
        level["ttft_later_turns_ms"] = summarize([r.ttft for r in later])
        for key, same in (("ttft_same_replica_ms", True), ("ttft_other_replica_ms", False)):
            placed = [r.ttft for r in later if r.same_replica is same]
            if placed:
                level[key] = summarize(placed)
    if objective.attainment_pct is not None:
        level["meets_slo"] = bool(done) and level["goodput_req_pct"] >= objective.attainment_pct
    else:
        level["meets_slo"] = level_meets_slo(level, objective.slo)
    return level


def find_knee(levels: list[dict]) -> dict | None:
    """The last level that meets the SLO, in the order run (rising load)."""
    meeting = [lv for lv in levels if lv["meets_slo"]]
    return meeting[-1] if meeting else None


def goodput_rate(levels: list[dict]) -> float | None:
    """DistServe's goodput as one figure: the highest request rate whose level met the objective (with --goodput:
    at least 90% of its requests good); None when no rate did."""
    rates = [lv["request_rate"] for lv in levels if lv["meets_slo"] and lv["request_rate"] is not None]
    return max(rates) if rates else None


def rate_sweep_should_stop(level: dict, objective: Objective) -> bool:
    """With --goodput, a rate sweep ends after the first rate below the attainment line: higher rates only queue
    more, and on a small machine each one costs minutes."""
    return objective.attainment_pct is not None and not level["meets_slo"]


def sweep_should_stop(levels: list[dict]) -> bool:
    """Stop raising the load once the server is saturated (goodput under half the throughput, or TTFT p99
    double the first level's) and the knee is behind us (the last level missed the SLO)."""
    last = levels[-1]
    if last["meets_slo"]:
        return False
    base = levels[0]["ttft_ms"]["p99"]
    ttft = last["ttft_ms"]["p99"]
    doubled = base is not None and ttft is not None and ttft >= 2 * base
    return last["goodput_tok_per_s"] < 0.5 * last["output_tok_per_s"] or doubled or not last["completed"]
