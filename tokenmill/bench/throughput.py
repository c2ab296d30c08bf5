"""`tokenmill bench throughput`: offline engine throughput on random prompts, optionally against HF transformers.

Prompts are random token ids of exactly --input-len tokens, each different (no accidental prefix sharing),
and every request generates exactly --output-len tokens (ignore_eos)."""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from tokenmill.config import EngineConfig


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, help="same as --model")
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--hf-baseline", action="store_true",
                        help="also run the prompts through HF transformers generate() in static batches")
    parser.add_argument("--hf-batch-size", type=int, default=32, help="static batch size of the HF baseline")
    parser.add_argument("--output-json", default=None, help="write the figures to this file")


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Skip the lowest ids, which are special tokens in most vocabularies.
    return torch.randint(100, vocab_size, (num, length), generator=g).tolist()


def figures(name: str, seconds: float, num: int, input_len: int, output_len: int) -> dict:
    return {"engine": name, "seconds": round(seconds, 2), "requests_per_s": round(num / seconds, 3),
            "output_tok_per_s": round(num * output_len / seconds, 1),
            "total_tok_per_s": round(num * (input_len + output_len) / seconds, 1)}


def print_figures(f: dict) -> None:
    print(f"[{f['engine']}] {f['seconds']:.1f} s: {f['requests_per_s']:.2f} requests/s, "
          f"{f['output_tok_per_s']:.1f} output tok/s, {f['total_tok_per_s']:.1f} total tok/s", flush=True)


def run_tokenmill(config: EngineConfig, prompts, output_len: int, temperature: float) -> float:
    from tokenmill import LLM, SamplingParams
    llm = LLM(**vars(config))
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompts[0]], params, use_tqdm=False)  # warm-up: first-call allocations
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    print(f"engine stats: {llm.engine.stats()}, steps {llm.engine.num_steps}")
    return elapsed


def run_hf(config: EngineConfig, prompts, output_len: int, batch_size: int, dtype: torch.dtype,
           temperature: float) -> float:
    from transformers import AutoModelForCausalLM

    from tokenmill.engine.runner import resolve_device
    from tokenmill.models.paths import resolve_model_path
    device = resolve_device(config.device)  # the engine's device: the same GPU when it runs on one
    path = resolve_model_path(config.model, config.download_dir)
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32).to(dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    model.to(device).eval()
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=temperature > 0,
                  pad_token_id=0)
    if temperature > 0:
        kwargs.update(temperature=temperature, top_p=1.0, top_k=0)
    with torch.inference_mode():
        model.generate(torch.tensor(prompts[:1], device=device), **{**kwargs, "max_new_tokens": 2,
                                                                     "min_new_tokens": 2})
        start = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            # Same-length prompts: a static batch needs no padding.
            model.generate(torch.tensor(prompts[i:i + batch_size], device=device), **kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return time.perf_counter() - start


def main(args: argparse.Namespace) -> int:
    if args.model_tag:
        args.model = args.model_tag
    config = EngineConfig.from_cli_args(args)
    from tokenmill.engine.runner import resolve_device
    from tokenmill.models.loader import load_model_config, resolve_dtype
    from tokenmill.models.paths import resolve_model_path
    info = load_model_config(resolve_model_path(config.model, config.download_dir), config.load_format,
                             config.trust_remote_code, config.hf_overrides)
    prompts = random_prompts(args.num_prompts, args.input_len, info.hf_config.vocab_size, config.seed)
    dtype = resolve_dtype(config.dtype, info.hf_config, resolve_device(config.device))
    print(f"model {info.path}, dtype {dtype}, {args.num_prompts} prompts x ({args.input_len} in, "
          f"{args.output_len} out), threads {torch.get_num_threads()}", flush=True)

    elapsed = run_tokenmill(config, prompts, args.output_len, args.temperature)
    ours = figures("tokenmill", elapsed, args.num_prompts, args.input_len, args.output_len)
    print_figures(ours)
    result = {"tokenmill": ours, "dtype": str(dtype).removeprefix("torch."), "input_len": args.input_len,
              "output_len": args.output_len, "num_prompts": args.num_prompts}
    if args.hf_baseline:
        hf_elapsed = run_hf(config, prompts, args.output_len, args.hf_batch_size, dtype, args.temperature)
        hf = figures(f"hf-transformers static batch {args.hf_batch_size}", hf_elapsed, args.num_prompts,
                     args.input_len, args.output_len)
        print_figures(hf)
        ratio = hf_elapsed / elapsed
        print(f"tokenmill / HF throughput ratio: {ratio:.2f}x")
        result.update(hf=hf, ratio=round(ratio, 2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
