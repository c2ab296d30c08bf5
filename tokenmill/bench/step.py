"""`tokenmill bench step`: where one engine step's time goes, on a fixed workload.

Throughput says how fast, not why: before optimizing a kernel, the scheduler or the front end, this shows
which of them a step actually waits on. It measures from outside, wrapping the runner's attributes at run
time, so it keeps working while the runner, models and kernels change underneath it.

Two passes of the same kind of step: one without the profiler for the wall times, one under torch.profiler for
the op times, so the profiler's own overhead does not show up as Python overhead. An op counts with its
children, in the category of its outermost op in the model (the index_select inside aten::embedding is not
attention); "other (python/dispatch)" is the model's wall time that no op covers, views included."""
from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import time
from collections import Counter, defaultdict

import msgspec
import torch

from tokenmill.bench.env_probe import hardware
from tokenmill.bench.throughput import random_prompts
from tokenmill.config import EngineConfig
from tokenmill.detokenizer import IncrementalDetokenizer
from tokenmill.engine.messages import EngineCoreOutputs, EngineMessage
from tokenmill.kernels import cpu_flags
from tokenmill.sampling_params import SamplingParams

WARMUP_STEPS = 2
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
LINEAR = {"mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm",
          "tokenmill::small_m_linear", "tokenmill::quant_linear", "tokenmill::lora_delta"}
ATTENTION = {"aten::scaled_dot_product_attention", "aten::index_select", "aten::index_copy_",
             "tokenmill::paged_attention", "tokenmill::rope_and_cache"}
VIEWS = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::split",
         "aten::split_with_sizes", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze",
         "aten::narrow", "aten::as_strided", "aten::expand", "aten::transpose", "aten::t", "aten::permute",
         "aten::flatten", "aten::detach", "aten::alias", "aten::lift_fresh", "aten::empty", "aten::empty_like",
         "aten::empty_strided", "aten::resolve_conj", "aten::resolve_neg"}  # no compute: left to "other"
OPS = ("linear layers", "attention", "norms/RoPE/activations")
REGION = "bench_step::"  # our record_function regions: bench_step::model, bench_step::sampler


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, help="same as --model")
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--batch-size", type=int, default=32, help="requests in flight")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-steps", type=int, default=20, help="steps to profile, after warm-up")
    parser.add_argument("--mode", choices=["decode", "prefill", "mixed"], default="decode",
                        help="decode: steps after every prompt is prefilled; prefill: prompt chunks only; "
                             "mixed: new requests keep arriving, so chunked prefills ride along with decodes")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's current)")
    parser.add_argument("--output-json", default=None, help="write every figure and the machine info here")


def machine_info() -> dict:
    """The CPU and the flags (lscpu's, which come from /proc/cpuinfo) that decide which kernels can run."""
    flags = cpu_flags()
    return {"cpu": hardware()["cpu"], "flags": {f: f in flags for f in CPU_FLAGS},
            "torch_threads": torch.get_num_threads()}


class _Delegate:
    """Stands in for an object whose __call__ is wrapped; everything else goes to the object."""

    def __init__(self, target, call):
        self._target, self._call = target, call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._target, name)


class StepProfiler:
    def __init__(self, llm, args: argparse.Namespace):
        self.llm, self.engine, self.args = llm, llm.engine, args
        self.t: defaultdict[str, float] = defaultdict(float)  # per pass: seconds, and token counts
        self.active, self.profiling = set(), False  # the timers running now; whether the profiler records
        self.detoks, self.unfinished = {}, set()
        self.ramp: set[str] = set()  # requests of the first batch that have no token yet
        self.ids, self.seeds, self.pool = itertools.count(), itertools.count(llm.config.seed), []
        self.encoder, self.decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineMessage)
        runner = self.engine.runner  # instance attributes shadow what the engine calls; what is gone is skipped
        runner.execute = self._timed(runner.execute, "execute")
        model = getattr(runner, "model", None)
        for name in ("forward", "compute_logits"):
            if callable(getattr(model, name, None)):
                setattr(model, name, self._timed(getattr(model, name), "model"))
        if callable(getattr(runner, "sampler", None)):
            runner.sampler = _Delegate(runner.sampler, self._timed(runner.sampler.__call__, "sampler"))

    def _timed(self, fn, key: str):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if key in self.active:  # e.g. compute_logits called from inside forward: counted once
                return fn(*args, **kwargs)
            self.active.add(key)
            start = time.perf_counter()
            try:
                with torch.profiler.record_function(REGION + key) if self.profiling else contextlib.nullcontext():
                    return fn(*args, **kwargs)
            finally:
                self.t[key] += time.perf_counter() - start
                self.active.discard(key)
        return wrapper

    def add(self, max_tokens: int) -> str:
        if not self.pool:
            self.pool = random_prompts(self.args.batch_size, self.args.input_len, self.engine.runner.vocab_size,
                                       next(self.seeds))
        prompt, rid = self.pool.pop(), f"step-{next(self.ids)}"
        params = SamplingParams(temperature=self.args.temperature, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(rid, prompt, params, self.llm.tokenizer.eos_token_id)
        self.detoks[rid] = IncrementalDetokenizer(self.llm.tokenizer, params, prompt), params
        self.unfinished.add(rid)
        return rid

    def start(self) -> None:
        a = self.args
        if a.mode == "decode":  # enough tokens that nobody finishes during ramp, warm-up and both passes
            ramp = math.ceil(a.batch_size * a.input_len / self.engine.scheduler.max_num_batched_tokens) + 1
            need = max(a.output_len, ramp + WARMUP_STEPS + 2 * a.num_steps + 1)
            self.ramp = {self.add(min(need, self.engine.max_model_len - a.input_len)) for _ in range(a.batch_size)}
        elif a.mode == "mixed":  # staggered lengths: requests finish, and new ones arrive, every few steps
            self.ramp = {self.add(max(1, (i + 1) * a.output_len // a.batch_size)) for i in range(a.batch_size)}
        while self.ramp and self.engine.has_unfinished_requests():
            self.run(1)
        self.run(WARMUP_STEPS)

    def run(self, n: int) -> int:
        """Runs up to n steps and what the front end does with each; returns how many ran."""
        t, engine = self.t, self.engine
        for i in range(n):
            while self.args.mode != "decode" and len(self.unfinished) < self.args.batch_size:
                self.add(1 if self.args.mode == "prefill" else self.args.output_len)
            if not engine.has_unfinished_requests():
                return i
            start = time.perf_counter()
            outputs = engine.step()
            t["step"] += time.perf_counter() - start
            start = time.perf_counter()
            for o in outputs:
                if o.request_id in self.detoks:
                    detok, params = self.detoks[o.request_id]
                    if detok.finish(o.new_token_ids, o.finish_reason, params.stop_token_ids)[0] is not None:
                        del self.detoks[o.request_id]
            t["detok"] += time.perf_counter() - start
            start = time.perf_counter()
            step_tokens = getattr(engine, "last_step_tokens", 0)
            msg = EngineCoreOutputs(outputs, [], [], time.monotonic(), engine.scheduler_stats(step_tokens))
            self.decoder.decode(self.encoder.encode(msg))
            t["ipc"] += time.perf_counter() - start
            t["tokens"] += step_tokens
            for o in outputs:
                t["output_tokens"] += len(o.new_token_ids)
                if o.new_token_ids:
                    self.ramp.discard(o.request_id)
                if o.finish_reason is not None:
                    self.unfinished.discard(o.request_id)
        return n

    def measure(self, profile: bool) -> tuple[dict, Counter]:
        """One pass of --num-steps: per step, the wall figures (s) and the model's op time by category and op (ms)."""
        self.t.clear()
        self.profiling = profile
        cpu = [torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=cpu) if profile else contextlib.nullcontext() as prof:
            steps = self.run(self.args.num_steps)
        self.profiling = False
        if steps == 0:
            raise RuntimeError("no step ran: every request finished before profiling started")
        ops = Counter()
        for e in prof.events() if profile else ():
            for key in _categories(e):
                ops[key] += e.cpu_time_total / 1e3 / steps
        return {k: v / steps for k, v in self.t.items()}, ops


def _categories(e) -> tuple[str, ...]:
    """Where an op's total time counts: (category, "op:<name>") for an outermost op of the model, ("argmax",)
    for a tokenmill argmax outside the model and the sampler, else (). By name, so that it holds whether or not
    tokenmill's kernels are there."""
    def annotation(x):
        return bool(getattr(x, "is_user_annotation", False)) or x.name.startswith(REGION)
    if annotation(e):
        return ()
    if e.name.endswith("::llama_forward"):  # the fused decoder stack: its kernels and linears count, not it
        return ()
    regions, nested, p = [], False, e.cpu_parent
    while p is not None:
        if p.name.endswith("::llama_forward"):
            pass
        elif not annotation(p):
            nested = nested or f"{REGION}model" not in regions
        elif p.name.startswith(REGION):
            regions.append(p.name)
        p = p.cpu_parent
    namespace, _, op = e.name.partition("::")  # tokenmill's kernels register as tokenmill_avx512::, tokenmill_avx2::
    name = "tokenmill::" + op if namespace.startswith("tokenmill") else e.name
    if f"{REGION}model" not in regions:
        return ("argmax",) if name == "tokenmill::argmax" and f"{REGION}sampler" not in regions else ()
    if nested or name in VIEWS:
        return ()
    if name in ATTENTION or name.startswith("aten::_scaled_dot_product"):
        return "attention", "op:" + e.name
    if name in LINEAR:
        return "linear layers", "op:" + e.name
    return "norms/RoPE/activations", "op:" + e.name


def breakdown(wall: dict, ops: Counter) -> dict:
    """ms per step of each row; they add up to engine.step + detokenization + IPC of the unprofiled pass."""
    ms = defaultdict(float, {k: v * 1e3 for k, v in wall.items()})
    covered = sum(ops[c] for c in OPS)
    scale = min(1.0, ms["model"] / covered) if covered else 0.0  # profiled ops may not exceed the model's wall
    rows = {c: ops[c] * scale for c in OPS}
    rows["other (python/dispatch)"] = ms["model"] - covered * scale
    rest = ms["execute"] - ms["model"] - ms["sampler"]
    argmax = min(max(rest, 0.0), ops["argmax"])
    rows.update({"sampling": ms["sampler"] + argmax, "building inputs": rest - argmax,
                 "scheduling": ms["step"] - ms["execute"], "detokenization": ms["detok"], "IPC": ms["ipc"]})
    return rows


def main(args: argparse.Namespace) -> int:
    if args.model_tag:
        args.model = args.model_tag
    if args.threads:
        torch.set_num_threads(args.threads)
    from tokenmill import LLM
    llm = LLM(**vars(EngineConfig.from_cli_args(args)))
    engine, machine = llm.engine, machine_info()
    dtype = str(engine.runner.dtype).removeprefix("torch.")
    flags = " ".join(f"{f}={'yes' if on else 'no'}" for f, on in machine["flags"].items())
    print(f"cpu: {machine['cpu']} ({flags}), torch threads {machine['torch_threads']}")
    print(f"model {engine.model_info.path}, {dtype}, mode {args.mode}: batch {args.batch_size}, {args.input_len} in, "
          f"{args.output_len} out, {args.num_steps} steps profiled", flush=True)
    prof = StepProfiler(llm, args)
    prof.start()
    wall, _ = prof.measure(profile=False)
    profiled_wall, ops = prof.measure(profile=True)
    for rid in prof.unfinished:  # leaves the engine empty, to be used again
        engine.abort_request(rid)
    rows = breakdown(wall, ops)
    total = sum(rows.values())
    tokens, out_tokens = wall.get("tokens", 0.0), wall.get("output_tokens", 0.0)
    print("a step: engine.step, then detokenizing and IPC-coding its outputs as the API server's front end would")
    print(f"{'category':<26}{'ms/step':>10}{'% of step':>11}")
    for name, value in [*rows.items(), ("total step", total)]:
        print(f"{name:<26}{value:>10.2f}{100 * value / total:>10.1f}%")
    print(f"{tokens:.1f} tokens/step ({out_tokens:.1f} sampled): {tokens / total * 1e3:.1f} tok/s, "
          f"{out_tokens / total * 1e3:.1f} output tok/s")
    if args.output_json:
        workload = {k: getattr(args, k) for k in ("mode", "batch_size", "input_len", "output_len", "num_steps")}
        result = {**workload, "model": engine.model_info.path, "dtype": dtype, "machine": machine,
                  "ms_per_step": rows, "total_step_ms": total,
                  "pct_of_step": {k: v / total * 100 for k, v in rows.items()},
                  "tokens_per_step": tokens, "output_tokens_per_step": out_tokens, "tok_per_s": tokens / total * 1e3,
                  "output_tok_per_s": out_tokens / total * 1e3, "model_ms": 1e3 * wall.get("model", 0.0),
                  "model_ms_under_profiler": 1e3 * profiled_wall.get("model", 0.0),
                  "top_ops_ms": {k[3:]: v for k, v in ops.most_common() if k.startswith("op:")}}
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
