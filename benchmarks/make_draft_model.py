"""A draft model for speculative decoding measurements (benchmarks/spec_decode.sh): the target with most of its
decoder layers dropped, written as an HF safetensors directory with the target's own tokenizer.

The default model is a GGUF; HF transformers' GGUF loader dequantizes it (float32), the kept layers are
renumbered, and the weights are saved in bfloat16. Dropping layers keeps the embeddings, the final norm and the
tied lm_head, so the draft's distribution is a rough copy of the target's: good enough to measure acceptance
(not trained as a draft; no speed-up is promised on a CPU, where a draft step costs a good part of a target step).

Usage: .venv/bin/python benchmarks/make_draft_model.py OUT_DIR [--keep-every 3] [--model M]
  (keeps layers 0, N, 2N, ... and always the last one; prints the directory)"""
from __future__ import annotations

import argparse
import os

import torch


def kept_layers(num_layers: int, every: int) -> list[int]:
    return sorted(set(range(0, num_layers, every)) | {num_layers - 1})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--keep-every", type=int, default=3)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from tokenmill.models.paths import resolve_model_path
    from tokenmill.tokenizer import load_tokenizer
    path = resolve_model_path(args.model)
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = model.config
    num_layers = config.num_hidden_layers
    keep = kept_layers(num_layers, args.keep_every)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("model.layers."):
            index, rest = name.removeprefix("model.layers.").split(".", 1)
            if int(index) not in keep:
                continue
            name = f"model.layers.{keep.index(int(index))}.{rest}"
        state[name] = tensor
    config.num_hidden_layers = len(keep)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in keep]
    if hasattr(config, "quantization_config"):  # the GGUF's: the draft is saved dense
        del config.quantization_config
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    draft.load_state_dict(state)
    draft.to(torch.bfloat16).save_pretrained(args.out_dir, safe_serialization=True)
    load_tokenizer(path).save_pretrained(args.out_dir)
    print(f"{args.out_dir}: layers {keep} of the target's {num_layers}")


if __name__ == "__main__":
    main()
