"""Reports for `tokenmill bench serve`: results.json, results.csv, PNG plots and a self-contained report.html.

A run is the result dict of one engine; several runs (--compare) share the plots and get a side-by-side table."""
from __future__ import annotations

import base64
import csv
import datetime
import html
import json
import math
import os
import re

METRICS = ("ttft", "itl", "tpot", "e2e")
CLASSES = ("short", "long")  # the request classes of --long-prompt-share
STATS = ("mean", "p50", "p90", "p95", "p99")
CSV_COLUMNS = (["engine", "concurrency", "request_rate", "num_requests", "completed", "errors", "duration_s",
                "requests_per_s", "output_tok_per_s", "total_tok_per_s"]
               + [f"{m}_{s}_ms" for m in METRICS for s in STATS]
               + ["request_goodput", "goodput_tok_per_s", "goodput_req_pct", "meets_slo", "client_cpu_pct"]
               # a workload that mixes long prompts into chat: each class apart (empty otherwise)
               + [f"{c}_{m}_{s}_ms" for c in CLASSES for m in ("ttft", "itl") for s in ("p50", "p99")]
               + [f"{c}_goodput_req_pct" for c in CLASSES])
PLOTS = ("pareto", "ttft", "itl", "goodput")
NONE = "\u2014"  # em dash: a level with no completed requests has no percentiles


def _fmt(v, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return NONE
    if isinstance(v, bool):
        return "yes" if v else "no"
    if not isinstance(v, float):
        return str(v)
    return f"{v:.{digits}f}"


def _value(level: dict, key: str, stat: str | None = None):
    """A percentile of a latency metric when stat is given, else a plain field."""
    return (level.get(f"{key}_ms") or {}).get(stat) if stat else level.get(key)


def _x_key(run: dict) -> str:
    return "request_rate" if run.get("mode") == "request_rate" else "concurrency"


def _x_label(x_key: str) -> str:
    return "request rate (req/s)" if x_key == "request_rate" else "concurrency"


def _fmt_x(v) -> str:
    return NONE if v is None else f"{v:g}"


def _knee_x(run: dict):
    knee = run.get("results_at_knee")
    return None if knee is None else knee.get(_x_key(run))


# (header, field, percentile or None, decimals) of the per-engine level table, for terminal and HTML alike.
_LEVEL_COLUMNS = [
    ("req/s", "requests_per_s", None, 2), ("out tok/s", "output_tok_per_s", None, 1),
    ("TTFT p50", "ttft", "p50", 1), ("TTFT p99", "ttft", "p99", 1), ("ITL p50", "itl", "p50", 1),
    ("ITL p99", "itl", "p99", 1), ("TPOT p50", "tpot", "p50", 1), ("E2E p99", "e2e", "p99", 1),
    ("goodput req/s", "request_goodput", None, 2), ("goodput tok/s", "goodput_tok_per_s", None, 1),
    ("SLO attained %", "goodput_req_pct", None, 1),
    ("meets SLO", "meets_slo", None, 0), ("errors", "errors", None, 0), ("client CPU %", "client_cpu_pct", None, 1),
]
# Shown when the levels have request classes: what long prompts do to the short requests' gaps, and their own wait.
_CLASS_COLUMNS = [("short ITL p99", "short_itl", "p99", 1), ("short attained %", "short_goodput_req_pct", None, 1),
                  ("long TTFT p99", "long_ttft", "p99", 1), ("long attained %", "long_goodput_req_pct", None, 1)]
_COMPARE_COLUMNS = [("out tok/s", "output_tok_per_s", None), ("TTFT p99", "ttft", "p99"),
                    ("ITL p50", "itl", "p50"), ("goodput tok/s", "goodput_tok_per_s", None)]


def _level_table(run: dict) -> tuple[list[str], list[list[str]], list[bool]]:
    """Headers, cell strings and a per-row 'is the knee' flag; latencies are in ms."""
    x, knee = _x_key(run), _knee_x(run)
    columns = _LEVEL_COLUMNS + (_CLASS_COLUMNS if any(lv.get("classes") for lv in run["results"]) else [])
    headers = [_x_label(x)] + [c[0] for c in columns]
    rows = [[_fmt_x(lv.get(x))] + [_fmt(_value(lv, key, stat), digits)
                                    for _, key, stat, digits in columns] for lv in run["results"]]
    flags = [knee is not None and lv.get(x) == knee for lv in run["results"]]
    return headers, rows, flags


def _comparison_table(runs: list[dict]) -> tuple[list[str], list[list[str]], list[list[bool]]]:
    """One row per level (the union of the sweeps, in case they differ), four columns per engine."""
    x = _x_key(runs[0])
    levels = sorted({lv.get(x) for r in runs for lv in r["results"] if lv.get(x) is not None})
    headers = [_x_label(x)] + [f"{r['engine']} {c[0]}" for r in runs for c in _COMPARE_COLUMNS]
    rows, flags = [], []
    for v in levels:
        row, flag = [_fmt_x(v)], [False]
        for r in runs:
            lv = next((lv for lv in r["results"] if lv.get(x) == v), {})
            row += [_fmt(_value(lv, key, stat)) for _, key, stat in _COMPARE_COLUMNS]
            flag += [_knee_x(r) == v] * len(_COMPARE_COLUMNS)
        rows.append(row)
        flags.append(flag)
    return headers, rows, flags


def goodput_summary(run: dict) -> str | None:
    """The run's goodput as one figure (a --request-rate run with --goodput), else None."""
    if run.get("mode") != "request_rate" or run.get("goodput_attainment_pct") is None:
        return None
    within = (f"{run['goodput_attainment_pct']:g}% of requests within --goodput "
              + " ".join(f"{k}:{v:g}" for k, v in run["goodput"].items()))
    rate = run.get("goodput_request_rate")
    if rate is None:
        rates = [lv["request_rate"] for lv in run["results"]]
        return f"goodput: under {min(rates):g} req/s (no rate tried had {within})" if rates else None
    return f"goodput: {rate:g} req/s (the highest rate with >= {within})"


def _knee_summary(runs: list[dict]) -> list[str]:
    x = _x_label(_x_key(runs[0]))
    return [f"{r['engine']}: {x} {_fmt_x(_knee_x(r))}" if _knee_x(r) is not None
            else f"{r['engine']}: no level meets the SLO" for r in runs]


def _text_table(headers: list[str], rows: list[list[str]], marks: list[str]) -> str:
    widths = [max(len(c) for c in col) for col in zip(headers, *rows)]
    lines = ["  " + "  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines += [m.ljust(2) + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row, m in zip(rows, marks)]
    return "\n".join(lines)


def format_table(run: dict) -> str:
    headers, rows, flags = _level_table(run)
    title = " ".join(filter(None, [run["engine"], run.get("engine_version"), "(latencies in ms, * = knee)"]))
    return title + "\n" + _text_table(headers, rows, ["*" if f else "" for f in flags])


def format_comparison(runs: list[dict]) -> str:
    headers, rows, _ = _comparison_table(runs)
    goodput = [f"{r['engine']}: {line}" for r in runs if (line := goodput_summary(r)) is not None]
    return ("side by side (latencies in ms)\n" + _text_table(headers, rows, [""] * len(rows))
            + "\nknee: " + "; ".join(_knee_summary(runs)) + "".join(f"\n{g}" for g in goodput))


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "engine"


def _plot(path: str, runs: list[dict], kind: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key, slo = _x_key(runs[0]), runs[0].get("slo") or {}
    # y label, series (label, field, percentile, line style), SLO key prefix
    spec = {"ttft": ("TTFT (ms)", [("p50", "ttft", "p50", "-"), ("p99", "ttft", "p99", ":")], "ttft_"),
            "itl": ("ITL (ms)", [("p50", "itl", "p50", "-"), ("p99", "itl", "p99", ":")], "itl_"),
            "goodput": ("output tok/s", [("goodput", "goodput_tok_per_s", None, "-"),
                                         ("throughput", "output_tok_per_s", None, ":")], None)}
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    all_x = []
    for i, run in enumerate(runs):
        color, knee = f"C{i % 10}", _knee_x(run)
        if kind == "pareto":
            pts = [(_value(lv, "ttft", "p99"), lv.get("output_tok_per_s"), lv.get(x_key)) for lv in run["results"]]
            pts = [p for p in pts if p[0] is not None and p[1] is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=color, label=run["engine"])
            for px, py, lvl in pts:
                ax.annotate(_fmt_x(lvl), (px, py), textcoords="offset points", xytext=(4, 4), fontsize=8)
                if knee is not None and lvl == knee:
                    ax.plot(px, py, "*", color=color, markersize=16, label=f"{run['engine']} knee")
            continue
        for label, key, stat, style in spec[kind][1]:
            pts = [(lv.get(x_key), _value(lv, key, stat)) for lv in run["results"]]
            pts = [p for p in pts if p[0] is not None and p[1] is not None and math.isfinite(p[0])]
            all_x += [p[0] for p in pts]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=color,
                    label=f"{run['engine']} {label}")
            for px, py in pts:
                if knee is not None and px == knee:
                    ax.plot(px, py, "*", color=color, markersize=16)
    if kind == "pareto":
        ax.set_xlabel("TTFT p99 (ms)")
        ax.set_ylabel("output tok/s")
        if slo.get("ttft_p99_ms") is not None:
            ax.axvline(slo["ttft_p99_ms"], color="gray", linestyle="--",
                       label=f"SLO TTFT p99 {slo['ttft_p99_ms']:g} ms")
        ax.set_title("throughput vs tail latency (points labelled with the level, \u2605 = knee)")
    else:
        ylabel, _, prefix = spec[kind]
        for key, val in slo.items():
            if prefix and key.startswith(prefix) and val is not None:
                name = key[:-3].replace("_", " ").upper().replace(" P", " p")
                ax.axhline(val, color="gray", linestyle="--", label=f"SLO {name} {val:g} ms")
        bound = (runs[0].get("goodput") or {}).get("ttft") if runs[0].get("goodput_from") == "--goodput" else None
        if kind == "ttft" and bound is not None:
            ax.axhline(bound, color="gray", linestyle="-.", label=f"--goodput TTFT {bound:g} ms per request")
        ax.set_xlabel(_x_label(x_key))
        ax.set_ylabel(ylabel)
        ax.set_title(f"{ylabel.split(' (')[0]} vs {_x_label(x_key)} (\u2605 = knee)")
        # Sweeps usually double the level; a log2 axis spaces them evenly.
        levels = sorted(set(all_x))
        if len(levels) > 1 and all(v > 0 and float(v).is_integer() and (int(v) & (int(v) - 1)) == 0 for v in levels):
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [_fmt_x(v) for v in levels])
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def _html_table(headers: list[str], rows: list[list[str]], flags: list) -> str:
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in headers) + "</tr>"]
    for row, flag in zip(rows, flags):
        cell_flags = flag if isinstance(flag, list) else [flag] * len(row)
        out.append("<tr>" + "".join(f"<td{' class=knee' if f else ''}>{html.escape(c)}</td>"
                                    for c, f in zip(row, cell_flags)) + "</tr>")
    return "\n".join(out + ["</table>"])


def _html(runs: list[dict], pngs: dict[str, str]) -> str:
    first = runs[0]
    meta = [("model", first.get("model")), ("precision", first.get("precision")),
            ("hardware", ", ".join(f"{k}: {_fmt(v)}" for k, v in (first.get("hardware") or {}).items())),
            ("dataset", ", ".join(f"{k}: {_fmt(v)}" for k, v in (first.get("dataset") or {}).items())),
            ("SLO", ", ".join(f"{k}: {_fmt(v)}" for k, v in (first.get("slo") or {}).items()) or NONE),
            ("good request", " and ".join(f"{k} \u2264 {v:g} ms" for k, v in (first.get("goodput") or {}).items())
             + f" (from {first.get('goodput_from')})" if first.get("goodput") else NONE),
            ("harness", f"{first.get('harness')} {first.get('harness_version')}"),
            ("date", first.get("date") or datetime.datetime.now().astimezone().isoformat(timespec="seconds"))]
    body = ["<h1>tokenmill bench serve: " + html.escape(" vs ".join(r["engine"] for r in runs)) + "</h1>",
            "<table class=meta>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>"
                                           for k, v in meta) + "</table>"]
    if len(runs) > 1:
        body += ["<h2>side by side</h2>", _html_table(*_comparison_table(runs)),
                 "<p>knee (last level meeting the SLO): " + html.escape("; ".join(_knee_summary(runs))) + "</p>"]
    for r in runs:
        body += [f"<h2>{html.escape(r['engine'])} {html.escape(str(r.get('engine_version') or ''))}</h2>",
                 "<p>" + html.escape(f"{r.get('base_url')}, mode {r.get('mode')}, sweep "
                                     f"{r.get('concurrency_sweep')}, knee {_fmt_x(_knee_x(r))}") + "</p>",
                 _html_table(*_level_table(r))]
        if (line := goodput_summary(r)) is not None:
            body.append(f"<p><b>{html.escape(line)}</b></p>")
    for name, path in pngs.items():
        with open(path, "rb") as f:
            data = base64.b64encode(f.read()).decode("ascii")
        body.append(f'<h2>{name}</h2><img alt="{name}" src="data:image/png;base64,{data}">')
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
             "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}.meta th,.meta td{text-align:left}"
             "td.knee{background:#ffe9a8;font-weight:bold}img{max-width:100%}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=utf-8><title>tokenmill bench report</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_report(out_dir: str, runs: list[dict]) -> dict[str, str]:
    """Write every artifact for `runs` (one dict per engine) into out_dir; returns file name -> path."""
    os.makedirs(out_dir, exist_ok=True)
    written: dict[str, str] = {}

    def dump(name: str, obj) -> None:
        written[name] = os.path.join(out_dir, name)
        with open(written[name], "w") as f:
            json.dump(obj, f, indent=2)

    if len(runs) == 1:
        dump("results.json", runs[0])
    else:
        dump("results.json", {"harness": runs[0].get("harness"), "harness_version": runs[0].get("harness_version"),
                              "comparison": runs})
        for r in runs:
            name = f"results-{_safe_name(r['engine'])}.json"
            # Comparing two builds of the same engine must not overwrite one file with the other.
            while name in written:
                name = name[:-5] + "_.json"
            dump(name, r)

    written["results.csv"] = os.path.join(out_dir, "results.csv")
    with open(written["results.csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in runs:
            for lv in r["results"]:
                row = {k: lv.get(k) for k in CSV_COLUMNS}
                row["engine"] = r["engine"]
                row.update({f"{m}_{s}_ms": _value(lv, m, s) for m in METRICS for s in STATS})
                row.update({f"{c}_{m}_{s}_ms": _value(lv, f"{c}_{m}", s)
                            for c in CLASSES for m in ("ttft", "itl") for s in ("p50", "p99")})
                w.writerow(row)

    pngs = {f"{kind}.png": os.path.join(out_dir, f"{kind}.png") for kind in PLOTS}
    for kind in PLOTS:
        _plot(pngs[f"{kind}.png"], runs, kind)
    written.update(pngs)

    written["report.html"] = os.path.join(out_dir, "report.html")
    with open(written["report.html"], "w", encoding="utf-8") as f:
        f.write(_html(runs, pngs))
    return written
