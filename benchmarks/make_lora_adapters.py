"""Random PEFT LoRA adapters for a model, for benchmarks/lora.sh: prints one `name=path` per adapter.

Made with peft on a model of the same shapes (its own weights do not matter: only the adapter is saved), with
random non-zero A and B (peft starts B at zero, which would add nothing), ranks 8 to 16 over different modules.

Usage: .venv/bin/python benchmarks/make_lora_adapters.py OUT_DIR [MODEL]"""
from __future__ import annotations

import os
import sys

import torch

ADAPTERS = {  # name → peft LoraConfig fields
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "attn-r16": dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp-r8": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all-r16": dict(r=16, lora_alpha=16, use_rslora=True,
                    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def main(out_dir: str, model: str = "SmolLM2-135M-Instruct") -> None:
    import peft
    from transformers import AutoModelForCausalLM

    from tokenmill.models.loader import load_model_config
    from tokenmill.models.paths import resolve_model_path
    config = load_model_config(resolve_model_path(model)).hf_config
    for seed, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        lora = peft.get_peft_model(AutoModelForCausalLM.from_config(config),
                                   peft.LoraConfig(task_type="CAUSAL_LM", **kw))
        with torch.no_grad():
            for param_name, p in lora.named_parameters():
                if "lora_" in param_name:
                    p.normal_(0.0, 0.02)
        path = os.path.join(out_dir, name)
        lora.save_pretrained(path)
        print(f"{name}={path}")


if __name__ == "__main__":
    main(*sys.argv[1:])
